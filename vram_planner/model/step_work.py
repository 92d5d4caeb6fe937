"""The work of one pass of the model: FLOPs, bytes moved and eager operations, as pure functions of the architecture.

What a GPU does in a pass is bounded three ways (vram_planner/model/step_time.py turns them into seconds): its
matmuls' FLOPs at the card's tensor throughput, the bytes its kernels read and write at the card's memory bandwidth,
and, for small batches in eager PyTorch, the host's time to launch each operation. Symbols as in components.py:
N the decoder's linear parameters, h hidden size, V vocabulary, L tokens of a sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from vram_planner.model import components as m
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.memo import remembered_work
from vram_planner.model.spec import TrainingConfig

# Eager operations (kernels launched) of a decoder layer's forward in transformers' Llama-style code
# (models/llama/modeling_llama.py, which Qwen2/Qwen3/Mistral copy), besides its linears (one each):
# - RMSNorm: pow, mean, add, rsqrt, multiply, multiply by the weight; and the float32 cast of a 16-bit residual
#   stream there and back (LlamaRMSNorm.forward).
NORM_OPS = 6
NORM_CAST_OPS = 2
# - rotary embedding on q and on k: q * cos, rotate_half's negation and concatenation, * sin, the sum
#   (apply_rotary_pos_emb, rotate_half); the cache update's torch.cat of keys and of values (cache_utils.py,
#   DynamicLayer.update); SDPA itself and the transpose(1, 2).contiguous() of its output; two residual adds.
ROTARY_OPS = 2 * 5
CACHE_UPDATE_OPS = 2
ATTENTION_OPS = 2
RESIDUAL_OPS = 2
# - SDPA's integration repeats the key and value heads for grouped-query attention under a mask (repeat_kv: one copy
#   each; integrations/sdpa_attention.py), which FlashAttention-2 does not.
REPEAT_KV_OPS = 2
# - the MLP's activation, and a gated MLP's product of gate and up.
GATED_MLP_OPS = 2
# Once per forward outside the layers: the embedding, the rotary embedding's cos and sin (expand, matmul,
# concatenation, cos, sin, scaling and casts: about ten; LlamaRotaryEmbedding.forward), the attention mask
# (masking_utils.py: a few), the final norm and the LM head.
MODEL_OPS_PER_FORWARD = 1 + 10 + 4 + NORM_OPS + NORM_CAST_OPS + 1
# What PEFT's LoRA Linear adds to each adapted layer's forward: A, B, the scaling and the add to the base layer's
# output (peft/tuners/lora/layer.py, Linear.forward); with adapters in another dtype than the activations (PEFT
# upcasts 16-bit adapters to float32, autocast_adapter_dtype=True, tuners_utils.cast_adapter_dtype) also the
# input's cast to the adapters' dtype and the result's cast back (_cast_input_dtype, result.to).
LORA_OPS_PER_LINEAR = 4
LORA_CAST_OPS_PER_LINEAR = 2
# Under autocast (the loss forward; LoRA generates without it, components.as_generated) the adapters' matmuls run in
# the compute dtype: autocast casts the float32 input back and each adapter weight (cached once per forward for a
# leaf that requires grad; torch's autocast_mode.cpp, cached_cast), and the output's cast back is then a no-op:
# two more kernels per adapted linear.
LORA_AUTOCAST_OPS_PER_LINEAR = 2
# bitsandbytes 0.50's 4-bit Linear multiplies up to m.BNB_FUSED_MAX_ROWS rows in one fused kernel that reads the
# packed weight, above them by dequantizing the weight and calling F.linear (m.fused_4bit): one kernel reading the
# packed weight and writing a 16-bit copy that the matmul then reads; with double quantization
# (bnb_4bit_use_double_quant, vram-plan's default) the absmax is dequantized and its offset added first: two more.
# MatMul4Bit.backward dequantizes the same way for the input's gradient.
DEQUANT_OPS_PER_LINEAR = 1
DOUBLE_QUANT_OPS_PER_LINEAR = 2
DEQUANT_BYTES_PER_PARAM = 2 + 2  # the 16-bit copy written, then read by the matmul (besides the 4-bit read)
# Each call of a 4-bit Linear dispatches, around its matmul (bitsandbytes 0.50: nn/modules.py Linear4bit.forward,
# autograd/_functions.py matmul_4bit, backends/cuda/ops.py gemm_4bit and _gemm_4bit_kernel_impl): the input's cast
# to the compute dtype, the weight's view through Params4bit's Python __torch_function__ (two crossings), the custom
# op's dispatch to its Python kernel, A.contiguous(), the output's torch.empty, the absmax offset's cast to float32
# and the output's cast back: eight host crossings of about an eager op's cost each, where a 16-bit Linear makes one.
# Decoding is launch-bound, so they set QLoRA's generation time: the H200 decoded Llama-3.2-1B with 4-bit weights
# 60% slower than with 16-bit ones (benchmarks/results/gpu/h200-step-times.json, call 5).
BNB_4BIT_CALL_OPS = 8
# Autocast casts each float32 weight to the compute dtype at every use: one more kernel per linear (torch's
# autocast, cached_cast), besides the bytes `weight_pass_bytes` counts.
CAST_OPS_PER_LINEAR = 1
# Per decoding step, generate() samples (logits processors, softmax, multinomial), updates the attention mask and
# the cache positions and checks its stopping criteria (transformers' generation/utils.py, _sample).
GENERATE_OPS_PER_TOKEN = 30
# The backward's kernels per forward op, from autograd's derivative formulas (torch's tools/autograd/derivatives.yaml)
# of the ops listed above; autograd's engine launches them, and a checkpointed layer's forward runs again inside it:
# - RMSNorm: pow's backward (pow, mul, mul), mean's (one division of the expanded gradient), rsqrt's (-0.5 * grad *
#   result.pow(3): three), the product with the normalizer (a mul for each side and the broadcast side's sum), the
#   weight's product (the same three; one where the weight is frozen), the sum of the input's two gradients (it feeds
#   pow and the product), and a cast back for each float32 cast; a LayerNorm is one fused backward kernel.
NORM_BACKWARD_OPS = 3 + 1 + 3 + 3 + 3 + 1
NORM_FROZEN_WEIGHT_SAVING = 2
# - a linear: the input's gradient (one mm) and, where it trains, the weight's (another; its bias a sum).
LINEAR_BACKWARD_OPS = 1
WEIGHT_GRAD_OPS = 1
# - rotary on q and on k: the gradients through `* cos` and `* sin`, the negation's, the two slices' of rotate_half
#   (slice_backward: zeros and a copy each) and the sum of the three gradients of q (or k).
ROTARY_BACKWARD_OPS = 2 * (3 + 2 * 2 + 2)
# - SDPA's backward kernel and the contiguous copy of the gradient of its transposed output; repeat_kv's sum over
#   each group of query heads (key and value); at each of the residual stream's two forks, the sum of its gradients.
ATTENTION_BACKWARD_OPS = 2
REPEAT_KV_BACKWARD_OPS = 2
RESIDUAL_BACKWARD_OPS = 2
# - the gated MLP: the activation's backward and the product's two sides; a plain MLP the activation's only.
GATED_MLP_BACKWARD_OPS = 3
# - PEFT's LoRA per adapted linear: A's and B's input and weight gradients (four mms), the scaling's mul and the sum of
#   the base's and the adapter's input gradients; every cast's backward is a cast again (ToCopyBackward0).
LORA_BACKWARD_OPS_PER_LINEAR = 4 + 1 + 1
# - bitsandbytes' MatMul4Bit.backward dequantizes the weight again for the input's gradient
#   (bitsandbytes/autograd/_functions.py: torch.matmul(grad_output, F.dequantize_4bit(B, ctx.state).t())): the
#   dequantization's kernels again (`dequant_ops`), its bytes as the forward's.
# - around the layers: the final norm's backward, the embedding's (embedding_dense_backward: a sort, a count and a
#   scatter; trained weights only).
EMBEDDING_BACKWARD_OPS = 3
# TRL's training forward turns the cache off (trl/trainer/utils.py, add_fused_lm_head: kwargs["use_cache"] = False):
# no cache concatenation there.
# TRL 1.16's loss (GRPOTrainer._compute_loss): the prompt and completion concatenations, the ratio (sub, exp), the
# clipped objective (clamp, two products, min, neg), the masked means (mul, two sums, clamp, div, mean, the
# accumulation's division): about 20 kernels, and the metrics it logs each micro-batch: the entropy's and three clip
# ratios' global masked means (mul, sum, sum, cast, stack, gather, div, clamp: 8 each), the clip masks (seven
# comparisons and logical ops), two per-sequence clip means with their min and max: about 60; each metric ends in
# .item(), which waits for the device.
LOSS_OPS = 20 + 60
LOSS_BACKWARD_OPS = 20
# TRL's fused LM head (TRL >= 1.15; trl/kernels/chunked_logprob.py, ChunkedLogProbFunction) projects the scored
# tokens in tiles of TOKEN_CHUNK_SIZE tokens by _CHUNKED_LOGPROB_CHUNK_SIZE vocabulary entries (trl/trainer/utils.py).
# Forward per tile: torch.mm into the tile and the Triton kernel folding it into running statistics; backward per tile:
# the same mm again (the logits are never kept), the backward fold writing the logits' gradient into the tile, and an
# fp32 addmm into the hidden states' gradient, and another into the weight's where the head trains.
FUSED_HEAD_TOKENS = 4096
FUSED_HEAD_VOCAB = 32768
FUSED_HEAD_FORWARD_OPS_PER_TILE = 2
FUSED_HEAD_BACKWARD_OPS_PER_TILE = 3
# Around the tiles: the labels' shift and mask, `hidden_states[mask]` and `labels[mask]` (nonzero and index: a wait
# for the device), seven statistics filled, log_z, the log-probs and the entropy, two masked_scatters back; in the
# backward the zeroed fp32 gradients, the incoming gradients' casts, the casts back and the mask's index backward.
FUSED_HEAD_FORWARD_OPS = 25
FUSED_HEAD_BACKWARD_OPS = 10
# Bytes per logit of a tile: the forward's mm writes it and the fold reads it; the backward's mm writes it, the fold
# reads and rewrites it, and each addmm reads it.
FUSED_HEAD_FORWARD_ACCESSES = 2
FUSED_HEAD_BACKWARD_ACCESSES = 4
# Bytes the elementwise kernels of a layer's forward move per token and element of the tensor they work on (the
# matmuls' own reads and writes go with their FLOPs): RMSNorm's pow, mean, the product with the normalizer and the
# weight's in float32 (4 + 4, 4, 4 + 4, 4 + 4), and with a 16-bit residual stream its casts there and back (2 + 4,
# 4 + 2) with the weight's product in 16 bits (2 + 2); rotary's five ops on q and k, each reading and writing them
# (the sum two reads): about six passes of two bytes each way.
NORM_BYTES_PER_ELEMENT = {"float32": 28, "16-bit": 36}
ROTARY_PASSES = 6
# An elementwise op's backward reads the incoming gradient and a saved input and writes the input's gradient: about
# twice the forward's bytes.
ELEMENTWISE_BACKWARD_PER_FORWARD = 2
# The backward of a matmul computes the input's gradient and the weight's: twice the forward's FLOPs; with frozen
# weights (LoRA's base) only the input's (Kaplan et al. 2020, section 2.1: ~6N FLOPs per token for training).
BACKWARD_FLOPS_PER_FORWARD = 2
FROZEN_BACKWARD_FLOPS_PER_FORWARD = 1


@dataclass(frozen=True)
class Work:
    """What one pass asks of the card: FLOPs of its matmuls, bytes its kernels move, eager ops the host launches."""

    flops: float = 0.0
    bytes_moved: float = 0.0
    ops: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.bytes_moved + other.bytes_moved, self.ops + other.ops)

    def __mul__(self, factor: float) -> Work:
        return Work(self.flops * factor, self.bytes_moved * factor, self.ops * factor)


def attention_flops(arch: ModelArchitecture, tokens: int, context: float) -> float:
    """Scores and weighted values (2 x 2 FLOPs per query, key and head dimension) of `tokens` queries that each see
    `context` keys on average, summed over the layers (sliding layers see at most their window)."""
    width = arch.num_attention_heads * arch.head_dim
    full = arch.num_layers - arch.sliding_layers
    window = min(context, arch.sliding_window or context)
    return 4 * tokens * width * (full * context + arch.sliding_layers * window)


def _norms(arch: ModelArchitecture) -> int:
    return arch.family.norms_per_layer + (2 if arch.family.qk_norm else 0)


def _norm_casts(train: TrainingConfig) -> int:
    """RMSNorm's float32 casts there and back: float32 weights keep a float32 residual stream under autocast."""
    return NORM_CAST_OPS if m.sizes(train).residual < 4 else 0


def layer_ops(arch: ModelArchitecture, train: TrainingConfig, cache: bool = True, rows: int = 1) -> float:
    """Eager ops of one forward of `rows` tokens in all: every decoder layer's and the model's own around them
    (`cache`: the forward concatenates each layer's keys and values to a cache, as generate() does)."""
    family = arch.family
    linears = len(arch.layer_linears())
    # a LayerNorm is one fused kernel (native_layer_norm)
    norm_ops = 1 if family.layer_norm_bias else NORM_OPS + _norm_casts(train)
    per_layer = (_norms(arch) * norm_ops + linears + ROTARY_OPS + (CACHE_UPDATE_OPS if cache else 0)
                 + ATTENTION_OPS + RESIDUAL_OPS + (GATED_MLP_OPS if family.gated_mlp else 1))
    per_layer += _layer_extras(arch, train, REPEAT_KV_OPS, LORA_OPS_PER_LINEAR, rows)
    return arch.num_layers * per_layer + MODEL_OPS_PER_FORWARD


def _layer_extras(arch: ModelArchitecture, train: TrainingConfig, repeat_kv: int, lora_per_linear: int,
                  rows: int | None) -> float:
    """A layer's kernels for SDPA's repeat_kv, PEFT's adapters and the 4-bit weights' calls or autocast casts: a
    forward's of `rows` tokens in all or, with `rows` None and the backward's counts for the first two, its
    backward's (a cast's backward is a cast, and bitsandbytes' backward dequantizes again)."""
    linears = len(arch.layer_linears())
    extras = 0
    if arch.num_attention_heads > arch.num_kv_heads and train.attn_implementation != "flash_attention_2":
        extras += repeat_kv
    if train.uses_lora:
        extras += (lora_per_linear + _lora_casts(train)) * len(arch.lora_linears(train.lora_targets))
    if train.load_in_4bit:
        calls = 0 if rows is None else BNB_4BIT_CALL_OPS - 1  # the matmul itself is the layer's linear op
        extras += (calls + (0 if m.fused_4bit(rows) else dequant_ops(train))) * linears
    elif m.autocast_casts_weights(train):
        extras += CAST_OPS_PER_LINEAR * linears
    return extras


def dequant_ops(train: TrainingConfig) -> int:
    """Kernels of one use of a 4-bit weight's dequantization."""
    return DEQUANT_OPS_PER_LINEAR + (DOUBLE_QUANT_OPS_PER_LINEAR if train.bnb_4bit_use_double_quant is not False
                                     else 0)


def weight_pass_bytes(arch: ModelArchitecture, train: TrainingConfig, rows: int | None = None) -> float:
    """Bytes one forward of `rows` tokens (None: more than bitsandbytes' fused kernel takes) moves to use every
    weight once: the weights as stored, plus autocast's 16-bit copy of each float32 linear weight (written, then read
    by the matmul) or bitsandbytes' dequantized copy of each 4-bit one where it dequantizes."""
    linear = arch.linear_params
    if train.load_in_4bit:
        packed = m.NF4_BYTES_PER_PARAM + m.NF4_ABSMAX_BYTES_PER_PARAM
        rest = (arch.params - linear) * m.sizes(train).weight
        return linear * (packed + (0 if m.fused_4bit(rows) else DEQUANT_BYTES_PER_PARAM)) + rest
    s = m.sizes(train)
    cast = linear * 2 * s.compute if m.autocast_casts_weights(train) else 0
    adapters = m.trainable_params(arch, train) * s.trainable if train.uses_lora else 0
    return arch.params * s.weight + cast + adapters


@remembered_work
def forward_work(arch: ModelArchitecture, train: TrainingConfig, sequences: int, tokens: int, context: float,
                 logit_tokens: int) -> Work:
    """One forward of `sequences` sequences of `tokens` new tokens each, attending to `context` keys on average,
    with logits for `logit_tokens` of each sequence's positions (TRL's logits_to_keep; generate() keeps one)."""
    lora = m.trainable_params(arch, train) if train.uses_lora else 0
    per_token = 2 * (arch.linear_params + lora)
    head = logit_tokens * 2 * arch.hidden_size * arch.vocab_size
    attention = attention_flops(arch, tokens, context)
    flops = sequences * (tokens * per_token + attention + head)
    rows = sequences * tokens
    return Work(flops=flops, bytes_moved=weight_pass_bytes(arch, train, rows), ops=layer_ops(arch, train, rows=rows))


@remembered_work
def kv_read_bytes(arch: ModelArchitecture, train: TrainingConfig, sequences: int, context: float) -> float:
    """Keys and values one decoding step reads: every cached token of every sequence."""
    return m.kv_cache_bytes(arch, train, sequences, 1) * context


def eager_kv_passes(arch: ModelArchitecture, train: TrainingConfig) -> int:
    """How many times one decoding step in transformers moves its KV cache: DynamicLayer.update concatenates the new
    token to each layer's keys and values (torch.cat: the cache read and written again, cache_utils.py), and with
    grouped-query attention under a padding mask (GRPO's left-padded prompts) SDPA's integration repeats each key and
    value head for its group of query heads before attending (repeat_kv: read once, written and read `groups` times;
    integrations/sdpa_attention.py, use_gqa_in_sdpa wants no mask on CUDA); FlashAttention-2 reads the cache once."""
    groups = arch.num_attention_heads // max(arch.num_kv_heads, 1)
    if train.attn_implementation == "flash_attention_2" or groups <= 1:
        return 2 + 1
    return 2 + 1 + 2 * groups


def backward_ops(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Kernels autograd's engine launches for the backward of one forward's decoder layers and the model around them
    (the LM head's and the loss's are counted with them, in `training_passes`)."""
    family = arch.family
    linears = len(arch.layer_linears())
    frozen = train.uses_lora
    if family.layer_norm_bias:
        norm = 1
    else:
        norm = NORM_BACKWARD_OPS + _norm_casts(train) - (NORM_FROZEN_WEIGHT_SAVING if frozen else 0)
    per_layer = (_norms(arch) * norm + linears * (LINEAR_BACKWARD_OPS + (0 if frozen else WEIGHT_GRAD_OPS))
                 + ROTARY_BACKWARD_OPS + ATTENTION_BACKWARD_OPS + RESIDUAL_BACKWARD_OPS
                 + (GATED_MLP_BACKWARD_OPS if family.gated_mlp else 1))
    per_layer += _layer_extras(arch, train, REPEAT_KV_BACKWARD_OPS, LORA_BACKWARD_OPS_PER_LINEAR, None)
    final_norm = 1 if family.layer_norm_bias else NORM_BACKWARD_OPS + _norm_casts(train)
    return arch.num_layers * per_layer + final_norm + (0 if frozen else EMBEDDING_BACKWARD_OPS)


def _lora_casts(train: TrainingConfig) -> int:
    """PEFT's casts per adapted linear and forward: the input to the adapters' dtype and the result back, and under
    autocast the adapters' weights and input to the compute dtype."""
    s = m.sizes(train)
    if s.trainable == s.compute:
        return 0
    return LORA_CAST_OPS_PER_LINEAR + (LORA_AUTOCAST_OPS_PER_LINEAR if train.mixed_precision != "no" else 0)


def fused_head_work(arch: ModelArchitecture, train: TrainingConfig, tokens: int) -> tuple[Work, Work]:
    """Forward and backward of TRL's fused LM head over `tokens` scored tokens: the logits' FLOPs once forward, and
    again backward (recomputed) with the hidden states' gradient and, where the head trains, the weight's."""
    tiles = math.ceil(tokens / FUSED_HEAD_TOKENS) * math.ceil(arch.vocab_size / FUSED_HEAD_VOCAB)
    logits_flops = 2 * tokens * arch.hidden_size * arch.vocab_size
    logits_bytes = tokens * arch.vocab_size * m.sizes(train).compute
    trains_head = not train.uses_lora
    # the vocabulary slice's cast to the compute dtype, where the head's weight is stored wider (autocast)
    cast = 1 if m.autocast_casts_weights(train) else 0
    head_bytes = arch.vocab_size * arch.hidden_size * m.sizes(train).weight
    forward = Work(logits_flops, FUSED_HEAD_FORWARD_ACCESSES * logits_bytes + head_bytes,
                   tiles * (FUSED_HEAD_FORWARD_OPS_PER_TILE + cast) + FUSED_HEAD_FORWARD_OPS)
    grads = 3 if trains_head else 2  # the recomputed logits, the hidden states' gradient, the weight's
    backward = Work(grads * logits_flops,
                    (FUSED_HEAD_BACKWARD_ACCESSES + int(trains_head)) * logits_bytes + 2 * head_bytes,
                    tiles * (FUSED_HEAD_BACKWARD_OPS_PER_TILE + int(trains_head) + cast) + FUSED_HEAD_BACKWARD_OPS)
    return forward, backward


def elementwise_bytes_per_token(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Bytes per token the elementwise kernels of one forward's decoder layers move, summed over the layers: the
    norms, rotary, SDPA's inputs and output (and repeat_kv's copies), the residual adds, the MLP's activation and
    product, and PEFT's casts, scaling and sum per adapted linear."""
    family, sz = arch.family, m.sizes(train)
    h, i, c = arch.hidden_size, arch.intermediate_size, sz.compute
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    norm = 2 * sz.residual if family.layer_norm_bias else NORM_BYTES_PER_ELEMENT[
        "16-bit" if sz.residual < 4 else "float32"]
    per_layer = family.norms_per_layer * norm * h + (norm * (q + kv) if family.qk_norm else 0)
    per_layer += ROTARY_PASSES * 2 * c * (q + kv)
    per_layer += c * (2 * q + 2 * kv) + 2 * c * q  # SDPA reads q, k, v and writes its output; the contiguous copy
    if arch.num_attention_heads > arch.num_kv_heads and train.attn_implementation != "flash_attention_2":
        per_layer += 2 * c * (kv + q)  # repeat_kv: keys and values read, written at every query head
    per_layer += 2 * 3 * sz.residual * h  # two residual adds: two reads, one write
    per_layer += (5 if family.gated_mlp else 2) * c * i  # the activation (read, write), the product (two reads, write)
    if train.uses_lora:
        cast = (2 * c + 2 * sz.trainable) if _lora_casts(train) else 0  # to the adapters' dtype and back to c
        per_layer += sum(cast * lin.in_features + 5 * c * lin.out_features  # the scaling's mul, the sum
                         for lin in arch.lora_linears(train.lora_targets))
    return arch.num_layers * per_layer


@remembered_work
def training_passes(arch: ModelArchitecture, train: TrainingConfig, sequences: int, prompt: int,
                    completion: int) -> tuple[Work, Work]:
    """The loss forward of one micro-batch (the backbone, the LM head over the completions and TRL's loss), and its
    backward (checkpointing's second forward of each layer included). They are apart because the host waits for the
    device between them: the LM head's boolean mask and the loss's metrics (`.item()`) synchronize."""
    length = prompt + completion
    fused = train.release.lm_head == "fused_chunked"
    backbone = forward_work(arch, train, sequences, length, length / 2, 0 if fused else completion)
    activations = sequences * length * elementwise_bytes_per_token(arch, train)
    backbone = replace(backbone, ops=layer_ops(arch, train, cache=False, rows=sequences * length),
                       bytes_moved=backbone.bytes_moved + activations)
    frozen = train.uses_lora
    multiplier = FROZEN_BACKWARD_FLOPS_PER_FORWARD if frozen else BACKWARD_FLOPS_PER_FORWARD
    # the backward reads each weight again and writes (full fine-tuning) a gradient of the trainable dtype
    grads = m.trainable_params(arch, train) * m.sizes(train).trainable
    backward = Work(multiplier * backbone.flops,
                    backbone.bytes_moved + (ELEMENTWISE_BACKWARD_PER_FORWARD - 1) * activations + grads,
                    backward_ops(arch, train))
    if train.gradient_checkpointing:  # each layer's forward again, not the model's ops around them nor the head
        head_flops = 0 if fused else sequences * completion * 2 * arch.hidden_size * arch.vocab_size
        backward = backward + Work(backbone.flops - head_flops, backbone.bytes_moved,
                                   backbone.ops - MODEL_OPS_PER_FORWARD)
    forward = backbone + Work(ops=LOSS_OPS)
    backward = backward + Work(ops=LOSS_BACKWARD_OPS)
    if fused:
        head_forward, head_backward = fused_head_work(arch, train, sequences * completion)
        forward, backward = forward + head_forward, backward + head_backward
    return forward, backward


def training_work(arch: ModelArchitecture, train: TrainingConfig, sequences: int, prompt: int,
                  completion: int) -> Work:
    """Forward and backward of one micro-batch, with checkpointing's second forward of each layer."""
    forward, backward = training_passes(arch, train, sequences, prompt, completion)
    return forward + backward
