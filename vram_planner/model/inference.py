"""What a no-grad forward holds at its widest moment, tensor by tensor: generation's prefill and the log-prob scoring
passes (old and reference log-probs), one decoder layer at a time.

Counted from what `vram-plan trace` sees alive in transformers 5.x's layers (llama, mistral, qwen2, qwen3, gemma
1-3: RMSNorms and a gated MLP of gate, up and down; phi3's fused gate_up and qkv; phi's parallel attention and
fc1/fc2 MLP) under PEFT's LoRA forward; Liger's kernels keep the calibrated working set
(`components.inference_working_bytes`). Gemma 2 and 3 normalise each sublayer's output too, which changes no moment
(the norm's input is freed as its output is made), and build a full and a sliding mask. Nothing is kept for backward, so only the moment
matters: a layer's tensors are freed as its forward moves on.

- Along the whole MLP the residual stream holds four hidden-wide tensors in its dtype: the embeddings (the model's
  forward keeps `inputs_embeds`), the layer's input (the residual), the sum after attention (the next residual) and
  the post-attention norm's output, which the MLP's argument holds until it returns. Autocast's casts of that output
  for each linear live only inside the linear.
- The plain MLP peaks at its product: the gate's activation, the up projection and the product, MLP wide, in the
  compute dtype (`STREAM_TENSORS`, `MLP_TENSORS`).
- An adapted linear (PEFT's `Linear.forward`) first runs the base layer, then copies its input to the adapter's dtype
  when that differs (`_cast_input_dtype`, alive to the end of the forward), lets autocast cast that copy again for
  lora_A, and adds `lora_B(...) * scaling` to the base output: lora_B's output and its scaled copy, or the scaled
  copy and the sum, exist beside the base output. The up projection's adapter runs while the gate's activation is
  alive, so it is the widest moment of a layer with float32 adapters; with float32 weights under autocast the
  input needs no copy there, and the down projection, whose bf16 input is copied to float32 and cast back by
  autocast, is the widest.
- The boolean [B, 1, L, L] mask lives through the forward; SDPA's compute-dtype copy of it (transformers 4.53 on)
  only inside attention, where the MLP's tensors do not exist. Eager attention peaks inside its softmax: the masked
  scores, softmax's float32 copy of them and its float32 output, per head and key; its probabilities, in the
  query's dtype, stay alive through the layer's MLP.
- Generation passes position ids per sequence, so rotary's cos and sin are per token (in the stream's dtype); the
  scoring forward's are per position.
"""

from __future__ import annotations

from vram_planner.model.architecture import Linear, ModelArchitecture
from vram_planner.model.blocks import ROTARY_EMBEDDINGS, blocks
from vram_planner.model.calibration import Calibration
from vram_planner.model.components import FP32_BYTES, sizes
from vram_planner.model.spec import TrainingConfig

# Hidden-wide tensors of the residual stream alive along the MLP, and MLP-wide tensors at its product (see above).
STREAM_TENSORS = 4
MLP_TENSORS = 3
# An fc1/fc2 MLP at its widest: fc1's output and a kernel activation's; gelu_new, written as an expression
# (0.5 * x * (1 + tanh(...))), holds its input, 0.5 * x and two temporaries at once
NON_GATED_MLP_TENSORS = {"gelu_new": 4}
BOOL_BYTES = 1
INT64_BYTES = 8
# generate()'s int64 tensors per prompt token in the prefill: the prompt ids and attention mask, the position ids it
# derives from the mask, and the ids' copy prepare_inputs_for_generation makes
GENERATE_INPUTS = 4


def counted(arch: ModelArchitecture, train: TrainingConfig) -> bool:
    """Whether the layer is counted tensor by tensor here: every layout, without Liger's kernels."""
    return not train.use_liger_kernel


def prefill_bytes(arch: ModelArchitecture, run: TrainingConfig, cal: Calibration, sequences: int,
                  length: int) -> float:
    """Generation's prefill of `sequences` prompts of `length` tokens, as generate() runs it (`run`, with the
    adapters on). The plain MLP moment's tensors are the calibration's (`inference_hidden_bytes` and
    `inference_mlp_bytes`, per element of a 2-byte tensor, which a probe fits on a real GPU; their defaults are the
    counted `STREAM_TENSORS` and `MLP_TENSORS`); rotary's cos and sin are per token, and the prompts' keys and values
    are the cache's."""
    counts = (cal.inference_hidden_bytes / 2, cal.inference_mlp_bytes / 2)
    return (sequences * length * _widest_moment(arch, run, length, run.uses_lora, counts, cached=True)
            + prefill_inputs_bytes(arch, run, sequences, length) + _mask_bytes(arch, run, sequences, length))


def prefill_inputs_bytes(arch: ModelArchitecture, run: TrainingConfig, sequences: int, length: int) -> float:
    """What the prefill's every layer reads beside its hidden states: rotary's cos and sin, per token, and
    generate()'s int64 inputs."""
    rotary = rotary_tables(arch) * arch.head_dim * sizes(run).residual
    return sequences * length * (rotary + GENERATE_INPUTS * INT64_BYTES)


def decoding_inputs_bytes(arch: ModelArchitecture, run: TrainingConfig, sequences: int) -> float:
    """`prefill_inputs_bytes` at a decoding step, one token per sequence: each tensor a block or a few."""
    rotary = rotary_tables(arch) * blocks(sequences * arch.head_dim * sizes(run).residual)
    return rotary + GENERATE_INPUTS * blocks(sequences * INT64_BYTES)


def scoring_bytes(arch: ModelArchitecture, train: TrainingConfig, sequences: int, length: int,
                  adapters: bool, cached: bool = False) -> float:
    """One chunk of the scoring forward: `sequences` sequences of `length` tokens, with the LoRA adapters on
    (`adapters`: the policy's old log-probs) or off (the reference's, the adapters disabled), filling a KV cache
    (`cached`, counted apart) or not."""
    counts = (STREAM_TENSORS, MLP_TENSORS)
    rotary = rotary_tables(arch) * rotary_table_bytes(arch, train, length)
    return (sequences * length * _widest_moment(arch, train, length, adapters and train.uses_lora, counts, cached)
            + _mask_bytes(arch, train, sequences, length) + rotary)


def decoding_repeated_kv_bytes(arch: ModelArchitecture, run: TrainingConfig, kv_bytes: float, tokens: int) -> float:
    """A masked decoding step's k and v of one layer repeated to every query head (`kv_bytes`: the whole cache of
    `tokens` tokens per sequence).

    A padded batch passes generate()'s mask, so SDPA cannot take grouped k and v (use_gqa_in_sdpa wants no mask) and
    repeat_kv copies the layer's whole cached k and v, as eager attention always does; from transformers 5.23 SDPA
    runs a single query on the key/value heads instead (pack_gqa, profiles/transformers.toml sdpa_decoding_gqa).
    With one key/value head the repeat is a view, copied only where SDPA makes its inputs contiguous (before 4.56).
    FlashAttention-2 reads the cache as it is.
    """
    groups = arch.num_attention_heads // arch.num_kv_heads
    sdpa = run.attn_implementation == "sdpa"
    if run.attn_implementation == "flash_attention_2" or groups == 1 or (sdpa and run.transformers.sdpa_decoding_gqa):
        return 0
    if arch.num_kv_heads == 1 and not (sdpa and run.transformers.sdpa_contiguous_inputs):
        return 0
    # the widest layer's cache, a full-attention one's (a sliding window's where every layer slides)
    widest = tokens if arch.sliding_layers < arch.num_layers else min(tokens, arch.sliding_window or tokens)
    return groups * kv_bytes * widest / arch.kv_layers_tokens(tokens)


def batch_ids_bytes(sequences: int, length: int) -> float:
    """The generation batch's token ids and attention mask (int64), alive through every scoring pass."""
    return 2 * INT64_BYTES * sequences * length


def rotary_table_bytes(arch: ModelArchitecture, train: TrainingConfig, length: int) -> float:
    """One rotary table (cos or sin) over `length` positions, in the residual stream's dtype: one row for the whole
    batch, as a forward given no position ids computes it (TRL's scoring and loss passes give none)."""
    return length * arch.head_dim * sizes(train).residual


def rotary_tables(arch: ModelArchitecture) -> int:
    """cos and sin of every rotary embedding the forward runs."""
    return 2 * ROTARY_EMBEDDINGS.get(arch.model_type, 1)


def _mask_bytes(arch: ModelArchitecture, train: TrainingConfig, sequences: int, length: int) -> float:
    """The mask alive at every moment: SDPA's boolean one (transformers 4.53 on), else a float mask in the
    embeddings' dtype that every layer reads (eager attention's; SDPA's before 4.53); none under FlashAttention-2,
    which unpads."""
    if train.attn_implementation == "flash_attention_2":
        return 0
    kinds = arch.attention_mask_kinds  # gemma 2 and 3: a full and a sliding mask
    if train.transformers.attention_mask == "shared" or train.attn_implementation == "eager":
        return kinds * sequences * length * length * sizes(train).residual
    return kinds * sequences * length * length * BOOL_BYTES


def _widest_moment(arch: ModelArchitecture, train: TrainingConfig, length: int, adapters: bool,
                   counts: tuple[float, float], cached: bool) -> float:
    """Per token: the most one layer's forward holds beside the masks, at the MLP or in attention."""
    s = sizes(train)
    h, i = arch.hidden_size, arch.intermediate_size
    f = arch.family
    parallel = f.norms_per_layer == 1  # phi: the attention's output waits for the MLP's, in the compute dtype,
    # in place of the residual sum after attention
    stream = (counts[0] - 1) * h * s.residual + h * (s.compute if parallel else s.residual)
    if train.attn_implementation == "eager":
        # the layer's `hidden_states, _ = self.self_attn(...)` keeps the probabilities (eager attention's second
        # output, in the query's dtype: rotary's, the stream's) in `_` until the layer returns
        stream += arch.num_attention_heads * length * s.residual
    # MLP-wide tensors of the plain moment beyond the gated MLP's three: phi3's gate_up output, 2 wide, which its two
    # halves keep; fc1/fc2 hold fc1's output and its activation, or gelu_new's (a Python expression) widest four
    extra = 1 if f.fused_gate_up else 0
    if not f.gated_mlp:
        extra = NON_GATED_MLP_TENSORS.get(arch.hidden_act, 2) - MLP_TENSORS
    plain = stream + (counts[1] + extra) * i * s.compute
    moments = [plain, _attention_moment(arch, train, length, cached)]
    if adapters:
        linears = {lin.name: lin for lin in arch.lora_linears(train.lora_targets)}
        # the plain moment's MLP-wide tensors that do not exist while each adapted linear runs: all three at the gate;
        # up and the product at up (the gate's activation waits); at down the activation and up, freed once the
        # product (down's input) is made. Fused, nothing at gate_up; at down only the activation is gone. fc2 reads
        # the activation's output alone.
        widest = counts[1] + extra
        if not f.gated_mlp:
            fc1, down = f.mlp_names
            absent = {fc1: widest, down: widest - 1}
        elif f.fused_gate_up:
            gate_up, down = f.mlp_names
            absent = {gate_up: widest, down: 1}
        else:
            gate, up, down = f.mlp_names
            absent = {gate: 3, up: 2, down: 2}
        for name, tensors in absent.items():
            if name in linears:
                input_bytes = s.compute if name == down else s.residual
                moments.append(plain - tensors * i * s.compute
                               + _adapted_linear_bytes(train, linears[name], input_bytes))
    return max(moments)


def _adapted_linear_bytes(train: TrainingConfig, lin: Linear, input_bytes: int) -> float:
    """Per token: PEFT's LoRA linear at its widest, its input's own tensor left out."""
    s = sizes(train)
    autocast = train.mixed_precision != "no"
    adapter = s.compute if autocast else s.trainable  # lora_A's and lora_B's outputs
    base = lin.out_features * s.compute
    copied = input_bytes != s.trainable
    copy = lin.in_features * s.trainable if copied else 0
    # autocast casts lora_A's (float32) input back to the compute dtype while lora_A runs
    recast = lin.in_features * s.compute if autocast and (s.trainable if copied else input_bytes) != s.compute else 0
    # lora_B's output and its scaled copy; then the scaled copy and the sum, promoted to the wider dtype
    summed = lin.out_features * (adapter + max(adapter, s.compute))
    return base + copy + max(recast + (train.lora_r or 0) * s.compute, summed)


def _attention_moment(arch: ModelArchitecture, train: TrainingConfig, length: int, cached: bool) -> float:
    """Per token: attention at its widest, beside the stream's layer input and embeddings and the norm's output.

    q and k after rotary, in the stream's dtype (cos and sin follow it), v in the compute dtype, and k and v repeated
    to every query head by repeat_kv (a padded batch passes a mask; with one key/value head the repeat is a view).
    SDPA adds autocast's compute-dtype casts of q and of the repeated k where the stream is wider, its
    compute-dtype copy of the boolean mask (a row of `length`), its output and a float32 log-sum-exp per head.
    Eager attention peaks inside softmax(..., dtype=float32): the masked scores (the matmul's compute dtype,
    promoted by the mask's), the float32 copy softmax makes of a narrower input, and its float32 output, per head
    and key."""
    s = sizes(train)
    r, c, a = s.residual, s.compute, arch.num_attention_heads
    q_width, kv_width = a * arch.head_dim, arch.num_kv_heads * arch.head_dim
    repeated = (r + c) * q_width if arch.num_kv_heads > 1 and q_width != kv_width else 0
    # k and v themselves are the cache's where the forward fills one (`cached`: counted as the KV cache); phi3's v is
    # a slice of the fused qkv_proj output, which it keeps whole
    v_bytes = c * (q_width + 2 * kv_width) if arch.family.fused_qkv else c * kv_width
    own_kv = 0 if cached else r * kv_width + v_bytes
    held = 3 * arch.hidden_size * r + r * q_width + own_kv + repeated
    if train.attn_implementation == "eager":
        masked = max(c, r)
        upcast = FP32_BYTES if masked != FP32_BYTES else 0
        return held + a * length * (masked + upcast + FP32_BYTES)
    casts = 2 * c * q_width if train.mixed_precision != "no" and r != c else 0
    per_layer_mask = train.attn_implementation == "sdpa" and train.transformers.attention_mask == "per_layer"
    copies, output_copy = _contiguous_inputs_bytes(arch, train)
    # inside the kernel its casts and log-sum-exp; once it returns (they are gone) the output's copy
    return (held + (c * length if per_layer_mask else 0) + c * q_width + copies
            + max(casts + FP32_BYTES * a, output_copy))


def _contiguous_inputs_bytes(arch: ModelArchitecture, train: TrainingConfig) -> tuple[float, float]:
    """Per token: the copies SDPA's inputs get where transformers makes them contiguous first (before 4.56,
    integrations/sdpa_attention.py `query.contiguous()`, and key and value), and the copy of its output after it.
    Rotary leaves q head-major but strided, so it is copied, and with one key/value head repeat_kv's views of k and v
    become query-wide copies; the output of a contiguous query comes back head-major, so `transpose(1, 2).contiguous()`
    copies it as the kernel returns. Phi's partial rotary concatenates q into a contiguous tensor: neither is copied."""
    if train.attn_implementation != "sdpa" or not train.transformers.sdpa_contiguous_inputs:
        return 0, 0
    s = sizes(train)
    q_width, kv_width = arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    strided = not arch.family.partial_rotary
    inputs = s.residual * q_width if strided else 0
    if arch.num_kv_heads == 1 and q_width != kv_width:
        inputs += (s.residual + s.compute) * q_width
    return inputs, s.compute * q_width if strided else 0
