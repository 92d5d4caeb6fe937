"""Offloaded model states: each GPU's and one node's host RAM as planned, beside DeepSpeed's own estimators.

    python benchmarks/offload_states.py

For catalog models x N in (1, 2, 4, 8) x ZeRO-2 and ZeRO-3 with the optimizer offloaded, ZeRO-3 with the parameters
offloaded as well, and FSDP2's CPU offload (full fine-tuning, AdamW, bf16, TRL 1.16's defaults): DeepSpeed 0.19.8's
estimate with cpu_offload (GPU per rank, host per node; copied in vram_planner/model/offload.py with its source lines,
none for FSDP2), the planner's model states in the optimizer step on one GPU and the step's peak, and the host RAM of
the node: the buffers every rank allocates as the engines' source allocates them (pinned ones rounded to a power of
two), the model while it loads, and what is planned, never below DeepSpeed's estimate. Where DeepSpeed is importable,
its own functions' numbers are checked against the copy. Read from the engines' source, not measured.
Results: benchmarks/results/offload_states.txt.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from public_measurements import planned_under, tested_transformers  # noqa: E402

from vram_planner import engine  # noqa: E402
from vram_planner.model import offload, zero  # noqa: E402
from vram_planner.units import GiB  # noqa: E402

TABLE = ROOT / "benchmarks" / "results" / "offload_states.txt"
MODELS = ["Qwen2.5-0.5B", "Llama-3.2-1B", "Llama-3.2-3B", "Qwen2.5-7B", "Llama-3.1-8B"]
MODEL_STATES = ("weights", "reference_weights", "gradients", "optimizer_states")
STRATEGIES = {"Z2+opt": {"zero_stage": 2, "offload_optimizer": "cpu"},
              "Z3+opt": {"zero_stage": 3, "offload_optimizer": "cpu"},
              "Z3+opt+par": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
              "FSDP2+off": {"fsdp": True, "offload_param": "cpu"}}


def deepspeeds_own(arch, train) -> tuple[int, int] | None:
    """DeepSpeed's estimator functions with cpu_offload, where DeepSpeed imports (host per node, GPU per rank)."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except ImportError:
        return None
    if train.fsdp:
        return None
    if train.zero_stage == 2:
        return estimate_zero2_model_states_mem_needs(arch.params, num_gpus_per_node=train.num_gpus, cpu_offload=True)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        arch.params, zero.largest_layer_params(arch), num_gpus_per_node=train.num_gpus, cpu_offload=True,
        cpu_offload_params=train.offload_param == "cpu", zero_init=True)
    return cpu, gpu


def _gib(n_bytes: float | None) -> str:
    return "-" if n_bytes is None else f"{n_bytes / GiB:.2f}"


# the tested set's transformers (constraints.txt): one table whichever release is installed (the analytic model
# follows the installed one; 5.25's kernelized norms keep less in the loss)
TRANSFORMERS = tested_transformers()


def table_rows() -> list[str]:
    """The table's lines, its last saying whether DeepSpeed's own functions were compared."""
    rows = [f"{'model':<13} {'N':>1} {'strategy':<10} {'DS gpu':>7} {'states':>7} {'peak':>6} {'DS host':>8} "
            f"{'buffers':>8} {'loading':>8} {'planned':>8}  (GiB: GPU per rank, host per node; "
            f"{planned_under(TRANSFORMERS)})"]
    checked = 0
    for name in MODELS:
        context = engine.make_context(name, "h200")
        arch = context.arch
        for gpus in (1, 2, 4, 8):
            for label, knobs in STRATEGIES.items():
                train = engine.make_training(context, {"transformers_version": TRANSFORMERS, "num_gpus": gpus,
                                                       "dtype": "bfloat16", **knobs})
                estimate = engine.judge(context, train).estimate
                step = next(p for p in estimate.phases if p.name == "optimizer")
                states = sum(step.components[c] for c in MODEL_STATES)
                theirs = offload.deepspeed_estimate(arch, train)
                own = deepspeeds_own(arch, train)
                if own is not None:
                    assert tuple(own) == theirs, (name, gpus, label)
                    checked += 1
                buffers = min(gpus, offload.MAX_GPUS_PER_NODE) * sum(
                    b.held_bytes for b in offload.host_buffers(arch, train))
                host = offload.host_bytes(arch, train)
                if theirs is not None:
                    assert states >= theirs[1] and host >= theirs[0], (name, gpus, label)
                rows.append(f"{name:<13} {gpus:>1} {label:<10} {_gib(theirs and theirs[1]):>7} {_gib(states):>7} "
                            f"{_gib(estimate.peak_bytes):>6} {_gib(theirs and theirs[0]):>8} {_gib(buffers):>8} "
                            f"{_gib(offload.loading_bytes(arch, train)):>8} {_gib(host):>8}")
    rows.append("DeepSpeed's own functions: " + (f"{checked} numbers equal to the copy" if checked else
                                                  "not importable here; the copy's formulas are cited in "
                                                  "vram_planner/model/offload.py"))
    return rows


def main() -> None:
    rows = table_rows()
    TABLE.write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
