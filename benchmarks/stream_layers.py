"""A traced step's layers as a loop: the step of a deeper model made from the trace of a shallow one, held to a fresh
trace of the deeper model, request for request.

    python benchmarks/stream_layers.py         # every fixture architecture: LoRA bf16 with and without checkpointing
                                               # and checkpointed reentrantly, full fp32 + beta
    python benchmarks/stream_layers.py --fixtures tiny-qwen3

benchmarks/stream_template.py made a step's requests at other sizes from a few traces, with the loops whose counts
change with the config left out. The layers are the first of those loops. The trace marks each event with the decoder
layer it belongs to (`Event.layer`: a layer's forward hooks in the forward, the autograd nodes its forward made in the
backward, the layer a cache update grows), so the events of one layer are known wherever they run: the prefill, the
decoding steps' cache growth, the last decoding step, the scoring passes, the loss forward, a checkpointed layer's
recomputation and the backward; the weights' allocations at loading and the optimizer step's in the layers of the
parameters they belong to.

Each fixture is traced with 2p + 3 layers, p the period of its layer types as the installed transformers lays them out
(1; gemma-2's alternating sliding and full attention 2, gemma-3's five sliding and one full 6), and the unit of layers
p + 1 .. 2p is copied twice in every run of its events (with the events outside any layer that follow them: the
model's loop frees a layer's input after the layer returns): after it where the layers run upwards (the forwards, the
cache growth), before it where they run downwards (the backward). Its neighbours are inner layers that are not the
first of their type (the first layer of each type and the last do more in the backward). Each copy makes its own
blocks; what the unit frees of the layer below it, a copy frees of the copy below it (the corresponding request of the
unit's last layer), what it frees of the layer above it, of the copy above; the layer above the copies frees the last
copy's; a free outside the layers of a block the unit made (a cache dropped after generation) frees the copies' blocks
beside it. The result is compared with a fresh trace with 2p more layers, the whole stream that `check --exact`
replays (loading, step 1, zero_grad, step 2): the same requests in the same order, of the same size, in the same layer
("exact"). Writes benchmarks/results/stream_layers.txt.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from itertools import count
from pathlib import Path

from stream_shape import (BASE, KNOBS, fixture_main, numbered, request_for_request, text_config, traced_events,
                          with_free_runs_sorted)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "stream_layers.txt"
COPIES = 2
# stream_shape's knobs, a run without gradient checkpointing (no layer runs again in the backward) and one that
# checkpoints reentrantly (a layer's forward inside one autograd node, its backward a backward of its own)
LAYER_KNOBS = {**KNOBS, "lora-bf16-nogc": {**KNOBS["lora-bf16"], "gradient_checkpointing": False},
               "lora-reentrant": {**KNOBS["lora-bf16"], "use_reentrant": True}}


def period(config: dict) -> int:
    """The period of the decoder's layer types as the installed transformers lays them out (1 where it names none)."""
    from transformers import CONFIG_MAPPING

    probe = with_layers(config, 24)
    built = CONFIG_MAPPING[probe["model_type"]](**{k: v for k, v in probe.items() if k != "model_type"})
    types = getattr(built.get_text_config(), "layer_types", None) or ["layer"] * 24
    return next(p for p in range(1, 25) if all(types[i] == types[i + p] for i in range(24 - p)))


def copied_unit(period: int) -> range:
    """The layers copied: a period of them, whose neighbours are inner layers that are not the first of their type
    (the first layer of each type and the last layer do more than the others in the backward)."""
    return range(period + 1, 2 * period + 1)


def with_layers(config: dict, layers: int) -> dict:
    out = json.loads(json.dumps(config))
    text_config(out)["num_hidden_layers"] = layers
    return out


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


def renumbered(events: list[tuple]) -> list[tuple]:
    return with_free_runs_sorted(numbered(events))


def table(fixtures: list[Path]) -> list[str]:
    exact = 0
    lines = [f"{'fixture':24} {'knobs':16} {'period':>6} {'layers':>7} {'events':>7} {'made':>7} {'aligned':>8} "
             f"{'other':>6} {'seconds':>8}"]
    for path in fixtures:
        config = json.loads(path.read_text())
        every = period(config)
        unit = copied_unit(every)
        shallow, deep = unit.stop + 2, unit.stop + 2 + COPIES * every
        for knobs_name, knobs in LAYER_KNOBS.items():
            start = time.perf_counter()
            settings = {**BASE, **knobs}
            fresh = renumbered(traced_events(with_layers(config, deep), settings))
            try:
                made = renumbered(expanded(traced_events(with_layers(config, shallow), settings), unit, COPIES))
            except ValueError as exc:
                lines.append(f"{path.stem:24} {knobs_name:16} no loop: {exc}")
                continue
            aligned, other = request_for_request(made, fresh)
            exact += aligned and not other
            lines.append(f"{path.stem:24} {knobs_name:16} {every:6d} {f'{shallow}->{deep}':>7} {len(fresh):7d} "
                         f"{len(made):7d} {'yes' if aligned else 'NO':>8} {other:6d} "
                         f"{time.perf_counter() - start:8.0f}")
            print(lines[-1], file=sys.stderr)
    return [*lines, f"{exact} of {len(lines) - 1} steps made exactly from a trace with fewer layers"]


if __name__ == "__main__":
    sys.exit(fixture_main(__doc__.splitlines()[0], table, RESULTS))
