"""cast_lm_head_to_fp32 in the planner: where TRL has it and runs it, what it costs, and what the plan recommends with
it. The trace's side is tests/tracing/test_cast_lm_head.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import family_fixture_files
from vram_planner import engine
from vram_planner.errors import ConfigError
from vram_planner.model.grpo_config import grpo_config_kwargs
from vram_planner.model.search import rungs
from vram_planner.model.trl_releases import trl_releases, version_tuple
from vram_planner.model.verdict import judge
from vram_planner.profiles import models

CAST = {"cast_lm_head_to_fp32": True}


def refusal(model: str, knobs: dict, trl_version: str | None = None) -> str:
    context = engine.make_context(model, "h100-80gb", trl_version=trl_version)
    with pytest.raises(ConfigError) as refused:
        engine.make_training(context, {**knobs, **CAST})
    return str(refused.value)


def test_trl_releases_before_0_25_have_no_such_field():
    assert "not a GRPOConfig field in TRL 0.24.0 (it came in 0.25)" in refusal("Qwen2.5-0.5B", {}, "0.24.0")


@pytest.mark.parametrize("knobs", [{"zero_stage": 2, "num_gpus": 2}, {"zero_stage": 3, "num_gpus": 8},
                                   {"fsdp": True, "num_gpus": 2}])
def test_zero_and_fsdp_are_refused_as_not_modelled(knobs):
    assert "planned on one GPU or DDP only" in refusal("Qwen2.5-7B", knobs)


def test_16_bit_weights_before_the_fused_head_are_refused_and_float32_weights_planned_as_without_the_cast():
    """TRL 0.25-1.14 project full logits through the cast head under autocast: with float32 weights (their default)
    that is the same computation as without it, so the plan is the same; over 16-bit weights it is not modelled."""
    assert "planned from TRL 1.15 on" in refusal("Qwen2.5-0.5B", {"dtype": "bfloat16"}, "1.0.0")
    context = engine.make_context("Qwen2.5-0.5B", "h100-80gb", trl_version="1.0.0")
    plain, cast = (judge(context, engine.make_training(context, knobs)).estimate for knobs in ({}, CAST))
    assert plain.phases == cast.phases


@pytest.mark.parametrize("fixture", family_fixture_files(), ids=lambda path: path.stem)
def test_lora_over_tied_embeddings_is_refused_as_trl_fails_there(fixture):
    """TRL hooks `model.model.embed_tokens` of a tied model, which PEFT's wrapper and a multimodal model lack."""
    context = engine.make_context(str(fixture), "h100-80gb")
    arch = context.arch
    for knobs in ({"lora_r": 8, "dtype": "bfloat16"}, {}):
        fails = arch.tie_word_embeddings and ("lora_r" in knobs or bool(arch.vision_params))
        if fails:
            assert "embed_tokens" in refusal(str(fixture), knobs)
        else:
            engine.make_training(context, {**knobs, **CAST})


@settings(max_examples=40, deadline=None, derandomize=True)
@given(model=st.sampled_from([entry.name for entry in models()]), dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
       mixed=st.sampled_from(["bf16", "fp16", "no"]), lora=st.booleans(), beta=st.sampled_from([0.0, 0.04]),
       checkpointing=st.booleans(), completion=st.sampled_from([64, 1024]))
def test_the_cast_raises_every_phase_over_16_bit_weights_and_is_free_in_float32_without_autocast(model, dtype, mixed, lora, beta,
                                                                                checkpointing, completion):
    context = engine.make_context(model, "h100-80gb")
    knobs = {"dtype": dtype, "mixed_precision": mixed, "lora_r": 8 if lora else None, "beta": beta,
             "gradient_checkpointing": checkpointing, "max_completion_length": completion}
    try:
        plain = engine.make_training(context, knobs)
        cast = engine.make_training(context, {**knobs, **CAST})
    except ConfigError:
        return  # a combination TRL or the card refuses, with or without the cast
    before, after = (judge(context, train).estimate for train in (plain, cast))
    if dtype != "float32":  # every copy of the head and all its work float32 instead of 16-bit
        for a, b in zip(before.phases, after.phases, strict=True):
            assert b.tensor_bytes > a.tensor_bytes, (a.name, a.tensor_bytes, b.tensor_bytes)
    elif mixed == "no":
        assert before.phases == after.phases
    # float32 weights under autocast: the fused head's float32 tiles against the bf16 casts of the weight's vocabulary
    # chunks that it no longer makes; either may weigh more (the trace decides: tests/tracing/test_cast_lm_head.py)


def test_the_ladder_leaves_out_lora_where_trl_cannot_cast_and_keeps_it_where_it_can():
    for model, tied in (("Qwen2.5-0.5B", True), ("Qwen2.5-7B", False)):
        context = engine.make_context(model, "h100-80gb")
        user = engine.make_training(context, CAST)
        ladder = list(rungs(user, True, context.arch))
        assert all(rung.cast_lm_head_to_fp32 for rung in ladder)
        assert any(rung.uses_lora for rung in ladder) is not tied
    result = engine.plan("Qwen2.5-0.5B", "8GiB", CAST)
    assert all(not v.train.uses_lora for v in (result.chosen, result.smallest) if v is not None)


def test_the_plan_writes_the_field_for_trl_and_the_real_grpo_config_takes_it(tmp_path):
    from trl import GRPOConfig

    train = engine.make_training(engine.make_context("Qwen2.5-7B", "h100-80gb"), {"dtype": "bfloat16", **CAST})
    kwargs = grpo_config_kwargs(train)
    assert kwargs["cast_lm_head_to_fp32"] is True
    assert GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kwargs).cast_lm_head_to_fp32
    assert "cast_lm_head_to_fp32" not in grpo_config_kwargs(engine.make_training(
        engine.make_context("Qwen2.5-7B", "h100-80gb"), {}))


def test_every_release_row_from_0_25_plans_the_cast_and_none_before():
    for row in trl_releases():
        context = engine.make_context("Qwen2.5-7B", "h100-80gb", trl_version=row.min_version)
        try:
            engine.make_training(context, CAST)
            planned = True
        except ConfigError:
            planned = False
        assert planned == (version_tuple(row.min_version) >= (0, 25, 0)), row.min_version
