"""DeepSpeed ZeRO stepping on the CPU: 2 gloo processes, each rank's bytes counted by PyTorch's MemTracker, beside the
planner's per-GPU ZeRO model.

    python benchmarks/deepspeed_cpu.py --python /tmp/dsvenv/bin/python

`--python` names an interpreter that imports DeepSpeed and this project's torch (the project's own with the `deepspeed`
extra, or a virtual environment with `pip install deepspeed`). Each stage runs `torch.distributed.run
--nproc_per_node 2` on this file's worker with DS_ACCELERATOR=cpu (DeepSpeed's CPU accelerator, gloo): a small
Llama-shaped model (28M parameters, untied) in float32 under DeepSpeed's bf16 engine with torch's AdamW, as accelerate
configures TRL's zero1/2/3 (stage, bf16, DeepSpeed's default buckets), two optimizer steps of a 2 x 32-token batch.
The optimizer is the one the Trainer hands DeepSpeed (the config names none: transformers/integrations/deepspeed.py
`deepspeed_optim_sched`), as the trace builds it: GRPOConfig's default `adamw_torch_fused` for every stage, and for
ZeRO-3, whose bucket lives from start-up so that its step is the peak, `adamw_torch` with foreach kernels, which torch
picks for CUDA parameters (torch/optim/optimizer.py `_default_to_fused_or_foreach`). Not DeepSpeed's own
`{"type": "AdamW", "torch_adam": true}`: that is torch's AdamW with torch's default kernels, which on CPU parameters is
the per-parameter loop, whose step holds two fp32 temporaries of the partition (`exp_avg_sq.sqrt() /
bias_correction2_sqrt`, torch/optim/adam.py `_single_tensor_adam`), 112 MB here that no CUDA run holds (CUDA's foreach
kernels hold one, which the plan counts): ZeRO-3's step was 6% above the plan with it.
MemTracker counts every tensor the rank allocates from `deepspeed.initialize` on (real CPU tensors, no rounding): per
iteration the peak of the loss (forward and backward) and of the optimizer step apart, and what stays after the steps,
beside the planner's loss and optimizer phases (`check --num-gpus 2 --zero-stage S --optim O` for the same model with
short sequences). What the run holds only because its collectives run on gloo is set beside (`gloo_only_bytes`: ZeRO-3's
reduce-scatter). CPU kernels stand in for CUDA's, so this holds the model states and DeepSpeed's buffers, not
activations. Results: benchmarks/results/deepspeed_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "deepspeed_cpu.json"
CONFIG = {"model_type": "llama", "vocab_size": 16000, "hidden_size": 512, "intermediate_size": 1376,
          "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "tie_word_embeddings": False,
          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
STEPS = 2


# The Trainer's optimizers (Trainer.get_optimizer_cls_and_kwargs): `optim` -> torch.optim.AdamW's keyword arguments
# (foreach as torch picks it for CUDA parameters, as vram_planner/tracing/phases.py `optimizer_recipe` plans it)
OPTIMIZERS = {"adamw_torch_fused": {"fused": True}, "adamw_torch": {"foreach": True}}
RUNS = [(1, "adamw_torch_fused"), (2, "adamw_torch_fused"), (3, "adamw_torch_fused"), (3, "adamw_torch")]


def worker(stage: int, optim: str) -> None:
    """One rank: DeepSpeed's engine on the CPU, counted by MemTracker; rank 0 prints one JSON line."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed._tools.mem_tracker import MemTracker

    deepspeed.init_distributed(dist_backend="gloo")
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**CONFIG),
                                                          dtype=torch.float32)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                 "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, **OPTIMIZERS[optim])
    tracker = MemTracker()
    cpu = torch.device("cpu")

    def peak_from_now() -> None:
        # MemTracker keeps one peak, from its start, with no public reset: started again as its __enter__ starts it
        tracker._peak_mem_snap = tracker.get_tracker_snapshot()
        tracker._peak_mem = {dev: snap["Total"] for dev, snap in tracker._peak_mem_snap.items()}

    loss_peaks, step_peaks = [], []
    with tracker:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        ids = torch.randint(0, 1000, (2, 32))
        for _ in range(STEPS):
            peak_from_now()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            loss_peaks.append(tracker.get_tracker_snapshot("peak")[cpu]["Total"])
            peak_from_now()
            engine.step()
            del loss
            step_peaks.append(tracker.get_tracker_snapshot("peak")[cpu]["Total"])
            tracker.reset_mod_stats()  # MemTracker refuses a module's second forward otherwise
        kept = tracker.get_tracker_snapshot("current")[cpu]["Total"]
    if dist.get_rank() == 0:
        print(json.dumps({"stage": stage, "optim": optim, "deepspeed": deepspeed.__version__,
                          "torch": torch.__version__, "loss_peak_bytes": loss_peaks,
                          "optimizer_step_peak_bytes": step_peaks,
                          "step_peak_bytes": [max(pair) for pair in zip(loss_peaks, step_peaks)],
                          "kept_bytes": kept}), flush=True)
    dist.barrier()


def planned(stage: int, optim: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from vram_planner.model.architecture import ModelArchitecture
    from vram_planner.model.calibration import Calibration
    from vram_planner.model.phases import estimate
    from vram_planner.model.spec import training_config
    from vram_planner.model.trl_releases import trl_release

    arch = ModelArchitecture.from_config(CONFIG)
    train = training_config({"num_gpus": 2, "zero_stage": stage, "dtype": "bfloat16", "per_device_train_batch_size": 2,
                             "num_generations": 2, "max_prompt_length": 16, "max_completion_length": 16,
                             "optim": optim})
    phases = {p.name: p for p in estimate(arch, train, trl_release(None), Calibration(), 80 * 2**30).phases}
    # the run's peak is its whole iteration's: with this small model, the loss phase's 1 GB reduce bucket
    peak = max(phases.values(), key=lambda p: p.tensor_bytes)
    return {"params": arch.params, "loss_phase_bytes": round(phases["training"].tensor_bytes),
            "optimizer_phase_bytes": round(phases["optimizer"].tensor_bytes),
            "peak_phase": peak.name, "peak_bytes": round(peak.tensor_bytes),
            "components": {k: round(v) for k, v in phases["optimizer"].components.items() if v}}


def gloo_only_bytes(stage: int, params: int) -> int:
    """What the run holds because its collectives run on gloo, which a CUDA run (NCCL) does not: ZeRO-3's
    reduce-scatter (`reduce_scatter_coalesced`, deepspeed/runtime/comm/coalesced_collectives.py:128, through
    deepspeed/comm/torch.py:437 to torch.distributed.reduce_scatter_tensor) gets, inside gloo's `work.wait()`, a
    tensor of its whole input's size (seen as gloo splits it, an `aten.split` of the flat bucket's numel there): one
    more copy of the bucket's flat 16-bit gradients, here every parameter's (fewer than the bucket's 5e8 elements).
    NCCL reduces in the input's place. ZeRO-1/2 all-reduce their bucket (use_multi_rank_bucket_allreduce), which gloo
    does in place."""
    return 2 * params if stage == 3 else 0


def error(planned_bytes: int, real: int) -> str:
    return f"{(planned_bytes - real) / real:+.2%}" if real else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="an interpreter with DeepSpeed and this project's torch")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(int(args.worker[0]), args.worker[1])
        return
    if not args.python:
        parser.error("--python is required: an interpreter that imports deepspeed")
    rows = []
    for stage, optim in RUNS:
        run = subprocess.run([args.python, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__,
                              "--worker", str(stage), optim], capture_output=True, text=True, timeout=900,
                             env={**os.environ, "DS_ACCELERATOR": "cpu"})
        lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
        measured = json.loads(lines[0]) if lines else {"stage": stage, "optim": optim,
                                                        "error": run.stderr.strip().splitlines()[-1:]}
        plan = planned(stage, optim)
        rows.append({**measured, "planned": plan, "gloo_only_bytes": gloo_only_bytes(stage, plan["params"])})
        print(f"ZeRO-{stage} {optim}: DeepSpeed on 2 CPU ranks, kept {measured.get('kept_bytes', 0) / 2**20:.1f} MiB; "
              + "; ".join(f"{what} peak {real / 2**20:.1f} MiB, planned {plan[key] / 2**20:.1f} "
                          f"({error(plan[key], real)})" for what, key, real in (
                              ("loss", "loss_phase_bytes", max(measured.get("loss_peak_bytes") or [0])),
                              ("step", "optimizer_phase_bytes", max(measured.get("optimizer_step_peak_bytes") or [0]))))
              + (f"; the loss's peak holds {rows[-1]['gloo_only_bytes'] / 2**20:.1f} MiB on gloo only (gloo_only_bytes)"
                 if rows[-1]["gloo_only_bytes"] else ""))
    RESULTS.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
