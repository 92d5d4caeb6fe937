"""The exact engine held to what an H200 did (2026-11-26; benchmarks/results/gpu/h200-boundary.json, made by
benchmarks/device_session.sh; `python benchmarks/gpu_boundary.py table` prints the comparison): each boundary point's
TRL step ran with the allocator limited to the need the allocator model bisects, less 2% and plus 2%."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from vram_planner import engine
from vram_planner.model.calibration import default_calibration

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results" / "gpu"
RUNS = json.loads((RESULTS / "h200-boundary.json").read_text())["configs"]
MEASURED = [run for run in RUNS if "error" not in run]


def _exact(run: dict):
    """Today's exact check of a run's point (vram_planner.engine.TraceOutcome), traced once for this file's tests:
    the calls ran the same points, and none of these tests patches what a trace runs."""
    return _exact_of(run["model"], json.dumps(run["settings"], sort_keys=True))


@functools.lru_cache(maxsize=None)
def _exact_of(model: str, settings: str):
    return engine.check(model, "h100-80gb", json.loads(settings), exact=True, calibration=default_calibration())


def test_every_run_on_the_h200_is_judged():
    # the fixtures' vision config failed to load in `run` (no image processor in its folder); every other point ran
    assert {run["point"] for run in RUNS if "error" in run} == {"tiny-gemma3-vision full beta",
                                                                "tiny-gemma3-vision lora B32"}
    assert len(MEASURED) == 44


def _last_step_allocated_bytes(point: str) -> int:
    """What PyTorch had allocated at the peak of the last step the H200 ran of this point (the +2% run)."""
    run = next(run for run in MEASURED if run["point"] == point and run["factor"] > 1)
    last = max(row["step"] for row in run["phases"])
    return max(row["allocated_peak_bytes"] for row in run["phases"] if row["step"] == last)


@pytest.mark.slow
@pytest.mark.parametrize("point", sorted({run["point"] for run in MEASURED
                                          if not run["ran"] or run["model"].endswith(".json")}))
def test_the_need_holds_what_the_gpu_allocated_and_more_than_it_ran_out_under(point):
    """Today's exact need of each fixture point and each point the H200 ran out on: at least what the GPU had
    allocated at its step's peak, and above every limit under which it ran out (a 'fits' there would crash). The
    points that ran at the need less 2% (the fixtures' full fine-tuning, by about 30 MiB of reserve; SmolLM2 LoRA at
    128 sequences) are where the engine is conservative."""
    runs = [run for run in MEASURED if run["point"] == point]
    need = _exact(runs[0]).need.capacity_bytes
    assert need >= _last_step_allocated_bytes(point), (need, _last_step_allocated_bytes(point))
    for run in runs:
        if not run["ran"]:
            assert need > run["limit_bytes"], (run["name"], need, run["limit_bytes"])


def test_no_point_ran_out_of_memory_above_its_need():
    assert all(run["ran"] for run in MEASURED if run["factor"] > 1)


# 2026-12-04's calls (h200-boundary-2026-12-04.json): the fixtures again (the same outcomes), two placement runs of
# SmolLM2's eager point and the catalog points. Where the GPU ran out of memory above today's need, the engine is
# short and a "fits" there would crash: known until the next GPU call's out-of-memory snapshots show what the allocator
# model misses (benchmarks/device_session.sh brackets them at +5% to +20%).
LATER = json.loads((RESULTS / "h200-boundary-2026-12-04.json").read_text())["configs"]
SHORT_OF_THE_GPU = {
    # ran out at +2% (4602 MiB) asking the tied embedding's 260 MiB gradient in step 2's LM head backward, where the
    # allocator model runs it; at -2% the GPU ran out on the 256 MiB before it, the model on that gradient
    "Qwen2.5-0.5B full c512 B8": "ran out at 4602 MiB, need 4512",
    # ran out in step 1's loss asking eager attention's 320 MiB score gradient, at 2499 and 2750 MiB; the GPU's
    # generation reserved 1206 MiB where the allocator model reserves 1108
    "SmolLM2-135M fp32 lora c1024 eager": "ran out at 2750 MiB, need 2450",
}


def _later_configs() -> dict[str, list[dict]]:
    """The runs of 2026-12-04 that ran out of memory, by config (both placement points are one config on the GPU)."""
    grouped: dict[str, list[dict]] = {}
    for run in LATER:
        if not run["model"].endswith(".json") and any(not r["ran"] for r in LATER if r["point"] == run["point"]):
            grouped.setdefault(run["point"].split(" (")[0], []).append(run)
    return grouped


@pytest.mark.slow
@pytest.mark.parametrize("config", [pytest.param(name, marks=pytest.mark.xfail(
    name in SHORT_OF_THE_GPU, reason=SHORT_OF_THE_GPU.get(name, ""), strict=True)) for name in sorted(_later_configs())])
def test_the_need_is_above_every_limit_the_h200_ran_out_under_on_2026_12_04(config):
    runs = _later_configs()[config]
    need = _exact(runs[0]).need.capacity_bytes
    assert all(need > run["limit_bytes"] for run in runs if not run["ran"]), need
    assert all(need <= run["limit_bytes"] * 1.02 / 0.98 for run in runs if run["ran"] and run["factor"] > 1)


def test_the_2026_12_04_fixture_runs_repeat_the_2026_11_26_outcomes():
    """The fixtures ran again on another H200 machine a week later: each run's outcome and its allocated peaks are
    the same, so the GPU side of these points is reproducible (the vision fixture's, which failed to load on
    2026-11-26, ran and bracketed its need)."""
    earlier = {run["name"]: run for run in MEASURED}
    repeated = [run for run in LATER if run["model"].endswith(".json") and run["name"] in earlier]
    assert len(repeated) == 20
    for run in repeated:
        first = earlier[run["name"]]
        assert run["ran"] == first["ran"], run["name"]
        if run["ran"]:
            assert [p["allocated_peak_bytes"] for p in run["phases"]] == \
                [p["allocated_peak_bytes"] for p in first["phases"]], run["name"]


def _bracketed_runs() -> list[dict]:
    """The +2% run of each point a call bracketed (out of memory at the need less 2%, ran at plus 2%), the later
    call's where both did."""
    runs = {}
    for call in (MEASURED, [run for run in LATER if "error" not in run]):
        for run in call:
            below = [r for r in call if r["point"] == run["point"] and r["factor"] < 1]
            if run["factor"] > 1 and run["ran"] and below and not any(r["ran"] for r in below):
                runs[run["point"]] = run
    return [runs[point] for point in sorted(runs)]


@pytest.mark.slow
@pytest.mark.parametrize("run", _bracketed_runs(), ids=lambda run: run["point"])
def test_the_allocator_model_reserves_what_the_gpu_reserved_under_the_same_limit(run):
    """Where the GPU bracketed the need, the caching allocator model, replaying the traced step under the limit the
    GPU ran under (its need plus 2%), holds what the GPU reserved in its last step within 2%. On a card with room it
    would hold more (4.2 times what the GPU held for Qwen3-0.6B's LoRA with a reference model: a decoding step's
    larger cache cannot reuse the last step's block), so only the same limit compares the two."""
    from helpers import benchmark_module

    gpu_boundary = benchmark_module("gpu_boundary")
    _, gpu_reserved = gpu_boundary.gpu_last_step_peaks(run)
    _, held = gpu_boundary.replayed_peaks(_exact(run), run["limit_bytes"])
    assert held is not None, "the allocator model ran out under the limit the GPU ran under"
    assert abs(held / gpu_reserved - 1) <= 0.02, (held, gpu_reserved)
