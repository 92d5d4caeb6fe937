"""Carry the cached needs over to code that traces and replays the same steps faster.

    python benchmarks/rekey_needs.py                 # re-bisect a sample of each cache, re-key where all agree
    python benchmarks/rekey_needs.py --points "Qwen3-0.6B lora p256 c128 B8 S64 eager" ...

A cached need is keyed by the tracing and allocator code (boundary.need_key), so any change to that code drops every
need, hours of bisection, even where the change only makes the trace or the replay faster. This re-bisects a sample
of the points of boundary-needs.json and boundary-heldout-needs.json with the current code (the points where the
change is at work, by default those whose scoring passes run several chunks, and a few drawn at random) and, where
each one reproduces its need, held bytes, tensor peaks and binding phase exactly, writes both caches under the
current key; else it prints what moved and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

from accuracy import save_atomically
from boundary import MODELS, RESULTS, exact, need_key, points
from boundary_heldout import point_label

CACHES = ("boundary-needs.json", "boundary-heldout-needs.json")
COMPARED = ("allocator_need_bytes", "allocator_held_bytes", "tensor_peak_bytes", "binding_phase")
SCORED_SAMPLE = 3  # per cache: the fastest points whose scoring runs at least four chunks (replayed forwards)
RANDOM_SAMPLE = 2  # per cache, drawn with a fixed seed


def known_points() -> dict[str, tuple[str, dict]]:
    """label -> (model, settings) of every grid point and every held-out table's point."""
    known = {label: (model, settings) for label, model, settings in points(list(MODELS), False)}
    for table in sorted(RESULTS.glob("boundary-heldout-*seed*.json")):
        for row in json.loads(table.read_text()):
            known[point_label(row["model"], row["settings"])] = (row["model"], row["settings"])
    return known


def scoring_chunks(settings: dict) -> int:
    """How many chunks each scoring pass runs: the generation batch over the micro-batch, where old log-probs are
    computed (more micro-batches per generation than accumulation steps) or a reference scores."""
    accumulation = settings.get("gradient_accumulation_steps", 1) or 1
    per_generation = settings.get("steps_per_generation") or accumulation
    scored = per_generation > accumulation or settings.get("beta")
    return per_generation if scored else 0


def sample(cache: dict, known: dict, seed: int) -> list[str]:
    labels = [label for label in cache if label in known]
    scored = sorted((label for label in labels if scoring_chunks(known[label][1]) >= 4),
                    key=lambda label: cache[label]["seconds"])[:SCORED_SAMPLE]
    rest = sorted(set(labels) - set(scored))
    return scored + random.Random(seed).sample(rest, min(RANDOM_SAMPLE, len(rest)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="+", metavar="LABEL", help="re-bisect these instead of a sample")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    known, key, moved = known_points(), need_key(), []
    caches = {name: json.loads((RESULTS / name).read_text()) for name in CACHES}
    for name, data in caches.items():
        chosen = [p for p in args.points if p in data["points"]] if args.points else sample(data["points"], known,
                                                                                             args.seed)
        for label in chosen:
            model, settings = known[label]
            fresh = exact(model, settings, {}, label)
            old = data["points"][label]
            differs = [field for field in COMPARED if fresh[field] != old[field]]
            print(f"{name}: {label}: {'moved: ' + ', '.join(differs) if differs else 'the same'} "
                  f"({old['seconds']:.1f} s then, {fresh['seconds']:.1f} s now)", flush=True)
            moved += [(label, field, old[field], fresh[field]) for field in differs]
    if moved:
        print(f"{len(moved)} values moved: the caches keep their key", file=sys.stderr)
        return 1
    for name, data in caches.items():
        if data["key"] != key:
            save_atomically(RESULTS / name, json.dumps({"key": key, "points": data["points"]}, indent=1))
    print(f"every point re-bisected agrees: the caches are keyed {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
