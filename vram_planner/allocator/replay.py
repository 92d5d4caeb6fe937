"""Replaying an ordered list of allocations and frees through the allocator model."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

from vram_planner.allocator.caching import CachingAllocator, OutOfMemory
from vram_planner.allocator.conf import AllocatorConf
from vram_planner.errors import VramPlanError

ALLOC, FREE, EMPTY_CACHE = "alloc", "free", "empty_cache"


class ReplayError(VramPlanError):
    """An event list that cannot have come from a program: a free of a tensor that is not allocated, say."""


@dataclass
class ReplayResult:
    """What the allocator did over the events: its segments, its peaks, and reserved bytes after every event."""

    segment_sizes: list[int]
    max_reserved_bytes: int
    max_allocated_bytes: int
    reserved_bytes_series: array = field(repr=False)  # after event i; events past an out-of-memory are not replayed
    allocated_bytes_series: array = field(repr=False)
    segment_log: list[tuple[str, int, int]] = field(repr=False, default_factory=list)
    out_of_memory: OutOfMemory | None = None  # the error that stopped the replay, if one did
    out_of_memory_event: int | None = None  # its event's index

    def reserved_bytes_after(self, index: int) -> int:
        """Reserved bytes once event `index` has happened."""
        return self.reserved_bytes_series[index]

    @property
    def events_replayed(self) -> int:
        return len(self.reserved_bytes_series)


def replay_events(events: Iterable[tuple[str, int, int]], conf: AllocatorConf = AllocatorConf(),
                  capacity_bytes: int | None = None, stream: int = 0, series: bool = True) -> ReplayResult:
    """Replay ("alloc" | "free" | "empty_cache", tensor_id, size_bytes) events in order through a fresh allocator;
    tensor ids are the caller's keys. torch gives cached segments back only when cudaMalloc fails (or on
    empty_cache), so without a capacity reserved bytes only grow: give the device's capacity for the figures a real
    card would show. With one, a request the allocator cannot meet stops the replay and is kept in the result
    (out_of_memory, out_of_memory_event). `series` False leaves the series empty (a bisection reads only the peaks
    and the out-of-memory: a tenth faster)."""
    allocator = CachingAllocator(conf, capacity_bytes)
    malloc, free = allocator.malloc, allocator.free
    addresses: dict[int, int] = {}
    reserved, allocated = array("q"), array("q")
    keep_reserved, keep_allocated = reserved.append, allocated.append
    oom = oom_event = None
    for index, (action, tensor_id, size_bytes) in enumerate(events):
        if action == ALLOC:
            if tensor_id in addresses:
                raise ReplayError(f"event {index} allocates tensor {tensor_id!r}, which is already allocated")
            try:
                addresses[tensor_id] = malloc(size_bytes, stream)
            except OutOfMemory as exc:
                oom, oom_event = exc, index
                break
        elif action == FREE:
            address = addresses.pop(tensor_id, None)
            if address is None:
                raise ReplayError(f"event {index} frees tensor {tensor_id!r}, which is not allocated")
            free(address)
        elif action == EMPTY_CACHE:
            allocator.empty_cache()
        else:
            raise ReplayError(f"event {index} has action {action!r}; expected {ALLOC!r}, {FREE!r} or {EMPTY_CACHE!r}")
        if series:
            keep_reserved(allocator.reserved_bytes)
            keep_allocated(allocator.allocated_bytes)
    return ReplayResult(list(allocator.segment_sizes), allocator.max_reserved_bytes, allocator.max_allocated_bytes,
                        reserved, allocated, list(allocator.segment_log), oom, oom_event)


class Replays:
    """One event list replayed through one allocator configuration at the capacities asked for; those in `kept`
    (the card's, None for no limit) are replayed once for every caller (each result holds two series as long as the
    events)."""

    def __init__(self, events: Iterable[tuple[str, int, int]], conf: AllocatorConf = AllocatorConf(),
                 kept: Iterable[int | None] = ()) -> None:
        self.events, self.conf = list(events), conf
        self._kept: dict[int | None, ReplayResult | None] = dict.fromkeys(kept)

    def __call__(self, capacity_bytes: int | None, series: bool = True) -> ReplayResult:
        """The replay at `capacity_bytes`; with `series` False, its series may be empty (`replay_events`)."""
        if capacity_bytes not in self._kept:
            return replay_events(self.events, self.conf, capacity_bytes, series=series)
        result = self._kept[capacity_bytes]
        if result is None:
            result = self._kept[capacity_bytes] = replay_events(self.events, self.conf, capacity_bytes)
        return result
