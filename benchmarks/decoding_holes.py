"""What generate()'s growing keys and values keep mapped under expandable segments, replayed through the allocator
model, beside the band the verdict reads (vram_planner.model.expandable_pages.decoding_cache_hole_bytes).

    python benchmarks/decoding_holes.py              # the held-out QLoRA point's shape, its neighbours, 60 drawn
    python benchmarks/decoding_holes.py --shapes 120 --seed 3

Each shape's decoding is replayed alone: the weights, then the prompts' keys and values, then every decoding step's
concatenation (each layer's keys, then its values, made a token longer before the shorter ones are freed, as
transformers' DynamicLayer.update does). The step's logits are left out: a block apart from the cache's, they strand
at most their own page (the LM head's share of the reserve), which in a tiny cache's replay outweighs the cache's. Its
need is bisected (vram_planner.allocator.need), and what
it needs beyond its live peak is what the decoding strands: printed beside the bound (a page a layer, or a layer's
block where shorter) and the share of the cache the fitted reserve gives generation under expandable segments.
Writes benchmarks/results/decoding_holes.txt.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from multiprocessing import Pool
from pathlib import Path

from accuracy import save_atomically

from vram_planner.allocator.conf import parse_allocator_conf
from vram_planner.allocator.need import least_capacity, live_peak_bytes
from vram_planner.model.calibration import default_calibration
from vram_planner.model.expandable_pages import islands_bytes
from vram_planner.units import MiB

RESULTS = Path(__file__).resolve().parent / "results"
EXPANDABLE = "expandable_segments:True"
WEIGHTS_BYTES = 200 * MiB  # a block made before the decoding, as the loaded weights are
# (layers, sequences, keys' bytes per token of a layer, prompt tokens, completion tokens): held-out QLoRA seed 1's
# SmolLM2-360M (10.2% under its need before the band), and its neighbours, one knob apart
NAMED = [(32, 64, 640, 64, 384), (30, 64, 640, 64, 384), (34, 64, 640, 64, 384), (32, 64, 640, 96, 384),
         (32, 64, 640, 64, 128), (32, 128, 640, 64, 384)]


def decoding_events(layers: int, sequences: int, token_bytes: int, prompt: int,
                    completion: int) -> list[tuple[str, int, int]]:
    """The decoding's allocations and frees, as the allocator model replays them."""
    events: list[tuple[str, int, int]] = []
    made = iter(range(1, 1 << 62))

    def alloc(size: int) -> tuple[int, int]:
        block = next(made)
        events.append(("alloc", block, size))
        return block, size

    alloc(WEIGHTS_BYTES)
    cache = [[alloc(sequences * prompt * token_bytes) for _ in range(2)] for _ in range(layers)]
    for step in range(1, completion):
        size = sequences * (prompt + step) * token_bytes
        for layer in cache:
            for kind, (block, old) in enumerate(layer):
                layer[kind] = alloc(size)
                events.append(("free", block, old))
    return events


def stranded_bytes(layers: int, sequences: int, token_bytes: int, prompt: int, completion: int) -> int:
    """What the decoding needs beyond its live peak: its need less the most it holds live at once."""
    events = decoding_events(layers, sequences, token_bytes, prompt, completion)
    return least_capacity(events, parse_allocator_conf(EXPANDABLE)).capacity_bytes - live_peak_bytes(events)


def bound_bytes(layers: int, sequences: int, token_bytes: int, prompt: int, completion: int) -> float:
    """decoding_cache_hole_bytes for this shape: a page a layer, or a layer's block where shorter."""
    return islands_bytes(layers, sequences * (prompt + completion - 1) * token_bytes)


def _row(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, float]:
    start = time.perf_counter()
    return shape, stranded_bytes(*shape), time.perf_counter() - start


def drawn(count: int, seed: int) -> list[tuple[int, ...]]:
    """Random shapes of catalog-like models, up to 16 GiB of cache and 80,000 concatenations."""
    rng, shapes = random.Random(seed), []
    while len(shapes) < count:
        layers = rng.choice([16, 22, 24, 26, 28, 30, 32, 36, 40])
        sequences = rng.choice([4, 8, 16, 32, 48, 64, 96, 128, 256])
        token_bytes = rng.choice([256, 512, 640, 1024, 2048])
        prompt = rng.choice([32, 64, 96, 128, 256, 512, 1024])
        completion = rng.choice([128, 192, 256, 384, 512, 768, 1024])
        if 2 * layers * sequences * (prompt + completion) * token_bytes <= 16 << 30 and layers * completion <= 40000:
            shapes.append((layers, sequences, token_bytes, prompt, completion))
    return shapes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=int, default=60, help="random shapes beside the named ones")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    share = default_calibration().allocator_reserve["expandable_segments"]["generation"]["kv_cache"]
    lines = [f"{'layers':>6} {'seqs':>5} {'B/tok':>6} {'prompt':>6} {'compl':>6} {'block MiB':>9} {'cache MiB':>9} "
             f"{'stranded':>9} {'bound':>7} {'ratio':>6} {'reserve':>8} {'s':>5}"]
    worst = 0.0
    with Pool(2) as pool:
        for (layers, sequences, token_bytes, prompt, completion), stranded, seconds in pool.imap(
                _row, NAMED + drawn(args.shapes, args.seed)):
            block = sequences * (prompt + completion - 1) * token_bytes
            bound = bound_bytes(layers, sequences, token_bytes, prompt, completion)
            worst = max(worst, stranded / bound)
            lines.append(f"{layers:6d} {sequences:5d} {token_bytes:6d} {prompt:6d} {completion:6d} {block / MiB:9.1f} "
                         f"{2 * layers * block / MiB:9.0f} {stranded / MiB:9.0f} {bound / MiB:7.0f} "
                         f"{stranded / bound:6.2f} {share * 2 * layers * block / MiB:8.0f} {seconds:5.1f}")
            print(lines[-1], flush=True)
    lines += ["", f"{len(NAMED)} named shapes and {args.shapes} drawn with seed {args.seed}: stranded at most "
              f"{worst:.2f} of the bound (MiB: what the decoding needs beyond its live peak; reserve: the fitted "
              f"share {share} of the cache that generation's estimate gives it)"]
    print(lines[-1])
    save_atomically(RESULTS / "decoding_holes.txt", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
