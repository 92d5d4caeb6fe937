"""Calibration profiles: the defaults, a probe's profile for a GPU, an explicit file."""

from __future__ import annotations

import json

import pytest

from vram_planner import engine
from vram_planner.errors import ProfileError
from vram_planner.model.calibration import Calibration, calibration_for, default_calibration
from vram_planner.profiles import GpuProfile
from vram_planner.validation import to_json


def test_defaults_ship_with_sources():
    cal = default_calibration()
    assert cal.name == "default" and cal.gpu is None and cal.source
    # the allocator's reserve is the function fitted over replays, not a measured fraction (no probe has run)
    assert cal.allocator_overhead_fraction is None
    assert set(cal.allocator_reserve) == {"default", "expandable_segments"}


def test_a_probe_calibration_for_the_gpu_is_picked_up(_private_home, llama_1b_file):
    folder = _private_home / "calibrations"
    folder.mkdir()
    measured = Calibration(name="probe-2026-11-22", gpu="card", cuda_context_bytes=0, allocator_overhead_fraction=0)
    (folder / "card.json").write_text(to_json(measured))
    assert calibration_for("card") == measured
    gpu = GpuProfile(name="card", total_memory_gib=24)
    verdict = engine.check(str(llama_1b_file), gpu, {"lora_r": 8, "dtype": "bfloat16"})
    assert verdict.context.calibration.name == "probe-2026-11-22"
    assert all(p.components["cuda_context"] == 0 for p in verdict.estimate.phases)


def test_explicit_file_wins_and_bad_files_are_clear(tmp_path):
    good = tmp_path / "cal.json"
    good.write_text(json.dumps({"name": "mine", "cuda_context_bytes": 1}))
    assert calibration_for("anything", good).name == "mine"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "mine", "unknown_coefficient": 1}))
    with pytest.raises(ProfileError, match="not a valid calibration"):
        calibration_for("anything", bad)
