"""NCCL's own device memory per rank, measured on N GPUs of one node, beside the planner's figure (model/nccl.py).

    torchrun --nproc-per-node N benchmarks/nccl_memory.py --gpu h100-80gb --out DIR [--communicators 2]

Each rank reads cudaMemGetInfo's used memory less torch.cuda.memory_reserved() (what its card holds outside PyTorch's
caching allocator) after a CUDA context of its own, after init_process_group with the device bound (the communicator
made at once), and after the first all_reduce (25 MiB, DDP's bucket), reduce_scatter_tensor and all_gather_into_tensor
(FSDP2's and ZeRO's collectives) and a barrier, each of which connects the algorithm NCCL picks for it. With
--communicators 2 a second group over every rank does the same, as DeepSpeed's clone of the world group does. The
increase over the bare context is NCCL's; rank 0 writes DIR/nccl-memory-<gpu>-<N>.json with every rank's readings and
the planner's figure for the card, N and the strategy (ddp for one communicator, zero3 for two). Needs N >= 2 CUDA
GPUs: the planner's figure is zero on one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BUCKET_ELEMENTS = 25 * 2**20 // 2  # DDP's default 25 MiB bucket, in bf16 elements


def _outside_allocator() -> int:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return int(total - free - torch.cuda.memory_reserved())


def _collectives(group: Any, world: int, readings: dict[str, int], prefix: str) -> None:
    import torch
    import torch.distributed as dist

    x = torch.ones(BUCKET_ELEMENTS, dtype=torch.bfloat16, device="cuda")
    dist.all_reduce(x, group=group)
    readings[f"{prefix}all_reduce"] = _outside_allocator()
    out = torch.empty(BUCKET_ELEMENTS // world, dtype=torch.bfloat16, device="cuda")
    dist.reduce_scatter_tensor(out, x, group=group)
    readings[f"{prefix}reduce_scatter"] = _outside_allocator()
    dist.all_gather_into_tensor(x, out, group=group)
    readings[f"{prefix}all_gather"] = _outside_allocator()
    dist.barrier(group=group)
    readings[f"{prefix}barrier"] = _outside_allocator()


def planned(gpu: str, world: int, communicators: int) -> dict[str, Any]:
    """The planner's figure for `communicators` communicators of `world` ranks on `gpu`."""
    from vram_planner.model.nccl import nccl_figure
    from vram_planner.profiles import GpuProfile

    figure = nccl_figure(GpuProfile.from_name(gpu), world, "zero3" if communicators == 2 else "ddp")
    return {"bytes": figure.bytes, "parts": figure.parts, "source": figure.source}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", required=True, help="the catalog card the GPUs are")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--communicators", type=int, choices=(1, 2), default=1)
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        sys.exit("needs CUDA GPUs and torchrun --nproc-per-node N (N >= 2)")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    torch.zeros(1, device="cuda")  # the CUDA context
    readings = {"context": _outside_allocator()}
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world = dist.get_world_size()
    readings["init"] = _outside_allocator()
    _collectives(None, world, readings, "")
    if args.communicators == 2:
        clone = dist.new_group(ranks=list(range(world)))
        _collectives(clone, world, readings, "second_")
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"rank": dist.get_rank(), **readings})
    if dist.get_rank() == 0:
        import importlib.metadata as metadata

        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        ranks = [{**r, "nccl_bytes": max(v for k, v in r.items() if k not in ("rank", "context")) - r["context"]}
                 for r in gathered]
        document = {"gpu": args.gpu, "device": torch.cuda.get_device_name(), "world": world, "torch": torch.__version__,
                    "nccl": nccl, "nccl_package": _version(metadata, "nvidia-nccl-cu13") or _version(
                        metadata, "nvidia-nccl-cu12"),
                    "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
                    "communicators": args.communicators, "ranks": ranks,
                    "planned": planned(args.gpu, world, args.communicators)}
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"nccl-memory-{args.gpu}-{world}.json"
        path.write_text(json.dumps(document, indent=1) + "\n")
        most = max(r["nccl_bytes"] for r in ranks)
        print(f"{args.gpu} x {world}: NCCL measured up to {most / 2**20:.0f} MiB per rank, planned "
              f"{document['planned']['bytes'] / 2**20:.0f} MiB ({path})")
    dist.destroy_process_group()


def _version(metadata: Any, package: str) -> str | None:
    try:
        return str(metadata.version(package))
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
