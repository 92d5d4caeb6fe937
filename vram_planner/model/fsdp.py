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
"""

from __future__ import annotations

from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.spec import DTYPE_BYTES, TrainingConfig

FP32_BYTES = 4
# A gathered unit and the all-gather output it was copied out of, alive together until the next unit's gather.
GATHER_COPIES = 2
# A layer's copy-out in the forward: its gathered parameters, its all-gather output and the previous layer's.
FORWARD_GATHER_LAYERS = 3


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


def shard_gradient_bytes_per_param(train: TrainingConfig) -> float:
    """A reduced gradient shard's bytes per parameter of the unit on this rank's GPU: none under CPU offload, which
    copies each reduced shard to the host (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:711-743)."""
    return 0 if offloaded(train) else master_bytes(train) / train.num_gpus


def shard_weight_bytes(arch: ModelArchitecture, train: TrainingConfig, trainable: int) -> float:
    """The policy's shards on one rank: trainable parameters as float32 masters, frozen ones (a LoRA base) as loaded;
    PEFT's adapters are float32 already. Under CPU offload the shards are on the host, and a unit's shards are copied
    to the GPU for its all-gather (`all_gather_inputs`, torch/distributed/fsdp/_fully_shard/_fsdp_param.py:897-900):
    the largest unit's shard is counted."""
    if offloaded(train):
        largest = max(layer_unit_params(arch, train, trainable), tail_params(arch), arch.embedding_params)
        return largest * master_bytes(train) / train.num_gpus
    if train.uses_lora:
        stored = arch.params * DTYPE_BYTES[train.dtype] + trainable * master_bytes(train)
    else:
        stored = arch.params * master_bytes(train)
    return stored / train.num_gpus


def tail_params(arch: ModelArchitecture) -> int:
    """The unit kept gathered between forward and backward: the final norm and the output projection, with the
    embedding when it is tied to it."""
    bias = arch.vocab_size if arch.family.lm_head_bias else 0
    return arch.norm_params + arch.vocab_size * arch.hidden_size + bias


def layer_unit_params(arch: ModelArchitecture, train: TrainingConfig, trainable: int) -> int:
    """One decoder layer's unit, its LoRA adapters included."""
    adapters = trainable // max(arch.num_layers, 1) if train.uses_lora else 0
    return arch.layer_params + adapters


def layer_unit_bytes(arch: ModelArchitecture, train: TrainingConfig, trainable: int) -> float:
    """One decoder layer gathered."""
    return layer_unit_params(arch, train, trainable) * gathered_bytes_per_param(train)


def embedding_unit_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """An untied embedding's own unit gathered (none when tied: the tail holds it)."""
    return 0 if arch.tie_word_embeddings else arch.embedding_params * gathered_bytes_per_param(train)


def embedding_shard_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """This rank's reduced gradient of an untied embedding, in the shards' dtype."""
    return 0 if arch.tie_word_embeddings else arch.embedding_params * shard_gradient_bytes_per_param(train)


def reference_gathered_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The reference model while it scores: TRL's prepare_fsdp makes it one unit (trl/models/utils.py), so the whole
    model is gathered, with its all-gather output."""
    return GATHER_COPIES * arch.params * gathered_bytes_per_param(train)


def tail_shard_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """This rank's reduced gradient of the tail, in the shards' dtype."""
    return tail_params(arch) * shard_gradient_bytes_per_param(train)


def gathered_bytes(arch: ModelArchitecture, train: TrainingConfig, trainable: int, layers: int,
                   tail_copies: int) -> float:
    """Gathered parameters alive beside the shards: `layers` decoder units' worth and `tail_copies` of the tail."""
    per_param = gathered_bytes_per_param(train)
    return (layers * layer_unit_params(arch, train, trainable) + tail_copies * tail_params(arch)) * per_param


def generation_gathered_bytes(arch: ModelArchitecture, train: TrainingConfig, trainable: int) -> float:
    """At the prefill's first gathers (`decoding_gathered_bytes` for later steps). The tail, once gathered, stays
    gathered across decoding steps (no backward reshards it). A tied embedding is in the tail, whose all-gather
    output the first gather then also holds, beside the first layer and its own; an untied embedding is gathered
    with its all-gather output, which stays beside the first layer's gather; later layers gather beside the
    previous layer's all-gather output."""
    layer = layer_unit_bytes(arch, train, trainable)
    tail = tail_params(arch) * gathered_bytes_per_param(train)
    embedding = embedding_unit_bytes(arch, train)
    if not embedding:
        return GATHER_COPIES * (tail + layer)
    return tail + max(GATHER_COPIES * embedding, embedding + GATHER_COPIES * layer, FORWARD_GATHER_LAYERS * layer)


def decoding_gathered_bytes(arch: ModelArchitecture, train: TrainingConfig, trainable: int) -> float:
    """At a later decoding step: the tail was gathered by the prefill and stays, so a tied embedding needs no gather
    and no all-gather output; each layer gathers beside the previous layer's all-gather output. An untied embedding
    is gathered anew at every step."""
    if embedding_unit_bytes(arch, train):
        return generation_gathered_bytes(arch, train, trainable)
    tail = tail_params(arch) * gathered_bytes_per_param(train)
    return tail + FORWARD_GATHER_LAYERS * layer_unit_bytes(arch, train, trainable)


def training_gathered_bytes(arch: ModelArchitecture, train: TrainingConfig, trainable: int) -> float:
    """Around the LM head in the loss forward and backward: the tail, kept gathered, and the last layer, gathered again
    for its backward."""
    return gathered_bytes(arch, train, trainable, 1, 1)


def accumulated_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig, trainable: int) -> float:
    """What the micro-batches before the last leave: transformers' Trainer runs them under accelerate's no_sync
    (FSDP2's set_requires_gradient_sync(False)), so each rank keeps every gradient whole, in bf16, unreduced."""
    return trainable * gathered_bytes_per_param(train)


def tail_reduction_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The tail's reduce-scatter, the last of the backward: its whole gradient, the flat copy reduce-scatter reads,
    and this rank's reduced shard."""
    per_param = gathered_bytes_per_param(train)
    return tail_params(arch) * per_param * (2 + 1 / train.num_gpus)
