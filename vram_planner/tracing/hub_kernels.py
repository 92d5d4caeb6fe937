"""The Hub's kernels that transformers swaps in on CUDA, as stand-ins that allocate and keep what the kernels do.

From transformers 5.25 `from_pretrained` kernelizes the model by default (profiles/transformers.toml hub_kernels;
before, with use_kernels=True): on CUDA, each class or function its modeling code decorates with
`use_kernel_forward_from_hub(name)` runs the Hub kernel mapped to `name` for training (hub_training_kernels) instead
of its torch code. The trace builds its models from a config on the CPU, where nothing is kernelized, so it puts
these stand-ins where kernelize would put the kernels:

- "RMSNorm": kernels-community/liger-kernels' LigerRMSNorm (`LigerRMSNormFunction`, casting mode "llama", in
  place): forward makes the output in the input's dtype and a float32 rstd per row, and keeps the input (made
  contiguous), the weight and the rstd; backward writes the input's gradient over the output's gradient and sums
  a float32 [SMs, width] partial of the weight's gradient, made whether or not the weight trains.
- "rotary_pos_emb": kernels-community/rotary's apply_rotary_transformers: clones q and k and rotates the clones in
  place. 5.24 mapped it for inference only ("the kernel's backward does not match the rotary embedding's"); 5.25
  maps it for training too, and a backward (the inverse rotation) needs cos and sin, so they are kept, as the torch
  code keeps them, and the gradients are made anew. The op checks that q and cos share a dtype (torch_binding.cpp),
  which float32 weights under bf16 autocast do not give (q is autocast's bf16, cos the float32 stream's): there the
  torch code is traced.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vram_planner.tracing.session import Session

RMS_NORM, ROTARY = "RMSNorm", "rotary_pos_emb"


def decorated_in(source: str) -> dict[str, str]:
    """{class or function name: the Hub layer name} for each definition in `source` decorated with
    `use_kernel_forward_from_hub(name)`."""
    return {node.name: decorator.args[0].value for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) for decorator in node.decorator_list
            if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "use_kernel_forward_from_hub"
            and decorator.args and isinstance(decorator.args[0], ast.Constant)}


@functools.lru_cache(maxsize=64)
def decorated_names(module_name: str) -> dict[str, str]:
    """`decorated_in` a loaded module, read from its source (without the kernels package the decorator leaves no
    mark on the object)."""
    module = sys.modules.get(module_name)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        source = ""
    return decorated_in(source)


def most_sms() -> int:
    """The most streaming multiprocessors of any catalog card: the weight-gradient partial of LigerRMSNorm's backward
    is one float32 row per SM, and the trace is of no one card, so it counts the largest."""
    from vram_planner.profiles import gpus

    return max((gpu.sm_count or 0 for gpu in gpus()), default=0) or 1


def hub_kernel_patches(session: Session) -> list[tuple[Any, str, Any]]:
    """(owner, attribute, stand-in) for every kernelized class and function of the session's models; none where the
    model is not kernelized (`TrainingConfig.hub_kernel_layers`)."""
    layers = session.train.hub_kernel_layers
    if not layers:
        return []
    patches: dict[tuple[int, str], tuple[Any, str, Any]] = {}
    for top in (session.model, session.ref_model):
        if top is None:
            continue
        for module in top.modules():
            cls = type(module)
            names = decorated_names(cls.__module__)
            if names.get(cls.__name__) == RMS_NORM and RMS_NORM in layers:
                patches[(id(cls), "forward")] = (cls, "forward", _rms_norm_forward)
            modeling = sys.modules.get(cls.__module__)
            if names.get("apply_rotary_pos_emb") == ROTARY and ROTARY in layers and modeling is not None:
                patches[(id(modeling), "apply_rotary_pos_emb")] = (
                    modeling, "apply_rotary_pos_emb", _rotary_stand_in(modeling.apply_rotary_pos_emb))
    return list(patches.values())


def _rms_norm_forward(self: Any, hidden_states: Any) -> Any:
    return _rms_norm_function().apply(hidden_states, self.weight)


@functools.lru_cache(maxsize=1)
def _rms_norm_function() -> Any:
    import torch

    sms = most_sms()

    class LigerRMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any) -> Any:
            x = x.contiguous()
            rows = x.numel() // max(x.shape[-1], 1)
            y = torch.empty_like(x, memory_format=torch.contiguous_format)
            rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
            ctx.save_for_backward(x, weight, rstd)
            return y

        @staticmethod
        def backward(ctx: Any, grad_y: Any) -> Any:
            _, weight, _ = ctx.saved_tensors
            grad_x = grad_y.contiguous()  # the kernel writes it in place
            partial = torch.empty((sms, weight.shape[0]), dtype=torch.float32, device=weight.device)
            grad_weight = partial.sum(dim=0).to(weight.dtype)
            return grad_x, grad_weight

    return LigerRMSNorm


def _rotary_stand_in(torch_code: Any) -> Any:
    def rotary(q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if q.dtype != cos.dtype:  # the kernel checks x1.dtype() == cos.dtype(): it runs on one dtype only
            return torch_code(q, k, cos, sin, *args, **kwargs)
        return _rotary_function().apply(q, k, cos, sin)
    return rotary


@functools.lru_cache(maxsize=1)
def _rotary_function() -> Any:
    import torch

    class Rotary(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, cos: Any, sin: Any) -> Any:
            ctx.save_for_backward(cos, sin)
            return q.clone(), k.clone()

        @staticmethod
        def backward(ctx: Any, grad_q: Any, grad_k: Any) -> Any:
            return grad_q.clone(), grad_k.clone(), None, None

    return Rotary
