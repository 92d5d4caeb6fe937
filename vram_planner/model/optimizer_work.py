"""The work of one optimizer step: the bytes its kernels move, the kernels it launches and the tensors its host loops
visit, as pure functions of the architecture (vram_planner/model/step_time.py turns them into seconds).

A step is `optimizer.step()` (the phase a probe times), then, around it in transformers' Trainer, the gradient
clipping before it and `model.zero_grad()` after it. Large trainables make the step stream bytes; LoRA's many small
adapters make it host-bound: torch.optim walks every parameter in Python before its kernels start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vram_planner.model import components as m
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.memo import remembered_work
from vram_planner.model.spec import Optimizer, TrainingConfig

# Bytes an optimizer moves per trainable parameter per step, by the passes its implementation makes over parameter,
# gradient and states (4-byte states; 16-bit trainables scale by their width, in `optimizer_bytes`):
# - torch's fused AdamW (one kernel, _fused_adamw): reads param, grad, exp_avg, exp_avg_sq; writes param and the
#   two states: 7 accesses.
# - torch's foreach AdamW (adamw_torch): lerp of exp_avg, mul and addcmul of exp_avg_sq, the bias corrections, a
#   sqrt/div/add building the denominator, weight decay and addcdiv each read and write whole lists: about 20.
# - bitsandbytes' 8-bit AdamW (one kernel, blockwise): param and grad at 4 bytes, both states at 1 byte, read and
#   written (the states' absmax per 256 values is negligible): 4 + 4 + 4 + 2 + 2 = 16 bytes at 4-byte params.
# - SGD without momentum (transformers' default): read param and grad, write param.
OPTIMIZER_ACCESSES = {"fused": 7, "foreach": 20, "sgd": 3, "one_state": 5, "adafactor": 10}
BNB_8BIT_BYTES_PER_PARAM = {"two_states": 16, "one_state": 14}
# transformers' Trainer clips gradients (max_grad_norm=1.0) through accelerate's clip_grad_norm_, torch's
# clip_grad_norm_ with foreach: _foreach_norm over the gradients (one read), then _foreach_mul_ by the clip
# coefficient (one read, one write).
CLIP_GRAD_ACCESSES = 3

# torch's multi_tensor_apply (ATen/native/cuda/MultiTensorApply.cuh) packs the tensors of a list into one kernel
# launch until it holds depth_to_max_tensors[depth - 1] tensors or depth_to_max_blocks chunks of kChunkSize elements
# (each tensor's last chunk partly filled). CUDA 13 builds pass 32 KB of kernel arguments (pytorch/pytorch#134373);
# older builds hold 110, 64, 48, 36 tensors and 320 chunks: the count below is the fewer launches.
MTA_CHUNK_ELEMENTS = 65536
MTA_MAX_TENSORS = {1: 770, 2: 448, 3: 336, 4: 252}
MTA_MAX_CHUNKS = 2240
# The foreach kernels of each implementation's step, by their lists' depth (torch/optim/adam.py):
# - fused AdamW: _foreach_add_ of the device step counters, then _fused_adamw_ over param, grad, exp_avg, exp_avg_sq.
# - foreach AdamW (_multi_tensor_adam): the weight decay's _foreach_mul_ of the params, _foreach_lerp_ of exp_avg
#   toward the grads, _foreach_mul_ and _foreach_addcmul_ of exp_avg_sq, _foreach_sqrt, _foreach_div_ and
#   _foreach_add_ building the denominator, _foreach_addcdiv_ of the params.
# - SGD without momentum: _foreach_add_ of the scaled grads to the params. RMSprop and Adagrad: a square average, its
#   sqrt, the addcdiv.
FOREACH_DEPTHS = {"fused": (1, 4), "foreach": (1, 2, 1, 3, 2, 1, 1, 3), "sgd": (2,), "one_state": (3, 2, 3)}
# Host visits per trainable tensor: AdamW.step's _init_group walks every parameter in Python (its grad, its state,
# five list appends; pytorch/pytorch#108090 measured it at a third of step() on models with many tensors); the foreach
# AdamW also builds its bias corrections and step sizes in Python lists per tensor (a second visit). bitsandbytes'
# optimizers (8-bit, paged) step each tensor in a Python loop and one kernel per tensor (Optimizer8bit.update_step);
# transformers' Adafactor runs about fifteen eager ops per tensor in its Python loop (optimization.py, Adafactor.step).
HOST_VISITS = {"fused": 1, "foreach": 2, "sgd": 1, "one_state": 1, "per_tensor": 1}
ADAFACTOR_OPS_PER_TENSOR = 15
# The clip: torch's _get_total_norm groups the gradients (one visit each), _foreach_norm (depth 1), a stack of the
# norms and their norm; clip_coef's division, the clamp, _foreach_mul_ (depth 1); the Trainer reads the norm back with
# .item() (_get_grad_norm), which waits for the device. model.zero_grad(set_to_none=True) visits every parameter.
CLIP_OPS = 5


@dataclass(frozen=True)
class OptimizerWork:
    """What one optimizer step asks: `step_*` of optimizer.step() alone, the rest of the clip and zero_grad around it."""

    step_bytes: float
    step_launches: float
    step_visits: float
    clip_bytes: float
    clip_launches: float
    clip_visits: float


def trainable_tensors(arch: ModelArchitecture, train: TrainingConfig) -> int:
    """Parameter tensors the optimizer steps: LoRA's A and B of every adapted linear, or every tensor of the model."""
    if train.uses_lora:
        return 2 * len(arch.lora_linears(train.lora_targets)) * arch.num_layers
    return parameter_tensors(arch)


def parameter_tensors(arch: ModelArchitecture) -> int:
    """Every parameter tensor of the model (tied embeddings once): each linear's weight and bias, each norm's."""
    family = arch.family
    norm = 2 if family.layer_norm_bias else 1
    per_layer = (sum(1 + int(lin.bias) for lin in arch.layer_linears())
                 + norm * (family.norms_per_layer + (2 if family.qk_norm else 0)))
    head = 0 if arch.tie_word_embeddings else 1 + int(family.lm_head_bias)
    return arch.num_layers * per_layer + 1 + norm + head


def _kind(opt: Optimizer) -> str:
    if opt.is_8bit or opt in (Optimizer.paged_adamw_32bit, Optimizer.lion_32bit):
        return "per_tensor"
    if opt is Optimizer.adamw_torch_fused:
        return "fused"
    if opt is Optimizer.sgd:
        return "sgd"
    if opt is Optimizer.adafactor:
        return "adafactor"
    if opt in (Optimizer.rmsprop, Optimizer.adagrad):
        return "one_state"
    return "foreach"


def mta_launches(tensors: float, elements: float, depth: int) -> float:
    """Kernel launches of one foreach op over `tensors` tensors of `elements` elements in all."""
    if tensors <= 0:
        return 0.0
    chunks = elements / MTA_CHUNK_ELEMENTS + tensors
    return max(math.ceil(tensors / MTA_MAX_TENSORS[depth]), math.ceil(chunks / MTA_MAX_CHUNKS))


def optimizer_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Bytes one optimizer step moves on one GPU, gradient clipping included (ZeRO and FSDP step their shard)."""
    work = optimizer_work(arch, train)
    return work.step_bytes + work.clip_bytes


@remembered_work
def optimizer_work(arch: ModelArchitecture, train: TrainingConfig) -> OptimizerWork:
    """The step's, the clip's and zero_grad's bytes, launches and host visits on one GPU (ZeRO and FSDP step their
    shard: a rank's shard is a share of every tensor's elements, its tensors as many)."""
    trainable = m.trainable_params(arch, train)
    width = m.sizes(train).trainable
    opt, kind = train.optim, _kind(train.optim)
    if opt.is_8bit:
        per_param = BNB_8BIT_BYTES_PER_PARAM["one_state" if "lion" in opt.value else "two_states"]
    elif kind == "per_tensor":  # the paged 32-bit AdamW and Lion: bitsandbytes' kernels make the fused passes
        per_param = (OPTIMIZER_ACCESSES["fused"] if opt is Optimizer.paged_adamw_32bit
                     else OPTIMIZER_ACCESSES["one_state"]) * 4
    elif kind == "one_state":
        per_param = OPTIMIZER_ACCESSES["one_state"] * 4
    else:
        per_param = OPTIMIZER_ACCESSES[kind] * width
    elements = m.shard_bytes(train, trainable, 1)
    tensors = trainable_tensors(arch, train)
    if kind in ("per_tensor", "adafactor"):
        launches = tensors * (ADAFACTOR_OPS_PER_TENSOR if kind == "adafactor" else 1)
        visits = tensors
    else:
        launches = sum(mta_launches(tensors, elements, depth) for depth in FOREACH_DEPTHS[kind])
        visits = tensors * HOST_VISITS[kind]
    grads = m.shard_bytes(train, trainable, 2)
    clip_launches = 2 * mta_launches(tensors, grads, 1) + CLIP_OPS
    return OptimizerWork(step_bytes=elements * per_param, step_launches=launches, step_visits=visits,
                         clip_bytes=grads * width * CLIP_GRAD_ACCESSES, clip_launches=clip_launches,
                         clip_visits=tensors + parameter_tensors(arch))
