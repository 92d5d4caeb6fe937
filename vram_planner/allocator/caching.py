"""A model of PyTorch's CUDA caching allocator (DeviceCachingAllocator in c10/cuda/CUDACachingAllocator.cpp).

Each method follows the function of the same name in that file: malloc, get_free_block, should_split,
alloc_found_block, free / free_block, try_merge_blocks, alloc_block, release_available_cached_blocks,
release_cached_blocks, release_block, garbage_collect_cached_blocks; expandable segments are in expandable.py.
"cudaMalloc" succeeds while the segments reserved stay within `capacity_bytes` (None: always); as in torch, cached
segments go back only when it fails or on empty_cache, so without a capacity reserved bytes never fall. Addresses are
made up (a new segment lies above every earlier one) unless use_device_addresses says where the device put them
(addresses.py: they break best fit's ties). One device; streams are kept apart as torch keeps them; record_stream,
CUDA graphs and private memory pools are not modeled.

Source followed: pytorch/pytorch c10/cuda/CUDACachingAllocator.cpp at 001074d25084 (read whole) and a late-2025 copy
of the same file (for the parts that moved: AcceleratorAllocatorConfig, large_segment_size, allowed_memory_maximum
set only for a fraction below 1), checked against what torch 2.13 installs: c10/core/AllocatorConfig.h and
c10/cuda/CUDAAllocatorConfig.h, and the configuration parser in its libc10.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

from vram_planner.allocator.addresses import DeviceAddresses
from vram_planner.allocator.blocks import ADDRESS_MASK, SIZE_SHIFT, STREAM_SHIFT, Block, BlockPool
from vram_planner.allocator.conf import AllocatorConf
from vram_planner.allocator.expandable import ExpandableSegments
from vram_planner.allocator.sizes import (K_MIN_BLOCK_SIZE, K_ROUND_LARGE, K_SMALL_SIZE, SIZE_MAX, allocation_size,
                                          round_size)
from vram_planner.errors import VramPlanError
from vram_planner.units import GiB, MiB

ONE_EXA_BYTES = 1 << 60  # "CUDA out of memory. Tried to allocate more than 1EB memory."


class OutOfMemory(VramPlanError):
    """The allocator could not get memory even after releasing its cached blocks (torch's OutOfMemoryError)."""

    def __init__(self, requested_bytes: int, segment_bytes: int, reserved_bytes: int, allocated_bytes: int,
                 capacity_bytes: int | None) -> None:
        self.requested_bytes = requested_bytes
        self.segment_bytes = segment_bytes
        self.reserved_bytes = reserved_bytes
        self.allocated_bytes = allocated_bytes
        self.capacity_bytes = capacity_bytes
        capacity = f" (capacity {format_size(capacity_bytes)})" if capacity_bytes is not None else ""
        super().__init__(f"out of memory: tried to allocate {format_size(segment_bytes)} with "
                         f"{format_size(reserved_bytes)} reserved{capacity}, of which "
                         f"{format_size(reserved_bytes - allocated_bytes)} is reserved but unallocated")


def format_size(n_bytes: int) -> str:
    """CUDACachingAllocator.cpp format_size: bytes, KiB, MiB or GiB, as torch's out-of-memory message prints them."""
    if n_bytes <= 1024:
        return f"{n_bytes} bytes"
    for limit, unit in ((MiB, "KiB"), (GiB, "MiB")):
        if n_bytes <= limit:
            return f"{n_bytes / (limit // 1024):.2f} {unit}"
    return f"{n_bytes / GiB:.2f} GiB"


class CachingAllocator(ExpandableSegments):
    """The caching allocator of one CUDA device: malloc/free by address, with torch.cuda.memory_stats' figures."""

    def __init__(self, conf: AllocatorConf = AllocatorConf(), capacity_bytes: int | None = None,
                 device_total_bytes: int | None = None) -> None:
        self.conf = conf
        self.capacity_bytes = capacity_bytes  # what cudaMalloc can hand out; None: unlimited
        self._device_bytes = device_total_bytes if device_total_bytes is not None else capacity_bytes
        fraction = conf.per_process_memory_fraction
        # allowed_memory_maximum: set only for a fraction below 1, and with it garbage collection
        self._allowed_bytes = (int(fraction * self._device_bytes)
                               if fraction < 1.0 and self._device_bytes is not None else None)
        self._collect_garbage = self._allowed_bytes is not None and conf.garbage_collection_threshold > 0
        self._plain_rounding = not any(conf.roundup_power2_divisions)
        self._small, self._large = BlockPool(is_small=True), BlockPool(is_small=False)
        self._active: dict[int, Block] = {}
        self._streams: dict[int, int] = {}
        self._addresses = DeviceAddresses()
        self.allocated_bytes = self.reserved_bytes = 0
        self.max_allocated_bytes = self.max_reserved_bytes = 0
        self.segment_sizes: list[int] = []  # every cudaMalloc, or (expandable) every mapping, in order
        self.segment_log: list[tuple[str, int, int]] = []  # (trace action, address, bytes), as a snapshot's trace
        self.num_alloc_retries = self.num_ooms = 0
        # What the capacity decided so far: the most reserved bytes cudaMalloc was let reach, and the least it was
        # refused at (None: never). Any capacity from the first up to, not including, the second decides the same.
        self.granted_bytes, self.refused_bytes = 0, None

    # -- the public calls ------------------------------------------------------------------------------------------

    def use_device_addresses(self, segments: Iterable[tuple[int, int]]) -> None:
        """The (address, bytes) the device's cudaMalloc returned, in order, for the segments the next malloc makes
        (a recording's segment_alloc events): its new segments lie there when the sizes agree."""
        self._addresses.offer(segments)

    def malloc(self, size_bytes: int, stream: int = 0) -> int:
        """DeviceCachingAllocator::malloc: the address of a block for `size_bytes` (0 for an empty request, which
        torch never passes to the allocator); OutOfMemory when no memory can be had within the capacity."""
        try:
            return self._malloc(size_bytes, stream)
        finally:
            self._addresses.forget_offers()

    def _malloc(self, size_bytes: int, stream: int) -> int:
        if size_bytes < 0:
            raise ValueError(f"cannot allocate {size_bytes} bytes")
        if size_bytes == 0:
            return 0
        if size_bytes >= ONE_EXA_BYTES:  # NativeCachingAllocator::allocate refuses these before malloc
            raise OutOfMemory(size_bytes, size_bytes, self.reserved_bytes, self.allocated_bytes, self.capacity_bytes)
        stream_index = self._streams.get(stream)
        if stream_index is None:
            stream_index = self._streams[stream] = len(self._streams)
        if self._plain_rounding:  # round_size without roundup_power2_divisions, inlined: the hot path
            size = K_MIN_BLOCK_SIZE if size_bytes < K_MIN_BLOCK_SIZE else (size_bytes + K_MIN_BLOCK_SIZE - 1) & -K_MIN_BLOCK_SIZE
        else:
            size = round_size(size_bytes, self.conf.roundup_power2_divisions)
        pool = self._small if size <= K_SMALL_SIZE else self._large
        block = self._get_free_block(pool, stream_index, size)
        if block is None:
            block = self._new_block(pool, stream_index, size, size_bytes)
        return self._alloc_found_block(block, pool, stream_index, size, size_bytes)

    def free(self, address: int) -> None:
        """DeviceCachingAllocator::free: the block goes back to its pool, merged with free neighbours."""
        if address == 0:
            return
        block = self._active.pop(address, None)
        if block is None:
            raise ValueError(f"invalid device pointer: {address:#x} is not an allocated block")
        block.allocated = False
        self.allocated_bytes -= block.size
        self._free_block(block)

    def block_size(self, address: int) -> int:
        """The bytes of the allocated block at `address` (the request rounded, or a whole block too small to split)."""
        return self._active[address].size

    def free_blocks(self) -> list[tuple[int, int]]:
        """The cached (reserved, unallocated) blocks as (address, bytes), mapped memory only: what a request could
        be cut from."""
        return [(b.ptr, b.size) for pool in (self._small, self._large) for b in pool.in_order() if b.mapped]

    def segment_blocks(self) -> list[list[tuple[int, int, bool]]]:
        """Every cudaMalloc'd segment's blocks in address order, as (address, bytes, allocated): where a cached
        block lies beside live ones, which keep its segment from being released."""
        blocks = [*self._active.values(), *(b for pool in (self._small, self._large) for b in pool.in_order())]
        firsts = {}
        for block in blocks:
            while block.prev is not None:
                block = block.prev
            firsts[block.ptr] = block
        segments = []
        for block in firsts.values():
            segment = []
            while block is not None:
                segment.append((block.ptr, block.size, block.allocated))
                block = block.next
            segments.append(segment)
        return segments

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache (release_cached_blocks): give back every cached block that is a whole segment,
        and every whole free page of the expandable segments."""
        self._release_cached_blocks()

    # -- finding a block -------------------------------------------------------------------------------------------

    def _get_free_block(self, pool: BlockPool, stream: int, size: int) -> Block | None:
        """get_free_block: best fit, the smallest cached block of the stream at least `size` long; an oversize block
        (>= max_split_size) only for a request within max_non_split_rounding of it."""
        if self._collect_garbage:
            pool.free_block_calls += 1
        keys = pool.keys
        index = bisect_left(keys, (stream << STREAM_SHIFT) | (size << SIZE_SHIFT))
        if index == len(keys) or keys[index] >> STREAM_SHIFT != stream:
            return None
        block = pool.blocks[keys[index] & ADDRESS_MASK]
        if block.segment is not None:
            index = self._smallest_expandable_fit(pool, index, stream)
            block = pool.block_at(index)
        max_split = self.conf.max_split_size_bytes
        if size < max_split <= block.size:
            return None  # do not return an oversized block for a smaller request
        if size >= max_split and block.size >= size + self.conf.max_non_split_rounding_bytes:
            return None
        del keys[index]  # pool.remove, with the index in hand
        del pool.blocks[block.ptr]
        return block

    @staticmethod
    def _smallest_expandable_fit(pool: BlockPool, index: int, stream: int) -> int:
        """get_free_block, expandable branch: a free block at the end of a segment counts as large as it can grow,
        so a block inside a segment that fits is preferred to it; the index of the block chosen."""
        def expandable_size(b: Block) -> int:
            return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

        block = pool.block_at(index)
        for following in range(index + 1, len(pool.keys)):
            candidate = pool.block_at(following)
            if block.segment is None or pool.stream_at(following) != stream or (
                    expandable_size(candidate) >= expandable_size(block)):
                break
            block, index = candidate, following
        return index

    def _new_block(self, pool: BlockPool, stream: int, size: int, requested: int) -> Block:
        """malloc's slow path: garbage collection, then a new segment, else release cached blocks and retry."""
        if self._collect_garbage:
            self._garbage_collect_cached_blocks()
        segment_size = allocation_size(size, self.conf.large_segment_size_bytes)
        block = self._alloc_block(pool, stream, size, segment_size, retry=False)
        if block is None and self._release_available_cached_blocks(pool, stream, size):
            block = self._alloc_block(pool, stream, size, segment_size, retry=False)
        if block is None:
            self._release_cached_blocks()
            block = self._alloc_block(pool, stream, size, segment_size, retry=True)
        if block is None:
            self.num_ooms += 1
            raise OutOfMemory(requested, segment_size, self.reserved_bytes, self.allocated_bytes,
                              self.capacity_bytes)
        return block

    def _should_split(self, block: Block, pool: BlockPool, size: int) -> bool:
        """should_split: small pool (or expandable segments) when at least kMinBlockSize is left; large pool when
        more than kSmallSize is left and the request is not oversize."""
        remaining = block.size - size
        if pool.is_small or self.conf.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.conf.max_split_size_bytes and remaining > K_SMALL_SIZE

    def _alloc_found_block(self, block: Block, pool: BlockPool, stream: int, size: int, requested: int) -> int:
        """alloc_found_block: split off the front `size` bytes when should_split says so; the rest stays cached."""
        if self._should_split(block, pool, size):
            remaining = block
            block = Block(remaining.ptr, size, stream, pool, remaining.segment)
            block.splice(remaining.prev, remaining)
            remaining.ptr += size
            remaining.size -= size
            pool.insert(remaining)
        block.allocated = True
        block.requested = requested
        self._active[block.ptr] = block
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.max_allocated_bytes:
            self.max_allocated_bytes = self.allocated_bytes
        return block.ptr

    # -- freeing ---------------------------------------------------------------------------------------------------

    def _free_block(self, block: Block) -> None:
        """free_block: merge with the free neighbours in the segment (try_merge_blocks), then cache."""
        before, after = block.prev, block.next
        if before is not None and not before.allocated:
            self._try_merge(block, before)
        if after is not None and not after.allocated:
            self._try_merge(block, after)
        block.pool.insert(block)

    @staticmethod
    def _try_merge(dst: Block, src: Block | None) -> int:
        """try_merge_blocks: `dst` takes in `src` when src is free and mapped alike; the bytes taken in."""
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if src.mapped:
            src.pool.remove(src)
        else:
            src.pool.remove_unmapped(src)
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # -- getting and giving back device memory ---------------------------------------------------------------------

    def _alloc_block(self, pool: BlockPool, stream: int, size: int, segment_size: int, retry: bool) -> Block | None:
        """alloc_block: cudaMalloc a segment of `segment_size` (or map pages of an expandable segment); None when
        over the allowed fraction or the capacity."""
        if retry:
            self.num_alloc_retries += 1
        if self._allowed_bytes is not None and self.reserved_bytes + segment_size > self._allowed_bytes:
            return None
        if self.conf.expandable_segments:
            return self._try_allocate_expandable_block(pool, stream, size)
        if self._device_would_refuse(segment_size):
            return None
        # the address is the driver's; best fit breaks ties by it (BlockComparatorSize), see addresses.py
        block = Block(self._addresses.cuda_malloc(segment_size, K_ROUND_LARGE), segment_size, stream, pool)
        self._grow_reserved(segment_size, "segment_alloc", block.ptr)
        return block

    def _release_available_cached_blocks(self, pool: BlockPool, stream: int, size: int) -> bool:
        """release_available_cached_blocks: with max_split_size set, free the smallest oversize cached block that
        is large enough, else oversize blocks from the largest down until enough is freed."""
        max_split = self.conf.max_split_size_bytes
        if max_split == SIZE_MAX:
            return False
        wanted = max(size, max_split)
        index = pool.lower_bound(stream, wanted)
        if index < len(pool.keys) and pool.stream_at(index) == stream:
            block = pool.block_at(index)
            if block.segment is None:  # release_block asserts on an expandable block; here it is kept instead
                self._release_block(block)
            return block.segment is None
        released = 0
        while index > 0 and released < wanted:
            index -= 1
            block = pool.block_at(index)
            if block.size < max_split or pool.stream_at(index) != stream or block.segment is not None:
                break
            released += block.size
            self._release_block(block)
        return released >= wanted

    def _release_cached_blocks(self) -> bool:
        """release_cached_blocks (release_blocks of the large, then the small pool): cudaFree every cached block
        that is a whole segment; unmap the whole free pages of expandable segments, dropping emptied segments."""
        for pool in (self._large, self._small):
            to_unmap = []
            for block in pool.in_order():
                if block.segment is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)
                if not block.mapped and block.prev is None and block.next is None:
                    self._release_expandable_segment(block)
        return True

    def _release_block(self, block: Block) -> None:
        """release_block: cudaFree a cached segment."""
        block.pool.remove(block)
        self._addresses.cuda_free(block.ptr)
        self._shrink_reserved(block.size, "segment_free", block.ptr)

    def _garbage_collect_cached_blocks(self) -> None:
        """garbage_collect_cached_blocks: above garbage_collection_threshold x the allowed memory, cudaFree the
        cached whole segments of the large pool at least as old as their average, until enough is reclaimed."""
        threshold = int(self.conf.garbage_collection_threshold * self._allowed_bytes)
        if self.reserved_bytes <= threshold:
            return
        target, reclaimed = self.reserved_bytes - threshold, 0
        pool = self._large
        ages = [pool.free_block_calls - b.gc_base for b in pool.in_order() if self._collectable(b)]
        total_age, count = sum(ages), len(ages)
        freed = count > 0
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for block in pool.in_order():
                age = pool.free_block_calls - block.gc_base
                if self._collectable(block) and age >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    @staticmethod
    def _collectable(block: Block) -> bool:
        return not block.is_split() and block.segment is None

    # -- bookkeeping -----------------------------------------------------------------------------------------------

    def _device_would_refuse(self, n_bytes: int) -> bool:
        reaching = self.reserved_bytes + n_bytes
        if self.capacity_bytes is not None and reaching > self.capacity_bytes:
            if self.refused_bytes is None or reaching < self.refused_bytes:
                self.refused_bytes = reaching
            return True
        if reaching > self.granted_bytes:
            self.granted_bytes = reaching
        return False

    def same_replay_until_now(self, capacity_bytes: int | None) -> bool:
        """Whether an allocator of `capacity_bytes` that saw the same calls would be in this one's state: every
        cudaMalloc this one made or was refused, it would have made or been refused too."""
        if capacity_bytes is None:
            return self.refused_bytes is None
        refused = self.refused_bytes
        return self.granted_bytes <= capacity_bytes and (refused is None or capacity_bytes < refused)

    def resumable(self) -> bool:
        """Whether clone() can copy this allocator: the capacity decides cudaMalloc alone (no expandable segments,
        whose pages map against it as well, and no memory fraction, which it scales)."""
        return not self.conf.expandable_segments and self._allowed_bytes is None

    def clone(self, capacity_bytes: int | None) -> CachingAllocator:
        """An independent copy of this allocator's state, its blocks and their links, with another capacity: where
        same_replay_until_now(capacity_bytes), what a replay on that capacity would have reached here."""
        if not self.resumable():
            raise ValueError("only an allocator of cudaMalloc'd segments and no memory fraction can be copied")
        copy = CachingAllocator(self.conf, capacity_bytes, self._device_bytes)
        copy._plain_rounding = self._plain_rounding
        copies: dict[int, Block] = {}
        pools = {id(self._small): copy._small, id(self._large): copy._large}

        def copied(block: Block) -> Block:
            twin = copies.get(id(block))
            if twin is None:
                twin = copies[id(block)] = Block(block.ptr, block.size, block.stream, pools[id(block.pool)])
                twin.allocated, twin.gc_base, twin.requested = block.allocated, block.gc_base, block.requested
            return twin

        for pool, twin_pool in ((self._small, copy._small), (self._large, copy._large)):
            twin_pool.keys = list(pool.keys)
            twin_pool.blocks = {ptr: copied(block) for ptr, block in pool.blocks.items()}
            twin_pool.free_block_calls = pool.free_block_calls
        copy._active = {ptr: copied(block) for ptr, block in self._active.items()}
        for block in [*self._active.values(), *self._small.blocks.values(), *self._large.blocks.values()]:
            twin = copies[id(block)]
            twin.prev = None if block.prev is None else copies[id(block.prev)]
            twin.next = None if block.next is None else copies[id(block.next)]
        copy._streams = dict(self._streams)
        copy._addresses = self._addresses.copy()
        copy.allocated_bytes, copy.reserved_bytes = self.allocated_bytes, self.reserved_bytes
        copy.max_allocated_bytes, copy.max_reserved_bytes = self.max_allocated_bytes, self.max_reserved_bytes
        copy.segment_sizes, copy.segment_log = list(self.segment_sizes), list(self.segment_log)
        copy.num_alloc_retries, copy.num_ooms = self.num_alloc_retries, self.num_ooms
        copy.granted_bytes, copy.refused_bytes = self.granted_bytes, self.refused_bytes
        return copy

    def _grow_reserved(self, n_bytes: int, action: str, address: int) -> None:
        self.reserved_bytes += n_bytes
        if self.reserved_bytes > self.max_reserved_bytes:
            self.max_reserved_bytes = self.reserved_bytes
        self.segment_sizes.append(n_bytes)
        self.segment_log.append((action, address, n_bytes))

    def _shrink_reserved(self, n_bytes: int, action: str, address: int) -> None:
        self.reserved_bytes -= n_bytes
        self.segment_log.append((action, address, n_bytes))
