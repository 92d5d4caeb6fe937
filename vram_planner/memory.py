"""Tensor bytes of each memory component, as pure functions of the architecture and the training config.

Symbols as in ../shared/design/grpo-memory.md: P params, T trainable params, h hidden size, n layers, a heads,
k kv heads, d head dim, i MLP width, V vocab, p prompt tokens, c completion tokens, L = p + c,
B per_device_train_batch_size, S steps_per_generation. Every function returns bytes on one GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from vram_planner.architecture import ModelArchitecture
from vram_planner.calibration import Calibration
from vram_planner.spec import DTYPE_BYTES, Optimizer, TrainingConfig

FP32_BYTES = 4
# bitsandbytes 4-bit: two weights per byte, one absmax per block of 64 weights; double quantisation stores the
# absmax in 8 bits with one fp32 constant per 256 blocks (QLoRA paper, Dettmers et al. 2023, section 2).
NF4_BYTES_PER_PARAM = 0.5
NF4_ABSMAX_BYTES_PER_PARAM = 4 / 64
NF4_DOUBLE_QUANT_ABSMAX_BYTES_PER_PARAM = 1 / 64 + 4 / (64 * 256)
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
    weight = DTYPE_BYTES[train.dtype]  # with 4-bit loading: the modules bitsandbytes leaves unquantised
    compute = weight if train.mixed_precision == "no" else 2
    # PEFT upcasts adapters to fp32 (autocast_adapter_dtype=True); TRL keeps them in bf16 under ZeRO-3 and casts them
    # to bf16 over a 4-bit base.
    if train.uses_lora:
        trainable = 2 if (train.load_in_4bit or train.zero_stage == 3) else FP32_BYTES
    elif train.zero_stage is not None:
        trainable = 2  # DeepSpeed runs the model in bf16 and keeps the fp32 master copy with the optimizer
    else:
        trainable = weight
    return Sizes(weight=weight, compute=compute, residual=weight, trainable=trainable)


def trainable_params(arch: ModelArchitecture, train: TrainingConfig) -> int:
    if train.uses_lora:
        return arch.lora_params(train.lora_r or 0, train.lora_targets)
    return arch.params


def _shard(train: TrainingConfig, n_bytes: float, from_stage: int) -> float:
    """Split n_bytes across GPUs when the ZeRO stage (FSDP counts as 3) shards this kind of state."""
    stage = 3 if train.fsdp else (train.zero_stage or 0)
    return n_bytes / train.num_gpus if stage >= from_stage else n_bytes


def weight_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Policy weights (base plus LoRA adapters), as held on one GPU between generations."""
    s = sizes(train)
    if train.load_in_4bit:
        absmax = (NF4_DOUBLE_QUANT_ABSMAX_BYTES_PER_PARAM if train.bnb_4bit_use_double_quant is not False
                  else NF4_ABSMAX_BYTES_PER_PARAM)
        base = arch.linear_params * (NF4_BYTES_PER_PARAM + absmax) + (arch.params - arch.linear_params) * s.weight
    elif train.zero_stage is not None:
        base = arch.params * 2  # DeepSpeed's bf16 engine casts the module to bf16
    else:
        base = arch.params * s.weight
    adapters = trainable_params(arch, train) * s.trainable if train.uses_lora else 0
    return _shard(train, base, 3) + _shard(train, adapters, 3)


def generation_weight_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Weights during generation: ZeRO-3 gathers the whole model (ds3_gather_for_generation), FSDP summons it."""
    if train.zero_stage == 3 or train.fsdp:
        unsharded = train.model_copy(update={"num_gpus": 1})
        return weight_bytes(arch, unsharded)
    return weight_bytes(arch, train)


def reference_weight_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """beta != 0 without PEFT loads a second copy (same dtype, no grads); with PEFT the adapter is disabled instead."""
    if not train.computes_ref_logps or train.uses_lora:
        return 0
    per_param = 2 if train.zero_stage is not None else sizes(train).weight
    return _shard(train, arch.params * per_param, 3)


def gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Gradients of the trainable parameters; DDP adds its bucket copy (gradient_as_bucket_view=False)."""
    grads = trainable_params(arch, train) * sizes(train).trainable
    if train.distributed == "ddp":
        return 2 * grads
    return _shard(train, grads, 2)


def optimizer_state_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Optimizer states (created at the first step, then kept), plus ZeRO's fp32 master weights."""
    trainable = trainable_params(arch, train)
    state_dtype = FP32_BYTES if train.zero_stage is not None else sizes(train).trainable
    opt = train.optim
    if opt.is_8bit:
        states = 1 if "lion" in opt.value else 2
        small = _small_tensor_params(arch, train)
        total = states * ((trainable - small) * BNB_8BIT_STATE_BYTES + small * FP32_BYTES)
    elif opt in (Optimizer.paged_adamw_32bit, Optimizer.lion_32bit):
        total = trainable * FP32_BYTES * (2 if opt is Optimizer.paged_adamw_32bit else 1)
    elif opt is Optimizer.adafactor:
        total = _adafactor_state_elements(arch, train) * FP32_BYTES
    elif opt is Optimizer.sgd:
        total = 0
    elif opt in (Optimizer.rmsprop, Optimizer.adagrad):
        total = trainable * state_dtype
    else:
        total = 2 * trainable * state_dtype
    if train.zero_stage is not None:
        total += trainable * MASTER_WEIGHT_BYTES
    return _shard(train, total, 1)


def optimizer_step_temporary_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Scratch memory of one optimizer step: foreach AdamW builds a param-sized denominator; fused kernels none."""
    if train.optim is Optimizer.adamw_torch:
        return _shard(train, trainable_params(arch, train) * sizes(train).trainable, 1)
    return 0


def _small_tensor_params(arch: ModelArchitecture, train: TrainingConfig) -> int:
    """Trainable parameters in tensors under bitsandbytes' min_8bit_size (norms, biases, small adapters)."""
    if train.uses_lora:
        r = train.lora_r or 0
        targets = arch.resolve_lora_targets(train.lora_targets)
        small = sum(r * dim for lin in arch.layer_linears() if lin.name in targets
                    for dim in (lin.in_features, lin.out_features) if r * dim < BNB_MIN_8BIT_SIZE)
        return small * arch.num_layers
    norms = arch.family.norms_per_layer * arch.num_layers + 1
    small = norms * arch.norm_params if arch.hidden_size < BNB_MIN_8BIT_SIZE else 0
    biases = sum(lin.out_features for lin in arch.layer_linears() if lin.bias and lin.out_features < BNB_MIN_8BIT_SIZE)
    return small + biases * arch.num_layers


def _adafactor_state_elements(arch: ModelArchitecture, train: TrainingConfig) -> int:
    """Adafactor factors each matrix's second moment into a row and a column vector; vectors keep a full one."""
    if train.uses_lora:
        r = train.lora_r or 0
        targets = arch.resolve_lora_targets(train.lora_targets)
        per_layer = sum(r + lin.in_features + lin.out_features + r
                        for lin in arch.layer_linears() if lin.name in targets)
        return per_layer * arch.num_layers
    matrices = sum(lin.in_features + lin.out_features for lin in arch.layer_linears()) * arch.num_layers
    embeddings = (arch.vocab_size + arch.hidden_size) * (1 if arch.tie_word_embeddings else 2)
    vectors = arch.params - arch.linear_params - arch.embedding_params - (
        0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size)
    return matrices + embeddings + vectors


def kv_cache_bytes(arch: ModelArchitecture, train: TrainingConfig, sequences: int, tokens: int) -> float:
    """Keys and values of every layer for `sequences` sequences of `tokens` tokens.

    Under autocast with fp32 weights the rotary cos/sin stay fp32, so keys are cached in fp32 and values in bf16.
    """
    s = sizes(train)
    key_bytes = FP32_BYTES if s.residual == FP32_BYTES and train.mixed_precision != "no" else s.residual
    value_bytes = s.compute if train.mixed_precision != "no" else s.residual
    per_token_layer = arch.num_kv_heads * arch.head_dim * (key_bytes + value_bytes)
    return sequences * arch.kv_layers_tokens(tokens) * per_token_layer


def layer_activation_bytes(arch: ModelArchitecture, train: TrainingConfig, cal: Calibration, tokens: int) -> float:
    """Tensors one decoder layer saves for backward over `tokens` tokens (no checkpointing)."""
    s = sizes(train)
    scale = s.compute / 2  # coefficients are for a 2-byte compute dtype
    if train.use_liger_kernel:
        hidden_coeff = cal.liger_act_hidden_bytes * s.residual / 2
        query, kv, mlp = cal.liger_act_query_bytes, cal.liger_act_kv_bytes, cal.liger_act_mlp_bytes
    else:
        hidden_coeff = cal.act_hidden_bytes_fp32 if s.residual == FP32_BYTES else cal.act_hidden_bytes_bf16
        query, kv, mlp = cal.act_query_bytes, cal.act_kv_bytes, cal.act_mlp_bytes
    per_token = (hidden_coeff * arch.hidden_size
                 + scale * (query * arch.num_attention_heads * arch.head_dim
                            + kv * arch.num_kv_heads * arch.head_dim + mlp * arch.intermediate_size)
                 + cal.act_head_bytes * arch.num_attention_heads)
    return tokens * per_token + _lora_activation_bytes(arch, train, tokens) + _attention_matrix_bytes(
        arch, train, tokens, saved=True)


def _lora_activation_bytes(arch: ModelArchitecture, train: TrainingConfig, tokens: int) -> float:
    """LoRA keeps x @ A (rank wide) per adapter, and with dropout a dropped copy of the input."""
    if not train.uses_lora:
        return 0
    s = sizes(train)
    targets = [lin for lin in arch.layer_linears() if lin.name in arch.resolve_lora_targets(train.lora_targets)]
    per_token = len(targets) * (train.lora_r or 0) * s.compute  # x @ A comes out of autocast in the compute dtype
    if train.lora_dropout:
        per_token += sum(lin.in_features * (s.compute + 1) for lin in targets)  # copy plus its boolean mask
    return tokens * per_token


def _attention_matrix_bytes(arch: ModelArchitecture, train: TrainingConfig, tokens: int, saved: bool) -> float:
    """Eager attention materialises [a, L, L] scores and probabilities per sequence; SDPA and FA2 do not."""
    if train.attn_implementation != "eager":
        return 0
    length = train.sequence_length
    sequences = tokens / length
    copies = 2 if saved else 1  # softmax output kept for backward, plus the scores while computing it
    return sequences * arch.num_attention_heads * length * length * sizes(train).compute * copies


def checkpoint_bytes(arch: ModelArchitecture, train: TrainingConfig, tokens: int) -> float:
    """Layer inputs kept across the forward when gradient checkpointing is on."""
    return arch.num_layers * tokens * arch.hidden_size * sizes(train).residual


def forward_saved_bytes(arch: ModelArchitecture, train: TrainingConfig, cal: Calibration, tokens: int) -> float:
    """Everything the decoder keeps from the forward for the backward of one micro-batch."""
    if train.gradient_checkpointing:
        return checkpoint_bytes(arch, train, tokens)
    return arch.num_layers * layer_activation_bytes(arch, train, cal, tokens)


def backward_working_bytes(arch: ModelArchitecture, train: TrainingConfig, cal: Calibration, tokens: int) -> float:
    """Gradient buffers of one layer's backward, plus that layer's recomputed activations under checkpointing."""
    s = sizes(train)
    grads = tokens * (cal.backward_hidden_bytes * arch.hidden_size * s.residual / 2
                      + cal.backward_mlp_bytes * arch.intermediate_size * s.compute / 2)
    recompute = layer_activation_bytes(arch, train, cal, tokens) if train.gradient_checkpointing else 0
    return grads + recompute


def inference_working_bytes(arch: ModelArchitecture, train: TrainingConfig, cal: Calibration, tokens: int) -> float:
    """Transient tensors of a no-grad forward over `tokens` tokens (one layer at a time)."""
    s = sizes(train)
    per_token = (cal.inference_hidden_bytes * arch.hidden_size * s.residual / 2
                 + cal.inference_mlp_bytes * arch.intermediate_size * s.compute / 2)
    return tokens * per_token + _attention_matrix_bytes(arch, train, tokens, saved=False)


def padded_prefill_mask_bytes(train: TrainingConfig, sequences: int) -> float:
    """SDPA with left-padded prompts builds a boolean [batch, 1, p, p] mask; FA2 unpads instead."""
    if train.attn_implementation == "flash_attention_2":
        return 0
    return sequences * train.max_prompt_length**2


def generation_logits_bytes(arch: ModelArchitecture, sequences: int) -> float:
    """Last-token logits per decoding step: the model's output, generate's fp32 copy, and the sampling probs."""
    return sequences * arch.vocab_size * (2 + FP32_BYTES + FP32_BYTES)
