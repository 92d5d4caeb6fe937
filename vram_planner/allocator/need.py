"""What a traced step needs: the least memory cudaMalloc must be able to hand out for the caching allocator model to
replay the step without running out, found by bisecting the capacity.

On a card with room the allocator holds far more than that: it keeps what the step frees cached for reuse and gives
it back only when cudaMalloc fails, then retries. A decoding step's larger KV cache cannot reuse the previous step's
block, so the cache alone can fill a roomy card that a fraction of it would run. Pure Python (no torch).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

from vram_planner.allocator.conf import AllocatorConf
from vram_planner.allocator.own_stack import on_own_stack
from vram_planner.allocator.replay import ALLOC, FREE, ReplayResult, Replays
from vram_planner.allocator.sizes import K_MIN_BLOCK_SIZE, K_ROUND_LARGE, K_SMALL_BUFFER


@dataclass(frozen=True)
class Need:
    """The least capacity on which the step runs, and what the allocator holds on the card it was asked about."""

    capacity_bytes: int  # the least cudaMalloc must be able to hand out (the card less its CUDA context)
    tensor_peak_bytes: int  # the most live at once, each storage in 512-byte blocks (the allocator may hold more of
    # a block it did not split: torch.cuda.max_memory_allocated, which counts that, depends on the capacity)
    held_bytes: int  # the most reserved at once on the card asked about, or without a limit where it runs out there
    fits_card: bool | None  # whether it runs on the card asked about (None: no card given)
    replays: int  # how many replays the bisection took, the card's own and the unlimited one included
    seconds: float


def granule_bytes(conf: AllocatorConf) -> int:
    """The size every reserved total is a multiple of: segments and pages are 2 MiB blocks, large requests rounded
    to 2 MiB, and the large segments (20 MiB unless large_segment_size_mb says otherwise). Two capacities between the
    same two multiples give the same replay, so bisecting over the multiples finds the need exactly."""
    return math.gcd(K_SMALL_BUFFER, K_ROUND_LARGE, conf.large_segment_size_bytes)


@on_own_stack  # its replays' calls, thousands of them, at no edge of the frame stack's chunks (own_stack.py)
def least_capacity(events: Iterable[tuple[str, int, int]], conf: AllocatorConf = AllocatorConf(),
                   card_bytes: int | None = None, replays: Replays | None = None) -> Need:
    """The least capacity (a multiple of `granule_bytes`) on which `events` replay through the allocator model
    without an out-of-memory, with what it holds on a card of `card_bytes` (what cudaMalloc can hand out there).

    The bracket starts at [the tensor peak, what the allocator holds with room]: no capacity below the tensors can
    hold them, and a replay that never reserved more than R behaves the same on a capacity of R. Each replay that
    succeeds lowers the top to what it reserved, not to the capacity tried. The allocator is not monotone in the
    capacity in general (it frees its cache at different moments): capacities above the bisection's answer are then
    tried (NEAR_TRIES of them within NEAR_SHARE of it, then at doubling distances), and where one runs out the need
    is bisected again above it, so the need is where the step runs on every capacity tried above it. The card's own replay anchors the bisection, so
    `capacity_bytes <= card_bytes` exactly when the step runs on that card. `replays`: the same events' replays
    under `conf` where the caller shares them.
    """
    start = time.perf_counter()
    replays = replays or Replays(events, conf)
    events = replays.events
    granule = granule_bytes(conf)
    count = 0

    def replay(capacity: int | None) -> ReplayResult:
        nonlocal count
        count += 1
        return replays(capacity, series=False)

    fails_at = None  # the largest capacity known to run out
    on_card = replay(card_bytes) if card_bytes is not None else None
    if on_card is not None and on_card.out_of_memory is None:
        roomy = on_card
    else:
        roomy = replay(None)
        if on_card is not None:
            fails_at = card_bytes // granule * granule  # any capacity up to the next multiple replays the same
    held = roomy.max_reserved_bytes
    runs_at = held
    tensor_peak = live_peak_bytes(events)
    tensors_floor = -(-tensor_peak // granule) * granule - granule
    fails_at = max(tensors_floor, fails_at if fails_at is not None else tensors_floor)
    step = granule
    while runs_at <= fails_at:  # only where a memory fraction scales with the capacity: search upwards for a top
        if replay(fails_at + step).out_of_memory is None:
            runs_at = fails_at + step
        else:
            fails_at, step = fails_at + step, step * 2
    # Anything from the top up runs: what a roomy card holds, or the card itself where the step runs there.
    top = min(held, card_bytes) if on_card is not None and on_card.out_of_memory is None else held

    def bisect(fails_at: int, runs_at: int) -> int:
        while runs_at - fails_at > granule:
            capacity = fails_at + (runs_at - fails_at) // (2 * granule) * granule
            result = replay(capacity)
            if result.out_of_memory is not None:
                fails_at = capacity
            else:
                runs_at = result.max_reserved_bytes if result.max_reserved_bytes > fails_at else capacity
        return runs_at

    runs_at = bisect(fails_at, runs_at)
    # The bisection may stop on an island: a capacity that runs below others that run out (freeing the cache at
    # another moment can leave room a little more memory does not). The need is where every larger capacity runs,
    # so capacities above it are tried (_runs_out_above); where one runs out, the need lies above it.
    while (failing := _runs_out_above(runs_at, top, granule, replay)) is not None:
        runs_at = bisect(failing, top)
    return Need(capacity_bytes=max(runs_at, 0), tensor_peak_bytes=tensor_peak, held_bytes=held,
                fits_card=None if on_card is None else on_card.out_of_memory is None, replays=count,
                seconds=time.perf_counter() - start)


# Where capacities above the bisection's answer are tried: every NEAR_SHARE / NEAR_TRIES of it up to NEAR_SHARE
# above (where the cards whose verdict the need decides lie), then at doubling distances up to the top.
NEAR_SHARE = 0.25
NEAR_TRIES = 12


def _runs_out_above(runs_at: int, top: int, granule: int, replay) -> int | None:
    """The first capacity tried between `runs_at` and `top` on which the replay runs out; None where each runs."""
    spacing = max(granule, int(runs_at * NEAR_SHARE / NEAR_TRIES) // granule * granule)
    tries = [runs_at + spacing * k for k in range(1, NEAR_TRIES + 1)]
    distance = spacing * NEAR_TRIES
    while runs_at + distance < top:
        distance *= 2
        tries.append(runs_at + distance)
    for capacity in tries:
        if capacity >= top:
            return None
        if replay(capacity).out_of_memory is not None:
            return capacity
    return None


def live_peak_bytes(events: list[tuple[str, int, int]]) -> int:
    """The most bytes live at once, each allocation rounded up to the allocator's 512-byte blocks: no capacity
    below it can hold the step, whatever the allocator does."""
    sizes: dict[int, int] = {}
    live = peak = 0
    for action, block, size in events:
        if action == ALLOC:
            sizes[block] = -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE
            live += sizes[block]
            peak = max(peak, live)
        elif action == FREE:
            live -= sizes.pop(block, 0)
    return peak
