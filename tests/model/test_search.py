"""The planner's search: fits, order of savers, reported savings, monotonicity."""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import FIXTURES, within_seconds
from vram_planner import engine
from vram_planner.model import search
from vram_planner.errors import ConfigError
from vram_planner.model.divisors import divisors, prime_factors
from vram_planner.model.search import (best_plan, micro_batch_sizes, micro_batch_variants, rungs, smallest_config,
                                       with_micro_batch)
from vram_planner.model.spec import MAX_COUNT, training_config, with_changes
from vram_planner.model.verdict import judge
from vram_planner.profiles import GpuProfile
from vram_planner.report.document import plan_report
from vram_planner.units import GiB


def gpu(gib: float, bf16: bool = True) -> GpuProfile:
    return GpuProfile(name=f"{gib}GiB", total_memory_gib=gib, bf16=bf16, flash_attention_2=bf16)


# the model the ladder's rungs are built for where a test names none
LLAMA = engine.make_context("Llama-3.2-1B", "24GiB").arch


def plan_for(model_file, gib, bf16=True, **kw):
    return engine.plan(str(model_file), gpu(gib, bf16), kw)


def assert_changes_are_truthful(result):
    """Every reported change saves memory, and replayed on the user's config they give the chosen one's peak."""
    assert all(c.saved_bytes >= 0 for c in result.changes), result.changes
    total_saved = sum(c.saved_bytes for c in result.changes)
    assert result.requested.estimate.peak_bytes - total_saved == pytest.approx(result.chosen.estimate.peak_bytes)


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
    assert_changes_are_truthful(result)


def test_micro_batch_variants_keep_generation_and_optimizer_batches():
    train = training_config({"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2})
    variants = list(micro_batch_variants(train))
    assert [v.per_device_train_batch_size for v in variants] == [8, 4, 2, 1]
    for v in variants:
        assert v.generation_batch_size == train.generation_batch_size
        assert v.per_device_train_batch_size * v.gradient_accumulation_steps == 16


def test_rungs_add_savers_in_order_of_cost():
    user = training_config({"gradient_checkpointing": False})
    first, *steps = list(rungs(user, gpu_bf16=True, arch=LLAMA))[1:]
    # expandable segments alone first (free); the savers after it keep the user's allocator
    assert first == with_changes(user, allocator_conf="expandable_segments:True")
    assert all(step.allocator_conf == "" for step in steps)
    steps = [user, *steps]
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
    steps = list(rungs(training_config({"mixed_precision": "fp16"}), gpu_bf16=False, arch=LLAMA))
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
    from helpers import LLAMA_1B
    from vram_planner.model.architecture import ModelArchitecture
    from vram_planner.model.calibration import Calibration
    from vram_planner.model.trl_releases import trl_release
    from vram_planner.model.verdict import Context

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
    assert_changes_are_truthful(result)


@pytest.mark.parametrize("knobs", [
    {"per_device_train_batch_size": 2**30},
    {"per_device_train_batch_size": 2**40, "gradient_accumulation_steps": 2**40},
    {"per_device_train_batch_size": 3**25, "steps_per_generation": 2**40, "num_generations": 3},
    {"per_device_train_batch_size": 2**31 - 1, "num_generations": 2**31 - 1},  # a prime: two micro-batches
    {"max_completion_length": 10**9, "max_prompt_length": 10**9},
    {"per_device_train_batch_size": 2**40, "num_generations": 2**40, "max_completion_length": 2**40},
])
def test_plan_time_does_not_grow_with_batch_or_lengths(knobs):
    # minutes before: every micro-batch from the requested one down to 1 was judged
    with within_seconds(2.0):
        result = engine.plan("Llama-3.2-1B", "24GiB", knobs)
    assert result.requested.train.per_device_train_batch_size == knobs.get("per_device_train_batch_size", 8)


def exhaustive_choice(context, user):
    """The ladder judged micro-batch by micro-batch, largest first: what the plan must choose."""
    for rung in rungs(user, context.gpu.bf16, context.arch):
        for variant in micro_batch_variants(rung):
            if judge(context, variant).fits:
                return variant
    return None


@pytest.mark.slow
@settings(max_examples=80, deadline=None, derandomize=True)
@given(model=st.sampled_from(sorted(p.name for p in FIXTURES.glob("tiny-*.json")) + ["Llama-3.2-1B", "Qwen2.5-0.5B"]),
       share=st.floats(-0.05, 1.05), groups=st.integers(1, 6), ga=st.integers(1, 6), s=st.none() | st.integers(1, 6),
       generations=st.sampled_from([2, 3, 4, 8]), completion=st.sampled_from([64, 300, 2048]),
       lora=st.booleans(), listed=st.sampled_from([2, 2**10]))
def test_the_search_chooses_what_the_exhaustive_search_chooses(model, share, groups, ga, s, generations, completion,
                                                               lora, listed):
    model = str(FIXTURES / model) if model.startswith("tiny") else model
    knobs = {"per_device_train_batch_size": groups * generations, "gradient_accumulation_steps": ga,
             "steps_per_generation": s, "num_generations": generations, "max_completion_length": completion,
             "lora_r": 8 if lora else None}
    # a card between what the bottom of the ladder and what the request needs, so that every rung gets chosen
    big = engine.make_context(model, gpu(1000))
    needs = judge(big, engine.make_training(big, knobs)).estimate.peak_bytes
    least = judge(big, smallest_config(engine.make_training(big, knobs), True, big.arch)).estimate.peak_bytes
    context = engine.make_context(model, gpu((least + share * (needs - least)) / 0.95 / GiB))
    user = engine.make_training(context, knobs)
    # `listed` 2: the list of micro-batches grows from 2 (to 4, 16, 256): the path huge batches take
    with mock.patch.object(search, "FIRST_LISTED_MICRO_BATCH", listed):
        result = best_plan(context, user)
    assert (result.chosen.train if result.fits else None) == exhaustive_choice(context, user)


def test_micro_batches_are_the_divisors_that_keep_both_batches():
    train = training_config({"per_device_train_batch_size": 6, "gradient_accumulation_steps": 2,
                             "steps_per_generation": 4, "num_generations": 2})
    # 6 x 2 = 12 sequences per optimizer step and 6 x 4 = 24 per generation round: 4 divides both, 5 neither
    assert [v.per_device_train_batch_size for v in micro_batch_variants(train)] == [6, 4, 3, 2, 1]
    # 3**20 generation rounds per optimizer step: only powers of two divide both 2**40 x 3**20 and 2**40
    huge = training_config({"per_device_train_batch_size": 2**40, "gradient_accumulation_steps": 3**20,
                            "steps_per_generation": 1})
    # ... and of those, only micro-batches of 3**20 or more keep the accumulation steps countable (2**40 at most)
    assert micro_batch_sizes(huge) == [2**k for k in range(40, 31, -1)]
    assert with_micro_batch(huge, 2**32).gradient_accumulation_steps == 2**8 * 3**20 <= MAX_COUNT


def test_every_reported_change_saves_memory_and_they_add_up():
    # a smaller micro-batch turns on accumulation, so full fine-tuning's gradients persist through the forward:
    # applied before bf16 weights and LoRA it cost 15 GiB ("saves -15.16 GiB" at 1024 tokens with the flat reserve)
    result = engine.plan("Qwen2.5-7B-Instruct", "rtx4090", {"max_completion_length": 1536})
    assert result.fits and [c.knob for c in result.changes][-1] == "per_device_train_batch_size"
    assert_changes_are_truthful(result)


def knob_part(change, knob: str) -> tuple[str, str] | None:
    """(before, after) of one knob of a change, merged ("lora_r + load_in_4bit") or not; None if it is not there."""
    knobs = change.knob.split(" + ")
    if knob not in knobs:
        return None
    if len(knobs) == 1:
        return str(change.before), str(change.after)
    i = knobs.index(knob)
    return str(change.before).split(", ")[i], str(change.after).split(", ")[i]


def test_the_generation_batch_shrinks_when_steps_per_generation_is_one():
    # 1024 completions per round do not fit 24 GiB whatever the savers; 512 do
    result = engine.plan("Llama-3.2-1B", "24GiB", {"per_device_train_batch_size": 1024})
    assert result.fits
    chosen = result.chosen.train
    assert chosen.generation_batch_size <= 512 and chosen.generation_batch_size % chosen.num_generations == 0
    shrunk = [part for c in result.changes if (part := knob_part(c, "generation_batch_size"))]
    assert shrunk and shrunk[0] == ("1024", str(chosen.generation_batch_size))


def test_the_generation_batch_rung_halves_the_batch_within_trl_rules():
    user = training_config({"per_device_train_batch_size": 24, "num_generations": 3})
    sizes = [r.generation_batch_size for r in rungs(user, gpu_bf16=True, arch=LLAMA) if r.num_generations == 3]
    assert 12 in sizes and 3 in sizes and all(size % 3 == 0 for size in sizes)
    # half, rounded down to a multiple of the group size
    user = training_config({"per_device_train_batch_size": 1000, "num_generations": 8})
    sizes = [r.generation_batch_size for r in rungs(user, gpu_bf16=True, arch=LLAMA) if r.num_generations == 8]
    assert sorted(set(sizes), reverse=True) == [1000, 496, 248, 120, 56, 24, 8]


def test_a_change_that_costs_memory_is_reported_with_the_one_that_pays_for_it():
    # 1024 sequences per micro-batch: LoRA's fp32 copies of the adapted linears' inputs outweigh the gradients and
    # optimizer states it frees, and 4-bit base weights pay for them
    result = engine.plan("Llama-3.2-1B", "24GiB", {"per_device_train_batch_size": 1024})
    context, bf16 = result.requested.context, with_changes(result.requested.train, dtype="bfloat16")
    assert judge(context, with_changes(bf16, lora_r=16)).estimate.peak_bytes > judge(context, bf16).estimate.peak_bytes
    # (with the generation batch halved too, at 1024 sequences: the fp32 copy of the MLP's intermediate that the
    # adapter on its output projection reads is also the largest block each layer's backward asks for)
    merged = [c for c in result.changes if "+" in c.knob]
    assert merged and knob_part(merged[0], "lora_r") == ("None", "16")
    assert knob_part(merged[0], "load_in_4bit") == ("False", "True")
    assert_changes_are_truthful(result)


def test_the_ladder_keeps_an_on_policy_run_on_policy():
    # gradient_accumulation_steps a multiple of steps_per_generation: TRL computes no old log-probs. Halving S from 5
    # to 2 would make it compute them (more memory, and memory no longer falling along the run the plan bisects)
    user = training_config({"per_device_train_batch_size": 8, "gradient_accumulation_steps": 5,
                            "steps_per_generation": 5})
    ladder = list(rungs(user, gpu_bf16=True, arch=LLAMA))
    assert not user.computes_old_logps and not any(r.computes_old_logps for r in ladder)
    assert [r.steps_per_generation for r in ladder][-1] == 1


def test_divisors_are_every_divisor_and_huge_numbers_factor_quickly():
    for n in range(1, 1500):
        assert divisors(n) == [d for d in range(n, 0, -1) if n % d == 0]
    assert divisors(720, at_most=10) == [10, 9, 8, 6, 5, 4, 3, 2, 1]
    # semiprimes of two 31- and 61-bit primes, a 127-bit prime, a square of a 61-bit prime
    with within_seconds(2.0):
        assert prime_factors((2**31 - 1) * (2**61 - 1)) == {2**31 - 1: 1, 2**61 - 1: 1}
        assert prime_factors(2**127 - 1) == {2**127 - 1: 1}
        assert prime_factors((2**61 - 1) ** 2 * 12) == {2: 2, 3: 1, 2**61 - 1: 2}


@settings(max_examples=40, deadline=None)
@given(gib=st.sampled_from([3, 6, 8, 12, 16, 24]), knobs=st.fixed_dictionaries({}, optional={
    "per_device_train_batch_size": st.sampled_from([2, 8, 32]), "max_completion_length": st.sampled_from([256, 2048]),
    "use_vllm": st.just(True), "optim": st.sampled_from(["adamw_torch", "adamw_8bit"]),
    "gradient_accumulation_steps": st.sampled_from([1, 4]), "steps_per_generation": st.sampled_from([1, 4])}))
def test_the_changes_settings_make_the_chosen_config(gib, knobs):
    # what --json's changes carry for a program to apply: a smaller micro-batch sets the accumulation too
    try:
        result = engine.plan("Qwen2.5-1.5B", gpu(gib), {"num_generations": 8, **knobs})
    except ConfigError:
        return  # a batch TRL refuses
    if not result.fits:
        return
    settings_ = {name: value for change in result.changes for name, value in change.settings.items()}
    assert with_changes(result.requested.train, **settings_) == result.chosen.train
    reported = plan_report(result).changes
    assert [c.settings for c in reported] == [
        {name: getattr(value, "value", value) for name, value in c.settings.items()} for c in result.changes]
