"""What decides a boundary point's need: the allocator model's segments one granule below it, where the step runs out.

    python benchmarks/segments_below_need.py "Qwen3-0.6B" "lora p1024 c384 B8 8bit"
    python benchmarks/segments_below_need.py "SmolLM2-1.7B" "lora p1024 c384 B8 8bit" --segments 20

Traces the point (a catalog model and a config of benchmarks/boundary.py, as `check --exact` traces it), replays its
stream one granule below the need and prints: the request that runs out, the segments released on the way (the
allocator frees its whole free segments when cudaMalloc fails), the live segments grouped by size and by the phase,
moment and step that made them with what is free in them, and the largest segments block by block with each block's
owner. A segment made by one phase that holds another's tensors, with a rest too short for the request that runs out,
is a pattern the analytic reserve has to count (vram_planner.model.fragmentation): Qwen3-0.6B's LoRA with
checkpointing at 1,024 + 384 tokens keeps its 22 MiB layer inputs four to a 96 MiB segment of generation's prefill
(the float32 output of a LoRA adapter on the MLP), 8 MiB beside them, when the backward asks for 66 MiB.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from boundary import CARD, below_need, points  # noqa: E402

from vram_planner import engine  # noqa: E402
from vram_planner.allocator.caching import CachingAllocator, OutOfMemory  # noqa: E402
from vram_planner.allocator.replay import ALLOC, FREE  # noqa: E402
from vram_planner.model.calibration import default_calibration  # noqa: E402

MiB = 2**20


def replay_below_need(model: str, config: str):
    """The point's stream replayed one granule below its need: the allocator where it ran out, the event that ran out,
    which event made each segment (by address), the segments released on the way, each live block's event, the
    stream."""
    (label, path, settings), = points([model], False, [config])
    outcome = engine.check(path, CARD, settings, exact=True, calibration=default_calibration())
    stream, conf, capacity = below_need(outcome)
    allocator = CachingAllocator(conf, capacity)
    addresses, owners, made, released, failed = {}, {}, {}, [], None
    for index, event in enumerate(stream.events):
        logged = len(allocator.segment_log)
        if event.kind == ALLOC:
            try:
                addresses[event.block] = allocator.malloc(event.size_bytes, 0)
            except OutOfMemory:
                failed = index
                break
            owners[addresses[event.block]] = index
        elif event.kind == FREE:
            owners.pop(addresses[event.block], None)
            allocator.free(addresses.pop(event.block))
        else:
            allocator.empty_cache()
        for action, address, n_bytes in allocator.segment_log[logged:]:
            if action == "segment_alloc":
                made[address] = index
            else:
                released.append((index, n_bytes))
    return outcome, allocator, failed, made, released, owners, stream


def _where(stream, index: int) -> str:
    event = stream.events[index]
    step = 2 if index >= stream.second_step else 1
    return f"step {step} {event.phase}/{event.moment}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a catalog model of the boundary grid")
    parser.add_argument("config", help="a config name of benchmarks/boundary.py (CONFIGS or PROMPT_BATCH_CONFIGS)")
    parser.add_argument("--segments", type=int, default=12, help="the largest segments to print block by block")
    args = parser.parse_args()
    outcome, allocator, failed, made, released, owners, stream = replay_below_need(args.model, args.config)
    print(f"need {outcome.need.capacity_bytes / 2**30:.3f} GiB (without the CUDA context); replayed one granule below")
    if failed is None:
        print("the replay ran through: the need is not where this step runs out (an island of the bisection)")
    else:
        event = stream.events[failed]
        print(f"runs out at event {failed}, {_where(stream, failed)} layer {event.layer}, asking "
              f"{event.size_bytes / MiB:.1f} MiB")
    print("\nsegments released (the allocator freed its whole free segments when cudaMalloc failed):")
    for (where, size), count in sorted(collections.Counter((_where(stream, i), n // MiB) for i, n in released).items()):
        print(f"  {count:4d} x {size:6d} MiB  in {where}")
    segments = allocator.segment_blocks()
    print("\nlive segments: count x size, made in, free in each")
    grouped = collections.Counter((sum(b[1] for b in s) // MiB, _where(stream, made[s[0][0]]),
                                   sum(b[1] for b in s if not b[2]) // MiB) for s in segments)
    for (size, where, free), count in sorted(grouped.items(), key=lambda item: (-item[0][0], item[0][1])):
        print(f"  {count:4d} x {size:6d} MiB  made in {where}, {free} MiB free")
    print(f"\nthe {args.segments} largest, block by block")
    for segment in sorted(segments, key=lambda s: -sum(b[1] for b in s))[:args.segments]:
        print(f"  segment {sum(b[1] for b in segment) / MiB:.1f} MiB, made in {_where(stream, made[segment[0][0]])}")
        for address, size, used in segment:
            if used:
                index = owners[address]
                print(f"      {size / MiB:8.1f} MiB  {_where(stream, index)} layer {stream.events[index].layer}")
            else:
                print(f"      {size / MiB:8.1f} MiB  free")


if __name__ == "__main__":
    main()
