"""The trace's allocation and free events, in order, and the stream of a steady-state step that a model of the CUDA
caching allocator replays to find the reserved bytes. Pure Python: no torch (the planner may import it)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

ALLOC, FREE = "alloc", "free"
LOADING = "loading"  # the phase of what exists before the first step: the weights, the reference model
# The phase that ends a step: its states are created once (step 1), its gradients freed by zero_grad afterwards.
OPTIMIZER = "optimizer"
ZERO_GRAD = "zero_grad(set_to_none=True)"


class Event(NamedTuple):
    """One storage allocated or freed, as the CUDA caching allocator would see it (one stream, one device)."""

    kind: str  # ALLOC or FREE
    block: int  # which allocation: a free names the block its allocation made
    size_bytes: int  # the storage's bytes as requested (the allocator rounds them)
    phase: str  # LOADING or a phase of the step ("generation", "scoring", "training", OPTIMIZER)
    moment: str  # where in the phase ("prefill", "forward", ...)
    layer: int = -1  # the decoder layer it belongs to (its forward, backward or cache), -1 for none


def live_bytes(events: Iterable[Event], block_bytes: int = 512) -> list[int]:
    """The live bytes after each event, each storage rounded up to `block_bytes` (torch.cuda.memory_allocated)."""
    live, out = 0, []
    for e in events:
        rounded = -(-e.size_bytes // block_bytes) * block_bytes
        live += rounded if e.kind == ALLOC else -rounded
        out.append(live)
    return out


@dataclass(frozen=True)
class SteadyStream:
    """The events of two steps: loading, step 1 (which creates the optimizer states), zero_grad, then step 2.

    `spans` gives, per phase, the [start, end) of the events that phase reports: step 2 for the phases before the
    optimizer step (they run with the states of step 1 alive, as every later step does), step 1 for the optimizer
    step (where its states are created, as the probe measures it).
    """

    events: list[Event]
    spans: dict[str, tuple[int, int]]
    second_step: int  # the index of step 2's first event


def steady_stream(events: Sequence[Event], gradients: Iterable[tuple[int, int]]) -> SteadyStream:
    """Repeat the step's phases before the optimizer step after it, as step 2 runs them.

    Args:
        events: the trace's events: LOADING first, then each phase of step 1 in order, OPTIMIZER last.
        gradients: (block, size_bytes) of the gradients alive after the optimizer step, which the trainer's
            zero_grad frees before the next step.
    """
    stream = list(events)
    spans = _spans(stream, 0)
    stream += [Event(FREE, block, size, OPTIMIZER, ZERO_GRAD) for block, size in gradients if size]
    repeated = [e for e in events if e.phase not in (LOADING, OPTIMIZER)]
    offset = 1 + max((e.block for e in events), default=0)
    made = {e.block for e in repeated if e.kind == ALLOC}
    start = len(stream)
    # A free of a block made before the repeated phases (none is expected) has nothing to free in step 2.
    stream += [e._replace(block=e.block + offset) for e in repeated if e.block in made]
    spans.update({phase: span for phase, span in _spans(stream[start:], start).items() if phase != OPTIMIZER})
    return SteadyStream(stream, spans, start)


def repeated_stream(events: Sequence[Event]) -> SteadyStream:
    """The steady stream of events that already hold both steps (loading, step 1, zero_grad's frees, step 2), as
    `steady_stream` lays them out: a copy of a traced step's (vram_planner.step_copy) made at other sizes."""
    freed = [i for i, e in enumerate(events) if e.moment == ZERO_GRAD]
    second = 1 + freed[-1] if freed else next((i for i, e in enumerate(events) if i and e.phase != OPTIMIZER
                                              and events[i - 1].phase == OPTIMIZER), 0)
    if not second:
        raise ValueError("no optimizer step between the two steps")
    spans = _spans(events[:freed[0] if freed else second], 0)
    spans.update({phase: span for phase, span in _spans(events[second:], second).items() if phase != OPTIMIZER})
    return SteadyStream(list(events), spans, second)


def with_workspaces(stream: SteadyStream, size_bytes: int) -> SteadyStream:
    """The stream with the cuBLAS workspaces allocated where a real step allocates them (vram_planner.model.cublas):
    one at step 1's first matrix product (its first phase after loading), another at its first backward (the
    training phase, on autograd's thread), never freed."""
    block = 1 + max((e.block for e in stream.events), default=0)
    inserts = []
    for phase, moment in (("training", "cuBLAS workspaces of autograd's thread"),
                          (None, "cuBLAS workspaces of the Python thread")):
        index = next((i for i, e in enumerate(stream.events[:stream.second_step])
                      if (e.phase == phase if phase else e.phase != LOADING)), None)
        if index is not None:
            inserts.append((index, [Event(ALLOC, block, size_bytes, stream.events[index].phase, moment)]))
            block += 1
    events, spans, second = list(stream.events), dict(stream.spans), stream.second_step
    for index, made in sorted(inserts, key=lambda insert: -insert[0]):
        events[index:index] = made
        spans = {phase: (start + len(made) * (start > index), end + len(made) * (end > index))
                 for phase, (start, end) in spans.items()}
        second += len(made)
    return SteadyStream(events, spans, second)


def _spans(events: Sequence[Event], base: int) -> dict[str, tuple[int, int]]:
    """[start, end) of each phase's run of events (phases run one after the other)."""
    spans: dict[str, tuple[int, int]] = {}
    for i, e in enumerate(events):
        start, _ = spans.get(e.phase, (base + i, 0))
        spans[e.phase] = (start, base + i + 1)
    return spans
