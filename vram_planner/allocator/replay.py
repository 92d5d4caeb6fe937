"""Replaying an ordered list of allocations and frees through the allocator model."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
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
    return _replay(events if isinstance(events, list) else list(events), conf, capacity_bytes, stream, series)


@dataclass(frozen=True)
class Checkpoint:
    """A replay's state before event `event`: its allocator (never run on: a replay resumes on a clone) and where
    each live tensor lies. A replay on any capacity the allocator's same_replay_until_now accepts reaches it."""

    event: int
    allocator: CachingAllocator
    addresses: dict[int, int]


def _replay(events: list[tuple[str, int, int]], conf: AllocatorConf, capacity_bytes: int | None, stream: int,
            series: bool, start: Checkpoint | None = None, every: int = 0,
            keep: Callable[[Checkpoint], None] | None = None, every_after_refusal: int = 0) -> ReplayResult:
    """replay_events, from `start` where given (the series then begin there), handing `keep` a checkpoint every
    `every` events (0: none), and every `every_after_refusal` events (at least `every`) once cudaMalloc has refused
    the allocator."""
    if start is None:
        allocator, addresses, first = CachingAllocator(conf, capacity_bytes), {}, 0
    else:
        allocator, addresses, first = start.allocator.clone(capacity_bytes), dict(start.addresses), start.event
    malloc, free = allocator.malloc, allocator.free
    reserved, allocated = array("q"), array("q")
    keep_reserved, keep_allocated = reserved.append, allocated.append
    oom = oom_event = None
    next_checkpoint = (first // every + 1) * every if every and keep is not None else len(events)
    every_after_refusal = max(every, every_after_refusal)
    for index in range(first, len(events)):
        if index == next_checkpoint:
            keep(Checkpoint(index, allocator.clone(capacity_bytes), dict(addresses)))
            next_checkpoint += every if allocator.refused_bytes is None else every_after_refusal
        action, tensor_id, size_bytes = events[index]
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


# The replays Replays keeps checkpoints of, and how many events apart it takes them. Until cudaMalloc first refuses
# a replay, its checkpoint serves every capacity at least what the allocator was granted so far, larger ones
# included: up to CHECKPOINTS_BEFORE_REFUSAL of them, at least MIN_CHECKPOINT_EVENTS apart (a clone costs what
# replaying one or two thousand events does). After it, one serves only the capacities between what was granted and
# what was refused, the bisection's last few: SPARSER_AFTER_REFUSAL times further apart.
CHECKPOINTED_REPLAYS = 2
CHECKPOINTS_BEFORE_REFUSAL = 32
MIN_CHECKPOINT_EVENTS = 4096
SPARSER_AFTER_REFUSAL = 4


def checkpoint_spacing(n_events: int) -> tuple[int, int]:
    """How many events apart a replay of `n_events` takes its checkpoints: before cudaMalloc first refuses it, and
    after."""
    before = max(MIN_CHECKPOINT_EVENTS, n_events // CHECKPOINTS_BEFORE_REFUSAL)
    return before, before * SPARSER_AFTER_REFUSAL


class Replays:
    """One event list replayed through one allocator configuration at the capacities asked for; those in `kept`
    (the card's, None for no limit) are replayed once for every caller (each result holds two series as long as the
    events).

    A replay without series starts from the latest checkpoint an earlier replay took that its capacity reaches:
    two capacities replay the same events alike until a cudaMalloc that one allows and the other refuses, so the
    replays of a bisection, whose capacities close in on one another, share ever longer beginnings, and the checks
    above its answer start where the replay below them was first refused (checkpoint_spacing). Only where the
    capacity alone decides cudaMalloc (CachingAllocator.resumable)."""

    def __init__(self, events: Iterable[tuple[str, int, int]], conf: AllocatorConf = AllocatorConf(),
                 kept: Iterable[int | None] = ()) -> None:
        self.events, self.conf = list(events), conf
        self._kept: dict[int | None, ReplayResult | None] = dict.fromkeys(kept)
        self._checkpoints: list[list[Checkpoint]] = []  # those of the latest replays, by replay, the latest last
        self.resumed_events = 0  # the events that replays started past

    def __call__(self, capacity_bytes: int | None, series: bool = True) -> ReplayResult:
        """The replay at `capacity_bytes`; with `series` False, its series may be empty (`replay_events`)."""
        if capacity_bytes not in self._kept:
            return self._replay(capacity_bytes, series)
        result = self._kept[capacity_bytes]
        if result is None:
            result = self._kept[capacity_bytes] = self._replay(capacity_bytes, series=True)
        return result

    def _replay(self, capacity_bytes: int | None, series: bool) -> ReplayResult:
        if not CachingAllocator(self.conf, capacity_bytes).resumable():
            return _replay(self.events, self.conf, capacity_bytes, 0, series)
        reached = [] if series else [(c.event, n, c) for n, replay in enumerate(self._checkpoints) for c in replay
                                     if c.allocator.same_replay_until_now(capacity_bytes)]
        event, source, start = max(reached, key=lambda r: r[:2], default=(0, 0, None))
        # the checkpoints it starts from are this replay's too
        kept = [c for c in self._checkpoints[source] if c.event <= event] if start is not None else []
        self._checkpoints = [*self._checkpoints, kept][-CHECKPOINTED_REPLAYS:]
        self.resumed_events += event
        every, every_after_refusal = checkpoint_spacing(len(self.events))
        return _replay(self.events, self.conf, capacity_bytes, 0, series, start, every, kept.append,
                       every_after_refusal)
