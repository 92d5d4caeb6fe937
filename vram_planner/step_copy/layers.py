"""The decoder's layers as a loop: a deeper model's stream from a shallow one's by copying a period of its layers.

The trace marks each event with the decoder layer it belongs to (`Event.layer`: a layer's forward hooks in the forward,
the autograd nodes its forward made in the backward, the layer a cache update grows), so the events of one layer are
known wherever they run. A shallow model of 2p + 3 layers (p the period of its layer types: 1; gemma-2's alternating
sliding and full attention 2, gemma-3's five sliding and one full 6) is traced, and the unit of layers p + 1 .. 2p is
copied in every run of its events (with the events outside any layer that follow them: the model's loop frees a
layer's input after the layer returns): after it where the layers run upwards (the forwards, the cache growth), before
it where they run downwards (the backward). Its neighbours are inner layers that are not the first of their type (the
first layer of each type and the last do more in the backward). Each copy makes its own blocks; what the unit frees of
the layer below it, a copy frees of the copy below it (the corresponding request of the unit's last layer), what it
frees of the layer above it, of the copy above; the layer above the copies frees the last copy's; a free outside the
layers of a block the unit made (a cache dropped after generation) frees the copies' blocks beside it
(benchmarks/stream_layers.py holds it to fresh traces of every fixture architecture). Pure Python.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import count


def copied_unit(period: int) -> range:
    """The layers copied: a period of them, whose neighbours are inner layers that are not the first of their type
    (the first layer of each type and the last layer do more than the others in the backward)."""
    return range(period + 1, 2 * period + 1)


def owners(events: list[tuple]) -> list[int]:
    """The layer each event belongs to: its own, or for an event outside the layers (a layer's output freed as the
    model's loop moves on, the LM head) that of the last layer before it."""
    out, owner = [], -1
    for event in events:
        owner = event[5] if event[5] != -1 else owner
        out.append(owner)
    return out


def expanded(events: list[tuple], unit: range, copies: int) -> list[tuple]:
    """The events with `copies` copies of the unit of layers in every run of its events (see the module)."""
    width = len(unit)
    below, above, last, first = unit.start - 1, unit.stop, unit.stop - 1, unit.start
    owner = owners(events)
    by_layer: dict[int, list[int]] = defaultdict(list)
    made_by: dict[int, int] = {}
    for i, event in enumerate(events):
        by_layer[owner[i]].append(i)
        if event[0] == "alloc":
            made_by[event[1]] = owner[i]
    if len(by_layer[below]) != len(by_layer[last]) or len(by_layer[above]) != len(by_layer[first]):
        raise ValueError("the unit's neighbours make other requests than its own first and last layers")
    # A block of the layer below (above) -> the block its counterpart in the unit's last (first) layer makes.
    counterpart: dict[int, int] = {}
    for neighbour, own in ((below, last), (above, first)):
        for a, b in zip(by_layer[neighbour], by_layer[own]):
            if events[a][0] == "alloc":
                counterpart[events[a][1]] = events[b][1]
    fresh = count(1 + max(e[1] for e in events))
    renamed: dict[tuple[int, int], int] = defaultdict(lambda: next(fresh))

    def in_copy(block: int, copy: int) -> int:
        """What copy `copy` (0: the unit itself) calls a block the unit's events name."""
        origin = made_by.get(block)
        if origin in unit:
            return renamed[(copy, block)] if copy else block
        if origin == below and copy > 0:
            return in_copy(counterpart[block], copy - 1)
        if origin == above and copy < copies:
            return in_copy(counterpart[block], copy + 1)
        return block

    def copied(event: tuple, copy: int) -> tuple:
        return (event[0], in_copy(event[1], copy), *event[2:5], event[5] + copy * width if event[5] in unit else -1)

    out: list[tuple] = []
    i = 0
    while i < len(events):
        event = events[i]
        if owner[i] not in unit:
            layer = event[5] + copies * width if event[5] >= unit.stop else event[5]
            of_unit = event[0] == "free" and made_by.get(event[1]) in unit
            # the layer above frees what the last copy made, now below it
            block = in_copy(event[1], copies) if of_unit and owner[i] == above else event[1]
            out.append((event[0], block, *event[2:5], layer))
            if of_unit and owner[i] not in (above, below):  # dropped outside the layers: the copies' blocks too
                out += [(event[0], renamed[(c, event[1])], *event[2:5], layer) for c in range(1, copies + 1)]
            i += 1
            continue
        end = next((k for k in range(i, len(events)) if owner[k] not in unit), len(events))
        run = events[i:end]
        upwards = owner[i - 1] != above if i else True
        made = [[copied(e, c) for e in run] for c in range(copies + 1)]
        out += [e for c in (made if upwards else reversed(made)) for e in c]
        i = end
    return out
