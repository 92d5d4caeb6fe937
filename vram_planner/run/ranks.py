"""Each rank's own bytes of a run on several GPUs, read off the model and the optimizer the engine prepared.

The plan counts one rank's share of the weights, gradients and optimizer states (FSDP2's shards, DeepSpeed's
partitions); these are the same three read from the tensors the rank holds when its optimizer has stepped: a DTensor's
local shard under FSDP2, a ZeRO-3 parameter's `ds_tensor` partition, the innermost torch optimizer's state (DeepSpeed
wraps it, and accelerate wraps that). numel x element size, no allocator rounding. Rank 0 gathers every rank's figures
into the run's record, so the processes never write the same file.
"""

from __future__ import annotations

from typing import Any


def _local(tensor: Any) -> Any:
    """The part of `tensor` this rank holds."""
    if hasattr(tensor, "ds_tensor"):  # a ZeRO-3 parameter: its data is gathered only around its layer's use
        return tensor.ds_tensor
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _bytes(tensor: Any) -> int:
    local = _local(tensor)
    return int(local.numel() * local.element_size())


def _innermost(optimizer: Any) -> Any:
    """The torch optimizer under accelerate's AcceleratedOptimizer and DeepSpeed's ZeRO optimizer."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def rank_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """This rank's weights, gradients and optimizer states, in bytes."""
    import torch

    parameters = list({id(p): p for p in model.parameters()}.values())
    states = [value for state in _innermost(optimizer).state.values() for value in state.values()
              if isinstance(value, torch.Tensor) and value.dim() > 0]  # the moments, not the step counters
    return {"weights": sum(_bytes(p) for p in parameters),
            "gradients": sum(_bytes(p.grad) for p in parameters if p.grad is not None),
            "optimizer_states": sum(_bytes(s) for s in states)}


class RankBytes:
    """A TrainerCallback's hooks: each rank's bytes after its optimizer's first step, before the gradients are
    freed."""

    def __init__(self) -> None:
        self.measured: dict[str, int] | None = None

    def on_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                          **_: Any) -> None:
        if self.measured is None and model is not None and optimizer is not None:
            self.measured = rank_bytes(model, optimizer)


def gathered(measured: dict[str, int] | None) -> list[dict[str, Any]]:
    """Every rank's figures, in rank order (on every rank; rank 0 records them)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [{"rank": 0, **(measured or {})}]
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, measured)
    return [{"rank": rank, **(figures or {})} for rank, figures in enumerate(found)]
