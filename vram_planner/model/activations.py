"""What one decoder layer keeps for backward, tensor by tensor, in bytes per token.

Counted from the autograd graph that transformers 5.x builds for a Llama-style layer under accelerate's autocast
(every count below was checked against `vram-plan trace`, which runs the real modeling code):

- RMSNorm upcasts its input to float32 and keeps it and the per-row rsqrt; the normalised tensor is kept only when
  the norm's weight trains (the weight multiply needs it), in the input's dtype.
- A linear keeps its input in the compute dtype for the weight gradient. Autocast casts a float32 input separately
  for each linear that reads it; a frozen linear keeps no input at all. Under PEFT, `lora_A` reads a copy cast to the
  adapter's dtype and autocast casts that again, so every adapted linear keeps its own compute-dtype copy.
  With LoRA and no checkpointing the first layer's input needs no gradient: its input norm keeps nothing and the
  linears reading it keep no weight cast (`first_layer_input_without_grad`).
- Rotary embeddings keep nothing large (one cos and one sin of the sequence, shared by the batch and every layer:
  `rotary_saved_bytes`). SDPA keeps q, k and v repeated to every query head
  (transformers repeats k/v whenever an attention mask is passed, and GRPO batches are padded; with one key/value
  head the repeat is a view), its output and a
  float32 log-sum-exp per head, plus a [B, 1, L, L] float mask in the compute dtype that each layer converts from the
  boolean one.
- Eager attention (transformers' eager_attention_forward, llama's and gemma2's alike) keeps, per head and query, a row
  of L: softmax's float32 output, the probabilities in the compute dtype for the matmul with v (a cast of their own
  unless that is float32), and with Gemma 2's softcapping tanh's output. Backward through softmax then holds the
  gradient of its output and of its input, both float32, after the matmul has freed its copy
  (`eager_softmax_backward_bytes`). Its masks are float, in the embeddings' dtype.
- Gemma 2 and 3 build a full and a sliding mask for their two kinds of layers; checkpointed layers keep both.
- The gated MLP keeps the gate and up projections, the activation of the gate, and the product (down's input). A
  kernel activation (silu, gelu) keeps its input; phi's gelu_new is a Python expression and keeps four tensors
  as wide as the MLP (`ACTIVATION_SAVED_TENSORS`).
- phi runs attention and MLP side by side on one LayerNorm's output (four readers of one tensor). LayerNorm's
  kernel keeps its input, a mean and a reciprocal deviation per row, and recomputes the normalised tensor.
  phi-2's resid_pdrop puts dropout on both outputs: CUDA's fused kernel keeps a one-byte mask of each (the trace
  takes that kernel; the CPU's keeps a noise tensor in the input's dtype). Partial rotary changes nothing kept: q
  and k leave rotary as one concatenated tensor, which SDPA's casts replace as before.
- phi3 fuses q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`): each norm output has one reader, and the v that SDPA
  keeps is a slice of the fused output, which keeps all of it alive. (The CPU flash kernel lays its output out like
  its query, which phi3's rotary makes head-major, so with full fine-tuning the trace also counts o_proj's contiguous
  copy of it, one q-wide tensor per layer; CUDA's memory-efficient kernel writes the token-major layout o_proj reads,
  which is what is counted here.)

Symbols as in `vram_planner.model.components`. Liger's kernels keep less; their coefficients stay in the calibration.
"""

from __future__ import annotations

from vram_planner.model import inference
from vram_planner.model.architecture import Linear, ModelArchitecture
from vram_planner.model.blocks import blocks
from vram_planner.model.calibration import Calibration
from vram_planner.model.components import FP32_BYTES, adapter_cast_bytes, autocast_casts_weights, sizes
from vram_planner.model.spec import TrainingConfig

BOOL_BYTES = 1
# Tensors as wide as the MLP that an activation keeps for backward, where transformers writes it as an expression
# (transformers/activations.py); a kernel (silu, gelu, gelu_pytorch_tanh, relu) keeps its input only.
# gelu_new, 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3))): pow keeps x, tanh its output, and the
# last product its two factors, 0.5 * x and 1 + tanh(...).
ACTIVATION_SAVED_TENSORS = {"gelu_new": 4}


def _autocast(train: TrainingConfig) -> bool:
    return train.mixed_precision != "no"


def mlp_activation_bytes(train: TrainingConfig) -> int:
    """The dtype width of the MLP's tensors (the gate and up projections' outputs, the activation, the product that
    the output projection reads, and its output): the compute dtype, but over 4-bit weights under autocast the
    residual stream's. bitsandbytes' Linear4bit hands its output back in its input's dtype (bitsandbytes 0.50
    nn/modules.py Linear4bit.forward: `.to(inp_dtype)`), and the MLP's first projections read the norm's output in
    the residual's dtype: float32 over float32 weights, where the attention's tensors are SDPA's compute-dtype casts
    all the same. (Qwen2.5-1.5B's float32 QLoRA, 8 x 192 tokens, no checkpointing: the trace kept 53.8 KB a token and
    layer more than the estimate, three float32 MLP tensors where it counted them in bfloat16.)"""
    s = sizes(train)
    return s.residual if train.load_in_4bit and _autocast(train) else s.compute


def _lora_targets(arch: ModelArchitecture, train: TrainingConfig) -> set[str]:
    return arch.resolve_lora_targets(train.lora_targets) if train.uses_lora else set()


def hub_rms_norm(arch: ModelArchitecture, train: TrainingConfig) -> bool:
    """Whether the Hub's RMSNorm kernel (LigerRMSNorm) runs the model's RMSNorms: the model is kernelized (by
    transformers' default or use_kernels, `TrainingConfig.hub_kernel_layers`) and its RMSNorm is decorated for it."""
    return "RMSNorm" in train.hub_kernel_layers and arch.family.hub_rms_norm


def hub_rotary_refuses(arch: ModelArchitecture, train: TrainingConfig) -> bool:
    """Whether the model is kernelized with the Hub's rotary kernel where its op's dtype check
    (`x1.dtype() == cos.dtype()`) meets autocast's 16-bit q beside the float32 stream's cos: float32 weights under
    mixed precision (vram_planner.tracing.hub_kernels traces the torch code there)."""
    s = sizes(train)
    return "rotary_pos_emb" in train.hub_kernel_layers and arch.family.hub_rotary and s.residual != s.compute


def norm_saved_bytes(arch: ModelArchitecture, train: TrainingConfig, width: int, input_bytes: int, trainable: bool,
                     rows: int = 1) -> float:
    """RMSNorm over `width` elements: its float32 input (or upcast copy), rsqrt per row, the normalised tensor.

    Llama-style norms cast the normalised tensor back to the input's dtype before the weight multiplies it; Gemma's
    multiply in float32. LayerNorm (phi) keeps its input, a mean and a reciprocal deviation per row, and never the
    normalised tensor (its backward recomputes it); the input as float32, as CUDA's autocast casts it. The Hub's
    RMSNorm kernel keeps its input as it came and a float32 rstd per row (`hub_rms_norm`).
    """
    if arch.family.layer_norm_bias:
        return FP32_BYTES * width + 2 * FP32_BYTES * rows
    if hub_rms_norm(arch, train):
        return input_bytes * width + FP32_BYTES * rows
    normed_bytes = FP32_BYTES if arch.family.fp32_norm_scale else input_bytes
    return FP32_BYTES * width + FP32_BYTES * rows + (normed_bytes * width if trainable else 0)


def linear_inputs_saved_bytes(arch: ModelArchitecture, train: TrainingConfig, readers: list[Linear],
                              input_bytes: int) -> float:
    """Per token: the copies of one tensor that the linears reading it keep for backward."""
    s = sizes(train)
    width = readers[0].in_features
    if not train.uses_lora:
        if not _autocast(train) or input_bytes == s.compute:
            return width * s.compute  # every reader keeps the same tensor
        return len(readers) * width * s.compute  # autocast casts it once per reader
    adapted = [lin for lin in readers if lin.name in _lora_targets(arch, train)]
    if not adapted:
        return 0
    kept = s.compute if _autocast(train) else s.trainable
    shared = input_bytes == s.trainable == kept and not train.lora_dropout
    mask = BOOL_BYTES if train.lora_dropout else 0
    return width * kept if shared else len(adapted) * width * (kept + mask)


def lora_rank_saved_bytes(arch: ModelArchitecture, train: TrainingConfig, linears: list[Linear] | None = None) -> float:
    """Per token: x @ A of every adapter (of `linears`, None: the layer's), rank wide, kept by lora_B."""
    if not train.uses_lora:
        return 0
    s = sizes(train)
    kept = s.compute if _autocast(train) else s.trainable
    adapted = [lin for lin in linears or arch.layer_linears() if lin.name in _lora_targets(arch, train)]
    return len(adapted) * (train.lora_r or 0) * kept


def attention_saved_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Per token: what the attention core keeps (after the q/k/v projections, before o_proj)."""
    s = sizes(train)
    c, a, k = s.compute, arch.num_attention_heads, arch.num_kv_heads
    q_width, kv_width = a * arch.head_dim, k * arch.head_dim
    total = _qk_norm_saved_bytes(arch, train)
    if train.attn_implementation == "flash_attention_2":
        return total + c * (2 * q_width + 2 * kv_width) + FP32_BYTES * a  # q, k, v, output, log-sum-exp
    if train.attn_implementation == "eager":
        # q and k as the scores' matmul keeps them, v as the probabilities' matmul does, the scores' rows; neither
        # matmul keeps its output, which only a trained o_proj keeps (with LoRA, lora_A keeps its own copy)
        output = 0 if train.uses_lora else c * q_width
        return (total + c * q_width + output + _repeated_kv_saved_bytes(arch, train)
                + a * train.sequence_length * eager_scores_saved_bytes(arch, train))
    total += c * 2 * q_width + _repeated_kv_saved_bytes(arch, train)  # q and the output; k and v
    total += _contiguous_inputs_saved_bytes(arch, train)
    # log-sum-exp per head; from transformers 4.53 SDPA converts the boolean mask to a float one in each layer (a row
    # per token), before it one float mask served all layers (kept_mask_bytes)
    per_layer = train.transformers.attention_mask == "per_layer" and masked_log_prob_forward(train)
    return total + FP32_BYTES * a + (c * train.sequence_length if per_layer else 0)


def masked_log_prob_forward(train: TrainingConfig) -> bool:
    """Whether the loss forward gets the batch's attention mask: TRL 0.14 passes none (profiles/trl.toml
    log_prob_attention_mask), so its forward attends causally and builds no mask."""
    return train.release.log_prob_attention_mask == "passed"


def _qk_norm_saved_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Per token: the per-head RMSNorm of q and k (Qwen3, Gemma 3), on the projections' compute-dtype output."""
    if not arch.family.qk_norm:
        return 0
    c, a, k, full = sizes(train).compute, arch.num_attention_heads, arch.num_kv_heads, not train.uses_lora
    return (norm_saved_bytes(arch, train, a * arch.head_dim, c, full, rows=a)
            + norm_saved_bytes(arch, train, k * arch.head_dim, c, full, rows=k))


def eager_scores_saved_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Per head, query and key: what eager attention keeps of its scores.

    softmax(..., dtype=float32) keeps its float32 output; the matmul with v keeps the probabilities in the compute
    dtype, a copy of their own (`.to(query.dtype)` or autocast's cast) unless that is float32; softcapping's tanh
    keeps its output in the scores' dtype, the compute dtype. Scaling, softcapping's divide and multiply by a number,
    and adding the mask keep nothing.
    """
    c = sizes(train).compute
    return FP32_BYTES + _probabilities_cast_bytes(train) + (c if arch.attn_logit_softcapping else 0)


def eager_softmax_backward_bytes(arch: ModelArchitecture, train: TrainingConfig, cal: Calibration,
                                 tokens: int) -> float:
    """One layer's tensors at the peak of eager attention's backward, softmax's, over `tokens` tokens (0 without
    eager attention).

    Backward has freed what the layer made after the scores (the MLP's tensors, o_proj's input, the probabilities'
    compute-dtype copy and v, which the matmul with v kept), and holds the gradient of softmax's float32 output
    while it makes the gradient of its input, float32 too: a [B, a, L, L] each. Alive besides: what the layer kept
    up to the scores (its input norm, the q/k/v projections' inputs and adapter ranks, q and k as the scores'
    matmul keeps them, softmax's and tanh's outputs), v's gradient as the matmul gave it (autograd runs the scores'
    branch first), and the gradient of the layer's output.
    """
    if train.attn_implementation != "eager" or train.use_liger_kernel:
        return 0
    s = sizes(train)
    c, a = s.compute, arch.num_attention_heads
    q_width = a * arch.head_dim
    linears = {lin.name: lin for lin in arch.layer_linears()}
    attention_in = [lin for lin in linears.values()
                    if lin.name in ("qkv_proj", "q_proj", "k_proj", "v_proj")] or [linears["q_proj"]]
    per_token = norm_saved_bytes(arch, train, arch.hidden_size, s.residual, not train.uses_lora)
    per_token += linear_inputs_saved_bytes(arch, train, attention_in, s.residual)
    per_token += _qk_norm_saved_bytes(arch, train) + c * q_width + _key_saved_bytes(arch, train)
    per_token += a * train.sequence_length * (eager_scores_saved_bytes(arch, train) - _probabilities_cast_bytes(train)
                                              + 2 * FP32_BYTES)
    per_token += c * q_width  # v's gradient, repeated to every head
    per_token += lora_rank_saved_bytes(arch, train, attention_in)
    per_token += cal.backward_hidden_bytes * arch.hidden_size * s.residual / 2
    return tokens * per_token


def _probabilities_cast_bytes(train: TrainingConfig) -> int:
    """Per score: eager attention's compute-dtype copy of the float32 probabilities (none when that is float32)."""
    c = sizes(train).compute
    return c if c != FP32_BYTES else 0


def activation_saved_tensors(arch: ModelArchitecture) -> int:
    """MLP-wide tensors the MLP's activation keeps for backward (its input among them)."""
    return ACTIVATION_SAVED_TENSORS.get(arch.hidden_act, 1)


def _repeated_kv_saved_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Per token: k and v as SDPA (or eager attention's two matmuls) keeps them, repeated to every query head by
    transformers' repeat_kv.

    With one key/value head the repeat is a view (expand, then a reshape that needs no copy), so v stays kv wide; k
    does too unless autocast has to cast it (its rotary output follows a float32 residual stream), and the cast of
    the expanded view is q wide. The same holds for multi-head attention, where nothing repeats.
    """
    c, k = sizes(train).compute, arch.num_kv_heads
    q_width, kv_width = arch.num_attention_heads * arch.head_dim, k * arch.head_dim
    # SDPA with enable_gqa: k and v reach the kernel grouped, never repeated (nor expanded, so a cast of k is kv wide)
    grouped = (train.transformers.sdpa_gqa_without_mask and not masked_log_prob_forward(train)
               and train.attn_implementation == "sdpa")
    if k > 1 and q_width != kv_width and not grouped:
        return 2 * c * q_width
    # phi3's v is a slice of the fused qkv_proj output: keeping it keeps the q and k columns of that tensor too
    fused = c * (q_width + kv_width) if arch.family.fused_qkv else 0
    key = c * kv_width if grouped else _key_saved_bytes(arch, train)
    return key + c * kv_width + fused


def _contiguous_inputs_saved_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Per token: what SDPA keeps more where transformers makes its inputs contiguous first (before 4.56,
    profiles/transformers.toml sdpa_contiguous_inputs). With one key/value head repeat_kv's k and v are views, which
    `.contiguous()` copies to the query's width. The query leaves a full rotary head-major but not contiguous; its
    copy makes the attention's output come back contiguous in that layout, so `transpose(1, 2).contiguous()` copies
    it before o_proj, which (trained in full) keeps that copy besides SDPA's own output. Phi's partial rotary
    concatenates q into a contiguous tensor: nothing is copied."""
    if not train.transformers.sdpa_contiguous_inputs:
        return 0
    c, k = sizes(train).compute, arch.num_kv_heads
    q_width, kv_width = arch.num_attention_heads * arch.head_dim, k * arch.head_dim
    extra = 0.0
    if k == 1 and q_width != kv_width:
        extra += 2 * c * q_width - _repeated_kv_saved_bytes(arch, train)
    if not arch.family.partial_rotary and not train.uses_lora:
        extra += c * q_width
    return extra


def _key_saved_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Per token: k as the attention keeps it (`_repeated_kv_saved_bytes`)."""
    s = sizes(train)
    c, k = s.compute, arch.num_kv_heads
    q_width, kv_width = arch.num_attention_heads * arch.head_dim, k * arch.head_dim
    key_cast = _autocast(train) and s.residual != c
    return c * (q_width if (k > 1 and q_width != kv_width) or key_cast else kv_width)


def layer_saved_bytes(arch: ModelArchitecture, train: TrainingConfig, tokens: int) -> float:
    """Tensors one decoder layer keeps from forward to backward over `tokens` tokens (no checkpointing)."""
    s = sizes(train)
    r, c = s.residual, s.compute
    f = arch.family
    full = not train.uses_lora
    linears = {lin.name: lin for lin in arch.layer_linears()}
    attention_in = [lin for lin in linears.values()
                    if lin.name in ("qkv_proj", "q_proj", "k_proj", "v_proj")] or [linears["q_proj"]]
    out_proj = linears[f.attention_out_name]
    mlp_in, mlp_out = [linears[n] for n in f.mlp_names[:-1]], linears[f.mlp_names[-1]]
    i = arch.intermediate_size

    parallel = f.norms_per_layer == 1  # phi: attention and MLP read the output of the layer's one norm
    per_token = (1 if parallel else 2) * norm_saved_bytes(arch, train, arch.hidden_size, r, full)
    if parallel:
        per_token += linear_inputs_saved_bytes(arch, train, attention_in + mlp_in, r)
    else:
        per_token += linear_inputs_saved_bytes(arch, train, attention_in, r)
        per_token += linear_inputs_saved_bytes(arch, train, mlp_in, r)
    per_token += attention_saved_bytes(arch, train)
    if train.uses_lora:  # fully trained, o_proj keeps the attention output that the attention kept already
        per_token += linear_inputs_saved_bytes(arch, train, [out_proj], c)
    if f.norms_per_layer == 4:  # Gemma 2/3 also normalise each sublayer's compute-dtype output
        per_token += 2 * norm_saved_bytes(arch, train, arch.hidden_size, c, full)
    if arch.resid_dropout:  # phi: dropout on the attention's and the MLP's outputs keeps its bool mask
        per_token += 2 * arch.hidden_size * BOOL_BYTES
    # what the activation keeps of the gate's (plain: fc1's) output; gated: also the up projection and the
    # activation's output, the product's factors
    mlp = mlp_activation_bytes(train)
    per_token += mlp * i * (activation_saved_tensors(arch) + (2 if f.gated_mlp else 0))
    per_token += linear_inputs_saved_bytes(arch, train, [mlp_out], mlp)
    per_token += lora_rank_saved_bytes(arch, train)
    return tokens * per_token


def recomputed_forward_bytes(arch: ModelArchitecture, train: TrainingConfig, tokens: int) -> float:
    """Under gradient checkpointing, what the layer's recomputed forward holds beside its saved tensors when it
    reaches the MLP's output projection, the last and widest moment of the recomputation (checked against the trace
    of SmolLM2 with LoRA, where it decides the loss phase).

    The residual stream after attention waits for the layer's last addition (phi's parallel layer adds to its
    input, kept already; the Hub's RMSNorm kernel keeps it as the post-attention norm's input, counted there), the
    output projection's result waits for its adapter's, and with frozen base layers (LoRA)
    the MLP's input (the norm's output) and the output projection's input are held by the forward's own references
    only, until the MLP returns; a trained linear keeps its input anyway. PEFT's float32 copy of that input for a
    float32 adapter exists while the adapter runs (`components._adapter_input_copy_bytes` counts it in the
    backward's working set, where it is the adapter input's gradient); with `lora_dropout` the dropout's output of
    that copy is beside it until lora_A's autocast cast is made (its mask is kept, counted with the saved tensors).
    """
    if not train.gradient_checkpointing:
        return 0.0
    s = sizes(train)
    r, c, hidden = s.residual, s.compute, arch.hidden_size
    mlp, mlp_out = mlp_activation_bytes(train), arch.layer_linears()[-1]
    kept_by_the_norm = arch.family.norms_per_layer == 1 or hub_rms_norm(arch, train)
    per_token = mlp * hidden + (0 if kept_by_the_norm else r * hidden)
    if train.uses_lora:
        per_token += r * hidden + mlp * mlp_out.in_features
        adapted = mlp_out.name in _lora_targets(arch, train)
        if adapted and _autocast(train) and s.trainable != c:
            per_token += FP32_BYTES * mlp_out.in_features * (2 if train.lora_dropout else 1)
    elif r != c:  # autocast casts the float32 norm output once per reader; the output itself is the forward's
        per_token += r * hidden
    return tokens * per_token


def liger_layer_saved_bytes(arch: ModelArchitecture, train: TrainingConfig, cal: Calibration, tokens: int) -> float:
    """With Liger's layer kernels (RMSNorm, SwiGLU, RoPE): coefficients from the calibration, per element."""
    s = sizes(train)
    scale = s.compute / 2
    per_token = (cal.liger_act_hidden_bytes * arch.hidden_size * s.residual / 2
                 + scale * (cal.liger_act_query_bytes * arch.num_attention_heads * arch.head_dim
                            + cal.liger_act_kv_bytes * arch.num_kv_heads * arch.head_dim
                            + cal.liger_act_mlp_bytes * arch.intermediate_size))
    core = FP32_BYTES * arch.num_attention_heads  # SDPA's log-sum-exp, as without Liger
    if train.attn_implementation == "sdpa":
        core += s.compute * train.sequence_length
    return tokens * (per_token + core + lora_rank_saved_bytes(arch, train))


def decoder_saved_bytes(arch: ModelArchitecture, train: TrainingConfig, cal: Calibration, tokens: int) -> float:
    """Everything the decoder stack keeps for backward: every layer, or only layer inputs under checkpointing."""
    s = sizes(train)
    if train.gradient_checkpointing:
        layers = arch.num_layers * tokens * arch.hidden_size * s.residual
    elif train.use_liger_kernel:
        layers = arch.num_layers * liger_layer_saved_bytes(arch, train, cal, tokens)
    else:
        layers = (arch.num_layers * layer_saved_bytes(arch, train, tokens)
                  - first_layer_unkept_bytes(arch, train, tokens))
    return layers + final_norm_saved_bytes(arch, train, tokens) + rotary_saved_bytes(arch, train)


def rotary_saved_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The loss forward's rotary cos and sin, kept for backward by every layer's `q * cos + rotate_half(q) * sin`
    (under checkpointing by the arguments each layer's recomputation runs with; by the Hub's rotary kernel, whose
    backward needs them, too), each a storage in whole blocks."""
    return inference.rotary_tables(arch) * blocks(inference.rotary_table_bytes(arch, train, train.sequence_length))


def first_layer_input_without_grad(train: TrainingConfig) -> bool:
    """Whether the first decoder layer's input needs no gradient: LoRA freezes the embedding, and TRL makes its output
    require grad only under gradient checkpointing, from 0.16 (`enable_input_require_grads`: trl 0.16.0
    trainer/grpo_trainer.py:581, 0.22.0 models/utils.py:492, 1.16.0 trainer/grpo_trainer.py:530; 0.14.0
    trainer/grpo_trainer.py:197-198 only wraps the model with get_peft_model: profiles/trl.toml
    checkpointing_input_grads). Autograd then records nothing of the first layer until a trainable weight joins
    (checked against the trace of TRL 0.14's LoRA step)."""
    return not train.first_layer_input_needs_grad


def _first_norm_readers(arch: ModelArchitecture) -> list[Linear]:
    """The linears that read the first norm's output: the attention's inputs (phi: the MLP's too)."""
    linears = arch.layer_linears()
    names = ("qkv_proj", "q_proj", "k_proj", "v_proj") + (arch.family.mlp_names[:-1]
                                                           if arch.family.norms_per_layer == 1 else ())
    return [lin for lin in linears if lin.name in names] or linears[:1]


def first_layer_unkept_bytes(arch: ModelArchitecture, train: TrainingConfig, tokens: int) -> float:
    """What the first layer keeps less than the others where its input needs no gradient
    (`first_layer_input_without_grad`): its input norm, frozen on a frozen input, keeps nothing for backward."""
    if not first_layer_input_without_grad(train):
        return 0
    return tokens * norm_saved_bytes(arch, train, arch.hidden_size, sizes(train).residual, trainable=False)


def first_layer_unkept_cast_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Weight casts of the first layer that no backward keeps where its input needs no gradient
    (`first_layer_input_without_grad`): a matmul keeps its weight only for its input's gradient, so the linears that
    read the first norm's output (frozen bases and their adapters' lora_A) keep their casts only in autocast's cache,
    which empties when the forward returns. lora_B reads lora_A's output, which does need a gradient."""
    if not first_layer_input_without_grad(train):
        return 0
    s = sizes(train)
    readers = _first_norm_readers(arch)
    base = sum(lin.in_features * lin.out_features for lin in readers) if autocast_casts_weights(train) else 0
    targets = _lora_targets(arch, train)
    adapters = (sum((train.lora_r or 0) * lin.in_features for lin in readers if lin.name in targets)
                if adapter_cast_bytes(arch, train) else 0)
    return (base + adapters) * s.compute


def final_norm_saved_bytes(arch: ModelArchitecture, train: TrainingConfig, tokens: int) -> float:
    return tokens * norm_saved_bytes(arch, train, arch.hidden_size, sizes(train).residual, not train.uses_lora)


def one_layer_saved_bytes(arch: ModelArchitecture, train: TrainingConfig, cal: Calibration, tokens: int) -> float:
    if train.use_liger_kernel:
        return liger_layer_saved_bytes(arch, train, cal, tokens)
    return layer_saved_bytes(arch, train, tokens)


def attention_mask_bytes(train: TrainingConfig, sequences: int, length: int) -> float:
    """The [B, 1, L, L] mask transformers builds for padded batches (FlashAttention-2 unpads instead): from 4.53
    (profiles/transformers.toml attention_mask "per_layer") boolean for SDPA, float in the embeddings' dtype for eager
    attention (masking_utils.eager_mask); before it a float mask in the embeddings' dtype, shared by every layer."""
    if train.attn_implementation == "flash_attention_2":
        return 0
    boolean = train.transformers.attention_mask == "per_layer" and train.attn_implementation != "eager"
    per_entry = BOOL_BYTES if boolean else sizes(train).residual
    return sequences * length * length * per_entry


def kept_mask_bytes(arch: ModelArchitecture, train: TrainingConfig, sequences: int, length: int) -> float:
    """The masks kept for backward besides the layers' own tensors: the shared float mask of transformers before 4.53
    (every layer's attention keeps it), or under checkpointing the later masks (the checkpointed layers' input): one
    per kind of layer (Gemma 2 and 3: full and sliding)."""
    if not masked_log_prob_forward(train):
        return 0
    if train.transformers.attention_mask == "shared" or train.gradient_checkpointing:
        return arch.attention_mask_kinds * attention_mask_bytes(train, sequences, length)
    return 0
