"""Memory snapshots in torch's format (torch/cuda/memory.py _snapshot's docstring, torch 2.13), made by the allocator
model: each malloc and free of a made-up step goes through CachingAllocator with a capacity, and is recorded as torch
records it (segment_alloc before the alloc that needed it, free_requested then free_completed, the segments the
allocator gives back before it fails, then an oom event with the failed request and device_free), with the final
segments and their blocks (active_allocated or inactive) as _snapshot() lists them."""

from __future__ import annotations

from vram_planner.allocator import AllocatorConf, parse_allocator_conf
from vram_planner.allocator.caching import CachingAllocator, OutOfMemory


class Recorder:
    """A device whose allocations are recorded: malloc/free as tensors are made and dropped."""

    def __init__(self, capacity_bytes: int | None = None, conf_text: str = "") -> None:
        self.conf: AllocatorConf = parse_allocator_conf(conf_text)
        self.conf_text = conf_text
        self.allocator = CachingAllocator(self.conf, capacity_bytes=capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self.events: list[dict] = []
        self.live: dict[int, int] = {}  # address -> requested bytes
        self.segments: dict[int, int] = {}  # address -> bytes

    def _segment_events(self, since: int) -> None:
        for action, address, size in self.allocator.segment_log[since:]:
            self.events.append({"action": action, "addr": address, "size": size, "stream": 0})
            if action in ("segment_alloc", "segment_map"):
                self.segments[address] = self.segments.get(address, 0) + size
            elif action == "segment_free":
                self.segments.pop(address, None)

    def malloc(self, size: int, frames: list[dict] | None = None) -> int:
        """The block's address; OutOfMemory after recording the oom event, as torch does before it raises."""
        since = len(self.allocator.segment_log)
        try:
            address = self.allocator.malloc(size)
        except OutOfMemory:
            self._segment_events(since)
            free = (self.capacity_bytes or 0) - self.allocator.reserved_bytes
            self.events.append({"action": "oom", "size": size, "device_free": free, "stream": 0,
                                "frames": frames or []})
            raise
        self._segment_events(since)
        self.events.append({"action": "alloc", "addr": address, "size": size, "stream": 0, "frames": frames or []})
        self.live[address] = size
        return address

    def free(self, address: int) -> None:
        size = self.live.pop(address)
        self.allocator.free(address)
        self.events += [{"action": action, "addr": address, "size": size, "stream": 0}
                        for action in ("free_requested", "free_completed")]

    def snapshot(self, with_blocks: bool = True) -> dict:
        """The snapshot as torch.cuda.memory._snapshot() returns it now."""
        free = dict(self.allocator.free_blocks())
        segments = []
        for address, total in sorted(self.segments.items()):
            inside = [(a, self.allocator.block_size(a), "active_allocated") for a in self.live
                      if address <= a < address + total]
            inside += [(a, s, "inactive") for a, s in free.items() if address <= a < address + total]
            segment = {"device": 0, "address": address, "total_size": total, "stream": 0,
                       "segment_type": "small" if total <= 2 * 2**20 else "large", "is_expandable": False}
            if with_blocks:
                segment["blocks"] = [{"address": a, "size": s, "requested_size": self.live.get(a, s), "state": state}
                                     for a, s, state in sorted(inside)]
            segments.append(segment)
        return {"segments": segments, "device_traces": [list(self.events)],
                "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": self.conf_text}}


def expand(sizes) -> list[int]:  # sizes: a Counter of byte sizes
    return [size for size, count in sorted(sizes.items()) for _ in range(count)]


def fragmented_until_oom(recorder: Recorder, block: int, count: int, request: int) -> None:
    """`count` blocks of `block` bytes, every other one freed, then `request`: the cached holes add up to more than
    the request, none of them holds it. Raises OutOfMemory where the capacity runs out."""
    addresses = [recorder.malloc(block) for _ in range(count)]
    for address in addresses[::2]:
        recorder.free(address)
    recorder.malloc(request)
