"""The caching-allocator model against hand-computed event sequences, one rule of c10/cuda/CUDACachingAllocator.cpp
(torch 2.13 where its headers and libc10 say so, else pytorch/pytorch@001074d25084) per test; each docstring names
the function the rule lives in."""

from __future__ import annotations

import pytest

from vram_planner.allocator import CachingAllocator, OutOfMemory, parse_allocator_conf
from vram_planner.allocator.sizes import round_size, roundup_power2_next_division

KiB, MiB = 1024, 1024**2


def allocator(conf: str = "", **kwargs) -> CachingAllocator:
    return CachingAllocator(parse_allocator_conf(conf), **kwargs)


@pytest.mark.parametrize("request_bytes,rounded", [(1, 512), (512, 512), (513, 1024), (1000, 1024),
                                                   (100_000, 100_352), (4097, 4608), (40 * MiB + 1, 40 * MiB + 512)])
def test_requests_round_up_to_512_bytes(request_bytes, rounded):
    """round_size: below kMinBlockSize (512) a request takes 512 bytes; above, the next multiple of 512."""
    a = allocator()
    a.malloc(request_bytes)
    assert a.allocated_bytes == rounded == round_size(request_bytes, a.conf.roundup_power2_divisions)


def test_roundup_power2_next_division_matches_the_example_in_its_comment():
    """roundup_power2_next_division: 1200 with 4 divisions lies between 1024 and 2048, steps 1024, 1280, 1536, 1792:
    1280. A power of two stays; a division finer than a byte rounds to the next power of two."""
    assert roundup_power2_next_division(1200, 4) == 1280
    assert roundup_power2_next_division(4096, 4) == 4096
    assert roundup_power2_next_division(3, 4) == 4


@pytest.mark.parametrize("conf,request_bytes,rounded", [
    ("roundup_power2_divisions:4", 4097, 5120),  # 4096..8192 in steps of 1024, above 512 x 4
    ("roundup_power2_divisions:4", 2000, 2048),  # not above 512 x 4 = 2048: plain 512 rounding
    ("roundup_power2_divisions:8", 1100, 1536),  # not above 512 x 8: 512 rounding, not 1152 (1024 + 128)
    ("roundup_power2_divisions:8", 5000, 5120),  # 4096..8192 in steps of 512
    ("roundup_power2_divisions:4", 40 * MiB + 1, 48 * MiB),  # 32..64 MiB in steps of 8 MiB
    ("roundup_power2_divisions:[256:1,512:2,>:4]", 300 * MiB + 1, 300 * MiB + 512),  # 256 MiB..: 1, no rounding
    ("roundup_power2_divisions:[256:1,512:2,>:4]", 600 * MiB, 768 * MiB),  # 512 MiB..1 GiB: 2 divisions
    ("roundup_power2_divisions:[256:1,512:2,>:4]", 1536 * MiB + 1, 1792 * MiB),  # 1 GiB..: 4 divisions
    ("roundup_power2_divisions:[256:1,512:2,>:4]", 8 * MiB + 1, 8 * MiB + 512),  # below 256 MiB: the first, 1
])
def test_roundup_power2_divisions_round_to_the_next_division(conf, request_bytes, rounded):
    """round_size with roundup_power2_divisions (AllocatorConfig.cpp roundup_power2_divisions: 16 intervals from
    1 MiB; `[interval_mb:divisions,...,>:d]`, the first value filling the intervals below it)."""
    a = allocator(conf)
    a.malloc(request_bytes)
    assert a.allocated_bytes == rounded


def test_small_requests_pack_into_one_2_mib_segment():
    """get_pool/get_allocation_size: requests up to kSmallSize (1 MiB) go to the small pool, whose segments are
    kSmallBuffer (2 MiB); alloc_found_block splits them (should_split: >= kMinBlockSize left). Twenty 100352-byte
    blocks fit in 2 MiB (2007040 bytes); the 21st would pass 2097152 and needs a second segment."""
    a = allocator()
    addresses = [a.malloc(100_000) for _ in range(20)]
    assert a.segment_sizes == [2 * MiB]
    assert [b - a_ for a_, b in zip(addresses, addresses[1:])] == [100_352] * 19  # packed back to back
    a.malloc(100_000)
    assert a.segment_sizes == [2 * MiB, 2 * MiB] and a.reserved_bytes == 4 * MiB


def test_a_5_mib_request_makes_a_20_mib_segment_that_later_ones_share():
    """get_allocation_size: 1 MiB < size < kMinLargeAlloc (10 MiB) asks for kLargeBuffer (20 MiB); should_split
    (large pool: more than kSmallSize left) leaves the rest cached, and four 5 MiB tensors share it."""
    a = allocator()
    first = a.malloc(5 * MiB)
    assert a.segment_sizes == [20 * MiB] and a.allocated_bytes == 5 * MiB and a.reserved_bytes == 20 * MiB
    rest = [a.malloc(5 * MiB) for _ in range(3)]
    assert a.segment_sizes == [20 * MiB] and rest == [first + i * 5 * MiB for i in (1, 2, 3)]
    a.malloc(5 * MiB)
    assert a.segment_sizes == [20 * MiB, 20 * MiB]


def test_a_segment_cut_by_a_later_request_strands_the_rest_beside_it():
    """segment_blocks: a freed 640 MiB segment (an activation of the loss phase, say) serves the next 193 MiB
    request (a layer's KV cache while decoding); the 447 MiB left stays cached in that segment, which its live block
    keeps from being released: the request that does not fit there needs a segment of its own."""
    a = allocator()
    activation = a.malloc(640 * MiB)
    a.free(activation)
    cache = a.malloc(193 * MiB)
    assert a.segment_blocks() == [[(activation, 193 * MiB, True), (activation + 193 * MiB, 447 * MiB, False)]]
    other = a.malloc(450 * MiB)
    segments = sorted(a.segment_blocks())
    assert len(segments) == 2 and segments[0][0] == (cache, 193 * MiB, True)
    assert (other, 450 * MiB, True) in segments[1] and a.reserved_bytes == 640 * MiB + 450 * MiB


@pytest.mark.parametrize("request_bytes,segment,block", [
    (30 * MiB, 30 * MiB, 30 * MiB),
    (30 * MiB + 1, 32 * MiB, 30 * MiB + 512),  # 2 MiB - 512 left over: more than 1 MiB, split off
    (10 * MiB, 10 * MiB, 10 * MiB),
    (11 * MiB, 12 * MiB, 12 * MiB),  # exactly 1 MiB left over: not split, the tensor holds 12 MiB
])
def test_a_large_request_makes_a_segment_of_its_size_rounded_to_2_mib(request_bytes, segment, block):
    """get_allocation_size: from kMinLargeAlloc (10 MiB) up the segment is the request rounded up to kRoundLarge
    (2 MiB); should_split keeps the whole segment as the block unless more than kSmallSize is left over."""
    a = allocator()
    a.malloc(request_bytes)
    assert a.segment_sizes == [segment] and a.allocated_bytes == block


def test_best_fit_takes_the_smallest_cached_block_that_is_large_enough():
    """get_free_block: lower_bound in the pool ordered by (stream, size, address): the smallest adequate block."""
    a = allocator()
    segments = {size: a.malloc(size * MiB) for size in (12, 16, 24)}
    for address in segments.values():
        a.free(address)
    assert a.malloc(14 * MiB) == segments[16]  # 12 is too small, 16 beats 24
    assert a.malloc(12 * MiB) == segments[12]
    assert a.malloc(13 * MiB) == segments[24]  # 16 is taken
    assert a.segment_sizes == [12 * MiB, 16 * MiB, 24 * MiB]


def test_a_block_cached_on_one_stream_is_not_given_to_another():
    """BlockComparatorSize orders by stream first and get_free_block stops at another stream's blocks."""
    a = allocator()
    a.free(a.malloc(5 * MiB, stream=1))
    a.malloc(5 * MiB, stream=0)
    assert a.segment_sizes == [20 * MiB, 20 * MiB]
    a.malloc(5 * MiB, stream=1)
    assert a.segment_sizes == [20 * MiB, 20 * MiB]


def test_the_large_pool_splits_only_when_more_than_1_mib_is_left():
    """should_split, large pool: remaining > kSmallSize. From the 15 MiB left of a 20 MiB segment a 14 MiB request
    leaves exactly 1 MiB: no split, the tensor holds all 15 MiB; 512 bytes less and it is split."""
    a = allocator()
    a.malloc(5 * MiB)
    a.malloc(14 * MiB)
    assert a.allocated_bytes == 20 * MiB
    b = allocator()
    b.malloc(5 * MiB)
    b.malloc(14 * MiB - 512)
    assert b.allocated_bytes == 19 * MiB - 512


def test_the_small_pool_splits_down_to_512_bytes():
    """should_split, small pool: remaining >= kMinBlockSize. 1 MiB, then 1 MiB - 512 leave a 512-byte block, which
    is split off and then serves a 512-byte request: one segment, every byte allocated."""
    a = allocator()
    a.malloc(MiB)
    a.malloc(MiB - 512)
    assert a.allocated_bytes == 2 * MiB - 512
    a.malloc(1)
    assert a.allocated_bytes == 2 * MiB and a.segment_sizes == [2 * MiB]


def test_freed_blocks_merge_with_free_neighbours():
    """free_block/try_merge_blocks: a freed block takes in its free neighbours in the segment, so two freed 5 MiB
    blocks serve a 10 MiB request without a new segment; when everything is free the segment is one block again,
    which release_cached_blocks (empty_cache) returns whole."""
    a = allocator()
    first, second, third = (a.malloc(5 * MiB) for _ in range(3))
    a.free(second)
    a.free(first)
    assert a.malloc(10 * MiB) == first and a.segment_sizes == [20 * MiB]
    a.free(third)
    a.free(first)
    a.empty_cache()
    assert a.reserved_bytes == 0 and a.segment_log[-1] == ("segment_free", first, 20 * MiB)


def test_an_oversize_block_is_not_split_nor_given_to_a_smaller_request():
    """max_split_size_mb (get_free_block, should_split): a cached block >= max_split_size is not returned for a
    request below it, and is not split."""
    a = allocator("max_split_size_mb:40")
    a.free(a.malloc(50 * MiB))
    a.malloc(30 * MiB)
    assert a.segment_sizes == [50 * MiB, 30 * MiB]
    default = allocator()
    default.free(default.malloc(50 * MiB))
    default.malloc(30 * MiB)
    assert default.segment_sizes == [50 * MiB] and default.allocated_bytes == 30 * MiB  # reused and split


def test_an_oversize_block_serves_an_oversize_request_within_the_rounding_limit():
    """get_free_block: an oversize request takes an oversize block unless the block is max_non_split_rounding
    (kLargeBuffer, 20 MiB, by default) or more larger; it takes it whole."""
    a = allocator("max_split_size_mb:40")
    a.free(a.malloc(70 * MiB))
    a.malloc(51 * MiB)  # 70 < 51 + 20: reused, not split
    assert a.segment_sizes == [70 * MiB] and a.allocated_bytes == 70 * MiB
    b = allocator("max_split_size_mb:40")
    b.free(b.malloc(70 * MiB))
    b.malloc(50 * MiB)  # 70 >= 50 + 20: a new segment
    assert b.segment_sizes == [70 * MiB, 50 * MiB]
    c = allocator("max_split_size_mb:40,max_non_split_rounding_mb:30")
    c.free(c.malloc(70 * MiB))
    c.malloc(50 * MiB)  # 70 < 50 + 30
    assert c.segment_sizes == [70 * MiB]


def test_cudamalloc_failure_frees_one_oversize_block_and_retries():
    """malloc -> alloc_block fails -> release_available_cached_blocks: with max_split_size set, the smallest cached
    oversize block at least as large as the request is cudaFree'd, and alloc_block retried; the cached small
    segment stays."""
    a = allocator("max_split_size_mb:40", capacity_bytes=100 * MiB)
    a.free(a.malloc(80 * MiB))
    a.free(a.malloc(100_000))
    a.malloc(50 * MiB)  # 80 >= 50 + 20: not reused; 80 + 2 + 50 > 100
    assert [entry[0] for entry in a.segment_log] == ["segment_alloc", "segment_alloc", "segment_free",
                                                     "segment_alloc"]
    assert a.reserved_bytes == 52 * MiB and a.num_alloc_retries == 0


def test_cudamalloc_failure_frees_every_cached_segment_and_retries():
    """malloc: when release_available_cached_blocks cannot help (no max_split_size), release_cached_blocks
    cudaFree's every cached block that is a whole segment, and alloc_block is retried (num_alloc_retries)."""
    a = allocator(capacity_bytes=64 * MiB)
    a.free(a.malloc(40 * MiB))
    a.free(a.malloc(100_000))
    address = a.malloc(50 * MiB)  # 40 + 2 + 50 > 64
    assert a.reserved_bytes == 50 * MiB and a.num_alloc_retries == 1 and a.segment_sizes[-1] == 50 * MiB
    assert address > 0


def test_out_of_memory_when_even_the_retry_fails():
    """malloc: after both releases, a request still over the capacity raises OutOfMemoryError; a 20 MiB segment
    with a 5 MiB tensor in it cannot be released, its 15 MiB free part is reserved but unallocated."""
    a = allocator(capacity_bytes=64 * MiB)
    a.malloc(5 * MiB)
    with pytest.raises(OutOfMemory) as caught:
        a.malloc(50 * MiB)
    error = caught.value
    assert (error.requested_bytes, error.segment_bytes) == (50 * MiB, 50 * MiB)
    assert (error.reserved_bytes, error.allocated_bytes, error.capacity_bytes) == (20 * MiB, 5 * MiB, 64 * MiB)
    assert a.num_ooms == 1 and "tried to allocate 50.00 MiB" in str(error)
    assert "15.00 MiB is reserved but unallocated" in str(error)


def test_per_process_memory_fraction_caps_what_is_reserved():
    """alloc_block: over allowed_memory_maximum (per_process_memory_fraction x device memory) cudaMalloc is not
    even tried."""
    a = allocator("per_process_memory_fraction:0.5", capacity_bytes=400 * MiB)
    with pytest.raises(OutOfMemory):
        a.malloc(250 * MiB)
    assert allocator(capacity_bytes=400 * MiB).malloc(250 * MiB) > 0


def test_garbage_collection_frees_the_oldest_cached_segments_above_the_threshold():
    """garbage_collect_cached_blocks: before a new segment, with reserved above threshold x allowed memory (0.5 x
    0.5 x 400 MiB = 100 MiB), the cached whole segments of the large pool at least as old as their average are
    cudaFree'd; age counts the pool's get_free_block calls since a block was cached. a (60 MiB) is cached at call
    3, a 12 MiB block is reused at calls 4 and 5 (cached again at 5), b (60) is cached at 5: at call 6 the ages are
    12: 1, a: 3, b: 1, their average 5/3, so only a goes, and its 60 MiB cover the 32 MiB over the threshold."""
    conf = "garbage_collection_threshold:0.5,per_process_memory_fraction:0.5"
    a = allocator(conf, capacity_bytes=400 * MiB)
    first, second, small = a.malloc(60 * MiB), a.malloc(60 * MiB), a.malloc(12 * MiB)
    a.free(first)
    a.free(small)
    for _ in range(2):
        a.free(a.malloc(12 * MiB))
    a.free(second)
    a.malloc(80 * MiB)
    assert [e for e in a.segment_log if e[0] == "segment_free"] == [("segment_free", first, 60 * MiB)]
    assert a.reserved_bytes == (12 + 60 + 80) * MiB


def test_garbage_collection_frees_every_block_of_average_age_not_just_enough():
    """garbage_collect_cached_blocks: "Free blocks of > avg age. Don't stop upon reaching the target_size": two
    60 MiB segments cached at the same call have the average age, and both go although one covers the 20 MiB
    over the 100 MiB threshold."""
    a = allocator("garbage_collection_threshold:0.5,per_process_memory_fraction:0.5", capacity_bytes=400 * MiB)
    first, second = a.malloc(60 * MiB), a.malloc(60 * MiB)
    a.free(first)
    a.free(second)
    a.malloc(80 * MiB)
    assert a.reserved_bytes == 80 * MiB and len([e for e in a.segment_log if e[0] == "segment_free"]) == 2


def test_garbage_collection_needs_a_memory_fraction():
    """malloc runs garbage_collect_cached_blocks only when allowed_memory_maximum is set (a fraction below 1)."""
    a = allocator("garbage_collection_threshold:0.5", capacity_bytes=400 * MiB)
    first, second = a.malloc(60 * MiB), a.malloc(60 * MiB)
    a.free(first)
    a.free(second)
    a.malloc(80 * MiB)
    assert not [e for e in a.segment_log if e[0] == "segment_free"] and a.reserved_bytes == 200 * MiB
    assert any("fraction" in note for note in a.conf.notes())


def test_stats_follow_memory_stats():
    """allocated_bytes counts blocks (rounded, whole when not split), reserved_bytes segments; both keep a peak."""
    a = allocator()
    x = a.malloc(1000)
    y = a.malloc(30 * MiB)
    a.free(y)
    assert (a.allocated_bytes, a.reserved_bytes) == (1024, 32 * MiB)
    assert (a.max_allocated_bytes, a.max_reserved_bytes) == (1024 + 30 * MiB, 32 * MiB)
    a.free(x)
    a.empty_cache()
    assert (a.allocated_bytes, a.reserved_bytes, a.max_reserved_bytes) == (0, 0, 32 * MiB)


def test_an_empty_request_takes_no_memory_and_a_bad_free_is_refused():
    """NativeCachingAllocator::allocate passes only nonzero sizes to malloc and refuses 1 EiB or more; free of an
    unknown pointer is an error ("invalid device pointer")."""
    a = allocator()
    assert a.malloc(0) == 0 and a.reserved_bytes == 0
    with pytest.raises(OutOfMemory):
        a.malloc(1 << 60)
    a.free(0)
    with pytest.raises(ValueError, match="invalid device pointer"):
        a.free(12345)


def test_best_fit_breaks_a_tie_by_the_address_cudamalloc_returned():
    """BlockComparatorSize orders a pool's free blocks by (stream, size, ptr): of two equal cached blocks best fit
    takes the lower address, and that address is the one cudaMalloc returned (alloc_block), which the driver picks.
    Told the device's addresses, the model's segments lie there, so a later segment at a lower address wins."""
    high, low = 0x7F00_4000_0000, 0x7F00_2000_0000
    a = allocator()
    a.use_device_addresses([(high, 12 * MiB)])
    first = a.malloc(12 * MiB)
    a.use_device_addresses([(low, 12 * MiB)])
    second = a.malloc(12 * MiB)
    assert (first, second) == (high, low)
    a.free(first)
    a.free(second)
    assert a.malloc(4 * MiB) == low


def test_a_device_address_that_cannot_be_the_segment_is_not_used():
    """An address offered for a segment of another size, or inside a segment still reserved, is not where the model's
    segment goes (it makes one up); what the next malloc leaves unused is not kept for the one after."""
    base = 0x7F00_4000_0000
    a = allocator()
    a.use_device_addresses([(base, 12 * MiB)])
    held = a.malloc(12 * MiB)
    a.use_device_addresses([(base + 2 * MiB, 12 * MiB), (base + 20 * MiB, 14 * MiB)])
    elsewhere = a.malloc(12 * MiB)
    assert held == base and elsewhere not in (base + 2 * MiB, base + 20 * MiB)
    a.use_device_addresses([(base + 40 * MiB, 12 * MiB)])
    a.malloc(512)  # the small pool makes a 2 MiB segment: the 12 MiB address does not fit it
    later = a.malloc(12 * MiB)
    assert later != base + 40 * MiB
