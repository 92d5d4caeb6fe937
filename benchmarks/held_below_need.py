"""What the allocator model holds where a boundary point runs out one granule below its need: the request it could
not meet, the cached blocks too short for it, and the live tensors by where the step made them. The patterns of
vram_planner/model/fragmentation.py and generation_patterns.py were read off this.

    python benchmarks/held_below_need.py "Llama-3.2-1B fp32 full adamw_8bit" "Mistral-7B-v0.3 full c1024 B8"
    python benchmarks/held_below_need.py --segments "Phi-3-mini-4k-instruct lora p512 c2048 G16 S2 beta"
    python benchmarks/held_below_need.py --pool --seed 3 "h17 Qwen3-1.7B"
    python benchmarks/held_below_need.py --segments --qlora --seed 1 --largest-gib 24 "h10 SmolLM2-360M"

Points are named as in benchmarks/results/boundary.txt; each is traced (seconds to a minute). `--segments` adds the
segments that hold the cached memory: each one's size, the request that made it (a cudaMalloc, in which phase), and
the live blocks that keep it from being released, the largest first. `--pool` adds, as each phase of the step begins,
the cached blocks it starts from (those a pattern cuts its requests from), by size. `--placements PHASE` adds, for
each request of that phase from --least-mib up, each time the phase runs, the segment it was cut from (its size and
the request that cudaMalloc'd it) and where in it, and what a new segment's cudaMalloc released first:

    python benchmarks/held_below_need.py --placements training --least-mib 64 "SmolLM2-135M lora c256 B128"
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from boundary import CARD, MODELS, QLORA_CONFIGS, RESULTS, below_need, points
from boundary_heldout import table_stem

from vram_planner import engine
from vram_planner.allocator import CachingAllocator
from vram_planner.allocator.caching import OutOfMemory
from vram_planner.model.calibration import default_calibration
from vram_planner.units import MiB

SHOWN = 12  # the largest groups of each kind


def held(model: str, settings: dict, segments: bool = False, pool: bool = False, placements: str | None = None,
         least_bytes: int = 0) -> list[str]:
    outcome = engine.check(model, CARD, settings, exact=True, calibration=default_calibration())
    stream, conf, capacity = below_need(outcome)
    allocator = CachingAllocator(conf, capacity)
    made: dict[int, tuple[int, object]] = {}  # block -> (address, its event)
    made_segment: dict[int, object] = {}  # a segment's address -> the event whose request cudaMalloc'd it
    pools: list[str] = []
    begun: Counter = Counter()  # how many times each phase has begun (the step, for the phases every step runs once)
    for index, event in enumerate(stream.events):
        if index == 0 or event.phase != stream.events[index - 1].phase:
            begun[event.phase] += 1
            if pool:
                pools.append(_pool_described(allocator, event, index))
        if event.kind != "alloc":
            allocator.free(made.pop(event.block)[0])
            continue
        logged = len(allocator.segment_log)
        try:
            made[event.block] = (allocator.malloc(event.size_bytes), event)
        except OutOfMemory as failed:
            lines = pools + _described(allocator, made, failed, event, index, outcome.need.capacity_bytes)
            return lines + (_segments_described(allocator, made, made_segment) if segments else [])
        log = allocator.segment_log[logged:]
        made_segment.update({address: event for action, address, _ in log if action == "segment_alloc"})
        if event.phase == placements and event.size_bytes >= least_bytes:
            pools.append(_placement_described(allocator, made[event.block][0], event, index, begun[event.phase],
                                              made_segment, log))
    return [f"runs {capacity / MiB:.0f} MiB: the allocator is not monotone in the capacity here"]


def _placement_described(allocator: CachingAllocator, address: int, event, index: int, time: int,
                         made_segment: dict, log: list) -> str:
    """Where one request landed: the segment it was cut from (what made it), where in it, and what its cudaMalloc
    released first."""
    first, size = next((segment[0][0], sum(n_bytes for _, n_bytes, _ in segment))
                       for segment in allocator.segment_blocks() if any(block == address for block, _, _ in segment))
    maker = made_segment[first]
    released = [n_bytes for action, _, n_bytes in log if action == "segment_free"]
    return (f"  {event.phase} {time}, event {index} ({event.moment}): {event.size_bytes / MiB:.1f} MiB at "
            f"{(address - first) / MiB:.1f} in a {size / MiB:.1f} MiB segment made in {maker.phase}, {maker.moment}"
            + (f" (new, after releasing {len(released)} cached segments of {sum(released) / MiB:.0f} MiB)"
               if released else " (new)" if maker is event else ""))


def _pool_described(allocator: CachingAllocator, event, index: int) -> str:
    """The cached blocks as a phase begins, the largest sizes first (MiB x count)."""
    cached = Counter(round(size / MiB) for _, size in allocator.free_blocks())
    largest = ", ".join(f"{size} x {n}" for size, n in sorted(cached.items(), reverse=True)[:2 * SHOWN])
    return (f"  {event.phase} begins (event {index}): {sum(size * n for size, n in cached.items()) / 1024:.1f} GiB "
            f"cached in {sum(cached.values())} blocks; MiB x count: {largest or 'none'}")


def _segments_described(allocator: CachingAllocator, made: dict, made_segment: dict) -> list[str]:
    """The segments with cached memory, grouped by (size, what made them, what lives in them), most cached first."""
    live_event = {address: event for address, event in made.values()}
    groups: Counter = Counter()
    count: Counter = Counter()
    for segment in allocator.segment_blocks():
        cached = sum(size for _, size, allocated in segment if not allocated)
        if not cached:
            continue
        maker = made_segment.get(segment[0][0])
        live = Counter(f"{live_event[address].phase}, {live_event[address].moment} {size / MiB:.1f}"
                       for address, size, allocated in segment if allocated and address in live_event)
        key = (sum(size for _, size, _ in segment), f"{maker.phase}, {maker.moment}" if maker else "before the stream",
               "; ".join(f"{n} x {what}" for what, n in sorted(live.items())) or "nothing")
        groups[key] += cached
        count[key] += 1
    lines = ["  segments holding cached memory (MiB):"]
    for (size, maker, live), cached in groups.most_common(SHOWN):
        lines.append(f"    {count[size, maker, live]:3} x {size / MiB:7.1f} made in {maker}: {cached / MiB:7.1f} "
                     f"cached beside {live}")
    return lines


def _described(allocator: CachingAllocator, made: dict, failed: OutOfMemory, event, index: int,
               need: int) -> list[str]:
    cached = sorted((size for _, size in allocator.free_blocks()), reverse=True)
    live = Counter()
    count = Counter()
    for address, made_by in made.values():
        key = (made_by.phase, made_by.moment, made_by.size_bytes)
        live[key] += allocator.block_size(address)
        count[key] += 1
    lines = [f"need {need / MiB:.0f} MiB; one granule below it, event {index} ({event.phase}, {event.moment}) asks "
             f"for {failed.requested_bytes / MiB:.1f} MiB with {failed.reserved_bytes / MiB:.0f} MiB reserved, "
             f"{failed.allocated_bytes / MiB:.0f} MiB of it allocated",
             f"  cached {sum(cached) / MiB:.0f} MiB in {len(cached)} blocks, the largest (MiB): "
             + ", ".join(f"{size / MiB:.1f}" for size in cached[:SHOWN])]
    for (phase, moment, size), n_bytes in live.most_common(SHOWN):
        lines.append(f"  live {n_bytes / MiB:9.0f} MiB: {count[phase, moment, size]:4} x {size / MiB:8.1f} MiB "
                     f"made in {phase}, {moment}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("points", nargs="+", help="labels of benchmarks/results/boundary.txt, boundary-qlora.txt or "
                        "boundary-heldout.txt")
    parser.add_argument("--segments", action="store_true", help="also the segments that hold the cached memory")
    parser.add_argument("--pool", action="store_true", help="also the cached blocks each phase begins from")
    parser.add_argument("--placements", metavar="PHASE", help="also where each request of that phase (training, "
                        "generation, ...) landed: the segment it was cut from and what made it, each time it runs")
    parser.add_argument("--least-mib", type=float, default=32.0, metavar="M",
                        help="--placements' smallest request shown (MiB; default 32)")
    parser.add_argument("--seed", type=int, default=0, help="the held-out sweep whose labels these are")
    parser.add_argument("--largest-gib", type=float, metavar="G", help="that sweep's bound on the analytic peak")
    parser.add_argument("--qlora", action="store_true", help="that sweep was over 4-bit weights")
    args = parser.parse_args()
    grid = {label: (model, settings) for label, model, settings in [*points(list(MODELS), quick=False),
                                                                     *points(list(MODELS), False, [*QLORA_CONFIGS])]}
    # benchmarks/boundary_heldout.py's points, as its table for that seed names them
    held_out = RESULTS / f"{table_stem(args.seed, args.largest_gib, args.qlora)}.json"
    grid.update({r["point"]: (r["model"], r["settings"]) for r in json.loads(held_out.read_text())}
                if held_out.is_file() else {})
    unknown = [label for label in args.points if label not in grid]
    if unknown:
        print(f"no boundary point {unknown[0]!r} (see benchmarks/results/boundary.txt and {held_out.name[:-5]}.txt)",
              file=sys.stderr)
        return 2
    for label in args.points:
        print("\n".join([f"== {label}", *held(*grid[label], segments=args.segments, pool=args.pool,
                                               placements=args.placements, least_bytes=int(args.least_mib * MiB))]),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
