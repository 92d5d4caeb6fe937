"""Exact once, then instant: `check --exact --keep-copy` keeps the step's copy, and `check` near the boundary at other
lengths answers from it, torch-free, as the exact engine answers on the same cards."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from helpers import FIXTURES
from vram_planner import api, engine
from vram_planner.app import views
from vram_planner.errors import ConfigError
from vram_planner.profiles import GpuProfile
from vram_planner.step_copy.make import with_layers
from vram_planner.units import GiB

pytestmark = pytest.mark.slow
CONFIG = with_layers(json.loads((FIXTURES / "tiny-qwen3.json").read_text()), 7)
SETTINGS = {"per_device_train_batch_size": 8, "num_generations": 8, "max_prompt_length": 32,
            "max_completion_length": 64, "dtype": "bfloat16", "lora_r": 8}
H100 = GpuProfile.from_name("h100-80gb")


def card(capacity_bytes: int) -> GpuProfile:
    return replace(H100, name=f"{capacity_bytes} bytes", total_memory_gib=capacity_bytes / GiB)


def test_check_near_the_boundary_answers_from_the_kept_copy_as_the_exact_engine_does():
    pytest.importorskip("trl")
    report = api.check(CONFIG, "2GiB", SETTINGS, exact=True, keep_copy=True)
    assert report.kept_copy.startswith("kept the exact engine's copy of this step in ")
    assert "Kept the exact engine's copy" in views.exact_markdown(report)  # the web page says it too
    other = {**SETTINGS, "max_prompt_length": 40, "max_completion_length": 80}
    need = engine.check(CONFIG, card(2 * GiB), other, exact=True).need_bytes
    replayed = 0
    for capacity in (need - (4 << 20), need - (2 << 20), need, need + (2 << 20)):
        exact = engine.check(CONFIG, card(capacity), other, exact=True)
        verdict = engine.check(CONFIG, card(capacity), other)
        if verdict.replayed is not None:  # near the boundary by the estimate: the copy decides
            replayed += 1
            assert verdict.fits == exact.fits and not verdict.near_boundary
    assert replayed == 4
    # no copy answers for other knobs
    assert engine.check(CONFIG, card(need), {**other, "lora_r": 16}).replayed is None


def test_keep_copy_without_exact_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="keep_copy keeps the copy that exact makes"):
        engine.check(CONFIG, H100, SETTINGS, keep_copy=True)
    run = subprocess.run([sys.executable, "-m", "vram_planner", "check", "--gpu", "h100-80gb", "--model",
                          "Qwen3-0.6B", "--keep-copy"], capture_output=True, text=True)
    assert run.returncode == 2 and "--exact" in run.stderr and "Traceback" not in run.stderr
