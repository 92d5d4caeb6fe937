"""Tensors as CUDA counts them: every storage in whole 512-byte blocks, and the small tensors a model carries.

`torch.cuda.memory_allocated` (and the trace, which counts as it does) rounds each storage up to the caching
allocator's kMinBlockSize. A large model's tensors are whole blocks already; a norm's weight, a bias, an optimizer's
`step` scalar or a rotary table is not, and on a small model they weigh percents. The element counts here follow
`ModelArchitecture.params` tensor by tensor (a test holds the two equal for every catalog model).
"""

from __future__ import annotations

from vram_planner.allocator.sizes import K_MIN_BLOCK_SIZE
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.spec import Optimizer, TrainingConfig

FP32_BYTES = 4
# Rotary embeddings a model's forward runs, each with its own frequencies and its own cos and sin: gemma 3 one per kind
# of layer (global and sliding, with their own base frequencies; 5.x keeps them as two sets of buffers of one module)
ROTARY_EMBEDDINGS = {"gemma3_text": 2, "gemma3": 2}


def blocks(n_bytes: float) -> float:
    """`n_bytes` rounded up to whole blocks (an empty storage takes none)."""
    return -(-n_bytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def layer_shapes(arch: ModelArchitecture) -> list[tuple[int, int]]:
    """(rows, elements per row) of one decoder layer's parameter tensors: a linear's weight is [out, in]."""
    f = arch.family
    norm = [(arch.hidden_size, 1)] * (2 if f.layer_norm_bias else 1)  # weight (and LayerNorm's bias)
    layer = [t for lin in arch.layer_linears()
             for t in ([(lin.out_features, lin.in_features)] + ([(lin.out_features, 1)] if lin.bias else []))]
    return layer + norm * f.norms_per_layer + ([(arch.head_dim, 1)] * 2 if f.qk_norm else [])


def tail_shapes(arch: ModelArchitecture) -> list[tuple[int, int]]:
    """The final norm and what the output projection adds to the embedding (an untied weight, a bias)."""
    norm = [(arch.hidden_size, 1)] * (2 if arch.family.layer_norm_bias else 1)
    head = [] if arch.tie_word_embeddings else [(arch.vocab_size, arch.hidden_size)]
    return norm + head + ([(arch.vocab_size, 1)] if arch.family.lm_head_bias else [])


def parameter_shapes(arch: ModelArchitecture) -> list[tuple[int, int]]:
    """(rows, elements per row) of every parameter tensor (tied embeddings once; a vision tower as one)."""
    vision = [(arch.vision_params, 1)] if arch.vision_params else []
    return [(arch.vocab_size, arch.hidden_size), *layer_shapes(arch) * arch.num_layers, *tail_shapes(arch), *vision]


def parameter_tensors(arch: ModelArchitecture) -> list[int]:
    """The element count of every parameter tensor (tied embeddings once; a vision tower as one)."""
    return [rows * width for rows, width in parameter_shapes(arch)]


def lora_layer_shapes(arch: ModelArchitecture, train: TrainingConfig) -> list[tuple[int, int]]:
    """lora_A [r, in] and lora_B [out, r] of every adapted linear of one layer."""
    return adapter_shapes(arch, train.lora_r, train.lora_targets)


def adapter_shapes(arch: ModelArchitecture, lora_r: int | None,
                   lora_targets: list[str] | None) -> list[tuple[int, int]]:
    """lora_A [r, in] and lora_B [out, r] of every linear of one layer that `lora_targets` adapts at rank `lora_r`."""
    r = lora_r or 0
    return [s for lin in arch.lora_linears(lora_targets) for s in ((r, lin.in_features), (lin.out_features, r))]


def lora_tensors(arch: ModelArchitecture, train: TrainingConfig) -> list[int]:
    """lora_A (r x in) and lora_B (out x r) of every adapted linear of every layer."""
    return [rows * width for rows, width in lora_layer_shapes(arch, train)] * arch.num_layers


def trainable_tensors(arch: ModelArchitecture, train: TrainingConfig) -> list[int]:
    return lora_tensors(arch, train) if train.uses_lora else parameter_tensors(arch)


def rounding_bytes(tensors: list[int], bytes_per_element: float) -> float:
    """What whole blocks add to `tensors` of `bytes_per_element` over their elements' bytes."""
    return sum(blocks(n * bytes_per_element) - n * bytes_per_element for n in tensors)


def rotary_buffer_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Rotary embeddings' float32 inv_freq buffers (head_dim / 2 frequencies), one block each for any head up to 256
    wide: transformers registers inv_freq, and from 5.0 original_inv_freq as a clone of it (before 5.0 an alias of
    the same tensor; profiles/transformers.toml rotary_buffers)."""
    tables = ROTARY_EMBEDDINGS.get(arch.model_type, 1) * train.transformers.rotary_buffers
    return tables * blocks(arch.head_dim // 2 * FP32_BYTES)


def optimizer_step_scalars_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Fused AdamW's per-parameter `step`, a float32 scalar on the parameter's device (one block each): torch hosts
    it on the CPU unless the optimizer is fused or capturable (torch/optim/adam.py:166-176, torch 2.13)."""
    if train.optim is not Optimizer.adamw_torch_fused:
        return 0
    return len(trainable_tensors(arch, train)) * blocks(FP32_BYTES)
