"""ZeRO's model states per GPU: the planner's count beside DeepSpeed's own estimator, and the whole step's peak.

    python benchmarks/zero_states.py

For catalog models x N in (2, 4, 8) x ZeRO-2 and ZeRO-3, full fine-tuning with AdamW in bf16 at TRL 1.16's defaults:
DeepSpeed 0.19.8's estimate of the model states without offload (estimate_zero2/3_model_states_mem_needs, copied in
vram_planner/model/zero.py with their source lines), the planner's model states at the optimizer step's peak (weights,
gradients and optimizer states as model/zero.py counts them, held to DeepSpeed's own step traced on fake tensors by
benchmarks/sharded.py --zero), their difference, and the step's peak per GPU. Where DeepSpeed is importable, its own
functions' numbers are checked against the copy. Results: benchmarks/results/zero_states.txt.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from public_measurements import planned_under, tested_transformers  # noqa: E402

from vram_planner import engine  # noqa: E402
from vram_planner.model import zero  # noqa: E402
from vram_planner.units import GiB  # noqa: E402

TABLE = ROOT / "benchmarks" / "results" / "zero_states.txt"
MODELS = ["Qwen2.5-0.5B", "Llama-3.2-1B", "Qwen2.5-1.5B", "Llama-3.2-3B", "Qwen2.5-7B", "Llama-3.1-8B"]
MODEL_STATES = ("weights", "reference_weights", "gradients", "optimizer_states")


def deepspeeds_own(params: int, largest: int, gpus: int) -> tuple[int, int] | None:
    """DeepSpeed's estimator functions, where DeepSpeed imports."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except ImportError:
        return None
    zero2 = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=gpus, cpu_offload=False)[1]
    zero3 = estimate_zero3_model_states_mem_needs(params, largest, num_gpus_per_node=gpus, cpu_offload=False)[1]
    return zero2, zero3


def _version() -> str:
    import deepspeed

    return str(deepspeed.__version__).strip()


# the tested set's transformers (constraints.txt): one table whichever release is installed (the analytic model
# follows the installed one; 5.25's kernelized norms keep less in the loss)
TRANSFORMERS = tested_transformers()


def table_rows() -> list[str]:
    """The table's lines, its last saying whether DeepSpeed's own functions were compared."""
    rows = [f"{'model':<14} {'N':>2} {'stage':>5} {'DeepSpeed':>10} {'planner':>9} {'diff':>6} {'peak':>7}"
            f"  (GiB per GPU; {planned_under(TRANSFORMERS)})"]
    checked = 0
    for name in MODELS:
        context = engine.make_context(name, "h200")
        arch = context.arch
        largest = zero.largest_layer_params(arch)
        for gpus in (2, 4, 8):
            own = deepspeeds_own(arch.params, largest, gpus)
            for stage in (2, 3):
                train = engine.make_training(context, {"transformers_version": TRANSFORMERS, "num_gpus": gpus,
                                                       "zero_stage": stage, "dtype": "bfloat16"})
                estimate = engine.judge(context, train).estimate
                step = next(p for p in estimate.phases if p.name == "optimizer")
                ours = sum(step.components[c] for c in MODEL_STATES)
                theirs = zero.deepspeed_estimate_bytes(arch.params, gpus, stage, largest)
                if own is not None:
                    assert own[stage - 2] == theirs, (name, gpus, stage)
                    checked += 1
                assert ours >= theirs, (name, gpus, stage)
                rows.append(f"{name:<14} {gpus:>2} {'ZeRO-' + str(stage):>5} {theirs / GiB:>10.2f} {ours / GiB:>9.2f} "
                            f"{(ours - theirs) / GiB:>+6.2f} {estimate.peak_bytes / GiB:>7.2f}")
    rows.append("DeepSpeed's own functions: " + (f"{checked} numbers equal to the copy (DeepSpeed {_version()})"
                                                  if checked else "not importable here; the copy's formulas are "
                                                  "cited in vram_planner/model/zero.py"))
    return rows


def main() -> None:
    rows = table_rows()
    TABLE.write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
