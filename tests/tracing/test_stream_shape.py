"""benchmarks/stream_shape.py's comparison of two traced steps: runs of frees in block order, sizes grown by whole
powers. tests/tracing/test_stream_template.py holds a traced step to the template the comparison rests on."""

from __future__ import annotations

import pytest

from helpers import benchmark_module


@pytest.fixture(scope="module")
def bench():
    return benchmark_module("stream_shape")


def test_runs_of_frees_compare_in_block_order_and_nothing_else_moves(bench):
    events = [("alloc", 0, 8, "p", "m"), ("free", 2, 4, "p", "m"), ("free", 1, 4, "p", "m"), ("alloc", 3, 8, "p", "m"),
              ("free", 0, 8, "p", "m")]
    assert bench.with_free_runs_sorted(events) == [events[0], events[2], events[1], events[3], events[4]]
    resized = [("alloc", 0, 16, "p", "m"), events[2], events[1], ("alloc", 3, 12, "p", "m"), events[4]]
    assert bench.compared(events, resized, 2.0) == (True, 2, 1)  # 8 -> 16 a product, 8 -> 12 not
    assert bench.compared(events, events[:4], 2.0)[0] is False
