"""FSDP2 on one rank of N, as accelerate prepares a model for TRL's fsdp2 config: pure arithmetic, held to the sharded
trace (vram_planner/tracing/sharded.py runs torch's own fully_shard; benchmarks/sharded.py prints both).

What accelerate 1.x does (accelerate/utils/fsdp_utils.py, `fsdp2_prepare_model`), with trl/accelerate_configs/fsdp2.yaml
(TRANSFORMER_BASED_WRAP, reshard_after_forward, mixed_precision bf16):
- under mixed precision every trainable parameter is upcast to float32 before sharding ("Upcast to fp32 master
  weights"): the shards, their gradients and AdamW's states are float32, 16 bytes per trainable parameter over N;
- `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`: layers are gathered and their gradients made in bf16;
- one unit per decoder layer (resharded after its forward and its backward); the final norm and the output
  projection (and the embedding when tied) one unit kept gathered from its forward to its backward; an untied
  embedding its own unit.
FSDP2 keeps a unit's all-gather output until the next unit's gather (`AllGatherState` in
torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py), so a gathered unit costs twice its bf16 bytes while the
next one gathers. TRL generates with the sharded model (trl/distributed.py: `summon_full_params` is FSDP1 only):
each layer is gathered per decoding step, never the whole model.

Every storage in whole 512-byte blocks (model/blocks.py), as torch 2.13's FSDP2 allocates them
(torch/distributed/fsdp/_fully_shard/):
- each parameter is sharded on its own along dim 0 into N chunks, every rank's padded to the first, largest one
  (`torch.chunk`: ceil(rows / N) rows), and the padded shard is a storage of its own (_fsdp_param.py:298-316);
  rank 0, whose bytes the planner counts, holds exactly that padded shard;
- a unit's gather makes one flat all-gather output of N padded shards (_fsdp_collectives.py:349-353) and copies
  each parameter out of it into a storage of its own of N padded shards (`alloc_all_gather_outputs`,
  _fsdp_collectives.py:463, _fsdp_param.py:621-628);
- a unit's reduce-scatter reads a flat copy of its parameters' whole gradients and leaves one flat reduced shard,
  cast to the shards' dtype, whose views are the parameters' gradients (_fsdp_collectives.py:592-611, 689-713).
"""

from __future__ import annotations

from collections.abc import Callable

from vram_planner.model import blocks
from vram_planner.model.architecture import Linear, ModelArchitecture
from vram_planner.model.spec import DTYPE_BYTES, TrainingConfig

FP32_BYTES = 4
# A gathered unit and the all-gather output it was copied out of, alive together until the next unit's gather.
GATHER_COPIES = 2
# A layer's copy-out in the forward: its gathered parameters, its all-gather output and the previous layer's, which
# `wait_for_unshard` drops from the shared state but holds in a local until the copy-out returns
# (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py:430-432).
FORWARD_GATHER_LAYERS = 3

# A parameter tensor of a unit: (rows, elements per row, whether it trains)
Tensor = tuple[int, int, bool]


def master_bytes(train: TrainingConfig) -> int:
    """Bytes per trainable parameter in the shards (and their gradients and optimizer states); PEFT's adapters are
    float32 whatever the policy."""
    return FP32_BYTES if train.mixed_precision != "no" or train.uses_lora else DTYPE_BYTES[train.dtype]


def gathered_bytes_per_param(train: TrainingConfig) -> int:
    """The dtype layers are gathered in: MixedPrecisionPolicy's param_dtype, else the stored one."""
    return 2 if train.mixed_precision != "no" else DTYPE_BYTES[train.dtype]


def offloaded(train: TrainingConfig) -> bool:
    """FSDP2's CPUOffloadPolicy: the shards, their gradients and the optimizer step on the host (model/offload.py)."""
    return train.offload_param == "cpu"


def _stored_bytes(train: TrainingConfig, trainable: bool) -> int:
    """A shard's bytes per element: trainable parameters as float32 masters, frozen ones (a LoRA base) as loaded."""
    return master_bytes(train) if trainable else DTYPE_BYTES[train.dtype]


def _shard(tensor: Tensor, gpus: int) -> int:
    """Rank 0's padded shard of a tensor, in elements: ceil(rows / N) rows."""
    rows, width, _ = tensor
    return -(-rows // gpus) * width


def layer_tensors(arch: ModelArchitecture, train: TrainingConfig) -> list[Tensor]:
    """One decoder layer's unit, its LoRA adapters included."""
    base = [(rows, width, not train.uses_lora) for rows, width in blocks.layer_shapes(arch)]
    adapters = [(rows, width, True) for rows, width in blocks.lora_layer_shapes(arch, train)] if train.uses_lora else []
    return base + adapters


def embedding_tensors(arch: ModelArchitecture, train: TrainingConfig) -> list[Tensor]:
    """An untied embedding's own unit (none when tied: the tail holds it)."""
    return [] if arch.tie_word_embeddings else [(arch.vocab_size, arch.hidden_size, not train.uses_lora)]


def tail_tensors(arch: ModelArchitecture, train: TrainingConfig) -> list[Tensor]:
    """The unit kept gathered between forward and backward: the final norm and the output projection, with the
    embedding when it is tied to it."""
    tied = [(arch.vocab_size, arch.hidden_size)] if arch.tie_word_embeddings else []
    return [(rows, width, not train.uses_lora) for rows, width in tied + blocks.tail_shapes(arch)]


def _units(arch: ModelArchitecture, train: TrainingConfig, idle: bool = True) -> list[list[Tensor]]:
    """Every unit: the layers, the embedding, the tail, and (`idle`) the root with what is left, a vision tower, idle
    in text-only GRPO: it gets no gradient, so neither a reduced shard nor optimizer states (AdamW makes them for
    parameters with a gradient only)."""
    vision = [[(arch.vision_params, 1, not train.uses_lora)]] if arch.vision_params and idle else []
    return [*[layer_tensors(arch, train)] * arch.num_layers, embedding_tensors(arch, train),
            tail_tensors(arch, train), *vision]


def shard_weight_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The policy's shards on one rank, each in whole blocks, and the rotary buffers every rank keeps whole. Under
    CPU offload the shards are on the host, and a unit's shards are copied to the GPU for its all-gather
    (`all_gather_inputs`, torch/distributed/fsdp/_fully_shard/_fsdp_param.py:897-900): the largest unit's shard is
    counted."""
    if offloaded(train):
        n = train.num_gpus
        return max(sum(_shard(t, n) for t in unit) for unit in _units(arch, train)) * master_bytes(train)
    return _stored_shard_bytes(arch, train, lambda t: _stored_bytes(train, t[2]))


def reference_shard_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The reference model's shards (a reference exists without PEFT only), frozen as loaded, and its own rotary
    buffers."""
    return _stored_shard_bytes(arch, train, lambda t: DTYPE_BYTES[train.dtype])


def _stored_shard_bytes(arch: ModelArchitecture, train: TrainingConfig,
                        element_bytes: Callable[[Tensor], int]) -> float:
    """Every parameter's padded shard at `element_bytes` of its tensor, each its own storage in whole blocks, and the
    rotary buffers every rank keeps whole."""
    return sum(blocks.blocks(_shard(t, train.num_gpus) * element_bytes(t)) for unit in _units(arch, train)
               for t in unit) + blocks.rotary_buffer_bytes(arch, train)


def trainable_shard_bytes(arch: ModelArchitecture, train: TrainingConfig, per_param: float) -> float:
    """Every trainable parameter's padded shard in `per_param` bytes, each a storage of its own in whole blocks: an
    optimizer state made like the shard (`torch.zeros_like` of its local tensor)."""
    return sum(blocks.blocks(_shard(t, train.num_gpus) * per_param) for unit in _units(arch, train, idle=False)
               for t in unit if t[2])


def _reduced_bytes(unit: list[Tensor], train: TrainingConfig) -> float:
    """A unit's reduced gradient: one flat shard in the shards' dtype."""
    return blocks.blocks(sum(_shard(t, train.num_gpus) for t in unit if t[2]) * master_bytes(train))


def shard_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Every unit's reduced gradient on this rank's GPU: none under CPU offload, which copies each reduced shard to
    the host (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:711-743)."""
    return 0 if offloaded(train) else sum(_reduced_bytes(unit, train) for unit in _units(arch, train, idle=False))


def gathered_unit_bytes(unit: list[Tensor], train: TrainingConfig, copies: int = 1) -> float:
    """A unit gathered: its parameters (`copies` 1), with its all-gather output (2), and a previous unit's of the
    same size (3)."""
    if not copies:
        return 0
    per_param, n = gathered_bytes_per_param(train), train.num_gpus
    params = sum(blocks.blocks(_shard(t, n) * n * per_param) for t in unit)
    return params + (copies - 1) * blocks.blocks(sum(_shard(t, n) for t in unit) * n * per_param)


def layer_unit_bytes(arch: ModelArchitecture, train: TrainingConfig, copies: int = 1) -> float:
    """One decoder layer gathered (`gathered_unit_bytes`)."""
    return gathered_unit_bytes(layer_tensors(arch, train), train, copies)


def tail_unit_bytes(arch: ModelArchitecture, train: TrainingConfig, copies: int = 1) -> float:
    """The tail gathered (`gathered_unit_bytes`)."""
    return gathered_unit_bytes(tail_tensors(arch, train), train, copies)


def embedding_unit_bytes(arch: ModelArchitecture, train: TrainingConfig, copies: int = 1) -> float:
    """An untied embedding's own unit gathered (none when tied: the tail holds it)."""
    return gathered_unit_bytes(embedding_tensors(arch, train), train, copies)


def embedding_shard_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """This rank's reduced gradient of an untied embedding, in the shards' dtype."""
    return _reduced_bytes(embedding_tensors(arch, train), train)


def tail_shard_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """This rank's reduced gradient of the tail, in the shards' dtype."""
    return _reduced_bytes(tail_tensors(arch, train), train)


def layer_shard_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """This rank's reduced gradient of one layer, in the shards' dtype."""
    return _reduced_bytes(layer_tensors(arch, train), train)


def reference_gathered_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The reference model while it scores: TRL's prepare_fsdp makes it one unit (trl/models/utils.py), so the whole
    model is gathered, with its all-gather output."""
    return gathered_unit_bytes([t for unit in _units(arch, train) for t in unit], train, GATHER_COPIES)


def gathered_bytes(arch: ModelArchitecture, train: TrainingConfig, layer_copies: int, tail_copies: int) -> float:
    """Gathered parameters alive beside the shards: a decoder unit's `layer_copies` and the tail's `tail_copies`
    (`gathered_unit_bytes`)."""
    return layer_unit_bytes(arch, train, layer_copies) + tail_unit_bytes(arch, train, tail_copies)


def _own_forward_roots(arch: ModelArchitecture, train: TrainingConfig) -> bool:
    """Whether each unit frees its all-gather output at its own post-forward in generation, never beside the next
    unit's gather: PEFT's generate() runs the transformers model inside the FSDP root, so the first unit to run
    begins the forward pass and frees the output as that forward ends (torch/distributed/fsdp/_fully_shard/
    _fsdp_state.py:333-343), then the next unit begins one. A tied tail (the embedding, the final norm and the output
    projection, one unit) ends its forward only at the LM head, holding every layer's pass as under the root."""
    return train.uses_lora and not arch.tie_word_embeddings


def generation_gathered_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """At the prefill's first gathers (`decoding_gathered_bytes` for later steps). The tail, once gathered, stays
    gathered across decoding steps (no backward reshards it). A tied embedding is in the tail, whose all-gather
    output the first gather then also holds, beside the first layer and its own; an untied embedding is gathered
    with its all-gather output, which stays beside the first layer's gather; later layers gather beside the
    previous layer's all-gather output; unless each unit frees its own (`_own_forward_roots`)."""
    two_layers = layer_unit_bytes(arch, train, GATHER_COPIES)
    embedding = embedding_unit_bytes(arch, train, GATHER_COPIES)
    if _own_forward_roots(arch, train):
        return tail_unit_bytes(arch, train) + max(embedding, two_layers)
    if not embedding:
        return tail_unit_bytes(arch, train, GATHER_COPIES) + two_layers
    output = embedding - embedding_unit_bytes(arch, train)
    three_layers = layer_unit_bytes(arch, train, FORWARD_GATHER_LAYERS)
    return tail_unit_bytes(arch, train) + max(embedding, output + two_layers, three_layers)


def decoding_gathered_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """At a later decoding step: the tail was gathered by the prefill and stays, so a tied embedding needs no gather
    and no all-gather output; each layer gathers beside the previous layer's all-gather output. An untied embedding
    is gathered anew at every step."""
    if embedding_unit_bytes(arch, train):
        return generation_gathered_bytes(arch, train)
    return tail_unit_bytes(arch, train) + layer_unit_bytes(arch, train, FORWARD_GATHER_LAYERS)


def prefill_layer_gathered_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Inside a layer's forward in the prefill: the layer and its all-gather output (the previous one's was freed by
    its copy-out), and the tail when it holds a tied embedding (an untied tail is gathered at the LM head)."""
    tail = tail_unit_bytes(arch, train) if arch.tie_word_embeddings else 0
    return tail + layer_unit_bytes(arch, train, GATHER_COPIES)


def decoding_layer_gathered_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Inside a layer's forward at a later decoding step: the tail, gathered since the prefill, the layer and its
    all-gather output."""
    return tail_unit_bytes(arch, train) + layer_unit_bytes(arch, train, GATHER_COPIES)


def lm_head_gathered_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """At the LM head: the tail; in the prefill an untied tail's all-gather output, kept to the end of its forward,
    at later steps the last layer's, which the forward's end frees (_fsdp_state.py:333-343; none where each unit
    frees its own, `_own_forward_roots`)."""
    tail = tail_unit_bytes(arch, train)
    tail_output = 0 if arch.tie_word_embeddings else tail_unit_bytes(arch, train, GATHER_COPIES) - tail
    own = _own_forward_roots(arch, train)
    layer_output = 0 if own else layer_unit_bytes(arch, train, GATHER_COPIES) - layer_unit_bytes(arch, train)
    return tail + max(tail_output, layer_output)


def training_gathered_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Around the LM head in the loss forward and backward: the tail, kept gathered, and the last layer, gathered again
    for its backward."""
    return gathered_bytes(arch, train, 1, 1)


def accumulated_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """What the micro-batches before the last leave: transformers' Trainer runs them under accelerate's no_sync
    (FSDP2's set_requires_gradient_sync(False)), so each rank keeps every gradient whole, in bf16, unreduced, each
    parameter's its own storage."""
    return sum(whole_gradient_bytes(unit, train) for unit in _units(arch, train, idle=False))


def whole_gradient_bytes(tensors: list[Tensor], train: TrainingConfig) -> float:
    """The trainable `tensors`' whole gradients as autograd makes them for the gathered parameters, in the gather
    dtype, each a storage of its own."""
    per_param = gathered_bytes_per_param(train)
    return sum(blocks.blocks(rows * width * per_param) for rows, width, trains in tensors if trains)


def mlp_output_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """A layer's MLP output projection's whole gradients (weight and bias), the first that the layer's backward
    makes, as `whole_gradient_bytes`."""
    last = arch.layer_linears()[-1]
    shapes = [(last.out_features, last.in_features)] + ([(last.out_features, 1)] if last.bias else [])
    return whole_gradient_bytes([(rows, width, not train.uses_lora) for rows, width in shapes], train)


def reduce_scatter_input_bytes(tensors: list[Tensor], train: TrainingConfig) -> float:
    """The flat copy of a unit's whole gradients, padded, that its reduce-scatter reads (in the reduce dtype)."""
    padded = sum(_shard(t, train.num_gpus) for t in tensors if t[2])
    return blocks.blocks(padded * train.num_gpus * gathered_bytes_per_param(train))


def tail_reduction_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The tail's reduce-scatter, the last of the backward: its whole gradients, the flat padded copy reduce-scatter
    reads, and this rank's reduced shard in the reduce dtype (_fsdp_collectives.py:592-615)."""
    tail = tail_tensors(arch, train)
    padded = sum(_shard(t, train.num_gpus) for t in tail if t[2])
    return (whole_gradient_bytes(tail, train) + reduce_scatter_input_bytes(tail, train)
            + blocks.blocks(padded * gathered_bytes_per_param(train)))


def vllm_sync_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """What a rank holds beside its shards while TRL 1.16 pushes the weights to vLLM (`_iter_named_params` in
    trl/generation/vllm_generation.py): PEFT's merge_adapter on the sharded model first (its `gather_params` is a
    no-op under FSDP), then each parameter whole, one at a time; unmerge_adapter after, as the merge."""
    return max(_pushed_bytes(arch, train), peft_merge_bytes(arch, train))


def _pushed_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """`_iter_fsdp2_params` all-gathers each parameter with `full_tensor()`, in named_parameters order, in its shard's
    dtype (float32 masters, a frozen base as loaded), N padded shards (torch/distributed/tensor/placement_types.py:
    591-617), and the loop that loads it into vLLM (`sync_weights`) still holds the one before while the next is
    gathered: the largest two in a row. PEFT's adapters are not pushed (merged already). A layer's norms, which some
    families register before its linears, sit here after them, beside no larger neighbour than they have."""
    n, per_param = train.num_gpus, _stored_bytes(train, not train.uses_lora)
    pushed = [blocks.blocks(-(-rows // n) * n * width * per_param) for rows, width in blocks.parameter_shapes(arch)]
    return max((a + b for a, b in zip(pushed, pushed[1:])), default=sum(pushed))


def peft_merge_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """merge_adapter, one adapted linear at a time (LoraLayer.get_delta_weight, peft 0.21): lora_B @ lora_A on
    DTensors sharded on dim 0 all-gathers lora_A whole (r x in) and leaves the product sharded like the weight
    (ceil(out / N) rows), then its scaled copy beside it, in the adapters' float32, added into the weight's shard
    in place."""
    if not train.uses_lora:
        return 0
    n, r, per_param = train.num_gpus, train.lora_r or 0, master_bytes(train)

    def merging(lin: Linear) -> float:
        product = blocks.blocks(-(-lin.out_features // n) * lin.in_features * per_param)
        return product + max(blocks.blocks(-(-r // n) * n * lin.in_features * per_param), product)

    return max((merging(lin) for lin in arch.lora_linears(train.lora_targets)), default=0)
