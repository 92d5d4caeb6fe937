"""benchmarks/stream_layers.py: the step of a deeper model made from the trace of a shallower one by copying a period
of its layers, request for request (the layers as a loop, for a torch-free copy of the exact engine)."""

from __future__ import annotations

import json

import pytest

from helpers import FIXTURES, benchmark_module

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench():
    return benchmark_module("stream_layers")


def test_a_gemma2_step_with_four_layers_more_is_made_from_its_trace_request_for_request(bench):
    config = json.loads((FIXTURES / "tiny-gemma2.json").read_text())
    settings = {**bench.BASE, **bench.KNOBS["lora-bf16"]}
    assert bench.layer_period(config) == 2
    unit = bench.copied_unit(2)
    shallow = unit.stop + 2
    fresh = bench.renumbered(bench.traced_events(bench.with_layers(config, shallow + 4), settings))
    made = bench.renumbered(bench.expanded(bench.traced_events(bench.with_layers(config, shallow), settings), unit, 2))
    assert len(fresh) > 30_000 and made == fresh
