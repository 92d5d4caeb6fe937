"""Blocks and the pools of free blocks, ordered as CUDACachingAllocator.cpp orders them.

A pool's free blocks are a std::set ordered by BlockComparatorSize: (stream, size, address); best fit is its
lower_bound. Here that set is a sorted list of ints packing the three (stream index, size, address), searched with
bisect: one integer comparison per step, and the blocks themselves in a dict by address. The unmapped blocks of
expandable segments are a second set ordered by BlockComparatorAddress: (stream, address).
"""

from __future__ import annotations

from bisect import bisect_left, insort

ADDRESS_BITS = 64  # addresses and sizes are size_t: below 2**64
SIZE_SHIFT = ADDRESS_BITS
STREAM_SHIFT = 2 * ADDRESS_BITS
ADDRESS_MASK = (1 << ADDRESS_BITS) - 1


class Block:
    """A piece of a segment: allocated, cached (free, mapped) or, in an expandable segment, unmapped."""

    __slots__ = ("ptr", "size", "stream", "pool", "allocated", "prev", "next", "mapped", "segment", "gc_base",
                 "requested")

    def __init__(self, ptr: int, size: int, stream: int, pool: BlockPool, segment=None, mapped: bool = True) -> None:
        self.ptr = ptr
        self.size = size
        self.stream = stream
        self.pool = pool
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None
        self.mapped = mapped
        self.segment = segment  # the ExpandableSegment it lies in, None for a cudaMalloc'd segment
        self.gc_base = 0  # the pool's get_free_block count when the block was cached (its age starts there)
        self.requested = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: Block | None, after: Block | None) -> None:
        """Block::splice: put this block between `before` and `after`."""
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


def size_key(stream: int, size: int, ptr: int = 0) -> int:
    return (stream << STREAM_SHIFT) | (size << SIZE_SHIFT) | ptr


class BlockPool:
    """BlockPool: the free blocks of one pool (small: requests up to 1 MiB; large: the rest)."""

    __slots__ = ("is_small", "keys", "blocks", "unmapped_keys", "unmapped", "free_block_calls")

    def __init__(self, is_small: bool) -> None:
        self.is_small = is_small
        self.keys: list[int] = []  # sorted size_key of every free mapped block
        self.blocks: dict[int, Block] = {}  # by address
        self.unmapped_keys: list[int] = []  # sorted (stream, address) of every unmapped block
        self.unmapped: dict[int, Block] = {}
        self.free_block_calls = 0  # get_free_blocks_call_count: the clock garbage collection measures age by

    def insert(self, block: Block) -> None:
        """BlockPool::insert_into_blocks: cache a free block; its age starts now."""
        block.gc_base = self.free_block_calls
        insort(self.keys, (block.stream << STREAM_SHIFT) | (block.size << SIZE_SHIFT) | block.ptr)
        self.blocks[block.ptr] = block

    def remove(self, block: Block) -> None:
        keys = self.keys
        del keys[bisect_left(keys, (block.stream << STREAM_SHIFT) | (block.size << SIZE_SHIFT) | block.ptr)]
        del self.blocks[block.ptr]

    def lower_bound(self, stream: int, size: int) -> int:
        """The index of the first free block of `stream` at least `size` long, in (stream, size, address) order."""
        return bisect_left(self.keys, size_key(stream, size))

    def block_at(self, index: int) -> Block:
        return self.blocks[self.keys[index] & ADDRESS_MASK]

    def stream_at(self, index: int) -> int:
        return self.keys[index] >> STREAM_SHIFT

    def in_order(self) -> list[Block]:
        """The free blocks in (stream, size, address) order."""
        return [self.blocks[key & ADDRESS_MASK] for key in self.keys]

    def insert_unmapped(self, block: Block) -> None:
        insort(self.unmapped_keys, (block.stream << ADDRESS_BITS) | block.ptr)
        self.unmapped[block.ptr] = block

    def remove_unmapped(self, block: Block) -> None:
        keys = self.unmapped_keys
        del keys[bisect_left(keys, (block.stream << ADDRESS_BITS) | block.ptr)]
        del self.unmapped[block.ptr]

    def unmapped_of(self, stream: int) -> list[Block]:
        """The unmapped blocks of `stream` by address (BlockComparatorAddress from lower_bound(stream, 0))."""
        keys = self.unmapped_keys
        start = bisect_left(keys, stream << ADDRESS_BITS)
        found = []
        for key in keys[start:]:
            if key >> ADDRESS_BITS != stream:
                break
            found.append(self.unmapped[key & ADDRESS_MASK])
        return found
