"""The probe measures its points one after another in one process: a step's models must be gone from the card before
the next point is measured. On an H100 (2026-11-23) each point after the first measured the previous point's model
and gradients too (Qwen2.5-0.5B LoRA 6.0 GiB allocated where TRL's own run allocates 2.0), because the cache was
emptied while the step's frame still named the model, a reference cycle that only gc frees."""

from __future__ import annotations

import weakref

import pytest
import torch

from helpers import FIXTURES

from vram_planner.model.spec import TrainingConfig
from vram_planner.probe import cuda
from vram_planner.probe.fit import ProbePoint
from vram_planner.tracing import session as tracing_session


@pytest.fixture
def cpu_measurer(monkeypatch):
    """The CUDA measurer running its steps on the CPU, with torch.cuda's statistics answered by nothing."""
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    for name in ("max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda: 0)
    measurer = object.__new__(cuda.CudaMeasurer)  # no CUDA device to initialise
    measurer.device_type = "cpu"
    return measurer


@pytest.mark.slow
@pytest.mark.parametrize("lora_r", [None, 16])
def test_every_model_of_a_step_is_freed_before_the_cache_is_emptied(cpu_measurer, monkeypatch, lora_r):
    built: list[weakref.ref] = []
    original = tracing_session._build_model

    def build(*args, **kwargs):
        model = original(*args, **kwargs)
        built.append(weakref.ref(model))
        return model

    monkeypatch.setattr(tracing_session, "_build_model", build)
    alive_at_release: list[int] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: alive_at_release.append(sum(r() is not None for r in built)))
    train = TrainingConfig(per_device_train_batch_size=2, num_generations=2, max_prompt_length=8,
                           max_completion_length=4, lora_r=lora_r, mixed_precision="no")
    measured = cpu_measurer.measure(ProbePoint(str(FIXTURES / "tiny-llama-headdim.json"), train))
    assert [p.name for p in measured.phases] == ["generation", "training", "optimizer"]
    assert built and alive_at_release[-1] == 0
