"""Replaying a snapshot's recorded allocations and frees through the allocator model, next to what was recorded."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from vram_planner.allocator.caching import CachingAllocator
from vram_planner.allocator.conf import AllocatorConf
from vram_planner.allocator.snapshot import Snapshot, SnapshotError, free_action
from vram_planner.units import MiB

GROWTH, RELEASE = ("segment_alloc", "segment_map"), ("segment_free", "segment_unmap")


@dataclass
class Recorded:
    """What the recorded allocator did: its segments in order, and its reserved bytes where they can be known."""

    segment_sizes: list[int]
    max_reserved_bytes: int | None  # None without the final segments to anchor the running total
    reserved_before_bytes: int | None  # reserved when recording began (made before it, so not in the trace)
    expandable: bool  # the trace maps pages (segment_map): the run used expandable_segments:True
    ooms: int


@dataclass
class SnapshotReplay:
    """The model's prediction for one device's trace, and the recorded figures beside it."""

    device: int
    allocs: int
    frees: int
    predicted_segment_sizes: list[int]
    predicted_max_reserved_bytes: int
    predicted_max_allocated_bytes: int
    recorded: Recorded
    unmatched_frees: int  # frees of blocks allocated before recording began: not modeled
    mirrored_releases: int  # recorded runs of segment_free/unmap replayed as empty_cache()
    notes: list[str] = field(default_factory=list)


def pick_device(snapshot: Snapshot, device: int | None) -> int:
    """The device to replay: the one asked for, else the only one with events."""
    with_events = snapshot.devices_with_events()
    if not with_events:
        raise SnapshotError("the snapshot holds no trace events; record them with "
                            "torch.cuda.memory._record_memory_history() before the step you dump")
    listed = ", ".join(str(d) for d in with_events)
    if device is None:
        if len(with_events) > 1:
            raise SnapshotError(f"the snapshot has events for devices {listed}; choose one with --device")
        return with_events[0]
    if device not in with_events:
        raise SnapshotError(f"the snapshot has no trace events for device {device}; devices with events: {listed}")
    return device


def replay_snapshot(snapshot: Snapshot, device: int, conf: AllocatorConf) -> SnapshotReplay:
    """Replay the device's alloc and free_completed events (free_requested where the trace has no completions:
    free_block, which returns memory to the pool, is what records free_completed). A run of recorded segment frees
    or unmaps is replayed as empty_cache(), the call that returns cached memory without an out-of-memory error.
    The segment_alloc events before an alloc say where cudaMalloc put its segments: the model's go there too, so
    best fit breaks its ties (equal free blocks: the lower address) as the recorded allocator did."""
    allocator, allocs, frees, unmatched, releases = _replay(snapshot.device_traces[device], conf)
    replay = SnapshotReplay(device, allocs, frees, list(allocator.segment_sizes), allocator.max_reserved_bytes,
                            allocator.max_allocated_bytes, recorded_figures(snapshot, device), unmatched, releases)
    replay.notes = _notes(replay, conf, snapshot)
    return replay


def replay_until(snapshot: Snapshot, device: int, conf: AllocatorConf,
                 stop: int) -> tuple[CachingAllocator, dict[int, int]]:
    """The allocator model as it stood just after event `stop` of the device's trace (as replay_snapshot replays),
    and the size of the block it gave each live recorded address (what torch.cuda.memory_allocated counts)."""
    addresses: dict[int, int] = {}
    allocator = _replay(snapshot.device_traces[device], conf, stop + 1, addresses)[0]
    return allocator, {recorded: allocator.block_size(modeled) for recorded, modeled in addresses.items()}


def _replay(events: list, conf: AllocatorConf, stop: int | None = None,
            addresses: dict[int, int] | None = None) -> tuple[CachingAllocator, int, int, int, int]:
    freed = free_action(events)
    allocator = CachingAllocator(conf)
    addresses = {} if addresses is None else addresses  # recorded address -> the model's
    device_segments: list[tuple[int, int]] = []  # the segment_alloc events since the last alloc
    allocs = frees = unmatched = releases = 0
    releasing = False
    for action, address, size, stream in itertools.islice(events, stop):
        if action == "alloc":
            if address in addresses:  # recorded twice without a free between: the later block replaces it
                allocator.free(addresses.pop(address))
            if device_segments:
                allocator.use_device_addresses(device_segments)
                device_segments = []
            addresses[address] = allocator.malloc(size, stream)
            allocs += 1
        elif action == "segment_alloc":
            device_segments.append((address, size))
        elif action == freed:
            modeled = addresses.pop(address, None)
            if modeled is None:
                unmatched += 1
            else:
                allocator.free(modeled)
                frees += 1
        elif action in RELEASE:
            if not releasing:
                allocator.empty_cache()
                releases += 1
            releasing = True
            continue
        releasing = False
    return allocator, allocs, frees, unmatched, releases


def recorded_figures(snapshot: Snapshot, device: int) -> Recorded:
    """The recorded segments and reserved bytes: the trace's segment events, anchored on the final segments."""
    events = snapshot.device_traces[device]
    sizes = [size for action, _, size, _ in events if action in GROWTH]
    running = peak = 0
    for action, _, size, _ in events:
        if action in GROWTH:
            running += size
            peak = max(peak, running)
        elif action in RELEASE:
            running -= size
    before = max_reserved = None
    if snapshot.has_segments:
        final = sum(s.total_size for s in snapshot.segments if s.device == device)
        before = max(final - running, 0)
        max_reserved = before + peak
    return Recorded(sizes, max_reserved, before, any(e[0] == "segment_map" for e in events),
                    sum(1 for e in events if e[0] == "oom"))


def _notes(replay: SnapshotReplay, conf: AllocatorConf, snapshot: Snapshot) -> list[str]:
    """What the reader needs to weigh the comparison."""
    recorded, notes = replay.recorded, list(conf.notes())
    if replay.unmatched_frees or recorded.reserved_before_bytes:
        notes.append(f"recording began mid-run: {_count(replay.unmatched_frees, 'free')} of blocks allocated before "
                     f"it, {_mib(recorded.reserved_before_bytes or 0)} already reserved; the model starts empty, so "
                     "its figures leave that earlier memory out")
    if replay.mirrored_releases:
        notes.append(f"the trace returns cached memory {_count(replay.mirrored_releases, 'time')} (empty_cache, "
                     "garbage collection or an out-of-memory retry); each is replayed as empty_cache()")
    if recorded.expandable != conf.expandable_segments and recorded.segment_sizes:
        used = "used" if recorded.expandable else "did not use"
        notes.append(f"the recorded run {used} expandable_segments:True, the replay "
                     f"{'does' if conf.expandable_segments else 'does not'}; pass the run's --allocator-conf")
    if snapshot.allocator_conf_text is not None and snapshot.allocator_conf_text != conf.text:
        used = (f"PYTORCH_CUDA_ALLOC_CONF={snapshot.allocator_conf_text!r}" if snapshot.allocator_conf_text else
                "torch's default allocator settings")
        notes.append(f"the snapshot says the run used {used}")
    if recorded.ooms:
        notes.append(f"the recorded run ran out of memory {_count(recorded.ooms, 'time')}; the replay has no "
                     "capacity, so it never does")
    if recorded.max_reserved_bytes is None:
        notes.append("the snapshot has no final segments, so the recorded reserved peak is unknown")
    return notes


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _mib(n_bytes: int) -> str:
    return f"{n_bytes / MiB:.2f} MiB"
