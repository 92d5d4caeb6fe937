"""How long the need's bisection takes (`check --exact` after the trace): its replays resumed from checkpoints taken
every 131,072 events (as before) and as `Replays` takes them now (densely until cudaMalloc first refuses the
replay, sparsely after), side by side on traced steps, with the events each replays and the need each finds.

    python benchmarks/bisection_speed.py            # five traced steps (about 5 minutes on 2 cores)
    python benchmarks/bisection_speed.py --repeat 3  # the median of three bisections each

The traces are made once per config; each bisection starts from fresh replays. The needs must agree: where they do
not, the script says so and exits 1. Writes benchmarks/results/bisection_speed.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time
from pathlib import Path
from unittest.mock import patch

from accuracy import save_atomically

from vram_planner.units import GiB

ROOT = Path(__file__).resolve().parent.parent
CARD = "h100-80gb"
BF16_LORA = {"lora_r": 16, "dtype": "bfloat16", "num_generations": 8, "per_device_train_batch_size": 8}
CONFIGS = (
    ("Qwen3-8B", "TRL's defaults", {}),
    ("Qwen3-0.6B", "64 x (1024 + 512), S8", {**BF16_LORA, "steps_per_generation": 8, "max_prompt_length": 1024,
                                              "max_completion_length": 512}),
    ("Qwen2.5-1.5B", "eager, 32 x (512 + 5056), S2", {
        "dtype": "bfloat16", "lora_r": 8, "per_device_train_batch_size": 16, "num_generations": 8,
        "steps_per_generation": 2, "max_prompt_length": 512, "max_completion_length": 5056,
        "attn_implementation": "eager"}),
    ("Qwen3-1.7B", "full, no checkpointing, B32 A4", {
        "dtype": "bfloat16", "per_device_train_batch_size": 32, "num_generations": 8,
        "gradient_accumulation_steps": 4, "max_prompt_length": 512, "max_completion_length": 384,
        "gradient_checkpointing": False}),
    ("gemma-3-4b-it", "512 x (512 + 128), S64", {**BF16_LORA, "gradient_accumulation_steps": 4,
                                                  "steps_per_generation": 64, "max_prompt_length": 512,
                                                  "max_completion_length": 128}),
)
BEFORE = {"MIN_CHECKPOINT_EVENTS": 1 << 17, "CHECKPOINTS_BEFORE_REFUSAL": sys.maxsize, "SPARSER_AFTER_REFUSAL": 1}


def traced_events(model: str, settings: dict):
    """The step's events with the cuBLAS workspaces, its allocator settings and what cudaMalloc can hand out, as
    `check --exact` traces them (engine.steps_to_trace)."""
    from vram_planner import engine
    from vram_planner.allocator import parse_allocator_conf
    from vram_planner.model.calibration import default_calibration
    from vram_planner.tracing.events import with_workspaces
    from vram_planner.tracing.step import trace_step

    context = engine.make_context(model, CARD, calibration=default_calibration())
    step, = engine.steps_to_trace(model, context, [engine.make_training(context, settings)])
    result = trace_step(step.config, step.train, step.release)
    stream = with_workspaces(result.steady_stream(), step.workspace_bytes)
    conf = parse_allocator_conf(step.train.allocator_conf, "--allocator-conf")
    return [(e.kind, e.block, e.size_bytes) for e in stream.events], conf, step.card_bytes


def bisected(events, conf, card: int, spacing: dict) -> tuple[int, int, int, float]:
    """(need, replays, events replayed, seconds) with the checkpoint spacing `spacing` (replay.py's names; empty: as
    it is); the seconds include the one garbage collection after it."""
    from vram_planner.allocator import replay as replay_module
    from vram_planner.allocator.replay import Replays
    from vram_planner.tracing.collection import collection_paused
    from vram_planner.allocator.need import least_capacity

    with patch.multiple(replay_module, **spacing) if spacing else contextlib.nullcontext():
        start = time.perf_counter()
        with collection_paused():  # as step_need bisects
            replays = Replays(events, conf)
            need = least_capacity(events, conf, card, replays)
        seconds = time.perf_counter() - start
    return need.capacity_bytes, need.replays, need.replays * len(events) - replays.resumed_events, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="bisections per config and spacing (the median)")
    args = parser.parse_args()
    import torch
    import transformers
    import trl

    lines = [f"the need's bisection on {CARD}, 2 cores ({platform.machine()}); torch {torch.__version__}, "
             f"transformers {transformers.__version__}, trl {trl.__version__}; median of {args.repeat}",
             f"{'model':<16}{'config':<34}{'events':>9}  {'before s':>8}{'now s':>7}{'ratio':>7}  "
             f"{'replayed before':>16}{'now':>11}  {'need GiB':>9}"]
    print(*lines, sep="\n")
    disagreements = 0
    for model, label, settings in CONFIGS:
        events, conf, card = traced_events(model, settings)
        runs = {name: [bisected(events, conf, card, spacing) for _ in range(args.repeat)]
                for name, spacing in (("before", BEFORE), ("now", {}))}
        (need, _, replayed_before, _), (need_now, _, replayed_now, _) = runs["before"][0], runs["now"][0]
        before_s, now_s = (statistics.median(r[3] for r in runs[name]) for name in ("before", "now"))
        same = need == need_now
        disagreements += not same
        line = (f"{model:<16}{label:<34}{len(events):>9,}  {before_s:>8.2f}{now_s:>7.2f}{now_s / before_s:>7.2f}  "
                f"{replayed_before:>16,}{replayed_now:>11,}  {need_now / GiB:>9.2f}"
                + ("" if same else f"  DIFFERENT NEED before: {need / GiB:.2f}"))
        print(line, flush=True)
        lines.append(line)
    lines.append("needs agree on every config" if not disagreements else f"{disagreements} needs differ")
    print(lines[-1])
    save_atomically(ROOT / "benchmarks" / "results" / "bisection_speed.txt", "\n".join(lines) + "\n")
    return 1 if disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
