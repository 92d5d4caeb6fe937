"""benchmarks/step_time.py: it compares every committed H100 timing, and its results file is the one committed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_time.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("step_time_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


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


def test_the_committed_results_are_what_the_script_prints(bench, capsys, tmp_path):
    bench.main(tmp_path / "step_time.txt")
    assert capsys.readouterr().out == bench.OUT.read_text() == (tmp_path / "step_time.txt").read_text()
