"""ZeRO-Offload's host buffers as DeepSpeed allocates them, on 2 CPU ranks, beside vram_planner/model/offload.py.

    python benchmarks/offload_cpu.py --python /tmp/dsvenv/bin/python

DeepSpeed is not a dependency: `--python` names an interpreter that imports it and this project's torch (see
benchmarks/deepspeed_cpu.py). Each case runs `torch.distributed.run --nproc_per_node 2` on this file's worker with
DS_ACCELERATOR=cpu (gloo): benchmarks/deepspeed_cpu.py's 28M-parameter Llama-shaped model under DeepSpeed's bf16 engine
(the Trainer's two optimizer groups), ZeRO-2 or ZeRO-3 with `offload_optimizer: {device: cpu}` (and `offload_param` for
ZeRO-3 as well), two micro-batches per step, four steps. After them each rank reads its optimizer's own buffers by name
and reports their tensors' bytes (numel x element size); the planner's buffers for the same model and config are set
beside them. Two things differ from a GPU run: the CPU accelerator's pin_memory does nothing, so the bytes are the
tensors' before CachingHostAllocator's power-of-two rounding (the planner's `tensor_bytes`, not its `held_bytes`), and
the optimizer is torch's AdamW with `zero_force_ds_cpu_optimizer: false` (DeepSpeedCPUAdam needs its C++ op built; its
two fp32 moments are the same bytes). Results: benchmarks/results/offload_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.deepspeed_cpu import CONFIG  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "offload_cpu.json"
CASES = {"zero2": (2, False), "zero3": (3, False), "zero3-params": (3, True)}
ACCUMULATION = 2
# DeepSpeed's optimizer attribute that holds each of the planner's buffers (vram_planner/model/offload.py's names)
ZERO2_BUFFERS = {"fp32 master partition": "single_partition_of_fp32_groups",
                 "16-bit copy of the partition for the upload": "param_buffer_of_bit16_for_cpu_offload_groups",
                 "fp32 gradient partition": "single_partition_of_fp32_groups.grad",
                 "gradient staging buffer": "temp_grad_buffer_for_cpu_offload",
                 "gradients accumulated on the host": "accumulated_grads_in_cpu"}
ZERO3_BUFFERS = {"fp32 master partition": "fp32_partitioned_groups_flat",
                 "fp32 gradient of each sub-group": "fp32_partitioned_groups_flat.grad",
                 "gradient partitions": "grad_partitions_flat_buffer",
                 "16-bit parameter partitions": "param_groups_fp16_flat_cpu_memory"}


def _bytes(value) -> int:
    import torch

    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _read(optimizer, attribute: str) -> int:
    name, _, grad = attribute.partition(".")
    value = getattr(optimizer, name)
    if grad:
        value = [t.grad for t in value if t.grad is not None]
    return _bytes(value)


def worker(stage: int, params_offloaded: bool) -> None:
    """One rank: the offloaded engine steps, then its buffers by name; rank 0 prints every rank's as one JSON line."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import transformers

    deepspeed.init_distributed(dist_backend="gloo")
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**CONFIG),
                                                          dtype=torch.float32)
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if params_offloaded:
        zero["offload_param"] = {"device": "cpu"}
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACCUMULATION,
                 "bf16": {"enabled": True}, "zero_optimization": zero, "zero_force_ds_cpu_optimizer": False,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}}}
    # the Trainer's two groups: weight decay on the matrices, none on norms and biases
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    groups = [{"params": decay}, {"params": [p for n, p in model.named_parameters() if p.dim() <= 1],
                                  "weight_decay": 0.0}]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config)
    ids = torch.randint(0, 1000, (2, 32))
    for _ in range(2 * ACCUMULATION):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    optimizer = engine.optimizer
    names = ZERO2_BUFFERS if stage != 3 else ZERO3_BUFFERS
    measured = {buffer: _read(optimizer, attribute) for buffer, attribute in names.items()}
    measured["DeepSpeedCPUAdam's moments"] = sum(_bytes([v for v in state.values() if v.dim() > 0])
                                                 for state in optimizer.optimizer.state.values())
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, measured)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(ranks), flush=True)


def planned(stage: int, params_offloaded: bool) -> dict[str, int]:
    from vram_planner.model import offload
    from vram_planner.model.architecture import ModelArchitecture
    from vram_planner.model.spec import training_config

    train = training_config({"num_gpus": 2, "zero_stage": stage, "offload_optimizer": "cpu",
                             "offload_param": "cpu" if params_offloaded else "none",
                             "gradient_accumulation_steps": ACCUMULATION, "per_device_train_batch_size": 2,
                             "num_generations": 2})
    return {b.name: b.tensor_bytes for b in offload.host_buffers(ModelArchitecture.from_config(CONFIG), train)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--python", required=True, help="an interpreter that imports deepspeed and this torch")
    parser.add_argument("--worker", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], bool(args.worker[1]))
        return
    results = {}
    for name, (stage, params_offloaded) in CASES.items():
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
        run = subprocess.run([args.python, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__,
                              "--python", args.python, "--worker", str(stage), str(int(params_offloaded))],
                             capture_output=True, text=True, env=env, timeout=900)
        line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{name}: no result\n{run.stderr[-3000:]}")
        ranks = json.loads(line.removeprefix("RESULT "))
        plan = planned(stage, params_offloaded)
        rows = {buffer: {"planned": plan.get(buffer), "measured": [rank[buffer] for rank in ranks]}
                for buffer in ranks[0]}
        results[name] = rows
        for buffer, row in rows.items():
            worst = max(row["measured"])
            diff = "" if row["planned"] is None else f"{(row['planned'] - worst) / worst:+.2%}" if worst else ""
            print(f"{name:<13} {buffer:<44} planned {row['planned']!s:>11} measured {row['measured']} {diff}")
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
