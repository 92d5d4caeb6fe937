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


def synthetic(layers: int, period: int) -> list[tuple]:
    """A forward that keeps each layer's activations and frees the layer below's output between layers, then a
    backward that frees them from the top down; a layer's sizes follow its type (its index modulo `period`)."""
    events, block = [], iter(range(10_000))
    phase = ("alloc", next(block), 64, "training", "forward", -1)
    events.append(phase)
    below, kept = phase[1], []
    for layer in range(layers):
        size = 100 + layer % period
        acts, out = next(block), next(block)
        events += [("alloc", acts, size, "training", "forward", layer), ("alloc", out, 10, "training", "forward", layer),
                   ("free", below, 0, "training", "forward", -1)]
        below = out
        kept.append((acts, size))
    head = next(block)
    events += [("alloc", head, 500, "training", "forward", -1), ("free", below, 0, "training", "forward", -1)]
    grad = head
    for layer in reversed(range(layers)):
        acts, size = kept[layer]
        new = next(block)
        events += [("alloc", new, 20 + layer % period, "training", "backward", layer),
                   ("free", acts, size, "training", "backward", layer), ("free", grad, 0, "training", "backward", layer)]
        grad = new
    return [*events, ("free", grad, 0, "training", "backward", -1)]


@pytest.mark.parametrize("period", [1, 2, 3])
def test_copies_of_a_period_of_layers_give_the_deeper_models_events(bench, period):
    unit = bench.copied_unit(period)
    shallow = unit.stop + 2
    made = bench.expanded(synthetic(shallow, period), unit, 2)
    assert bench.renumbered(made) == bench.renumbered(synthetic(shallow + 2 * period, period))
    assert bench.renumbered(made) != bench.renumbered(synthetic(shallow + period, period))


def test_neighbours_that_do_other_things_than_the_unit_are_refused(bench):
    events = synthetic(5, 1)
    events.append(("alloc", 9999, 1, "training", "backward", 1))  # the layer below the unit does one thing more
    with pytest.raises(ValueError, match="neighbours"):
        bench.expanded(events, bench.copied_unit(1), 2)


def test_a_gemma2_step_with_four_layers_more_is_made_from_its_trace_request_for_request(bench):
    config = json.loads((FIXTURES / "tiny-gemma2.json").read_text())
    settings = {**bench.BASE, **bench.KNOBS["lora-bf16"]}
    assert bench.period(config) == 2
    unit = bench.copied_unit(2)
    shallow = unit.stop + 2
    fresh = bench.renumbered(bench.traced_events(bench.with_layers(config, shallow + 4), settings))
    made = bench.renumbered(bench.expanded(bench.traced_events(bench.with_layers(config, shallow), settings), unit, 2))
    assert len(fresh) > 30_000 and made == fresh
