"""`check --json` and `plan --json` say where the CUDA context figure came from: the GPU catalog or a calibration."""

from __future__ import annotations

import json

from helpers import run
from vram_planner.model.cuda_context import catalog_figure
from vram_planner.profiles import GpuProfile


def _check(capsys, *args):
    code, out, _ = run(capsys, "check", "--model", "Qwen2.5-0.5B", "--lora-r", "16", "--json", *args)
    assert code in (0, 1)
    return json.loads(out)


def test_the_catalog_figure_and_its_source(capsys):
    doc = _check(capsys, "--gpu", "rtx4090")
    figure = catalog_figure(GpuProfile.from_name("rtx4090"))
    assert {p["components"]["cuda_context"] for p in doc["phases"]} == {figure.bytes}
    assert doc["cuda_context_source"] == figure.source and "Ada" in doc["cuda_context_source"]
    assert doc["calibration"] == "default"  # the existing field is kept


def test_a_card_given_by_size_says_so(capsys):
    doc = _check(capsys, "--gpu", "24GiB")
    assert "not in the GPU catalog" in doc["cuda_context_source"]


def test_a_calibration_with_a_measured_context_is_named(capsys, tmp_path):
    calibration = tmp_path / "probe.json"
    calibration.write_text(json.dumps({"name": "probe", "gpu": "rtx4090", "measured": {"cuda": "12.8"},
                                       "cuda_context_bytes": 300 * 2**20}))
    doc = _check(capsys, "--gpu", "rtx4090", "--calibration", str(calibration))
    assert {p["components"]["cuda_context"] for p in doc["phases"]} == {300 * 2**20}
    assert doc["cuda_context_source"].startswith("calibration probe (rtx4090): measured by vram-plan probe")
