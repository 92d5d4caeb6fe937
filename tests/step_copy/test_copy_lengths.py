"""vram_planner.step_copy: the document a copy keeps, its sizes through the lattice, the KV cache's growth at any
lengths, and the lengths it refuses (tests/step_copy/test_copy_make.py holds copies of traced steps to fresh traces)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from vram_planner import engine
from vram_planner.step_copy.document import StepCopy
from vram_planner.step_copy.lengths import lattice, lengths_to_trace, monomials, refusal, stream_at, window_regime
from vram_planner.step_copy.make import solved


def one_layer_copy(**changes) -> StepCopy:
    """A one-layer step: the prefill's keys and values (16 bytes a prompt token each), the cache growth, the last
    step's storages freed, a loss tensor of 4 x (p + c)² bytes."""
    fields = dict(
        windows=[None], unit=(0, 1), lattice=list(lattice(32, 64)), completion_range=None,
        names=["decoding steps", "generation", "optimizer", "prefill", "training", "backward", "forward",
               "last decoding step"],
        events=[(True, 0, 1, 3, 0), (True, 1, 1, 3, 0), (False, 10, 1, 7, 0), (False, 11, 1, 7, 0),
                (True, 20, 4, 6, -1), (False, 20, 4, 6, -1)],
        next_block=40, growth_at=[2], regions=[([0, 1], [16, 16], [10, 11])], denominator=1,
        coefficients=[(0, 16, 0, 0, 0, 0), (0, 16, 0, 0, 0, 0), (0, 0, 0, 4, 8, 4)], per_added_token=[0, 0, 0])
    return StepCopy(**{**fields, **changes})


@given(st.lists(st.integers(-10**6, 10**6), min_size=6, max_size=6), st.integers(1, 5000), st.integers(1, 5000))
@settings(max_examples=60, deadline=None)
def test_a_polynomial_of_degree_two_in_both_lengths_is_exact_through_the_lattice(coefficients, prompt, completion):
    points = list(lattice(32, 64))
    values = [sum(k * m for k, m in zip(coefficients, monomials(p, c))) for p, c in points]
    found = solved(points, values)
    assert sum(k * m for k, m in zip(found, monomials(prompt, completion))) == sum(
        k * m for k, m in zip(coefficients, monomials(prompt, completion)))


@given(st.integers(1, 3000), st.integers(4, 3000))
@settings(max_examples=60, deadline=None)
def test_the_made_stream_is_a_program_with_the_caches_growth_in_its_place(prompt, completion):
    events = stream_at(one_layer_copy(), prompt, completion)
    live: dict[int, int] = {}
    for kind, block, size, *_ in events:
        if kind == "alloc":
            assert block not in live
            live[block] = size
        else:
            assert live.pop(block) == size  # a free names a live block, with its size
    assert not live
    growth = [e for e in events if e[4] == "decoding steps"]
    # keys and values replaced at each recorded step (the last decoding step's own requests are the rest's)
    assert len(growth) == 4 * (completion - 3) and events[2:2 + len(growth)] == growth
    assert [e[2] for e in growth if e[0] == "alloc"][:2] == [16 * (prompt + 1)] * 2
    # the rest frees the last recorded step's storages, p + c - 3 tokens each, and the loss tensor is its polynomial
    after = events[2 + len(growth):]
    assert [e[:3] for e in after[:2]] == [("free", growth[-4][1], 16 * (prompt + completion - 3)),
                                          ("free", growth[-2][1], 16 * (prompt + completion - 3))]
    assert after[2] == ("alloc", 20, 4 * (prompt + completion) ** 2, "training", "forward", -1)


def test_a_copy_refuses_lengths_it_did_not_trace_the_regime_of():
    copy = one_layer_copy(completion_range=(257, 512))
    assert refusal(copy, 100, 300) is None
    assert "token tiles" in refusal(copy, 100, 256) and "token tiles" in refusal(copy, 100, 513)
    assert "completions of 4" in refusal(copy, 100, 3)
    never_filled = one_layer_copy(windows=[4096])
    assert refusal(never_filled, 1024, 2048) is None
    assert "sliding window" in refusal(never_filled, 1024, 4096)  # the decoding fills it: another last step
    assert "sliding window" in refusal(never_filled, 5000, 128)
    filled = one_layer_copy(windows=[16], lattice=list(lattice(32, 64)))
    assert refusal(filled, 24, 152) is None and "sliding window" in refusal(filled, 8, 152)
    with pytest.raises(ValueError, match="token tiles"):
        stream_at(copy, 100, 100)


@pytest.mark.parametrize(("prompt", "completion", "base"), [
    (400, 300, (477, 64)),  # the decoding fills the 512-token window: so do the prompts just short of it traced
    (1024, 100, (515, 64)),  # the prompt fills it: so do the prompts traced
    (200, 100, (32, 64)),  # neither: nor do the lengths traced
])
def test_the_lengths_traced_fill_a_sliding_window_as_the_configs_do(prompt, completion, base):
    context = engine.make_context("Qwen3-0.6B", "h100-80gb")
    train = engine.make_training(context, {"dtype": "bfloat16", "lora_r": 8, "max_prompt_length": prompt,
                                           "max_completion_length": completion})
    traced, _ = lengths_to_trace(train, context.release, {512})
    assert traced == lattice(*base)
    assert {window_regime(p, c, 512) for p, c in traced} == {window_regime(prompt, completion, 512)}


@given(st.integers(1, 2000), st.integers(4, 2000), st.integers(16, 1024))
@settings(max_examples=200, deadline=None)
def test_a_lattice_is_traced_in_the_configs_regime_or_refused_with_its_reason(prompt, completion, window):
    context = engine.make_context("Qwen3-0.6B", "h100-80gb")
    train = engine.make_training(context, {"dtype": "bfloat16", "lora_r": 8, "max_prompt_length": prompt,
                                           "max_completion_length": completion})
    try:
        traced, _ = lengths_to_trace(train, context.release, {window})
    except ValueError as error:
        assert "sliding window" in str(error) or "tile" in str(error)
        return
    assert {window_regime(p, c, window) for p, c in traced} == {window_regime(prompt, completion, window)}
    assert refusal(one_layer_copy(windows=[window], lattice=list(traced)), prompt, completion) is None


def test_a_damaged_document_is_refused_whole():
    with pytest.raises(ValidationError, match="a size for every request"):
        one_layer_copy(per_added_token=[0, 0])
    with pytest.raises(ValidationError, match="two cache storages a layer"):
        one_layer_copy(regions=[([0], [16], [10])])
    with pytest.raises(ValidationError, match="a name for every"):
        one_layer_copy(events=[(True, 0, 99, 3, 0), (True, 1, 1, 3, 0), (True, 20, 4, 6, -1)])
    with pytest.raises(ValidationError, match="format"):
        one_layer_copy(format=0)
    assert StepCopy.model_validate_json(one_layer_copy().model_dump_json()) == one_layer_copy()


def test_the_lengths_traced_lie_on_the_completions_side_of_the_fused_heads_token_tile():
    context = engine.make_context("SmolLM2-135M", "h100-80gb")

    def traced(sequences: int, completion: int):
        train = engine.make_training(context, {"dtype": "bfloat16", "lora_r": 16, "max_prompt_length": 256,
                                               "per_device_train_batch_size": sequences, "num_generations": sequences,
                                               "max_completion_length": completion})
        return lengths_to_trace(train, context.release)

    # 16 x 1,024 completion tokens make four 4,096-token tiles: traced from 769 tokens (16 x 769 in four tiles) on
    assert traced(16, 1024) == (lattice(32, 769), (769, 1024))
    assert {-(-16 * c // 4096) for _, c in lattice(32, 769)} == {4}
    # 8 x 384 stay in one tile, as the lattice's 8 x 64 to 8 x 128 do
    assert traced(8, 384) == (lattice(32, 64), (1, 512))
    with pytest.raises(ValueError, match="tile"):  # 64 x 32 make one tile, where the lattice's 64 x 128 make two
        traced(64, 32)
