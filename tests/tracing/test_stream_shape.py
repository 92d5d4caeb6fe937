"""benchmarks/stream_shape.py: a traced step makes the same requests in the same order whatever its sizes, each
width's and the batch's a factor of every request it changes (what a torch-free copy of the exact engine, replaying
a template of the step's requests, would rest on)."""

from __future__ import annotations

import json

import pytest

from helpers import FIXTURES, benchmark_module

pytestmark = pytest.mark.slow


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


@pytest.mark.parametrize("variant", ["prompt x1.5", "hidden x1.5", "heads x2"])
def test_a_traced_step_keeps_its_shape_as_one_size_changes(bench, variant):
    config = json.loads((FIXTURES / "tiny-qwen3.json").read_text())
    settings = {**bench.BASE, **bench.KNOBS["lora-bf16"]}
    _, setting_changes, config_changes, ratio = next(v for v in bench.VARIANTS if v[0] == variant)
    base = bench.traced_events(config, settings)
    other = bench.traced_events(bench.varied(config, config_changes), {**settings, **setting_changes})
    aligned, resized, products = bench.compared(base, other, ratio)
    assert aligned and resized > 0
    if variant != "prompt x1.5":  # a width scales every request it enters; a length enters sums (prompt + completion)
        assert products == resized
