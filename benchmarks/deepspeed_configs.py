"""DeepSpeed configs a user's `--deepspeed ds_config.json` may hold, traced beside the defaults the plan counts.

    python benchmarks/deepspeed_configs.py          # about three minutes on two cores

The plan counts DeepSpeed's default buckets (reduce_bucket_size 5e8, stage3_prefetch_bucket_size 5e7,
stage3_param_persistence_threshold 1e5; overlap_comm on at stage 3 only: vram_planner/launcher.py). A DeepSpeed
config may set them: as transformers' "auto" (filled from the model's hidden size, transformers/integrations/
deepspeed.py:232-241) or as numbers (transformers' examples: 2e8 buckets with overlap_comm on at stage 2). Each is
traced here with DeepSpeed's own engine on one rank of two (the sharded trace, `vram-plan trace --zero-stage S`), and
its tensor peak per phase and its need (bisected with the allocator model) printed beside the defaults'. What the
launcher reads (vram_planner/launcher.py) follows the table: "auto" is planned at the defaults, which bound it; other
values are refused, as some need more than the defaults (a 4e8 bucket with overlap_comm, at stage 2).
Writes benchmarks/results/deepspeed_configs.json and .txt.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MODEL, HIDDEN = "Qwen2.5-0.5B", 896
SETTINGS = {"num_gpus": 2, "dtype": "bfloat16", "per_device_train_batch_size": 4, "num_generations": 4,
            "max_completion_length": 64, "max_prompt_length": 32}
# transformers' fill of "auto" for this model (trainer_config_finalize)
AUTO = {"reduce_bucket_size": HIDDEN * HIDDEN, "stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
        "stage3_param_persistence_threshold": 10 * HIDDEN}
# (stage, name, zero_optimization as a config file writes it), the first of each stage the plan's own
CONFIGS = [
    (2, "DeepSpeed's defaults (planned)", {}),
    (2, "auto buckets, overlap_comm", {"reduce_bucket_size": "auto", "overlap_comm": True}),
    (2, "2e8 buckets, overlap_comm", {"reduce_bucket_size": 200_000_000, "allgather_bucket_size": 200_000_000,
                                      "overlap_comm": True}),
    (2, "2e8 buckets", {"reduce_bucket_size": 200_000_000, "allgather_bucket_size": 200_000_000}),
    (2, "4e8 bucket, overlap_comm", {"reduce_bucket_size": 400_000_000, "overlap_comm": True}),
    (3, "DeepSpeed's defaults (planned)", {}),
    (3, "auto buckets", dict.fromkeys(AUTO, "auto")),
]


def traced(stage: int, zero: dict) -> dict:
    from vram_planner import engine
    from vram_planner.tracing import zero as sharded

    planned = sharded.deepspeed_config

    filled = {key: AUTO[key] if value == "auto" else value for key, value in zero.items()}

    def with_values(session):
        config = planned(session)
        config["zero_optimization"] = {**config["zero_optimization"], **filled}
        return config

    sharded.deepspeed_config = with_values
    try:
        start = time.perf_counter()
        outcome = engine.trace(MODEL, "h100", {**SETTINGS, "zero_stage": stage})
    finally:
        sharded.deepspeed_config = planned
    return {"peak_bytes": {p.name: p.peak_bytes for p in outcome.result.phases},
            "need_bytes": outcome.need.capacity_bytes, "seconds": round(time.perf_counter() - start, 1)}


def versions() -> dict[str, str]:
    """The libraries whose code the traces ran."""
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "deepspeed", "accelerate", "transformers", "trl")}


def main() -> int:
    rows = []
    for stage, name, zero in CONFIGS:
        rows.append({"stage": stage, "config": name, "zero_optimization": zero, **traced(stage, zero)})
        print(f"{stage} {name}: {rows[-1]['seconds']} s", file=sys.stderr, flush=True)
    lines = [f"{MODEL}, one rank of {SETTINGS['num_gpus']}, tensor peaks and need in MiB; vs: the need against the "
             "defaults the plan counts", f"{'stage':>5}  {'config':32} {'generation':>10} {'training':>9} "
             f"{'optimizer':>9} {'need':>7} {'vs':>7}"]
    for row in rows:
        base = next(r for r in rows if r["stage"] == row["stage"])
        peaks = row["peak_bytes"]
        lines.append(f"{row['stage']:>5}  {row['config']:32} {peaks['generation'] / 2**20:10.0f} "
                     f"{peaks['training'] / 2**20:9.0f} {peaks['optimizer'] / 2**20:9.0f} "
                     f"{row['need_bytes'] / 2**20:7.0f} {row['need_bytes'] / base['need_bytes'] - 1:+7.1%}")
    text = "\n".join(lines + ["versions: " + ", ".join(f"{k} {v}" for k, v in versions().items())]) + "\n"
    print(text, end="")
    (RESULTS / "deepspeed_configs.txt").write_text(text)
    (RESULTS / "deepspeed_configs.json").write_text(json.dumps({"versions": versions(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
