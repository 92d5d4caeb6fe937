"""DeepSpeed ZeRO stepping on the CPU: 2 gloo processes, each rank's bytes counted by PyTorch's MemTracker, beside the
planner's per-GPU ZeRO model.

    python benchmarks/deepspeed_cpu.py --python /tmp/dsvenv/bin/python

DeepSpeed is not a dependency: `--python` names an interpreter that imports it and this project's torch (a virtual
environment with `pip install deepspeed`, never the project's own). Each stage runs `torch.distributed.run
--nproc_per_node 2` on this file's worker with DS_ACCELERATOR=cpu (DeepSpeed's CPU accelerator, gloo): a small
Llama-shaped model (28M parameters, untied) in float32 under DeepSpeed's bf16 engine with torch's AdamW, as accelerate
configures TRL's zero1/2/3 (stage, bf16, DeepSpeed's default buckets), two optimizer steps of a 2 x 32-token batch.
MemTracker counts every tensor the rank allocates from `deepspeed.initialize` on (real CPU tensors, no rounding);
its peak is each step's, the after-steps figure what stays. The planner's figure is the largest phase of `check
--num-gpus 2 --zero-stage S` for the same model with short sequences (with this small model the loss phase, where
DeepSpeed's 1 GB reduce bucket lives), the optimizer phase's beside it. CPU kernels stand in for CUDA's, so this
holds the model states and DeepSpeed's buffers, not activations. Results: benchmarks/results/deepspeed_cpu.json.
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


def worker(stage: int) -> None:
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
                 "zero_optimization": {"stage": stage},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}}}
    tracker = MemTracker()
    peaks = []
    with tracker:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
        ids = torch.randint(0, 1000, (2, 32))
        for _ in range(STEPS):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            del loss
            peaks.append(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
            tracker.reset_mod_stats()  # MemTracker refuses a module's second forward otherwise
        kept = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
    if dist.get_rank() == 0:
        print(json.dumps({"stage": stage, "deepspeed": deepspeed.__version__, "torch": torch.__version__,
                          "step_peak_bytes": peaks, "kept_bytes": kept}), flush=True)
    dist.barrier()


def planned(stage: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from vram_planner.model.architecture import ModelArchitecture
    from vram_planner.model.calibration import Calibration
    from vram_planner.model.phases import estimate
    from vram_planner.model.spec import training_config
    from vram_planner.model.trl_releases import trl_release

    arch = ModelArchitecture.from_config(CONFIG)
    train = training_config({"num_gpus": 2, "zero_stage": stage, "dtype": "bfloat16", "per_device_train_batch_size": 2,
                             "num_generations": 2, "max_prompt_length": 16, "max_completion_length": 16})
    phases = {p.name: p for p in estimate(arch, train, trl_release(None), Calibration(), 80 * 2**30).phases}
    # the run's peak is its whole iteration's: with this small model, the loss phase's 1 GB reduce bucket
    peak = max(phases.values(), key=lambda p: p.tensor_bytes)
    return {"params": arch.params, "optimizer_phase_bytes": round(phases["optimizer"].tensor_bytes),
            "peak_phase": peak.name, "peak_bytes": round(peak.tensor_bytes),
            "components": {k: round(v) for k, v in phases["optimizer"].components.items() if v}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="an interpreter with DeepSpeed and this project's torch")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    if not args.python:
        parser.error("--python is required: an interpreter that imports deepspeed")
    rows = []
    for stage in (1, 2, 3):
        run = subprocess.run([args.python, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__,
                              "--worker", str(stage)], capture_output=True, text=True, timeout=900,
                             env={**os.environ, "DS_ACCELERATOR": "cpu"})
        lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
        measured = json.loads(lines[0]) if lines else {"stage": stage, "error": run.stderr.strip().splitlines()[-1:]}
        rows.append({**measured, "planned": planned(stage)})
        peak = max(measured.get("step_peak_bytes") or [0])
        plan = rows[-1]["planned"]["peak_bytes"]
        error = f"{(plan - peak) / peak:+.2%}" if peak else "n/a"
        print(f"ZeRO-{stage}: DeepSpeed on 2 CPU ranks, step peak {peak / 2**20:.1f} MiB, kept "
              f"{measured.get('kept_bytes', 0) / 2**20:.1f} MiB; planned peak ({rows[-1]['planned']['peak_phase']}) "
              f"{plan / 2**20:.1f} MiB ({error})")
    RESULTS.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
