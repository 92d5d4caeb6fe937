"""The caching allocator's size arithmetic, as c10/cuda/CUDACachingAllocator.cpp and c10/core/AllocatorConfig.h do it.

Constants: c10/core/AllocatorConfig.h of torch 2.13 (kMinBlockSize, kSmallSize, kSmallBuffer, kMinLargeAlloc,
kRoundLarge); kLargeBuffer is the default `large_segment_size_mb` (20 MiB).
"""

from __future__ import annotations

from vram_planner.units import MiB

K_MIN_BLOCK_SIZE = 512  # all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 * MiB  # largest "small" allocation
K_SMALL_BUFFER = 2 * MiB  # "small" allocations are packed in 2 MiB blocks
K_MIN_LARGE_ALLOC = 10 * MiB  # allocations between 1 and 10 MiB may use kLargeBuffer
K_ROUND_LARGE = 2 * MiB  # round up large allocations to 2 MiB
K_LARGE_BUFFER = 20 * MiB  # "large" allocations may be packed in 20 MiB blocks
SIZE_MAX = 2**64 - 1  # std::numeric_limits<size_t>::max(): max_split_size when unset

# AcceleratorAllocatorConfig::roundup_power2_divisions(size): 16 intervals, from 1 MiB (2**20) to 64 GiB.
ROUNDUP_INTERVALS = 16
ROUNDUP_FIRST_LOG2 = 20


def divisions_for(size: int, divisions: tuple[int, ...]) -> int:
    """AllocatorConfig.cpp roundup_power2_divisions(size): the divisions of the power-of-2 interval holding size."""
    log_size = size.bit_length() - 1
    index = log_size - ROUNDUP_FIRST_LOG2 if log_size > ROUNDUP_FIRST_LOG2 else 0
    return divisions[min(index, ROUNDUP_INTERVALS - 1)]


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """CUDACachingAllocator.cpp roundup_power2_next_division: the next of `divisions` equal steps between the powers
    of two around size (1200 with 4 divisions: 1024, 1280, 1536, 1792 -> 1280)."""
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    power2_division = power2_floor >> (divisions.bit_length() - 1)  # >> floor(log2(divisions))
    if power2_division == 0:
        return power2_floor << 1
    round_size_floor = size & ~(power2_division - 1)
    return size if round_size_floor == size else round_size_floor + power2_division


def round_size(size: int, divisions_table: tuple[int, ...]) -> int:
    """CUDACachingAllocator.cpp round_size: at least kMinBlockSize, then a power-of-2 division when
    roundup_power2_divisions asks for one, else a multiple of kMinBlockSize."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = divisions_for(size, divisions_table)
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def allocation_size(size: int, large_segment_size: int) -> int:
    """CUDACachingAllocator.cpp get_allocation_size: the segment cudaMalloc is asked for when no cached block fits."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return large_segment_size
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)
