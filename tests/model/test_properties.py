"""Properties of the library API over the whole input space: every catalog model and fixture architecture, every
knob of TrainingConfig (inside, at and far beyond its range, and of the wrong type), every TRL release row and every
catalog card. The answer is a verdict or a plan or one VramPlanError, in bounded time; where physics says so, memory
is monotone; a plan's changes each save memory and add up."""

from __future__ import annotations

import itertools
import math
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from helpers import FIXTURES, within_seconds
from vram_planner import engine
from vram_planner.errors import ConfigError, VramPlanError
from vram_planner.model import activations as act
from vram_planner.model.phases import estimate as analytic_estimate
from vram_planner.model.calibration import UNFITTED_RESERVE_FRACTION
from vram_planner.model.components import FP32_BYTES, sizes
from vram_planner.model.fragmentation import pinned_layer_input_bytes
from vram_planner.model.nccl import nccl_figure
from vram_planner.model.search import (Plan, best_plan, ladder_runs, micro_batch_variants, smallest_micro_batch,
                                      with_micro_batch)
from vram_planner.model.spec import Optimizer, TrainingConfig, knob_names, knob_types, with_changes
from vram_planner.model.transformers_releases import transformers_releases
from vram_planner.model.trl_releases import trl_releases
from vram_planner.model.verdict import Verdict, judge
from vram_planner.profiles import gpus, models

MODELS = [m.name for m in models()] + [str(p) for p in sorted(FIXTURES.glob("tiny-*.json"))]
CARDS = [g.name for g in gpus()]
TRL_VERSIONS = [row.min_version for row in trl_releases()]
TRANSFORMERS_VERSIONS = [row.min_version for row in transformers_releases()]
# Derandomized, so CI runs the same examples every time; the per-example deadline is generous for 2 busy cores and
# the alarm of within_seconds stops a hang that the deadline (measured after the fact) would wait out.
EXAMPLE_DEADLINE = timedelta(seconds=3)
HARD_LIMIT_S = 10.0
QUICK = settings(deadline=EXAMPLE_DEADLINE, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])
# Sums of the same bytes in another order differ in their last bits.
FLOAT_NOISE = 1e-12

# --- anything at all -------------------------------------------------------------------------------------------

HUGE_INTS = [2**31, 2**40, 2**63, 10**30, 10**300, 10**400]
ODD_FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-300, 1e300, math.inf, -math.inf, math.nan]
WRONG_TYPES = [None, "", "eight", "8", [], [1], {}, {"a": 1}, b"\x00", 1.5, True]


def edge_values(field: str) -> list[Any]:
    """Values of a TrainingConfig field at and beyond its range's edges, and of the wrong types."""
    annotation = str(knob_types()[field])
    if "int" in annotation:
        typed = [1, 2, 3, 0, -1, -(2**40), *HUGE_INTS, 8.0, math.inf, math.nan]
    elif "float" in annotation:
        typed = [*ODD_FLOATS, 0.5, 0.999999, 2.0, 10**400, "0.1"]
    elif "bool" in annotation:
        typed = [True, False, "yes", "maybe", 2]
    elif field == "optim":
        typed = [o.value for o in Optimizer] + ["adamw-8bit", "ADAMW_8BIT", "adam"]
    elif field == "transformers_version":
        typed = [*TRANSFORMERS_VERSIONS, "5.24", "4.48.3", "5.25.0.dev0", "7.0", "3.9", "v5", "latest"]
    elif field == "lora_target_modules":
        typed = ["q_proj,v_proj", "all-linear", "qproj", ",,,", "gate_up_proj", ["q_proj", "q_proj"], [""]]
    else:  # a Literal of names
        names = annotation.split("'")[1::2]
        typed = names + [n.upper() for n in names] + ["auto", "bf-16"]
    return typed + WRONG_TYPES


def _any_value(field: str) -> st.SearchStrategy[Any]:
    """Edge values, and values drawn at random from the field's type and others."""
    annotation = str(knob_types()[field])
    drawn = (st.integers() if "int" in annotation else st.floats() if "float" in annotation
             else st.text(max_size=8))
    return st.one_of(st.sampled_from(edge_values(field)), drawn)


EDGES = [(field, value) for field in knob_names() for value in edge_values(field)]


ANY_CONTEXT = st.fixed_dictionaries({}, optional={
    "trl_version": st.sampled_from(TRL_VERSIONS + ["0.14", "1.16.0", "2.0", "-1", "", "latest"]),
    "safety_margin": st.one_of(st.floats(0, 0.5), st.sampled_from(ODD_FLOATS))})


def _answer(call) -> Any:
    """What a library call gives: its result or the VramPlanError it raised (any other exception fails the test)."""
    with within_seconds(HARD_LIMIT_S):
        try:
            return call()
        except VramPlanError as error:
            message = str(error)
            assert message and "\n" not in message, f"a VramPlanError should be one line: {message!r}"
            return error


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.rsplit("/", 1)[-1])
def test_every_model_is_judged_and_planned_on_every_release_and_card(model):
    # TRL's defaults for each release row, on the catalog's cards in turn (every card comes up for some model)
    offset = MODELS.index(model) * len(TRL_VERSIONS)
    for i, trl_version in enumerate(TRL_VERSIONS):
        card = CARDS[(offset + i) % len(CARDS)]
        context = _answer(lambda: engine.make_context(model, card, trl_version=trl_version))
        assert not isinstance(context, VramPlanError), context
        verdict = _answer(lambda: engine.check(model, card, trl_version=trl_version))
        assert isinstance(verdict, Verdict) and verdict.estimate.peak_bytes > 0
        assert isinstance(_answer(lambda: engine.plan(model, card, trl_version=trl_version)), Plan)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.rsplit("/", 1)[-1])
def test_every_model_is_judged_and_planned_under_every_transformers_release(model):
    # each transformers row with the newest TRL and with the oldest, on the catalog's cards in turn
    offset = MODELS.index(model) * len(TRANSFORMERS_VERSIONS)
    for i, version in enumerate(TRANSFORMERS_VERSIONS):
        card, trl_version = CARDS[(offset + i) % len(CARDS)], TRL_VERSIONS[i % 2 - 1]
        settings = {"transformers_version": version}
        verdict = _answer(lambda: engine.check(model, card, settings, trl_version=trl_version))
        assert isinstance(verdict, Verdict) and verdict.estimate.peak_bytes > 0, verdict
        assert verdict.train.transformers.version == version
        assert isinstance(_answer(lambda: engine.plan(model, card, settings, trl_version=trl_version)), Plan)


# --- valid configurations and the laws memory follows on them -------------------------------------------------

LORA = st.one_of(st.just({}), st.fixed_dictionaries(
    {"lora_r": st.sampled_from([4, 16, 64])},
    optional={"load_in_4bit": st.booleans(), "lora_dropout": st.sampled_from([0.0, 0.05]),
              "lora_target_modules": st.just("all-linear")}))


@st.composite
def valid_knobs(draw) -> dict[str, Any]:
    """Settings inside every range; a few combinations still break a cross-field rule and are rejected."""
    generations = draw(st.sampled_from([2, 3, 4, 8]))
    knobs = draw(st.fixed_dictionaries({}, optional={
        "gradient_accumulation_steps": st.integers(1, 12), "steps_per_generation": st.integers(1, 12),
        "max_prompt_length": st.integers(1, 3000), "max_completion_length": st.integers(1, 3000),
        "beta": st.sampled_from([0.0, 0.04]), "num_iterations": st.integers(1, 3),
        "optim": st.sampled_from([o.value for o in Optimizer]), "gradient_checkpointing": st.booleans(),
        "use_reentrant": st.booleans(), "dtype": st.sampled_from(["float32", "bfloat16", "float16"]),
        "mixed_precision": st.sampled_from(["bf16", "fp16", "no"]),
        "attn_implementation": st.sampled_from(["sdpa", "eager", "flash_attention_2"]),
        "use_liger_kernel": st.booleans(), "cast_lm_head_to_fp32": st.booleans(), "use_vllm": st.booleans(),
        "vllm_enable_sleep_mode": st.booleans(),
        "vllm_gpu_memory_utilization": st.floats(0.05, 0.95), "num_gpus": st.integers(1, 8),
        "zero_stage": st.integers(0, 3), "fsdp": st.booleans(),
        "reduce_bucket_size": st.sampled_from(["auto", 10**6, 2e8, "5e8"]), "overlap_comm": st.booleans(),
        "stage3_prefetch_bucket_size": st.sampled_from(["auto", 10**6, 2e8]),
        "stage3_param_persistence_threshold": st.sampled_from(["auto", 0, 10**4]),
        "transformers_version": st.sampled_from(TRANSFORMERS_VERSIONS),
        "temperature": st.floats(0.1, 2.0), "top_p": st.floats(0.05, 1.0), "top_k": st.integers(0, 200),
        "min_p": st.floats(0.0, 0.5), "repetition_penalty": st.floats(0.8, 1.5)}))
    knobs["num_generations"] = generations
    knobs["per_device_train_batch_size"] = generations * draw(st.integers(1, 4))
    return {**knobs, **draw(LORA)}


@st.composite
def any_knobs(draw) -> dict[str, Any]:
    """A valid config with up to three knobs set to anything: far from valid, the first check would refuse it."""
    knobs = draw(valid_knobs())
    for field in draw(st.lists(st.sampled_from(list(knob_names())), max_size=2, unique=True)):
        knobs[field] = draw(_any_value(field))
    # every field's edges equally likely, whatever hypothesis makes of the strategies above
    knobs.update(draw(st.lists(st.sampled_from(EDGES), max_size=2)))
    return knobs


@pytest.mark.slow
@settings(QUICK, max_examples=250)
@given(model=st.sampled_from(MODELS), card=st.sampled_from(CARDS + ["24GiB", "0.1GiB", "100000GiB"]),
       knobs=any_knobs(), options=ANY_CONTEXT)
def test_any_input_gives_a_verdict_a_plan_or_one_clear_error(model, card, knobs, options):
    checked = _answer(lambda: engine.check(model, card, knobs, **options))
    planned = _answer(lambda: engine.plan(model, card, knobs, **options))
    assert isinstance(checked, Verdict | VramPlanError) and isinstance(planned, Plan | VramPlanError)
    # both validate the same way before they estimate
    assert isinstance(checked, VramPlanError) == isinstance(planned, VramPlanError)


@pytest.mark.slow
@pytest.mark.parametrize("field", list(knob_names()))
def test_every_knob_at_its_edges_gives_a_verdict_a_plan_or_one_clear_error(field):
    for value in edge_values(field):
        for base in ({}, {"lora_r": 16, "load_in_4bit": True}):  # fields that need LoRA are checked with it
            knobs = {**base, field: value}
            checked = _answer(lambda: engine.check("Llama-3.2-1B", "24GiB", knobs))
            planned = _answer(lambda: engine.plan("Llama-3.2-1B", "24GiB", knobs))
            assert isinstance(checked, VramPlanError) == isinstance(planned, VramPlanError), knobs


def _valid(model: str, card: str, trl_version: str, knobs: dict[str, Any]):
    context = engine.make_context(model, card, trl_version=trl_version)
    try:
        return context, engine.make_training(context, knobs)
    except ConfigError:
        assume(False)  # a combination TRL or the card refuses: not a question of memory
        raise


def _changed(train: TrainingConfig, **changes: Any) -> TrainingConfig:
    try:
        return with_changes(train, **changes)
    except (ConfigError, ValueError):  # pydantic's errors are ValueErrors: a cross-field rule refuses the change
        assume(False)
        raise


def _peak(context, train: TrainingConfig) -> float:
    return judge(context, train).estimate.peak_bytes


VALID = dict(model=st.sampled_from(MODELS), card=st.sampled_from(CARDS), trl_version=st.sampled_from(TRL_VERSIONS),
             knobs=valid_knobs())


# Each law: more of something, as (the config, the config with more).
def _longer_prompt(t: TrainingConfig):
    return t, _changed(t, max_prompt_length=2 * t.max_prompt_length)


def _longer_completion(t: TrainingConfig):
    return t, _changed(t, max_completion_length=2 * t.max_completion_length)


def _bigger_micro_batch(t: TrainingConfig):
    return t, _changed(t, per_device_train_batch_size=2 * t.per_device_train_batch_size)


def _more_steps_per_generation(t: TrainingConfig):
    return t, _changed(t, steps_per_generation=2 * t.steps_per_generation_resolved)


def _more_generations(t: TrainingConfig):
    # the same prompts per round, twice the completions of each
    return t, _changed(t, num_generations=2 * t.num_generations,
                       per_device_train_batch_size=2 * t.per_device_train_batch_size)


def _every_sampling_filter(t: TrainingConfig):
    # each filter generate() did not run yet switched on
    return t, _changed(t, temperature=0.7 if t.sampling_temperature == 1.0 else t.sampling_temperature,
                       top_p=min(t.top_p, 0.9), top_k=t.sampling_top_k or 50,
                       min_p=0.05 if t.min_p is None else t.min_p,
                       repetition_penalty=1.1 if t.repetition_penalty == 1.0 else t.repetition_penalty)


MORE_NEEDS_MORE = [_longer_prompt, _longer_completion, _bigger_micro_batch, _more_steps_per_generation,
                   _more_generations, _every_sampling_filter]


# The LM head's backward, where TRL 0.15-1.14 strand a logits block, must be weighed with it when the loss's heaviest
# moment is chosen: with twice the prompt another moment was chosen, without it, and the step seemed to need less
HEAD_BLOCK_MODEL = str(FIXTURES / "tiny-gemma3-vision.json")


@settings(QUICK, max_examples=120)
@given(law=st.sampled_from(MORE_NEEDS_MORE), **VALID)
@example(law=_longer_prompt, model=HEAD_BLOCK_MODEL, card="rtx2060", trl_version="1.10.0",
         knobs={"gradient_accumulation_steps": 1, "repetition_penalty": 1.0, "min_p": 0.0, "top_k": 0, "top_p": 1.0,
                "temperature": 1.0, "zero_stage": 0, "num_generations": 2, "per_device_train_batch_size": 2})
def test_more_tokens_a_bigger_batch_more_generations_or_sampling_filters_never_need_less(law, model, card,
                                                                                         trl_version, knobs):
    context, train = _valid(model, card, trl_version, knobs)
    less, more = law(train)
    assert _peak(context, more) >= _peak(context, less) * (1 - FLOAT_NOISE)


@settings(QUICK, max_examples=60)
@given(law=st.sampled_from(MORE_NEEDS_MORE), **VALID)
@example(law=_longer_completion, model="SmolLM2-360M", card="h100-80gb", trl_version="1.16.0",
         knobs={"dtype": "bfloat16", "lora_r": 64, "load_in_4bit": True, "per_device_train_batch_size": 8,
                "num_generations": 16, "gradient_accumulation_steps": 4, "steps_per_generation": 8,
                "max_prompt_length": 64, "max_completion_length": 384, "attn_implementation": "eager"})
def test_the_decoding_band_never_falls_with_more_tokens_or_sequences_and_flags_every_smaller_card(law, model, card,
                                                                                                 trl_version, knobs):
    """Under expandable segments generation in this process has a band of its own (what its growing cache can
    strand): never less for more tokens or sequences, none under torch's default allocator or where vLLM generates,
    and a "fits" it flags stays flagged on every smaller card that still fits it."""
    context, train = _valid(model, card, trl_version, {**knobs, "allocator_conf": "expandable_segments:True"})
    less, more = law(train)
    assert judge(context, more).decoding_holes_bytes >= judge(context, less).decoding_holes_bytes
    verdict = judge(context, train)
    assert (verdict.decoding_holes_bytes > 0) == (not train.use_vllm)
    assert judge(context, _changed(train, allocator_conf="")).decoding_holes_bytes == 0
    # cards given by size share one CUDA context figure, so one estimate holds on all of them
    roomy = judge(engine.make_context(model, "100000GiB", trl_version=trl_version), train)
    band, fits_from = roomy.generation_band_bytes, roomy.fits_from_bytes
    for share in (0.95, 0.5, 0.05) if band > fits_from else ():
        capacity = fits_from + share * (band - fits_from)
        at = judge(engine.make_context(model, f"{capacity / 2**30:.6f}GiB", trl_version=trl_version), train)
        assert at.estimate.peak_bytes == roomy.estimate.peak_bytes and at.fits and at.near_boundary, capacity


# Each saver: (the config without it, the config with it, the bytes it may add); assume() keeps each to the configs
# it applies to.
def _checkpointing(context, t: TrainingConfig):
    # Checkpointing frees the saved activations of every layer but the one being recomputed, and keeps each layer's
    # input. In the backward through the first layer, the peak when the gradients outweigh the activations (short
    # sequences, few tokens), it holds that input (and the attention mask) next to the recomputed layer, which
    # without it only the first norm's float32 copy stood for: one hidden state of the micro-batch more, with its
    # share of the allocator's reserve. A model of one layer has nothing to free at all.
    assume(context.arch.num_layers > 1)
    b, length = t.per_device_train_batch_size, t.sequence_length
    layer_input = b * length * context.arch.hidden_size * sizes(t).residual
    reserve = 1 + _largest_reserve_per_byte(context.calibration)
    # And the kept inputs strand the cached segments of the layers' projections until the backward frees them
    # (fragmentation.pinned_layer_input_bytes), a pattern with its own share of reserve.
    off, on = _changed(t, gradient_checkpointing=False), _changed(t, gradient_checkpointing=True)
    stranded = pinned_layer_input_bytes(context.arch, on) * (reserve - 1)
    held = (layer_input + act.attention_mask_bytes(t, b, length)) * reserve + stranded
    return off, on, held


def _largest_reserve_per_byte(cal) -> float:
    """The most reserve the allocator model puts on a byte of any tensor in any phase."""
    fitted = [c for phases in cal.allocator_reserve.values() for comps in phases.values() for c in comps.values()]
    measured = [cal.allocator_overhead_fraction] if cal.allocator_overhead_fraction is not None else []
    return max([*fitted, *measured, UNFITTED_RESERVE_FRACTION])


def _eight_bit_optimizer(context, t: TrainingConfig):
    # bitsandbytes keeps tensors under min_8bit_size (4096 elements: norms, biases, rank-4 adapters) in fp32 states,
    # 8 bytes per parameter: that saves over torch's AdamW only when the trainable weights are fp32 too (torch's
    # states follow the parameter: 4 bytes per parameter for 16-bit adapters or bf16 full fine-tuning)
    assume(t.optim in (Optimizer.adamw_torch, Optimizer.adamw_torch_fused) and sizes(t).trainable == FP32_BYTES)
    return t, _changed(t, optim=Optimizer.adamw_8bit), 0


def _bf16_weights(context, t: TrainingConfig):
    assume(t.dtype == "float32")
    return t, _changed(t, dtype="bfloat16"), 0


STATEFUL_OPTIMIZERS = [o for o in Optimizer if "adamw" in o.value]


def _lora(context, t: TrainingConfig):
    # LoRA trades memory per parameter (the full model's gradients and optimizer states, the reference copy) for
    # memory per token: PEFT keeps an fp32 copy of the input of every adapted linear for the adapter's backward,
    # about (6 x hidden + intermediate) x 4 bytes per token and layer. It saves while the parameters outweigh the
    # tokens: up to params / (2 x layers x (6 x hidden + intermediate)) tokens per micro-batch (a factor 2 to spare),
    # with an optimizer that keeps two states per parameter (SGD and Adafactor keep almost nothing to free), and
    # adapters of rank 16 that are small next to their matrices (hidden size 256 or more: not the tiny fixtures).
    arch = context.arch
    tokens_per_micro_batch = t.per_device_train_batch_size * t.sequence_length
    most_tokens = arch.params / (2 * arch.num_layers * (6 * arch.hidden_size + arch.intermediate_size))
    assume(not t.uses_lora and t.optim in STATEFUL_OPTIMIZERS and arch.hidden_size >= 256
           and tokens_per_micro_batch <= most_tokens)
    return t, _changed(t, lora_r=16), 0


def _four_bit(context, t: TrainingConfig):
    assume(t.uses_lora and not t.load_in_4bit)
    return t, _changed(t, load_in_4bit=True), 0


SAVERS = [_checkpointing, _eight_bit_optimizer, _bf16_weights, _lora, _four_bit]


@settings(QUICK, max_examples=150, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(saver=st.sampled_from(SAVERS), **VALID)
@example(saver=_bf16_weights, model=HEAD_BLOCK_MODEL, card="rtx2060", trl_version="1.9.0",
         knobs={"num_generations": 2, "per_device_train_batch_size": 6})
def test_a_saver_never_adds_memory(saver, model, card, trl_version, knobs):
    context, train = _valid(model, card, trl_version, knobs)
    without, with_saver, may_add = saver(context, train)
    assert _peak(context, with_saver) <= (_peak(context, without) + may_add) * (1 + FLOAT_NOISE)


@settings(QUICK, max_examples=60)
@given(**VALID)
def test_memory_grows_with_the_micro_batch_once_gradients_accumulate(model, card, trl_version, knobs):
    # the plan's bisection relies on it; the requested micro-batch without accumulation is judged on its own
    context, train = _valid(model, card, trl_version, knobs)
    accumulating = [v for v in micro_batch_variants(train) if v.gradient_accumulation_steps > 1]
    peaks = [_peak(context, v) for v in accumulating]  # largest micro-batch first
    assert _never_rises(peaks), accumulating


@settings(QUICK, max_examples=40)
@given(**VALID)
def test_memory_falls_along_every_run_of_the_ladder(model, card, trl_version, knobs):
    # the plan bisects each run for the first rung on which something fits: the rung's own micro-batch or, with the
    # same generation and optimizer batches, its smallest micro-batch (1, or under TRL 0.15-0.16 one whole group;
    # between them memory grows with the micro-batch)
    context, train = _valid(model, card, trl_version, knobs)
    for run in ladder_runs(train, context.gpu.bf16, context.arch):
        assert _never_rises([_peak(context, rung) for rung in run]), run
        assert _never_rises([_peak(context, with_micro_batch(rung, smallest_micro_batch(rung))) for rung in run]), run


def _never_rises(peaks: list[float]) -> bool:
    return all(later <= earlier * (1 + FLOAT_NOISE) for earlier, later in itertools.pairwise(peaks))


@settings(QUICK, max_examples=80)
@given(**VALID)
def test_every_reported_change_saves_memory_and_the_changes_add_up(model, card, trl_version, knobs):
    context, train = _valid(model, card, trl_version, knobs)
    plan = best_plan(context, train)
    # a saving or a cost, never a negative one, never both; only a larger vLLM share costs (the trainer's changes
    # that cost where they are made are joined with the one that pays for them)
    assert all(min(change.saved_bytes, change.cost_bytes) == 0 <= max(change.saved_bytes, change.cost_bytes)
               for change in plan.changes), plan.changes
    assert all(change.knob.startswith("vllm_") for change in plan.changes if change.cost_bytes > 0), plan.changes
    # and no row saves nothing but vLLM's: its share where sleep mode frees it outside the peak, or its shorter
    # context where the share stays, made only where the model's whole context would need a larger share to start
    # (joined with the share where that changes)
    for change in plan.changes:
        if change.saved_bytes + change.cost_bytes == 0:
            assert change.knob.startswith("vllm_") and plan.fits, plan.changes
        if change.knob == "vllm_max_model_length" and plan.fits:
            whole = judge(context, with_changes(plan.chosen.train, vllm_max_model_length=None)).estimate.vllm
            short = plan.chosen.estimate.vllm
            assert whole.problem is not None or (whole.recommended_gpu_memory_utilization
                                                 != short.recommended_gpu_memory_utilization), plan.changes
    # the trainer's changes each save something: one that saves nothing (16-bit weights under DeepSpeed, which holds
    # 16-bit weights anyway) is joined with the next, as a cost is
    assert all(change.saved_bytes > 0 for change in plan.changes if not change.knob.startswith("vllm_")), plan.changes
    if plan.fits:
        saved = sum(change.saved_bytes - change.cost_bytes for change in plan.changes)
        assert plan.requested.estimate.peak_bytes - saved == pytest.approx(plan.chosen.estimate.peak_bytes)


@settings(QUICK, max_examples=80)
@given(**VALID)
def test_the_first_micro_batch_is_judged_on_its_own_and_never_needs_more_than_the_step(model, card, trl_version,
                                                                                      knobs):
    # before the first optimizer step no optimizer state exists (nor, in the first micro-batch, any gradient kept
    # from an earlier one): each of its phases holds at most what the same phase holds in the steady step
    context, train = _valid(model, card, trl_version, knobs)
    verdict = judge(context, train)
    first, steady = verdict.first_micro_batch, {p.name: p for p in verdict.estimate.phases}
    assert [p.name for p in first.phases] == [p.name for p in verdict.estimate.phases if p.name != "optimizer"]
    for phase in first.phases:
        assert phase.components["optimizer_states"] == 0
        assert phase.total_bytes <= steady[phase.name].total_bytes * (1 + FLOAT_NOISE), phase.name
    assert verdict.first_micro_batch_fits or not verdict.fits


@settings(QUICK, max_examples=60)
@given(**VALID)
def test_every_phase_of_every_rank_carries_nccls_buffers(model, card, trl_version, knobs):
    verdict = judge(*_valid(model, card, trl_version, knobs))
    context, train = verdict.context, verdict.train
    figure = nccl_figure(context.gpu, train.num_gpus, train.distributed)
    assert (figure.bytes == 0) == (train.num_gpus == 1)
    for estimate in (verdict.estimate, verdict.first_micro_batch):
        assert {p.components["nccl_buffers"] for p in estimate.phases} == {figure.bytes}
    # outside the caching allocator: every phase grows by exactly the figure, the allocator's reserve stays
    gpu = context.gpu
    without = analytic_estimate(context.arch, train, context.release, context.calibration, context.capacity_bytes,
                                context.cuda_context.bytes, gpu.label, gpu.bf16, gpu.compute_capability)
    for counted, bare in zip(verdict.estimate.phases, without.phases, strict=True):
        assert counted.total_bytes - bare.total_bytes == pytest.approx(figure.bytes, rel=FLOAT_NOISE, abs=1)
        assert counted.components["allocator_overhead"] == bare.components["allocator_overhead"]
    assert sum("NCCL buffers" in note for note in verdict.estimate.notes) == (train.num_gpus > 1)
    # one more GPU never needs fewer NCCL bytes (NVLS buffers grow with the heads)
    assert nccl_figure(context.gpu, train.num_gpus + 1, train.distributed).bytes >= figure.bytes


@settings(QUICK, max_examples=60)
@given(**VALID)
def test_several_gpus_are_said_with_their_strategy_and_their_accelerate_config(model, card, trl_version, knobs):
    import yaml

    from vram_planner.report.document import per_gpu, plan_report
    from vram_planner.model import accelerate_config as launcher

    context, train = _valid(model, card, trl_version, knobs)
    plan = best_plan(context, train)
    report, shown = plan_report(plan), (plan.chosen or plan.smallest).train
    launch = report.distributed
    if train.num_gpus == 1 and train.zero_stage is None and not train.fsdp:
        assert launch is None and per_gpu(report) == ""
        return
    assert launch is not None and launch.num_gpus == train.num_gpus
    assert per_gpu(report) == f", per GPU, {train.num_gpus} x {launch.label.split(' x ')[1]}"
    config = yaml.safe_load(launcher.accelerate_config_yaml(shown) or "")
    assert config == launch.accelerate_config
    assert config["num_processes"] == train.num_gpus
    assert ("deepspeed_config" in config) == (train.zero_stage is not None)
    assert ("fsdp_config" in config) == train.fsdp
    deepspeed = launcher.deepspeed_config(shown)
    assert deepspeed == launch.deepspeed_config
    if deepspeed is None:
        assert config["mixed_precision"] == shown.mixed_precision
        if train.zero_stage is not None:
            assert config["deepspeed_config"]["zero_stage"] == train.zero_stage
    else:  # the plan's own buckets: the stage and mixed precision live in the DeepSpeed config it names
        assert "mixed_precision" not in config and deepspeed["bf16"] == {"enabled": "auto"}
        assert config["deepspeed_config"]["deepspeed_config_file"] == launch.deepspeed_config_file
        assert deepspeed["zero_optimization"]["stage"] == train.zero_stage
        assert deepspeed["zero_optimization"]["reduce_bucket_size"] == train.reduce_bucket_size
        for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
            assert deepspeed["zero_optimization"].get(key, getattr(TrainingConfig(), key)) == getattr(train, key)

