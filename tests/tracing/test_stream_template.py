"""benchmarks/stream_template.py: a request's size through three prompt lengths, and its power of each width's ratio
(the template's sizes; tests/tracing/test_stream_copy.py holds them, with the lengths and the layers, to a fresh
trace at every size changed at once)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from helpers import benchmark_module


@pytest.fixture(scope="module")
def bench():
    return benchmark_module("stream_template")


def test_a_size_through_three_prompt_lengths_is_exact_for_squares_and_sums(bench):
    # a mask of (prompt + 64)^2 bytes and a hidden state of 8 x (prompt + 64) x 128 bytes, through 32, 48 and 64
    for size in (lambda p: (p + 64) ** 2, lambda p: 8 * (p + 64) * 128):
        assert bench._through(bench.PROMPTS, [size(p) for p in bench.PROMPTS], 40) == size(40)
        assert isinstance(bench._through(bench.PROMPTS, [size(p) for p in bench.PROMPTS], 1000), Fraction)


def test_a_size_that_grew_by_no_whole_power_or_a_stream_of_another_shape_is_refused(bench):
    base = [("alloc", 0, 64, "p", "m"), ("free", 0, 64, "p", "m")]
    assert bench.exponents(base, [("alloc", 0, 256, "p", "m"), base[1]], 2.0) == [2, 0]
    with pytest.raises(ValueError, match="no whole power"):
        bench.exponents(base, [("alloc", 0, 96, "p", "m"), base[1]], 2.0)
    with pytest.raises(ValueError, match="other requests"):
        bench.exponents(base, base[:1], 2.0)
