"""What holds after any sequence of calls, whatever the settings: the bookkeeping of blocks, segments and pools that
CUDACachingAllocator.cpp keeps (a segment's blocks tile it; free neighbours are merged; every cached block is in its
pool; the stats are the sums of the blocks)."""

from __future__ import annotations

import random

import pytest

from vram_planner.allocator import CachingAllocator, OutOfMemory, parse_allocator_conf
from vram_planner.allocator.blocks import ADDRESS_MASK

MiB = 1024**2


def segments_of(allocator: CachingAllocator) -> list[list]:
    """Every segment as its list of blocks, from the cached, unmapped and allocated blocks."""
    blocks = list(allocator._active.values())
    for pool in (allocator._small, allocator._large):
        blocks += list(pool.blocks.values()) + list(pool.unmapped.values())
    heads = {id(b): b for b in blocks if b.prev is None}
    chains = []
    for head in heads.values():
        chain, block = [], head
        while block is not None:
            chain.append(block)
            block = block.next
        chains.append(chain)
    assert sum(len(c) for c in chains) == len(blocks), "a block outside every segment"
    return chains


def check(allocator: CachingAllocator) -> None:
    assert allocator.allocated_bytes == sum(b.size for b in allocator._active.values())
    mapped = 0
    for chain in segments_of(allocator):
        for block, following in zip(chain, chain[1:]):
            assert following.ptr == block.ptr + block.size, "blocks do not tile their segment"
            assert following.prev is block
            free_pair = not block.allocated and not following.allocated
            assert not (free_pair and block.mapped == following.mapped), "free neighbours left unmerged"
        mapped += sum(b.size for b in chain if b.mapped)
    assert allocator.reserved_bytes == mapped <= allocator.max_reserved_bytes
    for pool in (allocator._small, allocator._large):
        assert pool.keys == sorted(pool.keys) and len(pool.keys) == len(pool.blocks)
        assert {key & ADDRESS_MASK for key in pool.keys} == set(pool.blocks)
        assert all(not b.allocated and b.mapped and b.pool is pool for b in pool.blocks.values())
        assert all(not b.mapped for b in pool.unmapped.values())


SIZES = [1, 512, 70_000, MiB, MiB + 1, 3 * MiB, 9 * MiB, 12 * MiB, 33 * MiB, 100 * MiB]


@pytest.mark.parametrize("conf,capacity", [
    ("", None), ("expandable_segments:True", None), ("max_split_size_mb:40,roundup_power2_divisions:4", 400 * MiB),
    ("garbage_collection_threshold:0.6,per_process_memory_fraction:0.8", 500 * MiB),
    ("expandable_segments:True", 300 * MiB), ("", 300 * MiB),
])
def test_bookkeeping_holds_through_random_calls(conf, capacity):
    rng = random.Random(conf + str(capacity))
    allocator = CachingAllocator(parse_allocator_conf(conf), capacity)
    live: list[int] = []
    for step in range(3000):
        roll = rng.random()
        if roll < 0.005:
            allocator.empty_cache()
        elif live and roll < 0.45:
            allocator.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice(SIZES) + rng.randrange(0, 4096)
            try:
                live.append(allocator.malloc(size, stream=rng.choice((0, 0, 0, 1))))
            except OutOfMemory:
                assert capacity is not None
        if step % 100 == 0:
            check(allocator)
        if capacity is not None:
            assert allocator.reserved_bytes <= capacity
    for address in live:
        allocator.free(address)
    allocator.empty_cache()
    check(allocator)
    assert allocator.allocated_bytes == 0 and allocator.reserved_bytes == 0
