"""expandable_segments:True against hand-computed sequences (Note [Expandable Segments] and the functions
find_expandable_block, map_block, try_allocate_expandable_block, unmap_block, release_expandable_segment and
get_free_block's expandable branch of c10/cuda/CUDACachingAllocator.cpp), and the GRPO pattern it is for."""

from __future__ import annotations

import pytest

from vram_planner.allocator import CachingAllocator, OutOfMemory, parse_allocator_conf

MiB = 1024**2
EXPANDABLE = parse_allocator_conf("expandable_segments:True")


def test_a_segment_grows_in_20_mib_pages_and_later_tensors_tile_into_it():
    """find_expandable_block makes one segment for the large pool; map_block maps kLargeBuffer (20 MiB) pages:
    5 MiB maps one page and leaves 15 MiB free; 30 MiB takes that free end and maps one more page beside it, so
    both tensors lie back to back in 40 MiB where the default allocator reserves 20 + 30 MiB."""
    a = CachingAllocator(EXPANDABLE)
    first = a.malloc(5 * MiB)
    assert a.segment_sizes == [20 * MiB] and a.reserved_bytes == 20 * MiB
    second = a.malloc(30 * MiB)
    assert second == first + 5 * MiB
    assert a.segment_sizes == [20 * MiB, 20 * MiB] and a.reserved_bytes == 40 * MiB
    assert [action for action, _, _ in a.segment_log] == ["segment_map", "segment_map"]
    default = CachingAllocator()
    default.malloc(5 * MiB)
    default.malloc(30 * MiB)
    assert default.segment_sizes == [20 * MiB, 30 * MiB]


def test_the_small_pool_maps_2_mib_pages():
    """find_expandable_block: `pool->is_small ? kSmallBuffer : kLargeBuffer`: the small pool's pages are 2 MiB."""
    a = CachingAllocator(EXPANDABLE)
    a.malloc(1000)
    a.malloc(5 * MiB)
    assert a.segment_sizes == [2 * MiB, 20 * MiB]


def test_a_large_request_maps_as_many_pages_as_it_needs():
    """try_allocate_expandable_block maps min(size, unmapped) rounded up to whole pages (ExpandableSegment::map):
    50 MiB is three 20 MiB pages, mapped at once, and its 10 MiB rest is split off (should_split: expandable
    segments split whenever kMinBlockSize is left)."""
    a = CachingAllocator(EXPANDABLE)
    a.malloc(50 * MiB)
    assert a.segment_sizes == [60 * MiB] and a.allocated_bytes == 50 * MiB


def test_freed_pages_stay_mapped_until_cached_memory_is_released():
    """free_block keeps pages mapped; release_cached_blocks (empty_cache) unmaps every whole free page
    (unmap_block) and drops a segment left with nothing mapped (release_expandable_segment)."""
    a = CachingAllocator(EXPANDABLE)
    x, y = a.malloc(5 * MiB), a.malloc(30 * MiB)
    a.free(y)
    assert a.reserved_bytes == 40 * MiB
    a.empty_cache()  # x holds [0, 5) MiB: the page [20, 40) is wholly free, [0, 20) is not
    assert a.reserved_bytes == 20 * MiB and a.segment_log[-1] == ("segment_unmap", x + 20 * MiB, 20 * MiB)
    a.free(x)
    a.empty_cache()
    assert a.reserved_bytes == 0 and a.segment_log[-1] == ("segment_unmap", x, 20 * MiB)
    assert a.malloc(5 * MiB) != x and a.reserved_bytes == 20 * MiB  # a new segment: the empty one was dropped


def test_best_fit_prefers_a_hole_to_the_growable_end():
    """get_free_block, expandable branch: a free block at the end of a segment counts as large as it can grow, so
    a 6 MiB request skips the 8 MiB free end for the 10 MiB hole at the segment's start."""
    a = CachingAllocator(EXPANDABLE)
    hole = a.malloc(10 * MiB)  # [0, 10), page [0, 20) mapped
    a.malloc(10 * MiB)  # [10, 20)
    a.malloc(12 * MiB)  # [20, 32), page [20, 40) mapped: the free end is [32, 40)
    a.free(hole)
    assert a.malloc(6 * MiB) == hole


def test_out_of_memory_retry_unmaps_free_pages_of_another_stream():
    """malloc -> alloc_block fails (cuMemCreate out of memory: map_block fails) -> release_cached_blocks unmaps the
    free pages of every segment, here stream 1's, and the retry maps the page for stream 0."""
    a = CachingAllocator(EXPANDABLE, capacity_bytes=40 * MiB)
    a.free(a.malloc(25 * MiB, stream=1))  # two pages on stream 1, both free
    a.malloc(5 * MiB, stream=0)  # 40 + 20 > 40: unmap stream 1's pages, then map one for stream 0
    assert a.reserved_bytes == 20 * MiB and a.num_alloc_retries == 1
    with pytest.raises(OutOfMemory):  # the free 15 MiB at the end plus 25 MiB: 2 more pages, 20 + 40 > 40
        a.malloc(40 * MiB, stream=0)
    a.malloc(35 * MiB, stream=0)  # 15 MiB free plus one page: 20 + 20 = 40 fits
    assert a.reserved_bytes == 40 * MiB


def test_kv_cache_grown_by_concatenation():
    """The GRPO generation pattern: each token the KV cache is concatenated into a new, larger tensor and the old
    one freed (alloc new, then free old). Steps of 12, 14, ..., 22 MiB, worked out by hand:
    default (get_free_block never finds a cached block as large as the next step): a new segment every step,
    12 + 14 + 16 + 18 + 20 + 22 = 102 MiB reserved for at most 42 MiB live;
    expandable: 12 @0 (page [0,20)), 14 @12 (page [20,40)), 16 @26 (page [40,60)), 18 @0 (the hole [0,26) beats
    the growable end), 20 @18, 22 @38: three pages, 60 MiB."""
    steps = [12 * MiB, 14 * MiB, 16 * MiB, 18 * MiB, 20 * MiB, 22 * MiB]
    for conf, reserved, starts in ((parse_allocator_conf(""), 102 * MiB, None),
                                   (EXPANDABLE, 60 * MiB, [0, 12, 26, 0, 18, 38])):
        a = CachingAllocator(conf)
        previous, addresses = None, []
        for size in steps:
            addresses.append(a.malloc(size))
            if previous is not None:
                a.free(previous)
            previous = addresses[-1]
        assert a.max_reserved_bytes == a.reserved_bytes == reserved
        assert a.max_allocated_bytes == 42 * MiB
        if starts is not None:
            assert [(address - addresses[0]) // MiB for address in addresses] == starts


def test_kv_cache_growth_under_a_capacity_releases_the_cached_segments():
    """The same growth on a 64 MiB device, default allocator: at 20 MiB the cached 12, 14 and 16 MiB segments
    push cudaMalloc over (18 + 42 + 20 > 64), release_cached_blocks returns them and the retry succeeds (one
    retry); 22 then fits beside the cached 18: 60 MiB at most, where without a capacity all 102 stay reserved."""
    a = CachingAllocator(parse_allocator_conf(""), capacity_bytes=64 * MiB)
    previous = None
    for size in (12 * MiB, 14 * MiB, 16 * MiB, 18 * MiB, 20 * MiB, 22 * MiB):
        current = a.malloc(size)
        if previous is not None:
            a.free(previous)
        previous = current
    assert a.max_reserved_bytes == 60 * MiB and a.num_alloc_retries == 1
    assert [size // MiB for action, _, size in a.segment_log if action == "segment_free"] == [12, 14, 16]


def test_no_request_can_be_larger_than_torch_215s_reserve():
    """expandable_segments_reserve (torch 2.15): each segment reserves that much address space, whole 20 MiB pages
    of it (numSegments), and a request cannot span two segments: a quarter of a 1 GiB device is 13 pages, 260 MiB,
    so 260 MiB is met and 262 MiB is out of memory with the device nearly empty, where the default 9/8 reserve meets
    it. A second 200 MiB tensor needs a second segment."""
    device = 1024 * MiB
    reserved = CachingAllocator(parse_allocator_conf("expandable_segments:True,expandable_segments_reserve:0.25"),
                                capacity_bytes=device)
    reserved.free(reserved.malloc(260 * MiB))
    with pytest.raises(OutOfMemory):
        reserved.malloc(262 * MiB)
    CachingAllocator(EXPANDABLE, capacity_bytes=device).malloc(262 * MiB)
    two = CachingAllocator(parse_allocator_conf("expandable_segments:True,expandable_segments_reserve:0.25"),
                           capacity_bytes=device)
    first, second = two.malloc(200 * MiB), two.malloc(200 * MiB)
    assert second - first >= 260 * MiB and two.reserved_bytes == 400 * MiB
