"""`--num-gpus auto` (vram_planner/model/fewest_gpus.py): the count it answers fits, and on one GPU fewer no strategy
does; where none fits, none fits on any count of a node."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vram_planner import engine
from vram_planner.errors import ConfigError
from vram_planner.model import fewest_gpus as auto
from vram_planner.model.offload import MAX_GPUS_PER_NODE
from vram_planner.model.spec import TrainingConfig, with_changes
from vram_planner.model.verdict import Context, judge
from vram_planner.profiles import gpus, models

MODELS = [m.name for m in models()]
CARDS = [g.name for g in gpus()]
KNOBS = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["float32", "bfloat16"]), "lora_r": st.sampled_from([16]),
    "max_completion_length": st.sampled_from([256, 1024, 4096]), "gradient_accumulation_steps": st.sampled_from([1, 4]),
    "host_memory": st.sampled_from(["32GiB", "256GiB", "2TiB"])})


def _fits_under(context: Context, user: TrainingConfig, count: int, strategy: dict) -> bool:
    """Whether `user` fits on `count` GPUs under `strategy`, judged afresh (a combination the rules refuse does not)."""
    try:
        train = with_changes(user, num_gpus=count, **strategy)
    except ConfigError:
        return False
    return judge(context, train).fits


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(model=st.sampled_from(MODELS), card=st.sampled_from(CARDS), knobs=KNOBS)
def test_the_answer_fits_and_one_gpu_fewer_fits_under_no_strategy(model, card, knobs):
    context = engine.make_context(model, card)
    try:
        user = engine.make_training(context, knobs)
    except ConfigError:
        return  # a setting this card cannot run (FlashAttention-2 before Ampere): not a question of the count
    found = auto.fewest_gpus(context, user)
    if found.chosen is None:
        assert not any(_fits_under(context, user, count, strategy)
                       for count in range(1, MAX_GPUS_PER_NODE + 1) for strategy in auto.STRATEGIES)
        return
    chosen = found.chosen.train
    assert found.chosen.fits and judge(context, chosen).fits
    # the user's knobs are kept: only the count and the strategy changed
    assert {k: v for k, v in vars(chosen).items() if k not in ("num_gpus", *auto.STRATEGY_FIELDS)} == {
        k: v for k, v in vars(user).items() if k not in ("num_gpus", *auto.STRATEGY_FIELDS)}
    fewer = chosen.num_gpus - 1
    assert fewer == 0 or not any(_fits_under(context, user, fewer, strategy) for strategy in auto.STRATEGIES)
    # of its count, the first strategy in the order of preference that fits
    order = [{field: getattr(chosen, field) for field in auto.STRATEGY_FIELDS} == s for s in auto.STRATEGIES]
    before = auto.STRATEGIES[:order.index(True)]
    assert not any(_fits_under(context, user, chosen.num_gpus, strategy) for strategy in before)


def test_qwen_7b_full_fine_tuning_needs_several_h100s_and_the_search_says_why():
    context = engine.make_context("Qwen2.5-7B", "h100")
    user = engine.make_training(context, {"host_memory": "32GiB"})  # too little RAM for any offload
    found = auto.fewest_gpus(context, user)
    chosen = found.chosen.train
    assert chosen.num_gpus > 1 and not chosen.offloaded
    assert not judge(context, with_changes(user, num_gpus=1)).fits
    note = found.note(context.gpu.label)
    assert f"{chosen.num_gpus} x" in note and f"on {chosen.num_gpus - 1}, none of the" in note
    # with a node's RAM that holds the offloaded states, one GPU does it
    roomy = auto.fewest_gpus(context, with_changes(user, host_memory="2TiB")).chosen.train
    assert roomy.num_gpus == 1 and roomy.offloaded


def test_a_named_strategy_is_the_only_one_tried():
    context = engine.make_context("Qwen2.5-7B", "h100")
    found = auto.fewest_gpus(context, engine.make_training(context, {"zero_stage": 3}))
    assert {v.train.distributed for v in found.tried} == {"zero3"}
    assert found.chosen is not None and found.chosen.train.zero_stage == 3


def test_nothing_fits_on_a_node_then_the_closest_try_is_shown():
    context = engine.make_context("Qwen2.5-7B", "rtx2060")
    found = auto.fewest_gpus(context, engine.make_training(context, {"host_memory": "64GiB"}))
    assert found.chosen is None and found.closest.train.num_gpus == MAX_GPUS_PER_NODE
    assert found.closest.estimate.peak_bytes == min(v.estimate.peak_bytes for v in found.tried
                                                    if v.train.num_gpus == MAX_GPUS_PER_NODE)
    assert "no strategy fits on up to 8" in found.note(context.gpu.label)


@pytest.mark.parametrize("settings_", [{"num_gpus": "auto"}, {"num_gpus": "AUTO", "zero_stage": 2}])
def test_make_training_auto_reads_auto(settings_):
    context = engine.make_context("Llama-3.2-1B", "t4")
    train, found = engine.make_training_auto(context, settings_)
    assert found is not None and train == found.closest.train
    assert engine.make_training_auto(context, {"num_gpus": 2})[1] is None


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(model=st.sampled_from(MODELS), card=st.sampled_from(CARDS), knobs=KNOBS,
       named=st.fixed_dictionaries({}, optional={
           "reduce_bucket_size": st.sampled_from([200_000_000, "auto"]), "overlap_comm": st.booleans(),
           "offload_optimizer": st.sampled_from(["cpu"]), "offload_param": st.sampled_from(["cpu"]),
           "ds3_gather_for_generation": st.sampled_from([False])}).filter(bool))
def test_knobs_that_need_a_strategy_choose_among_the_strategies_that_take_them(model, card, knobs, named):
    """`--num-gpus auto` with an offload or a DeepSpeed knob and no stage: every strategy tried takes the knobs (the
    rules hold each config), the chosen one keeps them, and where the knobs are refused under every strategy the
    error is the knobs' own."""
    context = engine.make_context(model, card)
    try:
        train, found = engine.make_training_auto(context, {**knobs, **named, "num_gpus": "auto"})
    except ConfigError:
        for strategy in auto.STRATEGIES:
            with pytest.raises(ConfigError):
                engine.make_training(context, {**knobs, **strategy, **named})
        return
    assert found.tried and train == found.closest.train
    for verdict in found.tried:
        assert all(getattr(verdict.train, k) == (200_000_000 if k == "reduce_bucket_size" and v == 2e8 else v)
                   for k, v in named.items())
        if set(named) - {"offload_optimizer", "offload_param"}:  # DeepSpeed's own knobs
            assert verdict.train.zero_stage == 3 if "ds3_gather_for_generation" in named else verdict.train.zero_stage
        if set(named) & {"offload_optimizer", "offload_param"}:
            assert verdict.train.offloaded


def test_deepspeed_knobs_with_auto_search_the_zero_stages_only():
    context = engine.make_context("Qwen2.5-7B", "h100")
    train, found = engine.make_training_auto(context, {"num_gpus": "auto", "reduce_bucket_size": 200_000_000,
                                                       "host_memory": "32GiB"})
    assert {v.train.distributed for v in found.tried} == {"zero2", "zero3"}
    assert found.chosen is not None and train.reduce_bucket_size == 200_000_000 and train.num_gpus > 1
    # a stage named as well: that stage only, as before
    _, staged = engine.make_training_auto(context, {"num_gpus": "auto", "zero_stage": 3, "overlap_comm": False})
    assert {v.train.distributed for v in staged.tried} == {"zero3"}
    # a knob no strategy takes: its own error
    with pytest.raises(ConfigError, match="need"):
        engine.make_training_auto(context, {"num_gpus": "auto", "overlap_comm": True, "fsdp": True})
