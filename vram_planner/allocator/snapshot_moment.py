"""A memory snapshot at one moment: its failed allocation (the trace's last oom event), else the event after which
the most bytes were allocated; the live blocks, the reserved bytes and the cached blocks then.

The blocks are the file's own where the moment is the snapshot's end and it lists them (an out-of-memory observer's
snapshot), else the allocator model's, replaying the trace to the moment (it makes the recorded segments to the byte:
tests/allocator/test_real_snapshots.py). Reserved bytes come from the trace's segment events, anchored on the final
segments.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    reserved = (recorded_figures(snapshot, device).reserved_before_bytes or 0) + sum(
        size if action in GROWTH else -size if action in RELEASE else 0 for action, _, size, _ in events[:index])
    segments = [s for s in snapshot.segments if s.device == device]
    at_end = not any(e[0] in SIZED_ACTIONS for e in events[index:])
    if at_end and segments and all(s.blocks for s in segments):
        blocks = [block for s in segments for block in s.blocks]
        block_sizes = {address: size for address, size, allocated in blocks if allocated}
        free_sizes = [size for _, size, allocated in blocks if not allocated]
    else:
        allocator, block_sizes = replay_until(snapshot, device, conf, index - 1)
        free_sizes = [size for _, size in allocator.free_blocks()]
    failed = kind == "out_of_memory"
    return Moment(index, kind, conf, block_sizes, free_sizes, reserved, events[index][2] if failed else None,
                  snapshot.device_free.get((device, index)) if failed else None)


def _moment(events: list) -> tuple[int, Literal["out_of_memory", "worst"]]:
    """The last oom event, else the event after which the most bytes were allocated (the first such)."""
    ooms = [i for i, e in enumerate(events) if e[0] == "oom"]
    if ooms:
        return ooms[-1], "out_of_memory"
    freed = free_action(events)
    live: dict[int, int] = {}
    running = peak = 0
    at = len(events) - 1
    for index, (action, address, size, _) in enumerate(events):
        if action == "alloc":
            running += size - live.get(address, 0)
            live[address] = size
            if running > peak:
                peak, at = running, index
        elif action == freed and address in live:
            running -= live.pop(address)
    return at + 1, "worst"
