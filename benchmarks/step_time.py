"""The step-time model against every step time committed so far and against a cited public throughput figure.

    python benchmarks/step_time.py     # prints the tables, writes benchmarks/results/step_time.txt

Inputs, all measured before the step-time model existed (none of its constants was set from them):
1. benchmarks/results/gpu/h100-trl-steps.json: real TRL GRPO runs of two optimizer steps on an H100
   (benchmarks/gpu_steps.py). Their `seconds` is the wall time of the whole run: loading the model, building the
   trainer and TRL's start-up included, and for the first six allocator-history recording too. The prediction is
   two steps, so the difference is start-up; the ranking is what they can check. Runs since issue 30 also time each
   optimizer step (`step_seconds`), and their last step is compared with one predicted step.
2. benchmarks/results/gpu/h100-probe-record.json: probe points on the same H100, two steps each of the probe's
   phases (generation there is the prefill and one decoding step; vram_planner/tracing/phases.py), model building
   included; the first point also warmed the process up (Triton's kernels compiled).
3. A public decoding throughput: gpt-fast's README (github.com/pytorch-labs/gpt-fast, "Benchmarks"): Llama-3.1-8B
   in bf16, batch 1, on an A100-80GB power-limited to 330 W, 93.89 tokens/s, against the model's decoding in a
   CUDA-graph engine (its vLLM path; the priors' decode bandwidth efficiency cites gpt-fast's blog, so this row checks
   the bytes per token and the per-step overhead, not that factor).
Targets (issue 30): Spearman >= 0.9 over a measured set, median |error| < 15% before calibration.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from vram_planner import engine
from vram_planner.model.ranking import timed
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.step_time import Card, Efficiency, generation_round_seconds
from vram_planner.probe.step_fit import TimedPhase, predicted_seconds
from vram_planner.profiles import GpuProfile

ROOT = Path(__file__).resolve().parent
GPU_RESULTS = ROOT / "results" / "gpu"
OUT = ROOT / "results" / "step_time.txt"
CARD = "h100-80gb"
STEPS_PER_RUN = 2  # gpu_steps.py trains max_steps=2; the probe runs each point's step twice
GPT_FAST = {"model": "Llama-3.1-8B", "gpu": "a100-80gb", "tokens_per_second": 93.89,
            "source": "github.com/pytorch-labs/gpt-fast README, Benchmarks: Llama-3.1-8B Base, 8xA100-80GB at 330 W, "
                      "batch 1, 5-token prompts"}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's of the average ranks."""
    return float(pd.Series(a).rank().corr(pd.Series(b).rank()))


def trl_rows() -> list[dict]:
    runs = json.loads((GPU_RESULTS / "h100-trl-steps.json").read_text())["configs"]
    rows = []
    for run in runs:
        if run.get("ran") is False:  # stopped by the memory limit it was given: no step time
            continue
        verdict = engine.check(run["model"], CARD, {k: v for k, v in run["train"].items() if k != "trl_version"})
        if run.get("step_seconds"):  # runs since issue 30 time each step: the last, warm one is compared
            rows.append({"name": f"{run['name']} (step {len(run['step_seconds'])})",
                         "measured": run["step_seconds"][-1], "predicted": timed(verdict).step_seconds})
        else:
            rows.append({"name": run["name"], "measured": run["seconds"],
                         "predicted": STEPS_PER_RUN * timed(verdict).step_seconds})
    return rows


def probe_rows() -> list[dict]:
    record = json.loads((GPU_RESULTS / "h100-probe-record.json").read_text())
    gpu = GpuProfile.from_name(CARD)
    rows = []
    for point in record["points"]:
        train = TrainingConfig(**point["settings"])
        arch = engine.make_context(point["model"], gpu).arch
        work = sum(predicted_seconds(TimedPhase(arch, train, phase, 1.0), gpu, Efficiency())
                   for phase in ("training", "optimizer"))
        # the probe's generation phase: the prefill and one decoding step (the cache between is grown, not decoded)
        generation, _ = generation_round_seconds(arch, train, Card.of(gpu, train), new_tokens=2)
        rows.append({"name": point["label"], "measured": point["seconds"],
                     "predicted": STEPS_PER_RUN * (work + generation)})
    return rows


def public_rows() -> list[dict]:
    gpu = GpuProfile.from_name(GPT_FAST["gpu"])
    train = TrainingConfig(per_device_train_batch_size=1, num_generations=1, max_prompt_length=5,
                           max_completion_length=2, dtype="bfloat16", mixed_precision="no", use_vllm=True)
    arch = engine.make_context(GPT_FAST["model"], gpu).arch
    card = Card.of(gpu, train)
    one, _ = generation_round_seconds(arch, train, card, vllm_sequences=1, new_tokens=1)
    two, _ = generation_round_seconds(arch, train, card, vllm_sequences=1, new_tokens=2)
    return [{"name": f"{GPT_FAST['model']} decode tok/s, {gpu.label}", "measured": GPT_FAST["tokens_per_second"],
             "predicted": 1 / (two - one)}]


def table(title: str, rows: list[dict], unit: str) -> list[str]:
    lines = [title, f"{'config':<62} {'measured':>9} {'predicted':>9} {'error':>8}"]
    for row in rows:
        row["error"] = (row["predicted"] - row["measured"]) / row["measured"]
        lines.append(f"{row['name'][:62]:<62} {row['measured']:>8.2f}{unit} {row['predicted']:>8.2f}{unit} "
                     f"{row['error']:>+8.1%}")
    errors = [abs(r["error"]) for r in rows]
    summary = f"median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} over {len(rows)}"
    if len(rows) > 2:
        measured, predicted = [r["measured"] for r in rows], [r["predicted"] for r in rows]
        summary += f"; Spearman {spearman(measured, predicted):.3f}"
        # a diagnostic, not a fit of any constant: what is fixed per run (start-up) and how the rest scales
        slope, intercept = np.polyfit(predicted, measured, 1)
        summary += f"\nleast-squares line: measured = {intercept:.1f} s + {slope:.2f} x predicted"
    return [*lines, summary, ""]


def main(out: Path = OUT) -> int:
    text = [*table("Real TRL runs of two GRPO steps on an H100 (measured: the whole run, start-up included; "
                   "predicted: two steps)", trl_rows(), " s"),
            *table("Probe points on the same H100 (two steps of the probe's phases; measured includes building "
                   "the model)", probe_rows(), " s"),
            *table(f"Public decoding throughput ({GPT_FAST['source']})", public_rows(), "  "),
            "Efficiency factors: the priors (no committed calibration has fitted step-time factors yet: the probe "
            "timing each phase has not run on a GPU)."]
    output = "\n".join(text) + "\n"
    print(output, end="")
    out.write_text(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
