"""What the CUDA caching allocator reserves for a traced step: its events replayed through the allocator model.

Pure Python (no torch): the trace's events (vram_planner.tracing.events) go through vram_planner.allocator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vram_planner.allocator.caching import format_size
from vram_planner.allocator.conf import AllocatorConf
from vram_planner.allocator.replay import ReplayResult, Replays
from vram_planner.tracing.events import LOADING, SteadyStream


@dataclass(frozen=True)
class ReservedMemory:
    """The allocator model's reserved bytes over a traced step, per phase and at its peak."""

    by_phase: dict[str, int]  # phase name -> the most reserved during it (see `reserved_memory`)
    peak_bytes: int  # the most reserved at any moment of the two steps replayed
    allocator_conf: str  # the PYTORCH_CUDA_ALLOC_CONF text replayed ("" for torch's defaults)
    seconds: float  # wall time of the replays
    notes: tuple[str, ...] = field(default=())  # the configuration's caveats, an out-of-memory and where it happened
    out_of_memory: bool = False  # the allocator found no memory within the capacity, even after freeing its cache


def reserved_memory(stream: SteadyStream, conf: AllocatorConf, capacity_bytes: int | None = None,
                    replays: Replays | None = None) -> ReservedMemory:
    """Replay the events of a traced step through the caching allocator model configured by `conf`.

    A phase's reserved bytes are the most the allocator holds at any moment of it: what
    torch.cuda.max_memory_reserved() reports at the phase's end after torch.cuda.reset_peak_memory_stats() at its
    start (as the probe measures), in step 2 for the phases before the optimizer step and in step 1 for the step
    itself (`SteadyStream`). The allocator keeps what it reserved until it runs out, so a phase also holds the
    segments that earlier phases made it reserve: reserved bytes can be far above the phase's own tensors.

    Args:
        stream: the events of two steps, from `TraceResult.steady_stream()`.
        conf: the allocator's settings (vram_planner.allocator.parse_allocator_conf of a PYTORCH_CUDA_ALLOC_CONF).
        capacity_bytes: what cudaMalloc can hand out (the card less the CUDA context); None for no limit. When the
            allocator cannot find memory even after freeing its cache, the phase where it failed is given at least
            what it held then plus the segment it asked for, and a note says where.
        replays: the stream's replays under `conf`, where the caller shares them (the need's bisection).
    """
    start = time.perf_counter()
    replays = replays or Replays([(e.kind, e.block, e.size_bytes) for e in stream.events], conf)
    replay = replays(capacity_bytes)
    notes = list(conf.notes())
    failed = replay.out_of_memory
    if failed is not None:  # the figures of a card with room enough, and the failure's phase over the capacity
        event = stream.events[replay.out_of_memory_event or 0]
        notes.append(_out_of_memory_note(failed, event, replay.out_of_memory_event or 0, stream))
        replay = replays(None)
    by_phase = {phase: _most_reserved(replay, start_index, end) for phase, (start_index, end) in stream.spans.items()}
    if failed is not None:
        needed = failed.reserved_bytes + failed.segment_bytes
        by_phase[event.phase] = max(by_phase.get(event.phase, 0), needed)
    peak = max([replay.max_reserved_bytes, *by_phase.values()])
    return ReservedMemory(by_phase=by_phase, peak_bytes=peak, allocator_conf=conf.text,
                          seconds=time.perf_counter() - start, notes=tuple(notes), out_of_memory=failed is not None)


def _most_reserved(replay: ReplayResult, start: int, end: int) -> int:
    """The most reserved from just before event `start` (what the phase starts with) to after event `end - 1`."""
    series = replay.reserved_bytes_series
    return max(series[max(start - 1, 0):end], default=0)


def _out_of_memory_note(failed: Any, event: Any, index: int, stream: SteadyStream) -> str:
    """Where the allocator failed and with what, sized as torch's out-of-memory message sizes them."""
    where = event.moment if event.phase == LOADING else f"{event.moment}, step {2 if index >= stream.second_step else 1}"
    room = (f" of the {format_size(failed.capacity_bytes)} the CUDA context leaves"
            if failed.capacity_bytes is not None else "")
    return (f"the allocator could not find memory after freeing its cache: in {event.phase} ({where})"
            f" it asked for {format_size(failed.segment_bytes)} for a tensor of {format_size(failed.requested_bytes)}"
            f" with {format_size(failed.reserved_bytes)} reserved{room}, "
            f"{format_size(failed.reserved_bytes - failed.allocated_bytes)} of it cached but unallocated")
