"""Each rank's own bytes of a run on several GPUs, read off the model and the optimizer the engine prepared.

The plan counts one rank's share of the weights, gradients and optimizer states (FSDP2's shards, DeepSpeed's
partitions); these are the same three read from the tensors the rank holds when its optimizer has stepped: a
DTensor's local shard under FSDP2, a ZeRO-3 parameter's `ds_tensor` partition, the innermost torch optimizer's state
and ZeRO's fp32 master partitions (DeepSpeed wraps the torch optimizer, and accelerate wraps that). Each tensor in
the caching allocator's 512-byte blocks, as torch.cuda.memory_allocated and the plan count it. Rank 0 gathers every
rank's figures into the run's record, so the processes never write the same file.
"""

from __future__ import annotations

from typing import Any

from vram_planner.model.blocks import blocks


def _local(tensor: Any) -> Any:
    """The part of `tensor` this rank holds."""
    if hasattr(tensor, "ds_tensor"):  # a ZeRO-3 parameter: its data is gathered only around its layer's use
        return tensor.ds_tensor
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _bytes(tensor: Any) -> int:
    local = _local(tensor)
    return int(blocks(local.numel() * local.element_size()))


def _device_states(optimizer: Any) -> list[Any]:
    """The optimizer's state tensors a CUDA run keeps on the GPU: all but the `step` scalars torch hosts."""
    import torch

    from vram_planner.tracing.optimizer_peak import host_step_scalars

    host = host_step_scalars(optimizer)
    return [value for state in optimizer.state.values() for value in state.values()
            if isinstance(value, torch.Tensor) and not any(value is h for h in host)]


# DeepSpeed's fp32 master partitions, by the attribute of its ZeRO optimizer that holds them
# (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py); stage 3 takes them out of the torch optimizer's param_groups
# after each sub-group's step, so they are read here
MASTER_ATTRIBUTES = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")


def _optimizers(optimizer: Any) -> list[Any]:
    """accelerate's AcceleratedOptimizer, DeepSpeed's ZeRO optimizer where there is one, and the torch optimizer."""
    chain = [optimizer]
    while hasattr(chain[-1], "optimizer"):
        chain.append(chain[-1].optimizer)
    return chain


def rank_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """This rank's weights, gradients and optimizer states, in bytes."""
    parameters = list({id(p): p for p in model.parameters()}.values())
    chain = _optimizers(optimizer)
    states = _device_states(chain[-1])
    # what the optimizer steps that is not the model's own parameters: ZeRO's fp32 master partitions, which the
    # plan counts with the optimizer states
    stepped = [p for group in chain[-1].param_groups for p in group["params"]]
    stepped += [p for level in chain for name in MASTER_ATTRIBUTES for p in getattr(level, name, None) or []]
    model_ids = {id(p) for p in parameters}
    masters = list({id(p): p for p in stepped if id(p) not in model_ids}.values())
    return {"weights": sum(_bytes(p) for p in parameters),
            "gradients": sum(_bytes(p.grad) for p in parameters if p.grad is not None),
            "optimizer_states": sum(_bytes(s) for s in states) + sum(_bytes(p) for p in masters)}


def outside_allocator_bytes() -> int | None:
    """What this rank's card holds outside PyTorch's caching allocator (the CUDA context, NCCL's buffers, and any
    other process's memory on the card): used memory by cudaMemGetInfo less torch.cuda.memory_reserved(); None
    without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return int(total - free - torch.cuda.memory_reserved())


class RankBytes:
    """A TrainerCallback's hooks: each rank's bytes after its optimizer's first step, before the gradients are
    freed, and on CUDA what its card holds outside the allocator then (NCCL has connected by that step)."""

    def __init__(self) -> None:
        self.measured: dict[str, int] | None = None

    def on_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                          **_: Any) -> None:
        if self.measured is None and model is not None and optimizer is not None:
            outside = outside_allocator_bytes()
            self.measured = {**rank_bytes(model, optimizer),
                             **({} if outside is None else {"outside_allocator_bytes": outside})}


def gathered(measured: dict[str, int] | None) -> list[dict[str, Any]]:
    """Every rank's figures, in rank order (on every rank; rank 0 records them)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [{"rank": 0, **(measured or {})}]
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, measured)
    return [{"rank": rank, **(figures or {})} for rank, figures in enumerate(found)]
