"""benchmarks/stream_lengths.py and stream_copy.py: a step at other lengths, and at every size, length and depth
changed at once, made torch-free from traces of a shallow tiny model, request for request (the copy of the exact
engine that `check` would replay)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from helpers import FIXTURES, benchmark_module

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench():
    return benchmark_module("stream_copy")


@pytest.fixture(scope="module")
def template(bench):
    pytest.importorskip("trl")
    config = json.loads((FIXTURES / "tiny-qwen3.json").read_text())
    return bench.StepTemplate(config, {**bench.BASE, **bench.KNOBS["full-fp32-beta"]})


def test_a_polynomial_of_degree_two_in_both_lengths_is_exact_through_the_lattice():
    lengths = benchmark_module("stream_lengths")
    for size in (lambda p, c: 4 * (p + c) ** 2, lambda p, c: 8 * p * 128 + 3 * c, lambda p, c: 7 * p * p):
        coefficients = lengths.solved(list(lengths.LENGTHS), [size(p, c) for p, c in lengths.LENGTHS])
        assert sum(k * m for k, m in zip(coefficients, lengths._monomials(40, 1000))) == size(40, 1000)


def test_the_step_at_other_lengths_is_a_fresh_traces_with_its_own_number_of_decoding_steps(bench, template):
    prompt, completion = 24, 152
    fresh = bench.renumbered(bench.traced_events(template.shallow, {**template.settings, "max_prompt_length": prompt,
                                                                    "max_completion_length": completion}))
    made = bench.renumbered(template.lengths.instantiate(prompt, completion))
    assert made == fresh
    growth = [e for e in made if e[4] == "decoding steps" and e[5] >= 0]
    base = [e for e in bench.renumbered(template.lengths.base) if e[4] == "decoding steps" and e[5] >= 0]
    assert len(growth) == len(base) + 2 * 88 * 5 * 4  # two steps, 88 decoding steps more, 5 layers, 4 requests each
    with pytest.raises(ValueError, match="no whole number"):
        template.lengths.instantiate(prompt, completion, [Fraction(1, 3)] * len(template.lengths.coefficients))


def test_decoding_steps_grouped_several_tokens_at_a_time_are_made_as_a_deeper_models_trace_groups_them(bench, template):
    lengths = benchmark_module("stream_lengths")
    prompt, completion = 24, 152
    # 40 recorded steps for 150 tokens: the last adds 4, three more than the traces the template was made from
    with lengths.grouped_steps(40 * template.lengths.layers):
        assert lengths.additions(completion - 2, template.lengths.layers)[-1] == 4
        fresh = bench.renumbered(bench.traced_events(template.shallow, {
            **template.settings, "max_prompt_length": prompt, "max_completion_length": completion}))
        made = bench.renumbered(template.lengths.instantiate(prompt, completion))
    assert made == fresh
    assert any(template.lengths.per_added_token)


def test_the_step_at_every_size_length_and_depth_changed_is_a_fresh_traces(bench, template):
    requests, aligned, other_size = bench.tried(template)
    assert aligned and other_size == 0 and requests > 15_000


def test_the_short_lengths_traced_lie_on_the_points_side_of_the_fused_heads_token_tile():
    copy = benchmark_module("copy_at_boundary")
    lengths = benchmark_module("stream_lengths")
    settings = {"dtype": "bfloat16", "lora_r": 16, "max_prompt_length": 256}
    # 16 x 1,024 completion tokens make four 4,096-token tiles: traced from 769 tokens (16 x 769 in four tiles) on
    prompt, completion, short = copy.lengths_of("SmolLM2-135M", {**settings, "per_device_train_batch_size": 16,
                                                                 "num_generations": 16, "max_completion_length": 1024})
    assert (prompt, completion) == (256, 1024) and short == lengths.lattice(32, 769)
    assert {-(-16 * c // 4096) for _, c in short} == {4}
    # 8 x 384 stay below it, and 8 x 512 fill one tile, as the lattice's 8 x 64 to 8 x 128 stay below
    for completion in (384, 512):
        assert copy.lengths_of("SmolLM2-135M", {**settings, "per_device_train_batch_size": 8, "num_generations": 8,
                                                "max_completion_length": completion})[2] == lengths.LENGTHS
    # 64 x 32 make one tile, where the lattice's 64 x 128 would make two
    with pytest.raises(ValueError, match="tiles"):
        copy.lengths_of("SmolLM2-135M", {**settings, "per_device_train_batch_size": 64, "num_generations": 64,
                                         "max_completion_length": 32})
