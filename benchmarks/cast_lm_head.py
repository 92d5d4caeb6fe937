"""GRPOConfig's cast_lm_head_to_fp32 on real catalog models: the trace (TRL's float32 head, as GRPOTrainer sets it up)
against the analytic model, and what the cast adds by each engine, side by side.

    python benchmarks/cast_lm_head.py            # about 8 minutes on 2 cores; writes results/cast_lm_head.txt

Per point and phase: the traced tensor bytes with the cast, the analytic model's relative error against them
((analytic - trace) / trace), and the cast's cost (with minus without) by the trace and by the analytic model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.calibration import Calibration
from vram_planner.model.phases import estimate
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.trl_releases import trl_release
from vram_planner.tracing.step import engine_versions, trace_step
from vram_planner.units import GiB

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SHAPE = {"per_device_train_batch_size": 2, "num_generations": 2, "max_prompt_length": 64, "max_completion_length": 128}
# tied (135M, 0.5B) and untied (1.5B) heads; LoRA only where TRL can cast (untied)
POINTS = {
    "SmolLM2-135M": [{"dtype": "bfloat16"}, {}, {"dtype": "bfloat16", "beta": 0.04},
                     {"dtype": "bfloat16", "gradient_accumulation_steps": 2, "gradient_checkpointing": False}],
    "Qwen2.5-0.5B": [{"dtype": "bfloat16", "beta": 0.04}, {"dtype": "bfloat16", "steps_per_generation": 2}],
    "DeepSeek-R1-Distill-Qwen-1.5B": [{"dtype": "bfloat16", "lora_r": 16}, {"dtype": "bfloat16", "beta": 0.04},
                                      {"dtype": "bfloat16", "gradient_accumulation_steps": 2}],
}


def _tensor_bytes(config: dict, arch: ModelArchitecture, train: TrainingConfig) -> tuple[dict, dict]:
    traced = trace_step(config, train)
    analytic = estimate(arch, train, trl_release(), Calibration(), 80 * GiB)
    return ({p.name: p.peak_bytes for p in traced.phases}, {p.name: p.tensor_bytes for p in analytic.phases})


def main() -> int:
    versions = engine_versions()
    lines = ["cast_lm_head_to_fp32: trace vs analytic (tensor bytes, GiB; error = (analytic - trace) / trace)",
             "engines: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
             f"shape: {json.dumps(SHAPE)}", "",
             f"{'model':30s} {'knobs':58s} {'phase':10s} {'trace':>9s} {'error':>8s} "
             f"{'cost trace':>11s} {'cost plan':>10s}"]
    worst = 0.0
    for model, points in POINTS.items():
        config = json.loads((ROOT / "profiles" / "models" / f"{model}.json").read_text())
        arch = ModelArchitecture.from_config(config)
        for knobs in points:
            plain, cast = (TrainingConfig(**SHAPE, **knobs, cast_lm_head_to_fp32=c) for c in (False, True))
            (plain_trace, plain_plan), (cast_trace, cast_plan) = (_tensor_bytes(config, arch, t) for t in (plain, cast))
            for phase, traced in cast_trace.items():
                error = (cast_plan[phase] - traced) / traced
                worst = max(worst, abs(error))
                lines.append(f"{model:30s} {json.dumps(knobs):58s} {phase:10s} {traced / GiB:9.4f} {100 * error:+7.3f}% "
                             f"{(traced - plain_trace[phase]) / GiB:11.4f} "
                             f"{(cast_plan[phase] - plain_plan[phase]) / GiB:10.4f}")
                print(lines[-1], flush=True)
    lines += ["", f"worst |error| {100 * worst:.3f}%"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cast_lm_head.txt").write_text("\n".join(lines) + "\n")
    print(lines[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
