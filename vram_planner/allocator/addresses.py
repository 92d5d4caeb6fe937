"""Where the device puts segments: the addresses cudaMalloc returns, which the caching allocator does not choose.

They still decide which block it hands out: a pool orders its free blocks by BlockComparatorSize (stream, size,
ptr) in CUDACachingAllocator.cpp, so of two equal cached blocks get_free_block's lower_bound takes the one at the
lower address, and a different choice can change, much later, whether a request fits or needs a new segment. The
driver's choice cannot be derived (on an H100 with torch 2.11 new segments land below earlier ones about as often as
above), so addresses are made up, each new range above every earlier one, unless a replay passes on the addresses a
recording shows (its segment_alloc events); then the model chooses the blocks the recorded allocator chose.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable

FIRST_ADDRESS = 1 << 36


class DeviceAddresses:
    """The address ranges of one device: made-up ones, the cudaMalloc'd segments reserved, and the addresses a
    recording says cudaMalloc returned for the request under way."""

    __slots__ = ("_next_address", "_starts", "_bytes", "_offered")

    def __init__(self) -> None:
        self._next_address = FIRST_ADDRESS
        self._starts: list[int] = []  # sorted addresses of the cudaMalloc'd segments reserved
        self._bytes: dict[int, int] = {}  # their sizes, by address
        self._offered: list[tuple[int, int]] = []

    def copy(self) -> DeviceAddresses:
        twin = DeviceAddresses()
        twin._next_address, twin._starts, twin._bytes = self._next_address, list(self._starts), dict(self._bytes)
        twin._offered = list(self._offered)
        return twin

    def offer(self, segments: Iterable[tuple[int, int]]) -> None:
        """(address, bytes) cudaMalloc returned, in order, for the segments the next request makes."""
        self._offered = list(segments)

    def forget_offers(self) -> None:
        """The request is done: what it left unused was for it alone."""
        if self._offered:
            self._offered = []

    def cuda_malloc(self, n_bytes: int, alignment: int) -> int:
        """The address of a new segment: the first offered one of its size that overlaps no segment reserved (a
        model that has not freed a segment the recording freed cannot reuse its address), else a made-up one."""
        for index, (address, size) in enumerate(self._offered):
            if size == n_bytes and self._overlap_end(address, n_bytes) is None:
                del self._offered[index]
                break
        else:
            address = self.new_range(n_bytes, alignment)
            while (end := self._overlap_end(address, n_bytes)) is not None:  # past recorded segments in the way
                self._next_address = end
                address = self.new_range(n_bytes, alignment)
        index = bisect_left(self._starts, address)
        self._starts.insert(index, address)
        self._bytes[address] = n_bytes
        return address

    def cuda_free(self, address: int) -> None:
        """cudaFree: the segment's range is free for the device to hand out again."""
        del self._starts[bisect_left(self._starts, address)]
        del self._bytes[address]

    def new_range(self, n_bytes: int, alignment: int) -> int:
        """A made-up range above every earlier one (an expandable segment's address space, or a segment's)."""
        address = -(-self._next_address // alignment) * alignment
        self._next_address = address + n_bytes
        return address

    def _overlap_end(self, address: int, n_bytes: int) -> int | None:
        """The end of a reserved segment overlapping [address, address + n_bytes); None when none does."""
        index = bisect_right(self._starts, address)
        if index > 0:
            before = self._starts[index - 1]
            if before + self._bytes[before] > address:
                return before + self._bytes[before]
        if index < len(self._starts) and self._starts[index] < address + n_bytes:
            return self._starts[index] + self._bytes[self._starts[index]]
        return None
