"""Ranking every config that fits by predicted step time."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import within_seconds
from vram_planner import api, engine
from vram_planner.errors import ConfigError
from vram_planner.model.ranking import SPEED_KNOBS, knob_changes, rank_configs
from vram_planner.model.spec import knob_names
from vram_planner.model.verdict import judge
from vram_planner.profiles import GpuProfile


def ranking_for(model_file, gpu, **settings):
    context = engine.make_context(str(model_file), gpu)
    train = engine.make_training(context, settings)
    plan = engine.plan(str(model_file), gpu, settings)
    return context, train, plan, rank_configs(context, plan)


@pytest.mark.parametrize("gpu", ["rtx3080-mobile", "rtx4090", "t4", "h100-80gb"])
def test_every_ranked_config_fits_and_keeps_the_plans_semantics(llama_1b_file, gpu):
    context, train, plan, ranking = ranking_for(llama_1b_file, gpu)
    assert ranking.ranked and ranking.memory_choice.train == plan.chosen.train
    times = [r.step_seconds for r in ranking.ranked]
    assert times == sorted(times)
    assert ranking.memory_choice in ranking.ranked and ranking.fastest.step_seconds <= ranking.memory_choice.step_seconds
    semantic = [name for name in knob_names() if name not in SPEED_KNOBS]
    for ranked in ranking.ranked:
        assert judge(context, ranked.train).fits  # judged again, from the config alone
        assert {n: getattr(ranked.train, n) for n in semantic} == {n: getattr(plan.chosen.train, n) for n in semantic}
        assert ranked.train.generation_batch_size == plan.chosen.train.generation_batch_size
    assert len({str(r.train) for r in ranking.ranked}) == len(ranking.ranked)


def test_with_room_to_spare_the_fastest_drops_checkpointing(llama_1b_file):
    """On an H100 nothing needs saving: recomputing every layer's forward only costs time."""
    _, train, plan, ranking = ranking_for(llama_1b_file, "h100-80gb")
    assert plan.chosen.train == train and train.gradient_checkpointing
    assert not ranking.fastest.train.gradient_checkpointing
    assert "gradient_checkpointing" in knob_changes(train, ranking.fastest.train)
    # and the plan says why for the way it goes: not the saver's "recompute the rest (~20% slower)"
    change, = [c for c in api.plan(str(llama_1b_file), "h100-80gb", optimize="speed").changes
               if c.knob == "gradient_checkpointing"]
    assert (change.before, change.after) == (True, False) and change.reason.startswith("no recomputation (~20% faster)")


def test_nothing_fits_nothing_ranked(llama_1b_file):
    """A 4090's speed in a card of 1 GiB: not even QLoRA at one sequence fits, and the requested config is still
    timed."""
    tiny = replace(GpuProfile.from_name("rtx4090"), total_memory_gib=1.0)
    _, _, plan, ranking = ranking_for(llama_1b_file, tiny)
    assert not plan.fits
    assert ranking.ranked == () and ranking.fastest is None and ranking.requested.step_seconds > 0


def test_ranking_stays_fast(llama_1b_file):
    context = engine.make_context(str(llama_1b_file), "rtx4090")
    plan = engine.plan(str(llama_1b_file), "rtx4090", {"per_device_train_batch_size": 64, "num_generations": 16,
                                                      "gradient_accumulation_steps": 4})
    with within_seconds(1.0):
        rank_configs(context, plan)


def test_configs_with_lora_target_lists_are_ranked(llama_1b_file):
    """A list of target modules makes a config unhashable; the ranking keys configs by their values."""
    _, _, _, ranking = ranking_for(llama_1b_file, "t4", lora_r=8, lora_target_modules="q_proj,v_proj",
                                   dtype="float16", mixed_precision="fp16")
    assert ranking.ranked and all(r.train.lora_target_modules == ["q_proj", "v_proj"] for r in ranking.ranked)


def test_the_library_ranks_as_plan_does(llama_1b_file):
    ranking = api.rank(str(llama_1b_file), "rtx4090", {"max_completion_length": 256}, reward_seconds=0.2)
    _, _, _, direct = ranking_for(llama_1b_file, "rtx4090", max_completion_length=256)
    assert ranking.fastest.step_seconds <= ranking.memory_choice.step_seconds
    assert ranking.fastest.time.seconds["rewards"] == pytest.approx(0.2 * 8)
    assert direct.memory_choice.train == ranking.memory_choice.train


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(card=st.sampled_from(["t4", "rtx3060-12gb", "rtx4090", "rtx3080-mobile", "a100-40gb"]),
       completion=st.sampled_from([128, 512, 2048]), generations=st.sampled_from([2, 4, 8, 16]),
       lora=st.booleans(), speed=st.booleans())
def test_whatever_the_config_every_ranked_one_fits_in_order(llama_1b_file, card, completion, generations, lora,
                                                          speed):
    settings_ = {"max_completion_length": completion, "num_generations": generations,
                 "per_device_train_batch_size": generations, **({"lora_r": 8} if lora else {})}
    context = engine.make_context(str(llama_1b_file), card)
    plan = engine.plan(str(llama_1b_file), card, settings_)
    ranking = rank_configs(context, plan, try_vllm=speed)
    times = [r.step_seconds for r in ranking.ranked]
    assert times == sorted(times) and all(t > 0 for t in times)
    assert all(r.verdict.fits for r in ranking.ranked)
    assert (ranking.fastest is None) == (not plan.fits)
    if plan.fits:
        assert ranking.memory_choice in ranking.ranked
        assert all(r.train.generation_batch_size == plan.chosen.train.generation_batch_size for r in ranking.ranked)


# What a change's reason says when the change goes each way (the memory plan's savers, or --optimize speed undoing
# them and growing the micro-batch)
SAVER_WAY = {"gradient_checkpointing": ("recompute the rest", lambda before, after: after is True),
             "use_vllm": ("faster decoding", lambda before, after: after is True),
             "load_in_4bit": ("(QLoRA)", lambda before, after: after is True),
             "lora_r": ("train LoRA adapters", lambda before, after: after is not None),
             "optim": ("8-bit states", lambda before, after: "8bit" in after),
             "dtype": ("16-bit weights", lambda before, after: after != "float32"),
             "per_device_train_batch_size": ("more accumulation", lambda before, after: after < before)}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(card=st.sampled_from(["t4", "rtx3060-12gb", "rtx4090", "rtx3080-mobile", "h100-80gb"]),
       knobs=st.fixed_dictionaries({}, optional={
           "per_device_train_batch_size": st.sampled_from([1, 2, 4, 8, 16]), "use_vllm": st.just(True),
           "lora_r": st.sampled_from([8, 64]), "optim": st.sampled_from(["adamw_8bit", "adamw_torch_fused"]),
           "dtype": st.sampled_from(["bfloat16", "float32"]), "gradient_checkpointing": st.booleans(),
           "max_completion_length": st.sampled_from([256, 1024, 4096])}),
       optimize=st.sampled_from(["memory", "speed"]))
def test_every_change_says_why_for_the_way_it_goes(llama_1b_file, card, knobs, optimize):
    # --optimize speed turns savers off (checkpointing, vLLM, 8-bit states) where the card has room: the reason is
    # the other way's, not the saver's
    try:
        report = api.plan(str(llama_1b_file), card, {"num_generations": 8, **knobs}, optimize=optimize)
    except ConfigError:
        return  # a config TRL refuses (a batch the generations do not divide)
    for change in report.changes:
        parts = change.reason.split("; ")
        assert len(parts) == len(change.knob.split(" + ")) and all(parts), change
        if change.knob in SAVER_WAY:
            words, saver_way = SAVER_WAY[change.knob]
            assert (words in change.reason) == saver_way(change.before, change.after), change
