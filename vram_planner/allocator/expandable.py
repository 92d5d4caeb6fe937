"""expandable_segments:True: one segment per pool and stream that grows page by page (Note [Expandable Segments] in
CUDACachingAllocator.cpp).

A segment reserves address space for 1 1/8 of the device's memory (less under torch 2.15's
expandable_segments_reserve, and then no request larger than that can be met) and maps physical pages into it as
requests need them: 2 MiB pages for the small pool, kLargeBuffer (20 MiB, torch 2.13's large_segment_size) for the large pool
(find_expandable_block: `pool->is_small ? kSmallBuffer : kLargeBuffer`). Freed pages stay mapped until cached memory
is released (an out-of-memory retry or empty_cache), which unmaps every whole free page.
"""

from __future__ import annotations

from vram_planner.allocator.blocks import Block, BlockPool
from vram_planner.allocator.sizes import K_SMALL_BUFFER

DEFAULT_DEVICE_BYTES = 1 << 40  # the address space of a segment when the device's size is not given


class ExpandableSegment:
    """ExpandableSegment: a range of addresses and the page size its physical memory is mapped in."""

    __slots__ = ("base", "page", "size")

    def __init__(self, base: int, page: int, address_bytes: int) -> None:
        self.base = base
        self.page = page
        self.size = pages_for(address_bytes, page) * page  # max_handles_ = numSegments(reserve)

    def pages_to_map(self, ptr: int, size: int) -> tuple[int, int]:
        """ExpandableSegment::map's range: whole pages from the one holding `ptr` through the end of the range."""
        begin = (ptr - self.base) // self.page
        end = -(-(ptr + size - self.base) // self.page)
        return self.base + begin * self.page, (end - begin) * self.page

    def pages_to_unmap(self, ptr: int, size: int) -> tuple[int, int]:
        """ExpandableSegment::unmap's range: the pages wholly inside [ptr, ptr + size)."""
        begin = -(-(ptr - self.base) // self.page)
        end = (ptr + size - self.base) // self.page
        return self.base + begin * self.page, max(end - begin, 0) * self.page


def pages_for(size: int, page: int) -> int:
    """ExpandableSegment::numSegments: whole pages covering size."""
    return -(-size // page)


def allocatable(block: Block | None) -> bool:
    return block is not None and not block.allocated


def has_address_space(block: Block | None, size: int) -> bool:
    """find_expandable_block's has_available_address_space: free and unmapped blocks from here add up to size."""
    total = 0
    while total < size and allocatable(block):
        total += block.size
        block = block.next
    return total >= size


class ExpandableSegments:
    """The expandable-segment half of CachingAllocator (it mixes this in)."""

    def _find_expandable_block(self, pool: BlockPool, stream: int, size: int) -> Block | None:
        """find_expandable_block: the lowest address of any segment of this pool and stream with room for `size` in
        free and unmapped blocks; else a new segment; None where even a new segment's address space is too small
        (a reserve set below the request: a request cannot span two segments)."""
        for candidate in pool.unmapped_of(stream):
            if allocatable(candidate.prev):
                candidate = candidate.prev
            if has_address_space(candidate, size):
                return candidate
        page = K_SMALL_BUFFER if pool.is_small else self.conf.large_segment_size_bytes
        address_bytes = self.conf.expandable_segment_address_bytes(self._device_bytes or DEFAULT_DEVICE_BYTES)
        if pages_for(address_bytes, page) * page < size:
            return None
        segment = ExpandableSegment(self._addresses.new_range(0, page), page, address_bytes)
        self._addresses.new_range(segment.size, page)
        block = Block(segment.base, segment.size, stream, pool, segment, mapped=False)
        pool.insert_unmapped(block)
        return block

    def _map_block(self, to_map: Block, size: int) -> bool:
        """map_block: back the first `size` bytes of an unmapped block with pages, merged with free neighbours."""
        segment, pool = to_map.segment, to_map.pool
        start, mapped = segment.pages_to_map(to_map.ptr, size)
        if mapped == 0 or self._device_would_refuse(mapped):
            return False  # cuMemCreate ran out of memory: the pages made so far are released
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            remaining = Block(to_map.ptr + mapped, to_map.size - mapped, to_map.stream, pool, segment, mapped=False)
            remaining.splice(to_map, to_map.next)
            pool.insert_unmapped(remaining)
            to_map.size = mapped
        self._try_merge(to_map, to_map.prev)
        self._try_merge(to_map, to_map.next)
        pool.insert(to_map)
        self._grow_reserved(mapped, "segment_map", start)
        return True

    def _try_allocate_expandable_block(self, pool: BlockPool, stream: int, size: int
                                       ) -> Block | None:
        """try_allocate_expandable_block: map pages until a free block of `size` exists at the lowest address."""
        candidate = self._find_expandable_block(pool, stream, size)
        if candidate is None:
            return None
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next
            if not self._map_block(following, min(size - candidate.size, following.size)):
                return None
            candidate = following  # it took in the free block before it
        pool.remove(candidate)
        return candidate

    def _unmap_block(self, block: Block) -> None:
        """unmap_block: give back the whole pages of a free block; the parts of pages at its ends stay mapped."""
        start, unmapped = block.segment.pages_to_unmap(block.ptr, block.size)
        if unmapped == 0:
            return
        pool = block.pool
        pool.remove(block)
        before = start - block.ptr
        if before > 0:
            head = Block(block.ptr, before, block.stream, pool, block.segment)
            head.splice(block.prev, block)
            pool.insert(head)
        after = block.size - before - unmapped
        if after > 0:
            tail = Block(start + unmapped, after, block.stream, pool, block.segment)
            tail.splice(block, block.next)
            pool.insert(tail)
        block.ptr, block.size, block.mapped = start, unmapped, False
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.insert_unmapped(block)
        self._shrink_reserved(unmapped, "segment_unmap", start)

    def _release_expandable_segment(self, block: Block) -> None:
        """release_expandable_segment: a segment with nothing mapped is dropped, address space and all."""
        block.pool.remove_unmapped(block)
