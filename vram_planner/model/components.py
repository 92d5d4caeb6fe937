"""Tensor bytes of each memory component, as pure functions of the architecture and the training config.

Symbols as in ../shared/design/grpo-memory.md: P params, T trainable params, h hidden size, n layers, a heads,
k kv heads, d head dim, i MLP width, V vocab, p prompt tokens, c completion tokens, L = p + c,
B per_device_train_batch_size, S steps_per_generation. Every function returns bytes on one GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vram_planner.model import blocks, fsdp, sampling, zero
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.calibration import Calibration
from vram_planner.model.memo import remembered_work
from vram_planner.model.spec import DTYPE_BYTES, Optimizer, TrainingConfig

FP32_BYTES = 4
# bitsandbytes 4-bit: two weights per byte, one absmax per block of 64 weights; double quantisation stores the
# absmax in 8 bits with one fp32 constant per 256 blocks (QLoRA paper, Dettmers et al. 2023, section 2).
NF4_BYTES_PER_PARAM = 0.5
NF4_ABSMAX_BYTES_PER_PARAM = 4 / 64
NF4_DOUBLE_QUANT_ABSMAX_BYTES_PER_PARAM = 1 / 64 + 4 / (64 * 256)
# bitsandbytes 0.50's 4-bit Linear multiplies through its custom op bitsandbytes::gemm_4bit, with or without grad
# (bnb.matmul_4bit, MatMul4Bit.forward; autograd/_functions.py): up to BNB_FUSED_MAX_ROWS rows (tokens of the batch)
# in one fused kernel that reads the packed weight, above them by dequantizing the weight and calling F.linear
# (backends/cuda/ops.py, _gemm_4bit_use_custom_cuda: "custom wins up to M=512" for weights of 4M elements or more, the
# other shapes and sm100 with tighter bounds, a simplification here; _dequant_linear_fallback).
BNB_FUSED_MAX_ROWS = 512
# ... and only where a weight's rows are whole quantization blocks (in_features a multiple of the blocksize, 64 as
# transformers quantizes): else it warns and dequantizes at any number of rows.
BNB_4BIT_BLOCKSIZE = 64
# bitsandbytes 8-bit optimizers keep 32-bit state for tensors smaller than this (min_8bit_size).
BNB_MIN_8BIT_SIZE = 4096
# Blockwise 8-bit state: one fp32 absmax per 256 values (bitsandbytes optim, block size 256).
BNB_8BIT_STATE_BYTES = 1 + 4 / 256
# ZeRO keeps an fp32 master copy of every trainable parameter (Rajbhandari et al. 2020, section 3: 12 bytes of
# optimizer-side state per parameter for mixed-precision Adam: master weights, momentum, variance).
MASTER_WEIGHT_BYTES = 4


@dataclass(frozen=True)
class Sizes:
    """Byte widths that depend on how the model is loaded and run."""

    weight: int  # stored dtype of the base weights
    compute: int  # autocast dtype of the matmuls and activations
    residual: int  # dtype of the residual stream between layers
    trainable: int  # dtype of the trainable parameters (and their gradients)


def sizes(train: TrainingConfig) -> Sizes:
    # DeepSpeed's bf16 engine casts the module to bf16; with 4-bit loading `dtype` is what bitsandbytes leaves
    # unquantised.
    weight = 2 if train.zero_stage is not None else DTYPE_BYTES[train.dtype]
    compute = weight if train.mixed_precision == "no" else 2
    if kbit_prepared_in_float32(train):
        # every unquantized weight float32, and a 4-bit linear's output cast back to its float32 input's dtype
        weight = compute = FP32_BYTES
    # PEFT upcasts adapters to fp32 (autocast_adapter_dtype=True); DeepSpeed's bf16 engine casts them with the module
    # (the sharded trace holds them in 2 bytes under ZeRO-2 and 3), TRL 0.26 and later cast them to bf16 over a 4-bit
    # base (TrlRelease.qlora_setup).
    if train.uses_lora:
        bf16_over_4bit = train.load_in_4bit and train.release.qlora_setup == "bf16_adapters"
        trainable = 2 if (bf16_over_4bit or train.zero_stage is not None) else FP32_BYTES
    else:
        trainable = weight
    if train.fsdp and train.mixed_precision != "no":
        # FSDP2 computes with its layers gathered in bf16 and makes their gradients in bf16 (model/fsdp.py); the
        # float32 shards are counted there
        gathered = fsdp.gathered_bytes_per_param(train)
        return Sizes(weight=gathered, compute=compute, residual=gathered, trainable=gathered)
    return Sizes(weight=weight, compute=compute, residual=weight, trainable=trainable)


def autocast_casts_weights(train: TrainingConfig) -> bool:
    """Autocast makes compute-dtype copies of float32 weights (none under DeepSpeed or FSDP, which hold bf16)."""
    s = sizes(train)
    return (train.mixed_precision != "no" and s.weight != s.compute and not train.load_in_4bit
            and not train.fsdp and train.zero_stage is None)


def fused_4bit(rows: int | None, in_features: int | None = None) -> bool:
    """Whether bitsandbytes multiplies `rows` tokens by a 4-bit weight of `in_features` columns in its fused kernel
    (rows None: a backward, which dequantizes; in_features None: a weight of whole blocks)."""
    whole_blocks = in_features is None or in_features % BNB_4BIT_BLOCKSIZE == 0
    return rows is not None and rows <= BNB_FUSED_MAX_ROWS and whole_blocks


def dequantized_weight_bytes(arch: ModelArchitecture, train: TrainingConfig, rows: int | None) -> float:
    """bitsandbytes' copy of the largest 4-bit weight where it dequantizes one to multiply `rows` tokens (None: a
    backward, whose input gradient always dequantizes, MatMul4Bit.backward): F.dequantize_4bit writes the whole
    weight in the dtype it was loaded in (the quant state's), the matmul reads it, and it is freed when the call
    returns, so one is alive at a time, beside the layer's own tensors (a Llama-3.1-8B MLP weight: 112 MiB in
    bfloat16). The LM head stays 16-bit (transformers leaves the output embedding unquantized)."""
    if not train.load_in_4bit:
        return 0
    dequantized = [lin.in_features * lin.out_features for lin in arch.layer_linears()
                   if not fused_4bit(rows, lin.in_features)]
    return max(dequantized, default=0) * sizes(train).weight


def layer_weight_cast_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Compute-dtype copies of every decoder linear's weight, as autocast makes them during one forward.

    Autocast caches the cast of a leaf that requires grad until the forward's autocast context exits (no_grad or
    not); a frozen weight is cast anew on every use, and a linear keeps the cast for backward either way.
    """
    return arch.linear_params * sizes(train).compute if autocast_casts_weights(train) else 0


def adapter_cast_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Autocast's cached copies of float32 LoRA adapters."""
    s = sizes(train)
    if not train.uses_lora or train.mixed_precision == "no" or s.trainable == s.compute:
        return 0
    return trainable_params(arch, train) * s.compute


def lm_head_cast_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The compute-dtype copy of the output projection that generate()'s LM head makes under autocast: of float32
    weights, or of the float32 head of cast_lm_head_to_fp32, whose float32 linear autocast casts all the same."""
    head_in_fp32 = train.cast_lm_head_to_fp32 and train.mixed_precision != "no"
    casts = autocast_casts_weights(train) or head_in_fp32
    return arch.vocab_size * arch.hidden_size * sizes(train).compute if casts else 0


def head_tensors(arch: ModelArchitecture) -> list[int]:
    """The output projection's parameter tensors: its weight (the embedding's, when tied) and a bias."""
    return [arch.vocab_size * arch.hidden_size] + ([arch.vocab_size] if arch.family.lm_head_bias else [])


def head_upcast_bytes(arch: ModelArchitecture, train: TrainingConfig, per_param: float) -> float:
    """What GRPOConfig's cast_lm_head_to_fp32 adds to one copy of the head's tensors otherwise of `per_param` bytes
    (a weight, its gradient, an optimizer state): TRL casts the head module to float32 in place (grpo_trainer.py
    1.16.0:1014-1045), a tied embedding with it, so everything made after it is float32 too."""
    if not train.cast_lm_head_to_fp32 or per_param >= FP32_BYTES:
        return 0
    return sum(blocks.blocks(n * FP32_BYTES) - blocks.blocks(n * per_param) for n in head_tensors(arch))


def trained_head_upcast_bytes(arch: ModelArchitecture, train: TrainingConfig, per_param: float) -> float:
    """`head_upcast_bytes` of the head's gradient or an optimizer state (torch's optimizers keep each state in its
    parameter's dtype): only a trained head has them, none under LoRA."""
    return 0 if train.uses_lora else head_upcast_bytes(arch, train, per_param)


def trainable_params(arch: ModelArchitecture, train: TrainingConfig) -> int:
    if train.uses_lora:
        return arch.lora_params(train.lora_r or 0, train.lora_targets)
    return arch.params


def per_parameter_storages(train: TrainingConfig) -> bool:
    """Whether each parameter (and its gradient and states) is a storage of its own, in whole 512-byte blocks; DeepSpeed
    and FSDP keep flat buffers and shards instead."""
    return train.zero_stage is None and not train.fsdp


def _plain_weight_rounding(arch: ModelArchitecture, train: TrainingConfig, per_param: float) -> float:
    """Whole blocks of every parameter tensor, and the rotary embeddings' frequency buffers."""
    if not per_parameter_storages(train) or train.load_in_4bit:
        return 0
    return blocks.rounding_bytes(blocks.parameter_tensors(arch), per_param) + blocks.rotary_buffer_bytes(arch, train)


def _trainable_rounding(arch: ModelArchitecture, train: TrainingConfig, per_param: float) -> float:
    """Whole blocks of every trainable tensor (a weight, a gradient, an optimizer state) of `per_param` bytes."""
    if not per_parameter_storages(train):
        return 0
    return blocks.rounding_bytes(blocks.trainable_tensors(arch, train), per_param)


def shard_bytes(train: TrainingConfig, n_bytes: float, from_stage: int) -> float:
    """Split n_bytes across GPUs when the ZeRO stage (FSDP counts as 3) shards this kind of state."""
    stage = 3 if train.fsdp else (train.zero_stage or 0)
    return n_bytes / train.num_gpus if stage >= from_stage else n_bytes


def weight_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Policy weights (base plus LoRA adapters), as held on one GPU between generations."""
    s = sizes(train)
    if train.fsdp and not train.load_in_4bit:  # the shards (model/fsdp.py)
        return fsdp.shard_weight_bytes(arch, train)
    if train.zero_stage == 3 and train.offload_param == "cpu":  # the partitions live on the host (model/offload.py)
        base = 0
    elif train.load_in_4bit:
        absmax = (NF4_DOUBLE_QUANT_ABSMAX_BYTES_PER_PARAM if train.bnb_4bit_use_double_quant is not False
                  else NF4_ABSMAX_BYTES_PER_PARAM)
        base = arch.linear_params * (NF4_BYTES_PER_PARAM + absmax) + (arch.params - arch.linear_params) * s.weight
        base += head_upcast_bytes(arch, train, s.weight) + kbit_prepared_upcast_bytes(arch, train)
    elif train.zero_stage is not None:
        base = arch.params * 2  # DeepSpeed's bf16 engine casts the module to bf16
    else:
        base = (arch.params * s.weight + _plain_weight_rounding(arch, train, s.weight)
                + head_upcast_bytes(arch, train, s.weight))
    adapters = 0.0
    if train.uses_lora:
        adapters = trainable_params(arch, train) * s.trainable + _trainable_rounding(arch, train, s.trainable)
    return shard_bytes(train, base, 3) + shard_bytes(train, adapters, 3) + _zero3_gathered_bytes(arch, train)


def kbit_prepared_in_float32(train: TrainingConfig) -> bool:
    """A 4-bit model as TRL 0.22-0.25 set it up without bf16: PEFT's prepare_model_for_kbit_training leaves every
    unquantized weight float32 (the embedding and LM head too), so the norms' outputs, the residual stream and each
    4-bit linear's output (bitsandbytes casts it back to its input's dtype) are float32 (TrlRelease.qlora_setup)."""
    return (train.load_in_4bit and train.release.qlora_setup == "prepare_kbit_training"
            and train.mixed_precision != "bf16")


def kbit_prepared_upcast_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """What TRL 0.22-0.25's set-up of a 4-bit model adds to its unquantized weights: PEFT's
    prepare_model_for_kbit_training casts every one to float32, then under bf16 TRL puts the embedding and the LM head
    back to bfloat16 and leaves the norms (and the linears' biases) float32 (TrlRelease.qlora_setup)."""
    weight = sizes(train).weight
    if not train.load_in_4bit or train.release.qlora_setup != "prepare_kbit_training" or weight >= FP32_BYTES:
        return 0
    upcast = arch.params - arch.linear_params
    if train.mixed_precision == "bf16":
        upcast -= arch.embedding_params + arch.lm_head_params
    return upcast * (FP32_BYTES - weight)


def _zero3_gathered_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """ZeRO-3's largest layer gathered in 16 bits beside the partitions (model/zero.py)."""
    if train.zero_stage != 3:
        return 0
    return zero.largest_layer_params(arch) * zero.GATHERED_PARAM_BYTES


def zero3_persistent_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """ZeRO-3's persistent parameters, gathered again in 16 bits beside their partitions as its optimizer step ends
    (model/zero.py persistent_params, up to the config's threshold); none on one GPU, where a parameter's gather is a
    view of its partition (`NoGatherHandle`, partition_parameters.py:74)."""
    if train.zero_stage != 3 or train.num_gpus == 1:
        return 0
    threshold = zero.persistence_threshold_elements(arch, train)
    return zero.persistent_params(arch, train.lora_r, train.lora_targets, threshold) * zero.GATHERED_PARAM_BYTES


def zero3_fetch_buffer_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """ZeRO-3's all-gather buffer of the module it fetches inside a layer gathered layer by layer, beside the
    module's copied-out parameters (model/zero.py fetched_module_params), in 16 bits; none on one GPU, which gathers
    nothing (`NoGatherHandle`, partition_parameters.py:74)."""
    if train.zero_stage != 3 or train.num_gpus == 1:
        return 0
    return zero.fetched_module_params(arch) * zero.GATHERED_PARAM_BYTES


def zero3_prefetching_forward_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """What ZeRO-3 holds gathered beyond the largest layer, in 16 bits, at the peak of a forward its coordinator
    prefetches: the parameters up to max_live_parameters and the prefetch round in use twice, its flat all-gather
    buffer beside the parameters copied out of it (model/zero.py prefetching_forward_params); none on one GPU, which
    gathers nothing."""
    if train.zero_stage != 3 or train.num_gpus == 1:
        return 0
    prefetch = zero.prefetch_bucket_elements(arch, train)
    gathered = zero.prefetching_forward_params(arch, train.lora_r, train.lora_targets,
                                               prefetch) * zero.GATHERED_PARAM_BYTES
    return gathered - _zero3_gathered_bytes(arch, train)


def zero3_prefetched_weight_bytes(arch: ModelArchitecture, train: TrainingConfig, trace_kept: bool) -> float:
    """What ZeRO-3 holds gathered beyond the largest layer in a loss micro-batch of a step after the first whose
    coordinator has a complete trace of the loss and prefetches up to max_live_parameters (model/zero.py): when TRL's
    generation gathers the model, in every micro-batch where TRL keeps the trace across it (`trace_kept`, before 1.5),
    else from the second on; without that gather the generation's forwards leave a trace of their own, which the
    first micro-batch's backward finds wrong and invalidates (`zero3_follows_generation_trace`): the second
    records the loss's, the third on prefetch. Under PEFT the generation leaves none: from the second on (the sharded
    traces of a small Llama on 4 ranks, two and three micro-batches)."""
    if train.zero_stage != 3:
        return 0
    if zero3_follows_generation_trace(train):
        first_prefetching = 3
    else:
        first_prefetching = 1 if trace_kept and train.ds3_gather_for_generation else 2
    # counted in the micro-batches a generation round serves, which may span optimizer steps (the coordinator's trace
    # outlives them): steps_per_generation 3 with one micro-batch a step prefetches in the third step's loss
    if train.steps_per_generation_resolved < first_prefetching:
        return 0
    return zero3_whole_prefetch_bytes(arch, train)


def zero3_follows_generation_trace(train: TrainingConfig) -> bool:
    """Whether ZeRO-3's coordinator prefetches TRL's decoding steps and then a step's first loss forward, by the trace
    of the modules' order the generation's forwards record, when TRL's generation does not gather the model: the
    loss's forward runs them in the same order (the sharded trace of a small Llama on 4 ranks: its loss peaks in that
    forward), up to its backward, which the trace does not know. Not under PEFT, whose generate() runs the wrapped
    model below the root module whose forward hook ends the coordinator's step (`_start_of_forward_hook`,
    parameter_offload.py:304-306): the decoding steps' trace never completes, nothing is prefetched (the sharded trace
    of the same model with LoRA)."""
    return train.zero_stage == 3 and not train.ds3_gather_for_generation and not train.uses_lora


def zero3_whole_prefetch_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """ZeRO-3's prefetch up to max_live_parameters gathered in 16 bits (model/zero.py), beyond the largest layer."""
    params = arch.params + (trainable_params(arch, train) if train.uses_lora else 0)
    largest = zero.largest_after_embedding(zero.forward_params(arch, train.lora_r, train.lora_targets))
    return zero.prefetched_params(params, largest) * zero.GATHERED_PARAM_BYTES - _zero3_gathered_bytes(arch, train)


def generation_weight_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Weights during generation: ZeRO-3 gathers the whole model beside its partitions (ds3_gather_for_generation,
    TRL's default) or, without it, the layers its coordinator prefetches: the first decoding step's forward records
    the modules' order, complete at the next forward's reset_step, and from then on each forward prefetches up to
    max_live_parameters (partitioned_param_coordinator.py:251-280, :452-484; model/zero.py), the whole of a model of
    up to a billion parameters (under PEFT one layer at a time: `zero3_follows_generation_trace`); FSDP2
    gathers one layer at a time (model/fsdp.py)."""
    if train.fsdp and not train.load_in_4bit:
        return weight_bytes(arch, train) + fsdp.generation_gathered_bytes(arch, train)
    if train.zero_stage == 3 and train.ds3_gather_for_generation:
        # GatheredParameters all-gathers every parameter into a new full tensor while its ds_tensor partition stays
        # (deepspeed/runtime/zero/partition_parameters.py); the sharded trace counts both (vram_planner/tracing/zero.py)
        unsharded = replace(train, num_gpus=1, offload_param="none")
        partitions = weight_bytes(arch, train) - _zero3_gathered_bytes(arch, train)
        return partitions + weight_bytes(arch, unsharded) - _zero3_gathered_bytes(arch, unsharded)
    if train.fsdp:  # FSDP with 4-bit weights: gathered whole, as it was (not traced)
        unsharded = replace(train, num_gpus=1, offload_param="none")
        return weight_bytes(arch, unsharded)
    if zero3_follows_generation_trace(train):
        # the round in use twice beside the gathered layers: the sharded trace holds 97 MiB more in Qwen2.5-0.5B,
        # whose whole model is gathered
        return weight_bytes(arch, train) + zero3_prefetching_forward_bytes(arch, train)
    return weight_bytes(arch, train) + zero3_fetch_buffer_bytes(arch, train)  # ZeRO-3 layer by layer: a module twice


def vllm_weight_sync_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """What a training rank holds beside its weights while TRL pushes them to vLLM before a generation
    (VLLMGeneration.sync_weights and _iter_named_params in trl/generation/vllm_generation.py, 1.16; the same gathers
    in GRPOTrainer._move_model_to_vllm before): each parameter is gathered and handed over one at a time (ZeRO-3's
    GatheredParameters, FSDP2's full_tensor: model/fsdp.py), except that PEFT merges its adapters into a model ZeRO-3
    has gathered whole; merge_adapter adds each linear's delta weight to it, one linear at a time (LoraLayer.get_delta_weight:
    lora_B @ lora_A and its product with the scaling, two tensors of the weight's shape in the adapters' dtype, alive
    together; unmerge_adapter the same). Unsharded and without PEFT vLLM reads the weights in place."""
    if not train.use_vllm:
        return 0.0
    if train.fsdp and not train.load_in_4bit:  # model/fsdp.py
        return fsdp.vllm_sync_bytes(arch, train)
    gathered = 0.0
    if train.zero_stage == 3 and train.uses_lora:
        gathered = weight_bytes(arch, replace(train, num_gpus=1)) - weight_bytes(arch, train)
    elif train.zero_stage == 3:
        gathered = zero.largest_layer_params(arch) * zero.GATHERED_PARAM_BYTES
    if not train.uses_lora:
        return gathered
    adapter_bytes = 2 if train.zero_stage is not None else sizes(train).trainable  # DeepSpeed's engine casts to bf16
    delta = max((lin.in_features * lin.out_features for lin in arch.lora_linears(train.lora_targets)), default=0)
    return gathered + 2 * delta * adapter_bytes


def reference_weight_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """beta != 0 without PEFT loads a second copy (same dtype, no grads); with PEFT the adapter is disabled instead."""
    if not train.computes_ref_logps or train.uses_lora:
        return 0
    if train.fsdp:  # frozen: sharded as loaded, not upcast
        return fsdp.reference_shard_bytes(arch, train)
    per_param = 2 if train.zero_stage is not None else sizes(train).weight
    return (shard_bytes(train, arch.params * per_param, 3) + _plain_weight_rounding(arch, train, per_param)
            + head_upcast_bytes(arch, train, per_param))


def gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Gradients of the trainable parameters; DDP adds its bucket copy (gradient_as_bucket_view=False)."""
    grads = trainable_params(arch, train) * sizes(train).trainable + trained_head_upcast_bytes(
        arch, train, sizes(train).trainable)
    if train.fsdp:  # reduce-scattered into the shards' dtype (model/fsdp.py), on the host under CPU offload
        return fsdp.shard_gradient_bytes(arch, train)
    if train.zero_stage in (1, 2) and train.optimizer_offloaded:
        # ZeRO-Offload copies each reduced gradient to the host through one device buffer the size of the largest
        # parameter (deepspeed/runtime/zero/stage_1_and_2.py:659-661); no partition stays on the GPU
        largest = zero.largest_trainable_layer_params(arch, train.lora_r, train.lora_targets)
        return largest * zero.GATHERED_GRADIENT_BYTES
    if train.distributed in ("ddp", "zero0"):  # ZeRO-0 counted as DDP's bucket copy, as it was (not checked)
        return 2 * grads
    if train.zero_stage == 3:  # the largest trainable layer's full gradient before its reduce-scatter (model/zero.py)
        largest = zero.largest_trainable_layer_params(arch, train.lora_r, train.lora_targets)
        # the partition lives on the host when the optimizer does (zero/stage3.py:333 and :791)
        partition = 0 if train.optimizer_offloaded else shard_bytes(train, grads, 2)
        return partition + largest * zero.GATHERED_GRADIENT_BYTES
    return shard_bytes(train, grads, 2) + _trainable_rounding(arch, train, sizes(train).trainable)


def zero_optimizer_groups(arch: ModelArchitecture, train: TrainingConfig) -> list[list[int]]:
    """The trainable parameters' numels per optimizer group, as DeepSpeed flattens them (model/zero.py)."""
    return zero.optimizer_groups(arch, train.lora_r, train.lora_targets)


def zero_on_several_ranks(train: TrainingConfig) -> bool:
    """Whether DeepSpeed ZeRO partitions across several GPUs, so that the ranks may hold different bytes."""
    return train.zero_stage in (1, 2, 3) and train.num_gpus >= 2


def zero_heaviest_rank(arch: ModelArchitecture, train: TrainingConfig, phase: str) -> int:
    """The rank of num_gpus whose bytes the planner counts in `phase` under ZeRO (model/zero.py `heaviest_rank`);
    0 without DeepSpeed."""
    if not zero_on_several_ranks(train):
        return 0
    return zero.heaviest_rank(zero_optimizer_groups(arch, train), train.num_gpus, train.zero_stage, phase)


def zero_rank_excess_bytes(arch: ModelArchitecture, train: TrainingConfig, phase: str, rank: int) -> int:
    """Under ZeRO on several GPUs, the bytes the rank the planner counts in `phase` holds there above `rank`, where
    that is the whole difference (model/zero.py `rank_excess_bytes`: ZeRO-1/2's optimizer step on the GPU); 0
    otherwise."""
    if not zero_on_several_ranks(train) or train.optimizer_offloaded:
        return 0
    return zero.rank_excess_bytes(zero_optimizer_groups(arch, train), train.num_gpus, train.zero_stage, phase, rank)


def zero2_accumulated_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> int:
    """ZeRO-2's partition buffer of whole gradients, from a micro-batch's first reduction on (model/zero.py)."""
    return zero.accumulated_gradient_bytes(zero_optimizer_groups(arch, train), train.num_gpus)


def step_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The gradients at the optimizer step's peak: under ZeRO-1/2/3 without offload what DeepSpeed's step holds
    (model/zero.py: the 16-bit gradients, their flat and fp32 copies or the norm's fp64 one; ZeRO-3's partition
    beside, its bucket added in model/phases.py); otherwise the gradients as the backward leaves them and the fp32
    ones made in the step (`fp32_gradient_bytes`)."""
    if train.zero_stage in (1, 2, 3) and not train.optimizer_offloaded:
        return (zero.step_gradient_bytes(zero_optimizer_groups(arch, train), train.num_gpus, train.zero_stage)
                + zero3_gradient_partition_bytes(arch, train))
    return gradient_bytes(arch, train) + fp32_gradient_bytes(arch, train)


def step_weight_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Policy weights in the optimizer step: ZeRO-3 releases every gathered layer as its step begins
    (`_partition_all_parameters`, deepspeed/runtime/zero/stage3.py:2878), its partitions stay (the sharded trace sees
    it so)."""
    return weight_bytes(arch, train) - _zero3_gathered_bytes(arch, train)


def zero3_gradient_partition_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """ZeRO-3's 16-bit gradient partition, a flat buffer it allocates at start-up and keeps
    (`grad_partitions_flat_buffer`, deepspeed/runtime/zero/stage3.py:786-793); on the host with the optimizer."""
    if train.zero_stage != 3 or train.optimizer_offloaded:
        return 0
    return shard_bytes(train, trainable_params(arch, train) * sizes(train).trainable, 2)


def fp32_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """DeepSpeed's fp32 copy of the gradients: stage 0's BF16_Optimizer buffer of every parameter (model/zero.py);
    ZeRO-1/2/3 make theirs inside the step (`step_gradient_bytes`); none without DeepSpeed or offloaded (on the
    host, model/offload.py)."""
    if train.zero_stage != 0 or train.optimizer_offloaded:
        return 0
    return trainable_params(arch, train) * zero.FP32_GRADIENT_BYTES


def optimizer_state_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Optimizer states (created at the first step, then kept), plus ZeRO's fp32 master weights; none on the GPU when
    the optimizer is offloaded (model/offload.py counts them on the host)."""
    if train.optimizer_offloaded:
        return 0
    trainable = trainable_params(arch, train)
    state_dtype = FP32_BYTES if train.zero_stage is not None else sizes(train).trainable
    if train.fsdp:  # the optimizer steps the shards (model/fsdp.py)
        state_dtype = fsdp.master_bytes(train)
    opt = train.optim
    if opt.is_8bit:
        small = _small_tensor_params(arch, train)
        total = opt.state_tensors * ((trainable - small) * BNB_8BIT_STATE_BYTES + small * FP32_BYTES)
    elif opt in (Optimizer.paged_adamw_32bit, Optimizer.lion_32bit):
        total = trainable * FP32_BYTES * opt.state_tensors
    elif opt is Optimizer.adafactor:
        total = _adafactor_state_elements(arch, train) * FP32_BYTES
    elif opt is Optimizer.sgd:
        total = 0
    elif opt in (Optimizer.rmsprop, Optimizer.adagrad):
        total = opt.state_tensors * (trainable * state_dtype + trained_head_upcast_bytes(arch, train, state_dtype))
    else:
        # exp_avg and exp_avg_sq of every tensor in whole blocks, and fused AdamW's step scalars
        if train.fsdp:
            # each shard's exp_avg and exp_avg_sq a storage of its own, and fused AdamW's `step` scalars beside them
            # (one per parameter, not sharded)
            return 2 * fsdp.trainable_shard_bytes(arch, train, state_dtype) + blocks.optimizer_step_scalars_bytes(
                arch, train)
        total = 2 * (trainable * state_dtype + _trainable_rounding(arch, train, state_dtype)
                     + trained_head_upcast_bytes(arch, train, state_dtype))
        total += blocks.optimizer_step_scalars_bytes(arch, train) if per_parameter_storages(train) else 0
    if train.zero_stage is not None:
        total += trainable * MASTER_WEIGHT_BYTES
    return shard_bytes(train, total, 1)


def optimizer_step_temporary_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Scratch memory of one optimizer step: foreach AdamW builds a param-sized denominator; fused kernels none."""
    if train.optimizer_offloaded:
        return 0
    if train.optim is Optimizer.adamw_torch:
        per_param = fsdp.master_bytes(train) if train.fsdp else sizes(train).trainable
        return shard_bytes(train, trainable_params(arch, train) * per_param
                           + trained_head_upcast_bytes(arch, train, per_param), 1)
    return 0


def _small_tensor_params(arch: ModelArchitecture, train: TrainingConfig) -> int:
    """Trainable parameters in tensors under bitsandbytes' min_8bit_size (norms, biases, small adapters)."""
    if train.uses_lora:
        r = train.lora_r or 0
        small = sum(r * dim for lin in arch.lora_linears(train.lora_targets)
                    for dim in (lin.in_features, lin.out_features) if r * dim < BNB_MIN_8BIT_SIZE)
        return small * arch.num_layers
    norms = arch.family.norms_per_layer * arch.num_layers + 1
    small = norms * arch.norm_params if arch.hidden_size < BNB_MIN_8BIT_SIZE else 0
    per_layer = 0
    for lin in arch.layer_linears():  # a small model's narrow projections, and biases
        weight = lin.in_features * lin.out_features
        per_layer += weight if weight < BNB_MIN_8BIT_SIZE else 0
        per_layer += lin.out_features if lin.bias and lin.out_features < BNB_MIN_8BIT_SIZE else 0
    return small + per_layer * arch.num_layers


def _adafactor_state_elements(arch: ModelArchitecture, train: TrainingConfig) -> int:
    """Adafactor factors each matrix's second moment into a row and a column vector; vectors keep a full one."""
    if train.uses_lora:
        r = train.lora_r or 0
        per_layer = sum(r + lin.in_features + lin.out_features + r for lin in arch.lora_linears(train.lora_targets))
        return per_layer * arch.num_layers
    matrices = sum(lin.in_features + lin.out_features for lin in arch.layer_linears()) * arch.num_layers
    embeddings = (arch.vocab_size + arch.hidden_size) * (1 if arch.tie_word_embeddings else 2)
    vectors = arch.params - arch.linear_params - arch.embedding_params - (
        0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size)
    return matrices + embeddings + vectors


def kv_cache_bytes(arch: ModelArchitecture, train: TrainingConfig, sequences: int, tokens: int,
                   forward: TrainingConfig | None = None, prefill: bool = False) -> float:
    """Keys and values of every layer for `sequences` sequences of `tokens` tokens (`prefill`: just after a
    prefill of `tokens`, when the installed transformers' sliding-window layers still hold all of them).

    Keys come out of rotary in the residual stream's dtype (cos and sin follow it); values come out of v_proj in
    the dtype the forward computes in: generate()'s by default (autocast's, or the weights' for LoRA), `forward`'s
    for another forward that fills a cache (a scoring pass under accelerate's autocast). Where the installed transformers starts
    each layer's storage from an empty tensor of the keys' dtype (4.56 to 5.23), concatenation promotes the values
    to it: with float32 weights under autocast both are float32 (profiles/transformers.toml).
    """
    per_token_layer = arch.num_kv_heads * arch.head_dim * sum(kv_element_bytes(train, forward))
    keep_all = prefill and train.transformers.sliding_prefill_storage == "prompt"
    return sequences * arch.kv_layers_tokens(tokens, keep_all) * per_token_layer


def kv_element_bytes(train: TrainingConfig, forward: TrainingConfig | None = None) -> tuple[int, int]:
    """Bytes per element of the cached keys and of the values, as kv_cache_bytes says."""
    key_bytes = sizes(train).residual
    computing = forward or as_generated(train)
    return key_bytes, key_bytes if train.transformers.kv_values_dtype == "keys" else sizes(computing).compute


def backward_working_bytes(arch: ModelArchitecture, train: TrainingConfig, cal: Calibration, tokens: int) -> float:
    """Gradient buffers alive inside one layer's backward (the incoming hidden-state gradient and the MLP's)."""
    s = sizes(train)
    working = tokens * (cal.backward_hidden_bytes * arch.hidden_size * s.residual / 2
                        + cal.backward_mlp_bytes * arch.intermediate_size * s.compute / 2)
    # the gradient of PEFT's fp32 input copy is fp32 too
    return working + _adapter_input_copy_bytes(arch, train, tokens)


def _adapter_input_copy_bytes(arch: ModelArchitecture, train: TrainingConfig, tokens: int) -> float:
    """PEFT feeds fp32 adapters an fp32 copy of their compute-dtype input: the widest one, for `tokens` tokens."""
    s = sizes(train)
    if not train.uses_lora or train.mixed_precision == "no" or s.trainable == s.compute:
        return 0
    widest = max((lin.in_features for lin in arch.lora_linears(train.lora_targets)), default=0)
    return tokens * widest * FP32_BYTES


def inference_working_bytes(arch: ModelArchitecture, train: TrainingConfig, cal: Calibration, tokens: int,
                            length: int) -> float:
    """Transient tensors of a no-grad forward over `tokens` tokens of sequences `length` long (one layer at a time)."""
    s = sizes(train)
    per_token = (cal.inference_hidden_bytes * arch.hidden_size * s.residual / 2
                 + cal.inference_mlp_bytes * arch.intermediate_size * s.compute / 2)
    if train.attn_implementation == "eager":  # scores and their float32 softmax, [a, L] per query
        per_token += arch.num_attention_heads * length * (s.compute + FP32_BYTES)
    return tokens * per_token + _adapter_input_copy_bytes(arch, train, tokens)


def padded_mask_bytes(train: TrainingConfig, sequences: int, length: int) -> float:
    """Padded batches under SDPA: the boolean [B, 1, L, L] mask and the compute-dtype copy SDPA makes of it per layer
    (transformers 4.53 on).

    FlashAttention-2 unpads instead.
    """
    if train.attn_implementation == "flash_attention_2":
        return 0
    if train.transformers.attention_mask == "shared":  # one float mask in the embeddings' dtype, read by every layer
        return sequences * length * length * sizes(train).residual
    return sequences * length * length * (1 + sizes(train).compute)


def generation_logits_bytes(arch: ModelArchitecture, train: TrainingConfig, sequences: int) -> float:
    """Last-token logits at the last decoding step: the model's output in the compute dtype (`as_generated`; float32
    from the float32 head of cast_lm_head_to_fp32 outside autocast), generate's fp32 copy, and what sampling holds
    beside them (model/sampling.py: the logits processors the sampling knobs switch on, the probabilities, and the
    exponential noise torch.multinomial draws one sample per row with, argmax(p / q), q ~ Exp(1): a tensor like the
    probs, aten/src/ATen/native/Distributions.cpp multinomial_out)."""
    head_in_fp32 = train.cast_lm_head_to_fp32 and train.mixed_precision == "no"
    logits = sequences * arch.vocab_size * ((FP32_BYTES if head_in_fp32 else sizes(train).compute) + FP32_BYTES)
    # the last step's ids: the prompt and all completion tokens but the one it samples
    return logits + sampling.sampling_bytes(train, sequences, arch.vocab_size, train.sequence_length - 1)


@remembered_work  # the step-time model asks for it in every generation round it weighs
def as_generated(train: TrainingConfig) -> TrainingConfig:
    """`train` as generate() runs it. accelerate wraps the forward of the model it prepares in autocast, and a
    transformers model's generate() calls that forward; PEFT's generate() calls the base model's generate() and its
    own, unwrapped forward, so LoRA generates without autocast, in the weights' dtype (every TRL release: each
    generates through unwrap_model_for_generation(...).generate)."""
    return replace(train, mixed_precision="no") if train.uses_lora else train


def adapter_forward_bytes(arch: ModelArchitecture, train: TrainingConfig, tokens: int) -> float:
    """What PEFT's LoRA forward adds to a no-grad forward without autocast, for `tokens` tokens, at the adapted linear
    with the widest output (a gated MLP's up projection: the gate's activation and the base output alive).

    The adapters compute in their own dtype: lora_B's output and its scaled copy exist beside the base output, in
    place of one compute-dtype tensor of the plain forward's peak, and the input is copied to that dtype first.
    """
    if not train.uses_lora:
        return 0
    s = sizes(train)
    adapted = arch.lora_linears(train.lora_targets)
    if not adapted:
        return 0
    widest = max(adapted, key=lambda lin: lin.out_features)
    copy = widest.in_features * s.trainable if s.trainable != s.compute else 0
    return tokens * (widest.out_features * max(2 * s.trainable - s.compute, 0) + copy)
