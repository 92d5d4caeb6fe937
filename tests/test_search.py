"""The planner's search: fits, order of savers, reported savings, monotonicity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vram_planner import api
from vram_planner.profiles import GpuProfile
from vram_planner.search import best_plan, micro_batch_variants, rungs
from vram_planner.spec import training_config
from vram_planner.units import GiB


def gpu(gib: float, bf16: bool = True) -> GpuProfile:
    return GpuProfile(name=f"{gib}GiB", total_memory_gib=gib, bf16=bf16, flash_attention_2=bf16)


def plan_for(model_file, gib, bf16=True, **kw):
    return api.plan(str(model_file), gpu(gib, bf16), kw)


def test_a_big_card_needs_no_changes(llama_1b_file):
    result = plan_for(llama_1b_file, 80)
    assert result.fits and result.changes == () and result.rank == (0, -8)


def test_laptop_card_plan_fits_and_explains_itself(llama_1b_file):
    result = plan_for(llama_1b_file, 15.73)
    assert result.fits
    chosen = result.chosen
    assert chosen.estimate.peak_bytes <= 15.73 * GiB * 0.95
    assert not result.requested.fits
    assert result.changes and all(c.saved_bytes > 0 for c in result.changes)
    # the changes replayed on the user's config give the chosen one's peak
    total_saved = sum(c.saved_bytes for c in result.changes)
    assert result.requested.estimate.peak_bytes - total_saved == pytest.approx(chosen.estimate.peak_bytes)


def test_micro_batch_variants_keep_generation_and_optimizer_batches():
    train = training_config({"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2})
    variants = list(micro_batch_variants(train))
    assert [v.per_device_train_batch_size for v in variants] == [8, 4, 2, 1]
    for v in variants:
        assert v.generation_batch_size == train.generation_batch_size
        assert v.per_device_train_batch_size * v.gradient_accumulation_steps == 16


def test_rungs_add_savers_in_order_of_cost():
    steps = list(rungs(training_config({"gradient_checkpointing": False}), gpu_bf16=True))
    assert steps[1].gradient_checkpointing
    assert steps[2].optim.value == "adamw_8bit"
    assert steps[3].dtype == "bfloat16" and steps[3].lora_r is None
    assert steps[4].lora_r == 16 and steps[4].optim.value == "adamw_torch_fused"
    assert steps[5].load_in_4bit
    # then only the semantics: completion length first, then the group size
    tail = steps[6:]
    assert tail[0].max_completion_length == 256 and tail[0].num_generations == 8
    assert tail[-1].num_generations == 2 and tail[-1].max_completion_length == 64


def test_no_bf16_card_skips_bf16_weights_and_uses_float16_lora():
    steps = list(rungs(training_config({"mixed_precision": "fp16"}), gpu_bf16=False))
    assert all(s.dtype != "bfloat16" for s in steps)
    assert any(s.lora_r and s.dtype == "float16" for s in steps)


def test_nothing_fits_on_a_tiny_card(llama_1b_file):
    result = plan_for(llama_1b_file, 0.5)
    assert not result.fits and result.chosen is None
    assert result.smallest.estimate.peak_bytes > 0.5 * GiB * 0.95


@settings(max_examples=40, deadline=None)
@given(small=st.floats(1.0, 60.0), extra=st.floats(0.0, 40.0),
       completion=st.sampled_from([128, 512, 2048]), beta=st.sampled_from([0.0, 0.04]),
       ga=st.sampled_from([1, 2, 4]))
def test_more_memory_never_gives_a_worse_plan(small, extra, completion, beta, ga):
    from conftest import LLAMA_1B
    from vram_planner.architecture import ModelArchitecture
    from vram_planner.calibration import Calibration
    from vram_planner.trl_releases import trl_release
    from vram_planner.verdict import Context

    arch = ModelArchitecture.from_config(LLAMA_1B)
    train = training_config({"max_completion_length": completion, "beta": beta, "gradient_accumulation_steps": ga})
    release, cal = trl_release("1.16.0"), Calibration()
    smaller = best_plan(Context(arch, gpu(small), release, cal), train)
    larger = best_plan(Context(arch, gpu(small + extra), release, cal), train)
    if smaller.fits:
        assert larger.fits and larger.rank <= smaller.rank


def test_changes_that_cannot_stand_alone_are_reported_together(llama_1b_file):
    # on a card without bf16, LoRA comes with float16 weights, which full fine-tuning cannot use alone
    result = plan_for(llama_1b_file, 10, bf16=False, mixed_precision="fp16")
    assert result.fits and result.chosen.train.dtype == "float16" and result.chosen.train.lora_r == 16
    merged = [c for c in result.changes if c.knob == "dtype + lora_r"]
    assert merged and merged[0].before == "float32, None" and merged[0].after == "float16, 16"
    total_saved = sum(c.saved_bytes for c in result.changes)
    assert result.requested.estimate.peak_bytes - total_saved == pytest.approx(result.chosen.estimate.peak_bytes)
