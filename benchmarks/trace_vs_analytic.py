"""Trace against the analytic model on a small grid: per phase, both tensor peaks and their relative error.

Run with the train extras installed:
    python benchmarks/trace_vs_analytic.py [--models M ...] [--components] [--extras] [--out FILE]
Relative error is (analytic - trace) / trace, on tensor bytes only (no CUDA context, no allocator overhead).
The grid: Llama-3.2-1B, Qwen2.5-0.5B, SmolLM2-135M x full / LoRA r=16 x checkpointing on / off x completion 128 / 512
x B in {1, 4}, everything else at TRL 1.16's defaults (float32 weights, bf16 autocast, max_prompt_length 256).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from vram_planner.architecture import ModelArchitecture
from vram_planner.calibration import Calibration
from vram_planner.estimate import TENSOR_COMPONENTS, estimate
from vram_planner.spec import TrainingConfig
from vram_planner.trace import compare_with_estimate, trace_step
from vram_planner.trl_releases import trl_release
from vram_planner.units import GiB

MODELS_DIR = Path(__file__).resolve().parent.parent / "profiles" / "models"
MODELS = ("Llama-3.2-1B", "Qwen2.5-0.5B", "SmolLM2-135M")
CAPACITY = 80 * GiB  # only matters for vLLM's reservation, which the grid does not use
SHORT = {"weights": "W", "reference_weights": "R", "gradients": "G", "optimizer_states": "O", "kv_cache": "KV",
         "activations": "A", "lm_head_buffers": "H"}


def grid(models: list[str]) -> list[tuple[str, TrainingConfig]]:
    points = []
    for model, lora, checkpointing, completion, batch in itertools.product(
            models, (None, 16), (True, False), (128, 512), (1, 4)):
        # B=1 needs two micro-batches per generation round for a group of G=2 completions.
        train = TrainingConfig(per_device_train_batch_size=batch, num_generations=max(batch, 2),
                               gradient_accumulation_steps=max(2 // batch, 1), max_completion_length=completion,
                               gradient_checkpointing=checkpointing, lora_r=lora)
        points.append((model, train))
    return points


def extras(models: list[str]) -> list[tuple[str, TrainingConfig]]:
    """Configs with a scoring pass (reference or old log-probs), which the main grid does not have."""
    base = {"per_device_train_batch_size": 4, "num_generations": 4}
    variants = [{"beta": 0.04}, {"beta": 0.04, "lora_r": 16}, {"steps_per_generation": 2},
                {"dtype": "bfloat16"}, {"attn_implementation": "eager", "max_completion_length": 128}]
    return [(model, TrainingConfig(**base, **v)) for model in models for v in variants]


def label(model: str, train: TrainingConfig) -> str:
    kind = f"lora{train.lora_r}" if train.uses_lora else "full"
    text = (f"{model} {kind} gc={'on' if train.gradient_checkpointing else 'off'} "
            f"c={train.max_completion_length} B={train.per_device_train_batch_size} "
            f"GA={train.gradient_accumulation_steps}")
    changed = {k: v for k, v in train.model_dump(exclude_defaults=True).items()
               if k in ("beta", "steps_per_generation", "dtype", "attn_implementation")}
    return text + "".join(f" {k}={v}" for k, v in changed.items())


def gib(n: float) -> str:
    return f"{n / GiB:7.3f}"


def run_point(model: str, train: TrainingConfig, components: bool) -> dict:
    config = json.loads((MODELS_DIR / f"{model}.json").read_text())
    arch = ModelArchitecture.from_config(config, name=model)
    release = trl_release()
    analytic = estimate(arch, train, release, Calibration(cuda_context_bytes=0, allocator_overhead_fraction=0),
                        CAPACITY)
    traced = trace_step(config, train, release)
    rows = compare_with_estimate(traced, analytic)
    moments = {p.name: p.moment for p in analytic.phases}
    print(f"\n{label(model, train)}  (trace {traced.seconds:.1f} s)")
    print(f"  {'phase':<11}{'trace GiB':>10}{'analytic':>10}{'rel.err':>9}  peak moment: trace | analytic")
    for row in rows:
        moment = traced.phase(row.name).moment
        print(f"  {row.name:<11}{gib(row.trace_bytes):>10}{gib(row.analytic_bytes):>10}"
              f"{row.relative_error:>+9.1%}  {moment} | {moments.get(row.name) or '-'}")
        if components:
            parts = "  ".join(f"{SHORT[c]} {t / GiB:.3f}/{a / GiB:.3f}" for c, (t, a) in row.components.items()
                              if t or a)
            print(f"  {'':<11}trace/analytic GiB: {parts}")
    peak_error = (analytic.tensor_peak_bytes - traced.peak_bytes) / traced.peak_bytes
    print(f"  {'peak':<11}{gib(traced.peak_bytes):>10}{gib(analytic.tensor_peak_bytes):>10}{peak_error:>+9.1%}")
    return {"point": label(model, train), "seconds": traced.seconds, "peak_error": peak_error,
            "phases": {r.name: {"trace": r.trace_bytes, "analytic": r.analytic_bytes, "error": r.relative_error,
                                "components": {c: list(v) for c, v in r.components.items()}} for r in rows}}


def summary(results: list[dict]) -> None:
    print("\nmean |relative error| per phase (and worst):")
    phases = sorted({p for r in results for p in r["phases"]})
    for phase in [*phases, "peak"]:
        errors = [r["peak_error"] if phase == "peak" else r["phases"][phase]["error"]
                  for r in results if phase == "peak" or phase in r["phases"]]
        worst = max(errors, key=abs)
        print(f"  {phase:<11} mean {sum(map(abs, errors)) / len(errors):6.1%}   worst {worst:+7.1%}   n={len(errors)}")
    seconds = [r["seconds"] for r in results]
    print(f"trace wall time per point: mean {sum(seconds) / len(seconds):.1f} s, max {max(seconds):.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--components", action="store_true", help="print the per-component split too")
    parser.add_argument("--extras", action="store_true",
                        help="also trace scoring (beta, steps_per_generation), bfloat16 and eager-attention configs")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    points = grid(args.models) + (extras(args.models) if args.extras else [])
    results = [run_point(model, train, args.components) for model, train in points]
    summary(results)
    print(f"components: {', '.join(f'{v}={k}' for k, v in SHORT.items() if k in TENSOR_COMPONENTS)}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
