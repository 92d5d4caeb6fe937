"""vram_planner.step_copy.layers: a deeper model's events from a shallow one's by copying a period of its layers
(tests/tracing/test_stream_layers.py holds it to a traced gemma-2 step)."""

from __future__ import annotations

import pytest

from vram_planner.step_copy.layers import copied_unit, expanded
from vram_planner.step_copy.streams import renumbered


def synthetic(layers: int, period: int) -> list[tuple]:
    """A forward that keeps each layer's activations and frees the layer below's output between layers, then a
    backward that frees them and the gradient from above from the top down; a layer's sizes follow its type (its
    index modulo `period`)."""
    blocks = iter(range(10_000))

    def event(kind: str, made: tuple[int, int], moment: str, layer: int) -> tuple:
        return (kind, made[0], made[1], "training", moment, layer)

    below = (next(blocks), 64)  # the embeddings
    events, kept = [event("alloc", below, "forward", -1)], []
    for layer in range(layers):
        acts, out = (next(blocks), 100 + layer % period), (next(blocks), 10)
        events += [event("alloc", acts, "forward", layer), event("alloc", out, "forward", layer),
                   event("free", below, "forward", -1)]
        below = out
        kept.append(acts)
    grad = (next(blocks), 500)  # the LM head's
    events += [event("alloc", grad, "forward", -1), event("free", below, "forward", -1)]
    for layer in reversed(range(layers)):
        new = (next(blocks), 20 + layer % period)
        events += [event("alloc", new, "backward", layer), event("free", kept[layer], "backward", layer),
                   event("free", grad, "backward", layer)]
        grad = new
    return [*events, event("free", grad, "backward", -1)]


@pytest.mark.parametrize("period", [1, 2, 3])
def test_copies_of_a_period_of_layers_give_the_deeper_models_events(period):
    unit = copied_unit(period)
    shallow = unit.stop + 2
    made = expanded(synthetic(shallow, period), unit, 2)
    assert renumbered(made) == renumbered(synthetic(shallow + 2 * period, period))
    assert renumbered(made) != renumbered(synthetic(shallow + period, period))


def test_neighbours_that_do_other_things_than_the_unit_are_refused():
    events = synthetic(5, 1)
    events.append(("alloc", 9999, 1, "training", "backward", 1))  # the layer below the unit does one thing more
    with pytest.raises(ValueError, match="neighbours"):
        expanded(events, copied_unit(1), 2)
