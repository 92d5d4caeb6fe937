"""The planner held to what an H100 measured (2026-11-23; benchmarks/results/gpu, made by benchmarks/gpu_steps.py and
`vram-plan probe --validate`; benchmarks/gpu_compare.py prints the comparison): TRL's own GRPO steps, runs on
emulated smaller cards, and the shipped calibration of that card, which is the probe's fit of its record."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from vram_planner import engine
from vram_planner.model.calibration import calibration_for, load_calibration_file
from vram_planner.probe.fit import (ProbeRecord, compute_capability, emulated_card, fit_calibration, fit_quality,
                                    label_settings, summary)
from vram_planner.profiles import profile_dirs
from vram_planner.units import GiB

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results" / "gpu"
STEPS = json.loads((RESULTS / "h100-trl-steps.json").read_text())
VALIDATION = json.loads((RESULTS / "h100-probe-validation.json").read_text())["rows"]


def measured_peak_bytes(run: dict) -> int:
    return max(p["reserved_peak_bytes"] for p in run["phases"] if p["step"] == 2) + run["context_bytes"]


def test_the_shipped_h100_calibration_is_the_probes_fit_of_its_record():
    record = ProbeRecord.model_validate_json((RESULTS / "h100-probe-record.json").read_text())
    shipped = load_calibration_file(profile_dirs()[0] / "calibrations" / "h100-80gb.json")
    assert shipped == fit_calibration(record, "h100-80gb")
    assert shipped.measured["gpu"] == "NVIDIA H100 80GB HBM3" and shipped.measured["trl"] == "1.16.0"
    errors = summary(fit_quality(record, shipped))
    assert errors["median_error"] < 0.03 and errors["worst_error"] < 0.08  # the targets


def test_trls_own_steps_are_predicted_within_the_targets():
    runs = [r for r in STEPS["configs"] if not r.get("plan_on")]
    assert {r["model"] for r in runs} == {"Qwen2.5-0.5B", "Llama-3.2-1B"} and len(runs) == 6
    errors = []
    for run in runs:
        verdict = engine.check(run["model"], "h100-80gb", run["train"])
        assert verdict.context.calibration == calibration_for("h100-80gb")
        errors.append(abs(verdict.estimate.peak_bytes / measured_peak_bytes(run) - 1))
    assert statistics.median(errors) < 0.03 and max(errors) < 0.08


def test_runs_on_emulated_cards_agree_with_every_verdict_not_flagged_near_the_boundary():
    # The largest micro-batches plan found (in 2026-11) for a card, run on the H100 limited to that card, and one
    # limited to its prediction then: no "fits" ran out, and a verdict not flagged near the boundary says what
    # happened. Qwen2.5-0.5B's 80 sequences needed 15.48 of the laptop card's 15.49 GiB: within the margin, flagged.
    runs = [r for r in STEPS["configs"] if r.get("plan_on")]
    assert len(runs) == 4 and any(not r["ran"] for r in runs)
    for run in runs:
        at_prediction = run.get("limit") == "prediction"
        gpu = emulated_card(int(run["limit_bytes"]), "9.0") if at_prediction else run["plan_on"]
        verdict = engine.check(run["model"], gpu, run["train"])
        assert run["ran"] or not verdict.fits, run["name"]
        if not verdict.near_boundary:
            assert verdict.fits == run["ran"], run["name"]


@pytest.fixture
def one_trace_per_step(monkeypatch):
    """engine.trace with one trace_step per step: the runs that differ only in PYTORCH_CUDA_ALLOC_CONF share their
    traced tensors, which the allocator's settings do not change (tests/tracing/test_step.py holds that), and each
    is still replayed and bisected under its own settings."""
    from vram_planner.tracing import step

    traced, original = {}, step.trace_step

    def trace_step(config, train, release=None, progress=None, zero_rank=None):
        key = (json.dumps(config, sort_keys=True), replace(train, allocator_conf=""), release, zero_rank)
        if key not in traced:
            traced[key] = original(config, train, release, progress, zero_rank)
        return traced[key]

    monkeypatch.setattr(step, "trace_step", trace_step)
    return traced


@pytest.mark.slow
def test_the_traces_replay_holds_what_the_h100_held_in_every_phase(one_trace_per_step):
    # Each phase's most reserved bytes (step 2; the optimizer step's from step 1, where its states are created)
    # against `vram-plan trace`'s replay through the allocator model. LoRA generates without autocast (PEFT's
    # generate() bypasses accelerate's autocast wrapper): traced under autocast, its phases were 11-15% over.
    errors = []
    for run in (r for r in STEPS["configs"] if not r.get("plan_on")):
        traced = engine.trace(run["model"], "h100-80gb", run["train"]).reserved.by_phase
        for phase in run["phases"]:
            if phase["step"] == (1 if phase["phase"] == "optimizer" else 2):
                errors.append(abs(traced[phase["phase"]] / phase["reserved_peak_bytes"] - 1))
    assert len(errors) == 18 and len(one_trace_per_step) == 4  # six runs, two of them under expandable segments
    assert statistics.median(errors) < 0.01 and max(errors) < 0.05


@pytest.mark.parametrize("row", VALIDATION, ids=lambda r: f"{r['capacity_gib']:g}GiB {r['config']}")
def test_every_verdict_on_an_emulated_card_is_what_happened(row):
    model, settings = label_settings(row["config"])
    card = emulated_card(int(row["capacity_gib"] * GiB), compute_capability("h100-80gb"))
    verdict = engine.check(model, card, settings, calibration=calibration_for("h100-80gb"))
    assert verdict.fits == row["ran"]
    if row["ran"]:  # what it needs, against what the allocator held there (it keeps what it cached until it must not)
        assert verdict.estimate.peak_bytes / GiB == pytest.approx(row["measured_gib"], rel=0.12)
