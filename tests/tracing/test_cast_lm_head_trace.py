"""GRPOConfig's cast_lm_head_to_fp32: TRL's float32 LM head, traced as the release sets it up, and the analytic model
held to that trace."""

from __future__ import annotations

import json

import pytest

from helpers import FIXTURES, family_fixture_files
from vram_planner import engine
from vram_planner.errors import ConfigError
from vram_planner.model import components as m
from vram_planner.model.calibration import Calibration
from vram_planner.model.phases import estimate
from vram_planner.tracing.step import compare_with_estimate, trace_step
from vram_planner.units import GiB

pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

SHORT = {"per_device_train_batch_size": 2, "num_generations": 2, "max_prompt_length": 16, "max_completion_length": 16}
# What the cast changes: 16-bit weights (the head becomes float32), float32 weights under bf16 autocast (the fused head
# leaves autocast), a reference model, LoRA (a frozen float32 head), no mixed precision, accumulation without
# checkpointing, the old log-probs of a second micro-batch with foreach AdamW.
POINTS = {
    "bf16 full": {"dtype": "bfloat16"},
    "fp32 weights, bf16 autocast": {},
    "bf16 full, reference": {"dtype": "bfloat16", "beta": 0.04},
    "bf16 LoRA": {"dtype": "bfloat16", "lora_r": 8},
    "no mixed precision": {"mixed_precision": "no"},
    "accumulating, no checkpointing": {"dtype": "bfloat16", "gradient_accumulation_steps": 2,
                                       "gradient_checkpointing": False},
    "old log-probs, foreach AdamW": {"dtype": "bfloat16", "steps_per_generation": 2, "optim": "adamw_torch"},
}


def _traced(fixture, knobs):
    context = engine.make_context(str(fixture), "h100-80gb")
    train = engine.make_training(context, {**SHORT, **knobs})
    traced = trace_step(json.loads(fixture.read_text()), train, context.release)
    return context, train, traced


def _refused(fixture, knobs) -> bool:
    context = engine.make_context(str(fixture), "h100-80gb")
    try:
        engine.make_training(context, {**SHORT, **knobs})
    except ConfigError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.parametrize("fixture", family_fixture_files(), ids=lambda path: path.stem)
def test_every_copy_of_the_head_is_float32_in_the_trace_as_the_plan_counts_it(fixture):
    """Against the same step without the cast, the trace's weights, reference weights, gradients and AdamW states
    each grow by one float32 head over a bfloat16 one, as model/components.py counts it; a model TRL cannot cast
    (tied embeddings in a multimodal wrapper) is refused before any engine runs."""
    knobs = {"dtype": "bfloat16", "beta": 0.04}
    if _refused(fixture, {**knobs, "cast_lm_head_to_fp32": True}):
        context = engine.make_context(str(fixture), "h100-80gb")
        assert context.arch.tie_word_embeddings and context.arch.vision_params
        return
    context, train, cast = _traced(fixture, {**knobs, "cast_lm_head_to_fp32": True})
    plain = _traced(fixture, knobs)[2]
    head = m.head_upcast_bytes(context.arch, train, 2)
    assert head >= 2 * context.arch.vocab_size * context.arch.hidden_size
    grown = {name: cast.phase("optimizer").components[name] - plain.phase("optimizer").components[name]
             for name in ("weights", "reference_weights", "gradients", "optimizer_states")}
    assert grown == {"weights": head, "reference_weights": head, "gradients": head, "optimizer_states": 2 * head}
    assert cast.params == plain.params == context.arch.params


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny-qwen2", "tiny-mistral", "tiny-llama-bias"])
@pytest.mark.parametrize("point", list(POINTS))
def test_the_analytic_model_follows_the_trace_of_a_float32_head(fixture, point):
    """Every phase within 2% of the trace on the fixtures (a 1,000-token vocabulary, where the few kilobytes of a
    decoding step's small tensors weigh most; benchmarks/cast_lm_head.py compares real models)."""
    path = FIXTURES / f"{fixture}.json"
    knobs = {**POINTS[point], "cast_lm_head_to_fp32": True}
    if _refused(path, knobs):  # LoRA over tied embeddings: TRL's cast fails there
        assert "lora_r" in knobs and engine.make_context(str(path), "h100-80gb").arch.tie_word_embeddings
        return
    context, train, traced = _traced(path, knobs)
    analytic = estimate(context.arch, train, context.release, Calibration(), 80 * GiB)
    errors = {row.name: row.relative_error for row in compare_with_estimate(traced, analytic)}
    assert errors and all(abs(e) < 0.02 for e in errors.values()), errors


def test_a_float32_head_costs_what_the_plan_says_and_nothing_with_float32_weights_and_no_autocast():
    """Qwen2.5-7B's untied head (152,064 x 3,584) over bfloat16 weights: float32 doubles it in the weights, the
    reference, the gradients, and both AdamW states; with float32 weights computed in float32 the cast changes nothing."""
    context = engine.make_context("Qwen2.5-7B", "h100-80gb")
    knobs = {"dtype": "bfloat16", "beta": 0.04}
    plain = engine.make_training(context, knobs)
    cast = engine.make_training(context, {**knobs, "cast_lm_head_to_fp32": True})
    arch, head = context.arch, 152064 * 3584 * 2
    assert m.head_upcast_bytes(arch, cast, 2) == head
    assert m.weight_bytes(arch, cast) - m.weight_bytes(arch, plain) == head
    assert m.reference_weight_bytes(arch, cast) - m.reference_weight_bytes(arch, plain) == head
    assert m.gradient_bytes(arch, cast) - m.gradient_bytes(arch, plain) == head
    assert m.optimizer_state_bytes(arch, cast) - m.optimizer_state_bytes(arch, plain) == 2 * head
    full = {"mixed_precision": "no"}
    same = [estimate(arch, engine.make_training(context, {**full, "cast_lm_head_to_fp32": cast_head}), context.release,
                     Calibration(), 80 * GiB).phases for cast_head in (False, True)]
    assert same[0] == same[1]
