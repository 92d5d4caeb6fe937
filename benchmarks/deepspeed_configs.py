"""DeepSpeed configs' buckets, traced with DeepSpeed's own engine beside what the analytic model counts for them.

    python benchmarks/deepspeed_configs.py          # about ten minutes on two cores
    python benchmarks/deepspeed_configs.py --from-results   # the committed traces and needs against the analytic
                                                            # model as it is, tracing nothing (seconds)

A DeepSpeed config (`--deepspeed ds_config.json`, accelerate's deepspeed_config_file) may set the gradient
reduction bucket (reduce_bucket_size: a number of elements, or transformers' "auto", hidden_size^2) and whether its
reduction overlaps the backward (overlap_comm: two buckets below stage 3); transformers' example ds_config_zero2.json
sets 2e8 and overlap_comm. The plan counts them (vram_planner/model/zero.py, TrainingConfig.reduce_bucket_size and
overlap_comm). Each config here is traced on one rank with DeepSpeed's own engine (the sharded trace, `vram-plan trace
--zero-stage S --reduce-bucket-size B`), its tensor peak per phase printed beside the analytic model's, and the need
(bisected with the allocator model) beside the analytic "fits from". Full fine-tuning of Qwen2.5-0.5B and
Llama-3.2-1B (tied embeddings larger and smaller than a 2e8 bucket), LoRA, accumulation, 2 and 8 ranks; Llama-3.2-3B
on 2 and Qwen2.5-1.5B on 4; five configs at TRL's own batch and lengths, Qwen2.5-0.5B to Llama-3.1-8B; and ZeRO-3's
coordinator's sizes (stage3_prefetch_bucket_size, stage3_param_persistence_threshold: transformers' "auto", as its
example ds_config_zero3.json names them, smaller and larger buckets, no persistent parameters), two micro-batches
where the later one prefetches.
Writes benchmarks/results/deepspeed_configs.json and .txt; tests/test_launcher.py holds the analytic model to it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
BASE = {"dtype": "bfloat16", "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 64,
        "max_prompt_length": 32}
MODELS = ("Qwen2.5-0.5B", "Llama-3.2-1B")
# ZeRO-1 with overlap_comm is refused (spec.py), so not traced
BUCKETS = [("auto", None), (200_000_000, None), (200_000_000, True), (500_000_000, None), (500_000_000, True),
           ("auto", True)]
GRID = ([{"zero_stage": stage, "num_gpus": 2, "reduce_bucket_size": size, **({} if overlap is None else
                                                                              {"overlap_comm": overlap})}
         for stage in (1, 2) for size, overlap in BUCKETS if not (stage == 1 and overlap)]
        + [{"zero_stage": 3, "num_gpus": 2, "reduce_bucket_size": size} for size in ("auto", 200_000_000, 500_000_000)]
        + [{"zero_stage": 2, "num_gpus": 8, "reduce_bucket_size": 200_000_000, "overlap_comm": True},
           {"zero_stage": 2, "num_gpus": 8, "reduce_bucket_size": "auto", "gradient_accumulation_steps": 2},
           {"zero_stage": 2, "num_gpus": 2, "reduce_bucket_size": 200_000_000, "overlap_comm": True, "lora_r": 16},
           {"zero_stage": 2, "num_gpus": 2, "reduce_bucket_size": "auto", "overlap_comm": True, "lora_r": 16},
           {"zero_stage": 3, "num_gpus": 2, "reduce_bucket_size": 200_000_000, "lora_r": 16},
           {"zero_stage": 3, "num_gpus": 2, "reduce_bucket_size": "auto", "lora_r": 16},
           {"zero_stage": 3, "num_gpus": 2, "reduce_bucket_size": "auto", "lora_r": 16, "gradient_accumulation_steps": 2},
           {"zero_stage": 2, "num_gpus": 2, "reduce_bucket_size": 200_000_000, "overlap_comm": True,
            "gradient_accumulation_steps": 2},
           {"zero_stage": 2, "num_gpus": 2, "reduce_bucket_size": "auto", "gradient_accumulation_steps": 2},
           {"zero_stage": 2, "num_gpus": 2, "gradient_accumulation_steps": 2}])
# Larger models and TRL's own batch and lengths (only the dtype set: `defaults`), on the layouts whose steps strand
# the most beside DeepSpeed's buffers (vram_planner/model/zero_replay.py), DeepSpeed's defaults
LARGER = [("Llama-3.2-3B", {"zero_stage": 2, "num_gpus": 2}), ("Qwen2.5-1.5B", {"zero_stage": 2, "num_gpus": 4})]
DEFAULTS = {"dtype": "bfloat16"}
AT_TRLS_DEFAULTS = [("Qwen2.5-0.5B", {"zero_stage": 2, "num_gpus": 8}),
                    ("Qwen2.5-1.5B", {"zero_stage": 2, "num_gpus": 8}),
                    ("Llama-3.2-1B", {"zero_stage": 1, "num_gpus": 4}),
                    ("Qwen2.5-7B", {"zero_stage": 2, "num_gpus": 4}),
                    ("Llama-3.1-8B", {"zero_stage": 2, "num_gpus": 2})]


AUTO_SIZES = {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
              "stage3_param_persistence_threshold": "auto"}
ZERO3_COORDINATOR = [
    ("Qwen2.5-0.5B", {"zero_stage": 3, "num_gpus": 2, **AUTO_SIZES}),
    ("Qwen2.5-0.5B", {"zero_stage": 3, "num_gpus": 2, "lora_r": 16, "gradient_accumulation_steps": 2, **AUTO_SIZES}),
    ("Qwen2.5-0.5B", {"zero_stage": 3, "num_gpus": 8, "lora_r": 16, "gradient_accumulation_steps": 2, **AUTO_SIZES}),
    ("Qwen2.5-0.5B", {"zero_stage": 3, "num_gpus": 8, "lora_r": 16, "gradient_accumulation_steps": 2,
                      "stage3_prefetch_bucket_size": 200_000_000}),
    ("Llama-3.2-1B", {"zero_stage": 3, "num_gpus": 2, "gradient_accumulation_steps": 2}),
    ("Llama-3.2-1B", {"zero_stage": 3, "num_gpus": 2, "gradient_accumulation_steps": 2,
                      "stage3_prefetch_bucket_size": 10_000_000}),
    ("Llama-3.2-1B", {"zero_stage": 3, "num_gpus": 2, "gradient_accumulation_steps": 2,
                      "stage3_prefetch_bucket_size": 200_000_000}),
    ("Llama-3.2-1B", {"zero_stage": 3, "num_gpus": 8, "lora_r": 16, "gradient_accumulation_steps": 2, **AUTO_SIZES}),
    ("Llama-3.2-1B", {"zero_stage": 3, "num_gpus": 2, "stage3_param_persistence_threshold": 0}),
    ("Qwen2.5-7B", {"zero_stage": 3, "num_gpus": 4, "gradient_accumulation_steps": 2}),
    ("Qwen2.5-7B", {"zero_stage": 3, "num_gpus": 4, "gradient_accumulation_steps": 2,
                    "stage3_prefetch_bucket_size": 10_000_000})]


def traced(model: str, settings: dict, base: dict = BASE) -> dict:
    from vram_planner import engine

    start = time.perf_counter()
    outcome = engine.trace(model, "h100", {**base, **settings})
    compared = {c.name: c for c in outcome.comparison()}
    return {"model": model, "settings": settings, "rank": outcome.result.zero_rank,
            "traced_bytes": {name: c.trace_bytes for name, c in compared.items()},
            "analytic_bytes": {name: round(c.analytic_bytes) for name, c in compared.items()},
            "need_bytes": outcome.need_bytes,
            "fits_from_bytes": round(outcome.analytic.fits_from_bytes),
            "seconds": round(time.perf_counter() - start, 1)}


def versions() -> dict[str, str]:
    """The libraries whose code the traces ran."""
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "deepspeed", "accelerate", "transformers", "trl")}


def label(settings: dict, base: dict = BASE) -> str:
    shown = {"reduce_bucket_size": "bucket", "overlap_comm": "overlap", "gradient_accumulation_steps": "GA",
             "lora_r": "r", "num_gpus": "N", "stage3_prefetch_bucket_size": "prefetch",
             "stage3_param_persistence_threshold": "persist"}
    said = " ".join(f"{shown[k]}={v}" for k, v in settings.items() if k in shown)
    return said if base is BASE else f"{said} TRL's batch"


def analytic(model: str, settings: dict, rank: int) -> dict:
    """The analytic side of a row, as traced() records it: each phase's tensor peak on the traced rank and the
    "fits from" capacity."""
    from vram_planner import engine
    from vram_planner.model.components import zero_rank_excess_bytes

    verdict = engine.check(model, "h100", settings)
    return {"analytic_bytes": {p.name: round(p.tensor_bytes - zero_rank_excess_bytes(
                verdict.context.arch, verdict.train, p.name, rank)) for p in verdict.estimate.phases},
            "fits_from_bytes": round(verdict.fits_from_bytes)}


def from_results() -> list[dict]:
    """The committed rows with their analytic side recomputed (the traces and needs as committed)."""
    document = json.loads((RESULTS / "deepspeed_configs.json").read_text())
    return [{**row, **analytic(row["model"], {**row.get("base", document["base"]), **row["settings"]}, row["rank"])}
            for row in document["rows"]]


def main() -> int:
    if "--from-results" in sys.argv[1:]:
        return write(from_results())
    rows = []
    for model, settings, base in ([(model, settings, BASE) for model in MODELS for settings in GRID]
                                  + [(model, settings, BASE) for model, settings in LARGER + ZERO3_COORDINATOR]
                                  + [(model, settings, DEFAULTS) for model, settings in AT_TRLS_DEFAULTS]):
        rows.append({**traced(model, settings, base), **({"base": base} if base is not BASE else {})})
        print(f"{model} ZeRO-{settings['zero_stage']} {label(settings, base)}: {rows[-1]['seconds']} s",
              file=sys.stderr, flush=True)
    return write(rows)


def write(rows: list[dict]) -> int:
    text = report(rows)
    print(text, end="")
    (RESULTS / "deepspeed_configs.txt").write_text(text)
    (RESULTS / "deepspeed_configs.json").write_text(json.dumps({"versions": versions(), "base": BASE, "rows": rows},
                                                               indent=1) + "\n")
    return 0


def report(rows: list[dict]) -> str:
    """The table: per config, each phase's traced and analytic tensor peaks, the need and the "fits from"."""
    lines = ["one rank (the one the plan counts), tensor peaks per phase in MiB: traced with DeepSpeed's engine / "
             "analytic (error); need (bisected, CUDA context and NCCL included) and the analytic 'fits from'",
             f"{'model':13} {'stage':>5}  {'config':52} {'generation':>22} {'training':>22} {'optimizer':>22} "
             f"{'need':>6} {'fits from':>9}"]
    for row in rows:
        cells = [f"{row['traced_bytes'][p] / 2**20:6.0f}/{row['analytic_bytes'][p] / 2**20:6.0f} "
                 f"({row['analytic_bytes'][p] / row['traced_bytes'][p] - 1:+5.1%})"
                 for p in ("generation", "training", "optimizer")]
        config = label(row["settings"], row.get("base", BASE))
        lines.append(f"{row['model']:13} {row['settings']['zero_stage']:>5}  {config:52} "
                     f"{cells[0]:>22} {cells[1]:>22} {cells[2]:>22} {row['need_bytes'] / 2**20:6.0f} "
                     f"{row['fits_from_bytes'] / 2**20:9.0f}")
    worst = max((abs(r["analytic_bytes"][p] / r["traced_bytes"][p] - 1), r["model"],
                 label(r["settings"], r.get("base", BASE)), p)
                for r in rows for p in r["traced_bytes"])
    lines.append(f"worst phase: {worst[0]:.2%} ({worst[1]} {worst[2]}, {worst[3]})")
    lines.append("every config bfloat16; \"TRL's batch\": TRL's own batch and lengths, the others "
                 + ", ".join(f"{k} {v}" for k, v in BASE.items() if k != "dtype"))
    # where the allocator needs more than the estimate's reserve counts, beyond the safety margin
    windows = [r for r in rows if r["need_bytes"] > r["fits_from_bytes"]]
    lines.append(f"need above the analytic 'fits from' (windows): {len(windows)} of {len(rows)}, at most "
                 f"{max((r['need_bytes'] / r['fits_from_bytes'] - 1 for r in windows), default=0):.1%}")
    return "\n".join(lines + ["versions: " + ", ".join(f"{k} {v}" for k, v in versions().items())]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
