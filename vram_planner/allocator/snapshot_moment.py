"""A memory snapshot at one moment: its failed allocation (the trace's last oom event), else the event after which
the most bytes were allocated; the live blocks, the reserved bytes and the cached blocks then.

The blocks are the file's own where the moment is the snapshot's end and it lists them (an out-of-memory observer's
snapshot), else the allocator model's, replaying the trace to the moment (it makes the recorded segments to the byte:
tests/allocator/test_real_snapshots.py). Reserved bytes come from the trace's segment events, anchored on the final
segments.

A trace is a ring of the last max_entries events (torch's _record_memory_history), so a long run's snapshot may begin
mid-run: the blocks alive at the moment that no recorded event allocated (the weights, typically) are the file's
listed blocks with no alloc event, and the blocks the trace frees after the moment without having allocated them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from vram_planner.allocator.conf import AllocatorConf, parse_allocator_conf
from vram_planner.allocator.sizes import round_size
from vram_planner.allocator.snapshot import SIZED_ACTIONS, Snapshot, free_action
from vram_planner.allocator.snapshot_replay import GROWTH, RELEASE, recorded_figures, replay_until


@dataclass(frozen=True)
class Moment:
    """One device's allocator at the moment, in bytes."""

    index: int  # the moment is just before this event of the device's trace
    kind: Literal["out_of_memory", "worst"]
    conf: AllocatorConf  # the settings the snapshot says the run used
    block_sizes: dict[int, int]  # each live block's bytes by its address (what torch.cuda.memory_allocated counts)
    free_block_sizes: list[int]  # the cached blocks: reserved, not allocated
    reserved_bytes: int
    requested_bytes: int | None = None  # the failed request
    device_free_bytes: int | None = None  # what CUDA still had free when it failed
    # the live blocks made before the recorded history, by address: the tensors' requested bytes (in block_sizes too)
    before_history: dict[int, int] = field(default_factory=dict)
    history_truncated: bool = False  # the trace frees or holds blocks it never allocated, or began with memory reserved

    @property
    def allocated_bytes(self) -> int:
        return sum(self.block_sizes.values())

    @property
    def reserved_unallocated_bytes(self) -> int:
        return max(self.reserved_bytes - self.allocated_bytes, 0)

    @property
    def largest_free_block_bytes(self) -> int:
        return max(self.free_block_sizes, default=0)

    @property
    def fragmentation(self) -> float:
        """1 - the largest cached block's share of the cached bytes: 0 is one block, near 1 many small ones."""
        free = self.reserved_unallocated_bytes
        return round(1 - self.largest_free_block_bytes / free, 4) if free else 0.0

    @property
    def fragmentation_decided(self) -> bool:
        """The request would have fit the cached bytes in all, and fit no cached block."""
        if self.requested_bytes is None:
            return False
        request = round_size(self.requested_bytes, self.conf.roundup_power2_divisions)
        return self.largest_free_block_bytes < request <= self.reserved_unallocated_bytes


def moment_of(snapshot: Snapshot, device: int) -> Moment:
    """The device's failed allocation, else its worst moment."""
    events = snapshot.device_traces[device]
    conf = parse_allocator_conf(snapshot.allocator_conf_text or "")
    index, kind = _moment(events)
    reserved_before = recorded_figures(snapshot, device).reserved_before_bytes or 0
    reserved = reserved_before + sum(
        size if action in GROWTH else -size if action in RELEASE else 0 for action, _, size, _ in events[:index])
    segments = [s for s in snapshot.segments if s.device == device]
    at_end = not any(e[0] in SIZED_ACTIONS for e in events[index:])
    if at_end and segments and all(s.blocks for s in segments):
        blocks = [block for s in segments for block in s.blocks]
        block_sizes = {address: size for address, size, allocated, _ in blocks if allocated}
        free_sizes = [size for _, size, allocated, _ in blocks if not allocated]
    else:
        allocator, block_sizes = replay_until(snapshot, device, conf, index - 1)
        free_sizes = [size for _, size in allocator.free_blocks()]
    before, unmatched_frees = _made_before_history(events, index, segments, conf)
    block_sizes.update({address: size for address, (size, _) in before.items()})
    failed = kind == "out_of_memory"
    truncated = bool(before or unmatched_frees or reserved_before)
    return Moment(index, kind, conf, block_sizes, free_sizes, reserved, events[index][2] if failed else None,
                  snapshot.device_free.get((device, index)) if failed else None,
                  {address: requested for address, (_, requested) in before.items()}, truncated)


def _made_before_history(events: list, index: int, segments: list,
                         conf: AllocatorConf) -> tuple[dict[int, tuple[int, int]], int]:
    """The blocks alive just before event `index` that no recorded event allocated, by address: (block bytes,
    requested bytes); and how many frees in the whole trace are of such blocks. A block the file lists as allocated
    with no alloc event was alive throughout; one the trace frees first was alive until that free (its size is the
    tensor's, the block's as the allocator rounds it)."""
    freed = free_action(events)
    seen: set[int] = set()
    before: dict[int, tuple[int, int]] = {}
    unmatched = 0
    for at, (action, address, size, _) in enumerate(events):
        if action == "alloc":
            seen.add(address)
        elif action == freed and address not in seen:
            unmatched += 1
            seen.add(address)
            if at >= index:
                before[address] = (round_size(size, conf.roundup_power2_divisions), size)
    for segment in segments:
        for address, size, allocated, requested in segment.blocks:
            if allocated and address not in seen:
                before[address] = (size, requested)
    return before, unmatched


def _moment(events: list) -> tuple[int, Literal["out_of_memory", "worst"]]:
    """The last oom event, else the event after which the most bytes were allocated (the first such)."""
    ooms = [i for i, e in enumerate(events) if e[0] == "oom"]
    if ooms:
        return ooms[-1], "out_of_memory"
    freed = free_action(events)
    live: dict[int, int] = {}
    allocated: set[int] = set()
    running, peak = 0, float("-inf")  # beside the blocks made before the history, which only its frees lower
    at = len(events) - 1
    for index, (action, address, size, _) in enumerate(events):
        if action == "alloc":
            running += size - live.get(address, 0)
            live[address] = size
            allocated.add(address)
            if running > peak:
                peak, at = running, index
        elif action == freed and address in live:
            running -= live.pop(address)
        elif action == freed and address not in allocated:  # made before the history
            running -= size
            allocated.add(address)
    return at + 1, "worst"
