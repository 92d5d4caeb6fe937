"""The work of one pass of the model: FLOPs, bytes moved and eager operations, as pure functions of the architecture.

What a GPU does in a pass is bounded three ways (vram_planner/model/step_time.py turns them into seconds): its
matmuls' FLOPs at the card's tensor throughput, the bytes its kernels read and write at the card's memory bandwidth,
and, for small batches in eager PyTorch, the host's time to launch each operation. Symbols as in components.py:
N the decoder's linear parameters, h hidden size, V vocabulary, L tokens of a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from vram_planner.model import components as m
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.spec import Optimizer, TrainingConfig

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
# bitsandbytes' 4-bit Linear dequantizes its weight before the matmul (bnb.matmul_4bit for batches over one token):
# one more kernel per linear, reading the packed weight and writing a 16-bit copy that the matmul then reads.
DEQUANT_OPS_PER_LINEAR = 1
DEQUANT_BYTES_PER_PARAM = 2 + 2  # the 16-bit copy written, then read by the matmul (besides the 4-bit read)
# Autocast casts each float32 weight to the compute dtype at every use: one more kernel per linear (torch's
# autocast, cached_cast), besides the bytes `weight_pass_bytes` counts.
CAST_OPS_PER_LINEAR = 1
# Per decoding step, generate() samples (logits processors, softmax, multinomial), updates the attention mask and
# the cache positions and checks its stopping criteria (transformers' generation/utils.py, _sample).
GENERATE_OPS_PER_TOKEN = 30
# A backward launches about twice a forward's kernels (each op's input gradient, and its weight gradient where the
# op has weights), as autograd records one backward node per forward op.
BACKWARD_OPS_PER_FORWARD_OP = 2
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


def layer_ops(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Eager ops of one forward: every decoder layer's and the model's own around them."""
    family = arch.family
    linears = len(arch.layer_linears())
    s = m.sizes(train)
    sixteen_bit = s.residual < 4  # float32 weights keep a float32 residual stream under autocast
    norms = family.norms_per_layer + (2 if family.qk_norm else 0)
    # a LayerNorm is one fused kernel (native_layer_norm)
    norm_ops = 1 if family.layer_norm_bias else NORM_OPS + (NORM_CAST_OPS if sixteen_bit else 0)
    per_layer = (norms * norm_ops + linears + ROTARY_OPS
                 + CACHE_UPDATE_OPS + ATTENTION_OPS + RESIDUAL_OPS + (GATED_MLP_OPS if family.gated_mlp else 1))
    if arch.num_attention_heads > arch.num_kv_heads and train.attn_implementation != "flash_attention_2":
        per_layer += REPEAT_KV_OPS
    if train.uses_lora:
        casts = LORA_CAST_OPS_PER_LINEAR if s.trainable != s.compute else 0
        if casts and train.mixed_precision != "no":
            casts += LORA_AUTOCAST_OPS_PER_LINEAR
        per_layer += (LORA_OPS_PER_LINEAR + casts) * len(arch.lora_linears(train.lora_targets))
    if train.load_in_4bit:
        per_layer += DEQUANT_OPS_PER_LINEAR * linears
    elif m.autocast_casts_weights(train):
        per_layer += CAST_OPS_PER_LINEAR * linears
    return arch.num_layers * per_layer + MODEL_OPS_PER_FORWARD


def weight_pass_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Bytes one forward moves to use every weight once: the weights as stored, plus autocast's 16-bit copy of each
    float32 linear weight (written, then read by the matmul) or bitsandbytes' dequantized copy of each 4-bit one."""
    linear = arch.linear_params
    if train.load_in_4bit:
        packed = m.NF4_BYTES_PER_PARAM + m.NF4_ABSMAX_BYTES_PER_PARAM
        rest = (arch.params - linear) * m.sizes(train).weight
        return linear * (packed + DEQUANT_BYTES_PER_PARAM) + rest
    s = m.sizes(train)
    cast = linear * 2 * s.compute if m.autocast_casts_weights(train) else 0
    adapters = m.trainable_params(arch, train) * s.trainable if train.uses_lora else 0
    return arch.params * s.weight + cast + adapters


def forward_work(arch: ModelArchitecture, train: TrainingConfig, sequences: int, tokens: int, context: float,
                 logit_tokens: int) -> Work:
    """One forward of `sequences` sequences of `tokens` new tokens each, attending to `context` keys on average,
    with logits for `logit_tokens` of each sequence's positions (TRL's logits_to_keep; generate() keeps one)."""
    lora = m.trainable_params(arch, train) if train.uses_lora else 0
    per_token = 2 * (arch.linear_params + lora)
    flops = sequences * (tokens * per_token + attention_flops(arch, tokens, context)
                         + logit_tokens * 2 * arch.hidden_size * arch.vocab_size)
    return Work(flops=flops, bytes_moved=weight_pass_bytes(arch, train), ops=layer_ops(arch, train))


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


def training_work(arch: ModelArchitecture, train: TrainingConfig, sequences: int, prompt: int,
                  completion: int) -> Work:
    """Forward and backward of one micro-batch, with checkpointing's second forward of each layer."""
    length = prompt + completion
    forward = forward_work(arch, train, sequences, length, length / 2, completion)
    frozen = train.uses_lora
    backward_flops = (FROZEN_BACKWARD_FLOPS_PER_FORWARD if frozen else BACKWARD_FLOPS_PER_FORWARD) * forward.flops
    # the backward reads each weight again and writes (full fine-tuning) a gradient of the trainable dtype
    grads = m.trainable_params(arch, train) * m.sizes(train).trainable
    backward = Work(backward_flops, forward.bytes_moved + grads, BACKWARD_OPS_PER_FORWARD_OP * forward.ops)
    recompute = forward if train.gradient_checkpointing else Work()
    return forward + backward + recompute


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
# transformers' Trainer clips gradients (max_grad_norm=1.0): a norm over every gradient (one read), then a scale
# (one read, one write).
CLIP_GRAD_ACCESSES = 3


def optimizer_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Bytes one optimizer step moves on one GPU, gradient clipping included (ZeRO and FSDP step their shard)."""
    trainable = m.trainable_params(arch, train)
    width = m.sizes(train).trainable
    opt = train.optim
    if opt.is_8bit:
        per_param = BNB_8BIT_BYTES_PER_PARAM["one_state" if "lion" in opt.value else "two_states"]
    elif opt is Optimizer.adamw_torch_fused:
        per_param = OPTIMIZER_ACCESSES["fused"] * width
    elif opt is Optimizer.sgd:
        per_param = OPTIMIZER_ACCESSES["sgd"] * width
    elif opt is Optimizer.adafactor:
        per_param = OPTIMIZER_ACCESSES["adafactor"] * width
    elif opt in (Optimizer.rmsprop, Optimizer.adagrad, Optimizer.lion_32bit):
        per_param = OPTIMIZER_ACCESSES["one_state"] * 4
    else:  # adamw_torch and the paged 32-bit AdamW (bitsandbytes' kernel makes the fused passes)
        fused = opt is Optimizer.paged_adamw_32bit
        per_param = OPTIMIZER_ACCESSES["fused" if fused else "foreach"] * (4 if fused else width)
    step = m.shard_bytes(train, trainable * per_param, 1)
    clip = m.shard_bytes(train, trainable * width * CLIP_GRAD_ACCESSES, 2)
    return step + clip
