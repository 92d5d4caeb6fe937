"""The planner beside what a real GPU measured (no GPU needed): TRL GRPO steps and the probe's emulated-card runs.

    python benchmarks/gpu_compare.py            # prints the tables, writes benchmarks/results/gpu/h100-compare.txt
    python benchmarks/gpu_compare.py --trace    # also the trace engine's reserved bytes (per phase, minutes)

Inputs (committed, with GPU, driver, CUDA, torch, transformers and TRL versions): benchmarks/results/gpu/
h100-trl-steps.json (benchmarks/gpu_steps.py: TRL 1.16's GRPOTrainer, two steps, every completion full length) and
h100-probe-validation.json (`vram-plan probe --validate`). A step's measured peak is the most reserved memory of step
2 plus the CUDA context the process held; the prediction is `check`'s peak (tensors, cuBLAS workspaces, allocator
reserve, context) with the default calibration and with the card's shipped one. Error = (predicted - measured) /
measured. A run on an emulated card ran with the allocator limited to that card's capacity less its context.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from vram_planner import engine
from vram_planner.model.calibration import calibration_for, default_calibration
from vram_planner.probe.fit import compute_capability, emulated_card, label_settings
from vram_planner.units import GiB

RESULTS = Path(__file__).resolve().parent / "results" / "gpu"


def measured_peak_bytes(run: dict) -> int:
    """Step 2's peak reserved bytes plus the context the process held."""
    return max(p["reserved_peak_bytes"] for p in run["phases"] if p["step"] == 2) + run["context_bytes"]


def step_rows(runs: list[dict]) -> list[dict]:
    """Each full (unlimited) step on the H100: measured against both calibrations' predictions."""
    rows = []
    for run in runs:
        if run.get("plan_on") or not run.get("ran", True):
            continue
        measured = measured_peak_bytes(run)
        row = {"config": run["name"], "measured_gib": measured / GiB}
        for label, cal in (("default", default_calibration()), ("card", calibration_for("h100-80gb"))):
            predicted = engine.check(run["model"], "h100-80gb", run["train"], calibration=cal).estimate.peak_bytes
            row[label] = (predicted - measured) / measured
            row[f"{label}_gib"] = predicted / GiB
        rows.append(row)
    return rows


def phase_rows(runs: list[dict]) -> list[dict]:
    """Each full step's phases: the reserved bytes the H100 held (the most during the phase, as
    torch.cuda.max_memory_reserved reads after a reset at its start; step 2, the optimizer step's from step 1 as the
    trace reports it) beside what `vram-plan trace` replays through the allocator model, with either setting."""
    rows = []
    for run in runs:
        if run.get("plan_on"):
            continue
        traced = engine.trace(run["model"], "h100-80gb", run["train"]).reserved.by_phase
        for phase in run["phases"]:
            if phase["step"] == (1 if phase["phase"] == "optimizer" else 2) and phase["phase"] in traced:
                rows.append({"config": run["name"], "phase": phase["phase"],
                             "measured_gib": phase["reserved_peak_bytes"] / GiB,
                             "traced_gib": traced[phase["phase"]] / GiB})
    return rows


def emulated_rows(runs: list[dict]) -> list[dict]:
    """Each run on an emulated smaller card: the planner's verdict there and what happened."""
    rows = []
    for run in runs:
        if not run.get("plan_on"):
            continue
        verdict = engine.check(run["model"], run["plan_on"], run["train"])
        # runs made before the limit was recorded ran at the card's capacity less its catalog context
        limit = run.get("limit_bytes") or verdict.context.capacity_bytes - verdict.context.cuda_context.bytes
        rows.append({"config": run["name"], "card": run["plan_on"], "limit_gib": limit / GiB,
                     "fits": verdict.fits, "ran": run["ran"], "predicted_gib": verdict.estimate.peak_bytes / GiB,
                     "reserved_gib": max(p["reserved_peak_bytes"] for p in run["phases"]) / GiB})
    return rows


def validation_rows(rows: list[dict], traced: bool = False) -> list[dict]:
    """Each `probe --validate` run judged again with today's model and the card's shipped calibration; with
    `traced`, also what the trace engine's replay through the allocator model reserves for the runs that ran (what
    the allocator holds on a card with room, where `check` answers what the step needs)."""
    judged = []
    for row in rows:
        model, settings = label_settings(row["config"])
        card = emulated_card(int(row["capacity_gib"] * GiB), compute_capability("h100-80gb"))
        verdict = engine.check(model, card, settings, calibration=calibration_for("h100-80gb"))
        entry = {**row, "fits": verdict.fits, "predicted_gib": verdict.estimate.peak_bytes / GiB}
        if traced and row["ran"]:
            outcome = engine.trace(model, card, settings, calibration=calibration_for("h100-80gb"))
            entry["traced_gib"] = outcome.traced.estimate.peak_bytes / GiB
        judged.append(entry)
    return judged


def error_summary(errors: list[float]) -> str:
    return f"median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}"


def step_lines(runs: list[dict]) -> list[str]:
    lines = ["TRL GRPO steps (GiB, peak reserved of step 2 + context); error of check's peak:",
             f"{'config':<36} {'measured':>9} {'default':>9} {'error':>7} {'h100 cal':>9} {'error':>7}"]
    rows = step_rows(runs)
    for r in rows:
        lines.append(f"{r['config']:<36} {r['measured_gib']:9.2f} {r['default_gib']:9.2f} {r['default']:+7.1%} "
                     f"{r['card_gib']:9.2f} {r['card']:+7.1%}")
    for label in ("default", "card"):
        errors = [abs(r[label]) for r in rows]
        lines.append(f"{'default calibration' if label == 'default' else 'h100-80gb calibration'}: "
                     f"{error_summary(errors)} over {len(errors)} steps")
    return lines


def emulated_lines(runs: list[dict]) -> list[str]:
    lines = ["Runs on emulated cards (allocator limited; GiB):",
             f"{'config':<58} {'limit':>6} {'verdict':>12} {'ran':>4} {'predicted':>9} {'reserved':>9}"]
    for r in emulated_rows(runs):
        lines.append(f"{r['config']:<58} {r['limit_gib']:6.2f} {'fits' if r['fits'] else 'does not fit':>12} "
                     f"{'yes' if r['ran'] else 'OOM':>4} {r['predicted_gib']:9.2f} {r['reserved_gib']:9.2f}")
    return lines


def phase_lines(runs: list[dict]) -> list[str]:
    lines = ["Reserved per phase (GiB): the H100 against vram-plan trace's replay through the allocator model:",
             f"{'config':<36} {'phase':<11} {'measured':>9} {'trace':>7} {'error':>7}"]
    rows = phase_rows(runs)
    for r in rows:
        lines.append(f"{r['config']:<36} {r['phase']:<11} {r['measured_gib']:9.2f} {r['traced_gib']:7.2f} "
                     f"{r['traced_gib'] / r['measured_gib'] - 1:+7.1%}")
    errors = [abs(r["traced_gib"] / r["measured_gib"] - 1) for r in rows]
    return lines + [f"{error_summary(errors)} over {len(rows)} phases"]


def validation_lines(traced: bool) -> list[str]:
    lines = ["probe --validate runs on emulated cards, judged again (GiB; measured: peak reserved + context):",
             f"{'card':>5} {'config':<54} {'verdict':>12} {'ran':>4} {'predicted':>9} {'measured':>9} {'error':>7}"]
    judged = validation_rows(json.loads((RESULTS / "h100-probe-validation.json").read_text())["rows"], traced)
    for r in judged:
        measured = r["measured_gib"]
        lines.append(f"{r['capacity_gib']:5g} {r['config']:<54} {'fits' if r['fits'] else 'does not fit':>12} "
                     f"{'yes' if r['ran'] else 'OOM':>4} {r['predicted_gib']:9.2f} "
                     + (f"{measured:9.2f} {r['predicted_gib'] / measured - 1:+7.1%}" if measured else f"{'-':>9}")
                     + (f"  trace {r['traced_gib']:.2f} {r['traced_gib'] / measured - 1:+.1%}" if "traced_gib" in r
                        else ""))
    errors = [abs(r["predicted_gib"] / r["measured_gib"] - 1) for r in judged if r["measured_gib"]]
    lines.append(f"verdicts that match what happened: {sum(r['fits'] == r['ran'] for r in judged)} of {len(judged)}; "
                 f"wrong \"fits\": {sum(r['fits'] and not r['ran'] for r in judged)}; of the runs: "
                 f"{error_summary(errors)}")
    if traced:
        errors = [abs(r["traced_gib"] / r["measured_gib"] - 1) for r in judged if "traced_gib" in r]
        lines.append(f"vram-plan trace (reserved by the allocator model + context) against the runs: "
                     f"{error_summary(errors)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="store_true", help="also trace the runs on the CPU (minutes)")
    traced = parser.parse_args(argv).trace
    steps = json.loads((RESULTS / "h100-trl-steps.json").read_text())
    device = steps["device"]
    lines = [f"{device['gpu']}, driver {device['driver']}, CUDA {device['cuda']}, torch {device['torch']}, "
             f"transformers {device['transformers']}, TRL {device['trl']}, PEFT {device['peft']}", ""]
    lines += step_lines(steps["configs"]) + [""] + emulated_lines(steps["configs"])
    if traced:
        lines += [""] + phase_lines(steps["configs"])
    lines += [""] + validation_lines(traced)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    (RESULTS / "h100-compare.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
