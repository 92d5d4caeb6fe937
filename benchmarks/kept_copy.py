"""`check` from a kept copy of the exact engine, held to the exact engine on the same cards.

    python benchmarks/kept_copy.py                  # the points below (~20 minutes on two cores)
    python benchmarks/kept_copy.py --points "grid window"
    python benchmarks/kept_copy.py --held-out 4 --seed 7 --largest-gib 24   # a held-out sweep's first draws

`vram-plan check --exact --keep-copy` keeps the step's copy (vram_planner.step_copy); `check` of the same model and
knobs at other lengths then answers from it where the estimate lies near the boundary, torch-free. Here each point's
copy is kept at its own lengths, and at each of two other lengths, on five cards from 1% below the estimate's peak
to 7% above it (where steps' needs have been measured to lie, and where `check` says the estimate is near the
boundary), `check` and `check --exact` judge the step side by side, with the estimate's own verdict beside them (what
`check` said before the copy). The
points: the boundary grid's window (Qwen3-0.6B LoRA with 8-bit AdamW, 8 x (1,024 + 384) tokens), gemma-3-1b-it's LoRA
whose decoding fills its 512-token sliding window, and the held-out sweeps' two windows on laptop and desktop configs
(benchmarks/results/boundary-heldout-rejudged.txt), each at other lengths on the same sides of its windows and in as
many of the fused head's tiles. Writes benchmarks/results/kept_copy.txt. `--held-out N --seed S --largest-gib G` asks
a held-out sweep's first N draws instead (benchmarks/boundary_heldout.py: the same seed draws the same configs), each
at two other lengths drawn with the same seed where its copy answers (a prompt down to half, a completion from half
to twice as long in as many tiles, the same sides of the windows); writes kept_copy-heldout-...-firstN.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from boundary_heldout import add_draw_arguments, write_draws_table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vram_planner import engine  # noqa: E402
from vram_planner.model.verdict import judge  # noqa: E402
from vram_planner.profiles import GpuProfile  # noqa: E402
from vram_planner.units import GiB  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "kept_copy.txt"
CARDS = (0.99, 1.01, 1.03, 1.05, 1.07)  # the cards, as shares of the estimate's peak
# (label, model, knobs with the lengths the copy is kept at, the other (prompt, completion) lengths checked)
POINTS = (
    ("grid window", "Qwen3-0.6B", {"dtype": "bfloat16", "lora_r": 16, "num_generations": 8,
                                   "per_device_train_batch_size": 8, "max_prompt_length": 1024,
                                   "max_completion_length": 384, "optim": "adamw_8bit"}, ((1024, 400), (900, 448))),
    ("gemma-3 past its window", "gemma-3-1b-it", {"dtype": "bfloat16", "lora_r": 16, "num_generations": 8,
                                                  "per_device_train_batch_size": 8, "max_prompt_length": 256,
                                                  "max_completion_length": 400}, ((300, 350), (480, 250))),
    ("24gib-seed2 h31", "SmolLM2-1.7B", None, ((960, 416), (1024, 320))),
    ("24gib-seed7 h12", "SmolLM2-135M", None, ((1000, 120), (768, 160))),
)
H100 = GpuProfile.from_name("h100-80gb")


def settings_of(label: str, settings: dict | None) -> dict:
    """A point's knobs: its own, or a held-out sweep's point's as committed."""
    if settings is not None:
        return settings
    stem, name = label.split(" ", 1)
    points = json.loads((RESULTS.parent / f"boundary-heldout-{stem}.json").read_text())
    return next(p for p in points if p["point"].startswith(name))["settings"]


def drawn(n: int, seed: int, largest_gib: float | None) -> tuple:
    """The held-out sweep's first n draws as POINTS, each with two other lengths its copy answers for (none where
    no copy can be made of it: the table says why)."""
    import boundary_heldout as sweep

    from vram_planner.step_copy.lengths import lengths_to_trace, refusal
    from vram_planner.step_copy.store import copy_key

    rng = random.Random(seed)
    largest = round(largest_gib * GiB) if largest_gib else sweep.largest_card()
    points = []
    for label, model, settings in sweep.held_out(n, seed, largest):
        context = engine.make_context(model, H100)
        train = engine.make_training(context, settings)
        others: list[tuple[int, int]] = []
        try:
            copy_key(context.arch, train, context.release)  # ValueError where no copy can be made
        except ValueError as error:
            points.append((label, model, settings, f"no copy: {error}"))
            continue
        windows = [context.arch.sliding_window] if context.arch.sliding_layers else []
        lattice, completion_range = lengths_to_trace(train, context.release, frozenset(windows))
        low, high = completion_range or (4, train.max_completion_length)
        # what a copy traced at that lattice answers for (lengths.refusal reads no more of it)
        stand_in = SimpleNamespace(windows=windows, lattice=list(lattice), completion_range=completion_range)
        for _ in range(200):
            prompt = rng.randint(max(1, train.max_prompt_length // 2), train.max_prompt_length)
            completion = rng.randint(max(low, train.max_completion_length // 2),
                                     max(low, min(high, 2 * train.max_completion_length)))
            if (prompt, completion) not in others and refusal(stand_in, prompt, completion) is None:
                others.append((prompt, completion))
            if len(others) == 2:
                break
        points.append((label, model, settings, tuple(others)))
    return tuple(points)


def card(capacity_bytes: int) -> GpuProfile:
    return replace(H100, name=f"{capacity_bytes} bytes", total_memory_gib=capacity_bytes / GiB)


def table(points: tuple) -> list[str]:
    lines = [f"{'point':26} {'lengths':>10} {'card GiB':>9} {'exact':>6} {'check':>6} {'by':>8} {'estimate':>8} "
             f"{'check s':>7} {'exact s':>7}"]
    agree = decided = corrected = 0
    for label, model, settings, others in points:
        if isinstance(others, str):  # why no copy can be made of it
            lines.append(f"{label}: {others}")
            continue
        settings = settings_of(label, settings)
        start = time.perf_counter()
        kept = engine.check(model, H100, settings, exact=True, keep_copy=True).kept_copy
        print(f"{label}: {kept} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
        lines.append(f"{label}: {kept.split(' in /')[0]}")
        for prompt, completion in others:
            other = {**settings, "max_prompt_length": prompt, "max_completion_length": completion}
            peak = engine.check(model, H100, other).estimate.peak_bytes
            for capacity in (round(peak * share) for share in CARDS):
                start = time.perf_counter()
                exact = engine.check(model, card(capacity), other, exact=True)
                exact_seconds = time.perf_counter() - start
                start = time.perf_counter()
                verdict = engine.check(model, card(capacity), other)
                seconds = time.perf_counter() - start
                estimate = judge(verdict.context, verdict.train).fits
                agree += verdict.fits == exact.fits
                decided += verdict.replayed is not None
                corrected += verdict.replayed is not None and estimate != exact.fits
                lines.append(f"{label:26} {f'{prompt}+{completion}':>10} {capacity / GiB:9.4f} "
                             f"{'fits' if exact.fits else 'out':>6} {'fits' if verdict.fits else 'out':>6} "
                             f"{'copy' if verdict.replayed else 'estimate':>8} {'fits' if estimate else 'out':>8} "
                             f"{seconds:7.2f} {exact_seconds:7.1f}")
                print(lines[-1], file=sys.stderr)
    judged = sum(len(others) * len(CARDS) for *_, others in points if not isinstance(others, str))
    return [*lines, f"{agree} of {judged} verdicts as the exact engine's; {decided} decided by the kept copy, "
                    f"{corrected} of them where the estimate alone says otherwise"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="*", help="labels of the points (default: all)")
    add_draw_arguments(parser)
    args = parser.parse_args()
    os.environ["VRAM_PLAN_CACHE"] = tempfile.mkdtemp(prefix="kept-copy-")  # the user's own copies stay untouched
    if args.held_out:
        chosen = drawn(args.held_out, args.seed, args.largest_gib)
    else:
        chosen = tuple(p for p in POINTS if not args.points or p[0] in args.points)
        if args.points and len(chosen) != len(args.points):
            parser.error(f"known points: {', '.join(p[0] for p in POINTS)}")
    text = "\n".join(table(chosen))
    print(text)
    if args.held_out:
        write_draws_table("kept_copy", args, text)
    elif not args.points:
        RESULTS.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
