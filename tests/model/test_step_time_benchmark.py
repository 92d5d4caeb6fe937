"""benchmarks/step_time.py: it compares every committed H100 and H200 timing, and its results file and the H200's
calibration are the ones committed."""

from __future__ import annotations

import pytest

from helpers import benchmark_module


@pytest.fixture(scope="module")
def bench():
    return benchmark_module("step_time")


def test_spearman_is_rank_correlation(bench):
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert bench.spearman([1, 2, 3, 4], [1, 100, 2, 1000]) == pytest.approx(0.8)  # 1 - 6 * 2 / (4 * 15)


def test_every_committed_run_that_trained_is_compared(bench):
    import json

    runs = json.loads((bench.GPU_RESULTS / "h100-trl-steps.json").read_text())["configs"]
    rows = bench.trl_rows()
    assert [r["name"] for r in rows] == [r["name"] for r in runs if r.get("ran") is not False]
    assert all(r["predicted"] > 0 for r in rows)
    record = json.loads((bench.GPU_RESULTS / "h100-probe-record.json").read_text())
    assert len(bench.probe_rows()) == len(record["points"])


def test_every_h200_run_that_timed_its_steps_is_compared(bench):
    import json

    runs = json.loads((bench.GPU_RESULTS / "h200-step-times.json").read_text())["configs"]
    compared = bench.h200_runs()
    assert [r["name"] for r in compared] == [r["name"] for r in runs if r.get("step_seconds")]
    assert len(compared) >= 10 and sum(bool(r["last_phases"]) for r in compared) == 5 + 8  # calls 4 and 5
    # a run without phases is fitted by its whole step, one with them by each phase
    assert [s.phase for s in bench.h200_samples(compared[0])] == ["step"]
    assert {s.phase for s in bench.h200_samples(compared[-1])} == {"decoding", "training", "optimizer"}
    logged = bench.h200_run_rows({"Qwen2.5-0.5B": 58, "Llama-3.2-1B": 53})
    assert [len(rows) for rows in logged.values()] == [2, 2]
    assert all(r["measured"] > 1 and r["predicted"] > 1 for rows in logged.values() for r in rows)


@pytest.mark.slow
def test_the_committed_results_are_what_the_script_prints(bench, capsys, tmp_path):
    """The tables, and the H200's calibration the fit writes (the defaults' memory coefficients kept)."""
    from vram_planner.model.calibration import calibration_for, default_calibration, load_calibration_file

    bench.main(tmp_path / "step_time.txt", tmp_path / "h200.json")
    assert capsys.readouterr().out == bench.OUT.read_text() == (tmp_path / "step_time.txt").read_text()
    written = load_calibration_file(tmp_path / "h200.json")
    assert written == calibration_for("h200")
    # what the H200's phases bind: decoding's and the loss's launches, the optimizer's streams and its Python loop
    assert set(written.step_time) == {"op_seconds", "train_op_seconds", "optimizer_bandwidth", "tensor_seconds"}
    default = default_calibration()
    assert written.allocator_reserve == default.allocator_reserve
    assert written.backward_mlp_bytes == default.backward_mlp_bytes


def test_every_published_run_that_gives_its_step_time_is_compared(bench):
    public = benchmark_module("public_measurements")
    timed = [row for row in public.load_rows(public.DATA) if "measured_step_seconds" in row]
    rows = bench.public_step_rows()
    assert len(timed) >= 10 and [r["name"] for r in rows] == [row["id"] for row in timed]
    assert all(r["predicted"] > 0 and r["measured"] == row["measured_step_seconds"] for r, row in zip(rows, timed))
