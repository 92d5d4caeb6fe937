"""The Hub's kernels, on and off: the trace and `check`'s analytic model side by side, on catalog configs.

    python benchmarks/hub_kernels.py            # prints the table, writes benchmarks/results/hub_kernels.txt

transformers 5.25 kernelizes the model by default (profiles/transformers.toml hub_kernels), 5.24 when asked
(use_kernels=True): each config is traced with use_kernels false and kernelized (the installed release's default, or
use_kernels true where it kernelizes only when asked), and its analytic peak is worked out for both. The columns:
each peak in GiB, the analytic model's error against the trace, and what the kernels change in each. Run it under
the release to show (a 5.25 environment installs it without its `kernels` dependency, which the trace does not need).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "hub_kernels.txt"
POINTS = (
    ("Qwen2.5-0.5B", "bf16 full B8 p256 c512 nogc",
     {"dtype": "bfloat16", "per_device_train_batch_size": 8, "num_generations": 8, "max_prompt_length": 256,
      "max_completion_length": 512, "gradient_checkpointing": False}),
    ("Llama-3.2-1B", "bf16 lora16 B8 p256 c512 nogc",
     {"dtype": "bfloat16", "lora_r": 16, "per_device_train_batch_size": 8, "num_generations": 8,
      "max_prompt_length": 256, "max_completion_length": 512, "gradient_checkpointing": False}),
    ("Qwen3-0.6B", "bf16 full B8 p256 c1024",
     {"dtype": "bfloat16", "per_device_train_batch_size": 8, "num_generations": 8, "max_prompt_length": 256,
      "max_completion_length": 1024}),
    # LoRA with checkpointing, what a laptop runs: the recomputed layer's norms as the kernel keeps them
    ("Llama-3.2-1B", "bf16 lora16 B8 G16 A2 p512 c2048",
     {"dtype": "bfloat16", "lora_r": 16, "per_device_train_batch_size": 8, "num_generations": 16,
      "gradient_accumulation_steps": 2, "max_prompt_length": 512, "max_completion_length": 2048}),
    ("Qwen2.5-0.5B", "bf16 lora16 B16 p256 c256",
     {"dtype": "bfloat16", "lora_r": 16, "per_device_train_batch_size": 16, "num_generations": 16,
      "max_prompt_length": 256, "max_completion_length": 256}),
    ("SmolLM2-360M", "fp32 lora16 B16 p512 c256 nogc",
     {"lora_r": 16, "per_device_train_batch_size": 16, "num_generations": 16, "max_prompt_length": 512,
      "max_completion_length": 256, "gradient_checkpointing": False}),
    ("gemma-3-1b-it", "bf16 lora16 B8 p256 c512 nogc",
     {"dtype": "bfloat16", "lora_r": 16, "per_device_train_batch_size": 8, "num_generations": 8,
      "max_prompt_length": 256, "max_completion_length": 512, "gradient_checkpointing": False}),
)


def measure(model: str, settings: dict) -> dict[str, tuple[int, float]]:
    """{"off" | "on": (the traced peak, the analytic tensor peak)}, in bytes."""
    from vram_planner import engine
    from vram_planner.profiles import model_config
    from vram_planner.tracing.step import trace_step

    context = engine.make_context(model, "h100-80gb")
    config, _, _ = model_config(model)
    default = engine.make_training(context, settings)
    on = {} if default.hub_kernel_layers else {"use_kernels": True}
    out = {}
    for name, extra in (("off", {"use_kernels": False}), ("on", on)):
        train = engine.make_training(context, {**settings, **extra})
        traced = trace_step(config, train, context.release)
        out[name] = (traced.peak_bytes, engine.judge(context, train).estimate.tensor_peak_bytes)
    return out


def main() -> int:
    import transformers

    from vram_planner.files import write_atomically

    gib = 2 ** 30
    lines = [f"transformers {transformers.__version__}: kernels off (use_kernels false) and on; peaks in GiB",
             f"{'model':16s}{'knobs':32s}{'trace off':>10s}{'check off':>10s}{'error':>8s}"
             f"{'trace on':>10s}{'check on':>10s}{'error':>8s}{'trace moves':>13s}{'check moves':>13s}"]
    print("\n".join(lines), flush=True)
    for model, label, settings in POINTS:
        m = measure(model, settings)
        (t0, a0), (t1, a1) = m["off"], m["on"]
        lines.append(f"{model:16s}{label:32s}{t0 / gib:10.2f}{a0 / gib:10.2f}{(a0 - t0) / t0:+8.2%}"
                     f"{t1 / gib:10.2f}{a1 / gib:10.2f}{(a1 - t1) / t1:+8.2%}{(t1 - t0) / t0:+13.2%}"
                     f"{(a1 - a0) / a0:+13.2%}")
        print(lines[-1], flush=True)
    write_atomically(RESULTS, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
