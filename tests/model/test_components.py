"""Each component's formula against numbers worked out by hand for Llama-3.2-1B."""

from __future__ import annotations

import pytest

from vram_planner.model import blocks, zero
from vram_planner.model import components as m
from vram_planner.model.lm_head import lm_head_memory
from vram_planner.model.spec import training_config
from vram_planner.model.trl_releases import trl_release

P = 1_235_814_400
V, H, N_LAYERS, KV_WIDTH, I = 128256, 2048, 16, 8 * 64, 8192
# Every tensor of Llama-3.2-1B is whole 512-byte blocks; what blocks add: the rotary embedding's inv_freq and (from
# transformers 5.0, which the default plan follows) its original_inv_freq clone, one block each, and fused AdamW's
# float32 `step` scalar per parameter tensor (16 layers x 9, the embedding and the final norm), one block each
BLOCK = 512
ROTARY = 2 * BLOCK
STEPS = (N_LAYERS * 9 + 2) * BLOCK


def cfg(**kw):
    return training_config(kw)


def test_full_fine_tuning_in_float32_is_16_bytes_per_param(llama_1b):
    train = cfg()  # TRL's default: float32 weights, AdamW
    assert m.weight_bytes(llama_1b, train) == 4 * P + ROTARY
    assert m.gradient_bytes(llama_1b, train) == 4 * P
    assert m.optimizer_state_bytes(llama_1b, train) == 8 * P + STEPS
    assert m.optimizer_step_temporary_bytes(llama_1b, train) == 0  # fused AdamW needs no scratch


def test_bf16_weights_halve_weights_grads_and_states(llama_1b):
    train = cfg(dtype="bfloat16")
    assert (m.weight_bytes(llama_1b, train), m.gradient_bytes(llama_1b, train),
            m.optimizer_state_bytes(llama_1b, train)) == (2 * P + ROTARY, 2 * P, 4 * P + STEPS)


def test_foreach_adamw_needs_a_param_sized_scratch(llama_1b):
    assert m.optimizer_step_temporary_bytes(llama_1b, cfg(optim="adamw_torch")) == 4 * P


def test_8bit_adam_keeps_32bit_state_for_small_tensors(llama_1b):
    small = (2 * N_LAYERS + 1) * H  # every RMSNorm weight is under 4096 elements
    expected = 2 * ((P - small) * (1 + 4 / 256) + small * 4)
    assert m.optimizer_state_bytes(llama_1b, cfg(optim="adamw_8bit")) == pytest.approx(expected)


@pytest.mark.parametrize("optim,per_param", [("sgd", 0), ("rmsprop", 4), ("paged_adamw_32bit", 8), ("lion_32bit", 4)])
def test_other_optimizers(llama_1b, optim, per_param):
    assert m.optimizer_state_bytes(llama_1b, cfg(optim=optim)) == per_param * P


def test_adafactor_factors_matrices(llama_1b):
    states = m.optimizer_state_bytes(llama_1b, cfg(optim="adafactor"))
    per_layer = 2 * (H + H) + 2 * (H + KV_WIDTH) + 3 * (H + I)
    assert states == 4 * (N_LAYERS * per_layer + (V + H) + (2 * N_LAYERS + 1) * H)


def test_lora_adapters_are_fp32_with_their_own_grads_and_states(llama_1b):
    train = cfg(lora_r=16, dtype="bfloat16")
    t = llama_1b.lora_params(16, None)
    assert m.trainable_params(llama_1b, train) == t
    assert m.weight_bytes(llama_1b, train) == 2 * P + 4 * t + ROTARY
    assert m.gradient_bytes(llama_1b, train) == 4 * t
    # lora_A and lora_B of the 7 linears of 16 layers, a step scalar each
    assert m.optimizer_state_bytes(llama_1b, train) == 8 * t + N_LAYERS * 7 * 2 * BLOCK
    for stage in (1, 2, 3):  # DeepSpeed's bf16 engine casts the adapters with the module (benchmarks/sharded.py --zero)
        zero = cfg(lora_r=16, dtype="bfloat16", num_gpus=8, zero_stage=stage, per_device_train_batch_size=2)
        assert m.sizes(zero).trainable == 2


def test_qlora_base_is_half_a_byte_per_linear_weight_plus_constants(llama_1b):
    train = cfg(lora_r=16, load_in_4bit=True, dtype="bfloat16")
    t = llama_1b.lora_params(16, None)
    linear = llama_1b.linear_params
    per_weight = 0.5 + 1 / 64 + 4 / (64 * 256)  # double quantisation of the absmax
    assert m.weight_bytes(llama_1b, train) == pytest.approx(linear * per_weight + (P - linear) * 2 + 2 * t)
    no_dq = cfg(lora_r=16, load_in_4bit=True, dtype="bfloat16", bnb_4bit_use_double_quant=False)
    assert m.weight_bytes(llama_1b, no_dq) == pytest.approx(linear * (0.5 + 4 / 64) + (P - linear) * 2 + 2 * t)
    # TRL's default float32 loading keeps the unquantised embedding and norms in float32
    fp32_rest = cfg(lora_r=16, load_in_4bit=True)
    assert m.weight_bytes(llama_1b, fp32_rest) == pytest.approx(linear * per_weight + (P - linear) * 4 + 2 * t)


@pytest.mark.parametrize(("trl_version", "adapter_bytes"), [("0.19.1", 4), ("0.23.1", 4), ("0.26.2", 2), ("1.16.0", 2)])
def test_qlora_adapters_are_float32_until_trl_casts_them(llama_1b, trl_version, adapter_bytes):
    """Before 0.26 TRL leaves the adapters as PEFT makes them over a 4-bit model (float32); from 0.26 it casts every
    trainable parameter to bfloat16: the adapters, their gradients and AdamW's two states alike."""
    train = cfg(lora_r=16, load_in_4bit=True, dtype="bfloat16", trl_version=trl_version)
    t = llama_1b.lora_params(16, None)
    assert m.sizes(train).trainable == adapter_bytes
    assert m.gradient_bytes(llama_1b, train) == adapter_bytes * t


def test_trl_022_to_025_prepare_the_unquantized_weights_in_float32(llama_1b):
    """PEFT's prepare_model_for_kbit_training casts every weight left unquantized to float32; under bf16 TRL puts the
    embedding (tied to the LM head) back to bfloat16 and leaves the norms float32; without it everything stays float32
    and so are the activations a 4-bit linear hands back (its output in its input's dtype)."""
    linear = llama_1b.linear_params
    per_weight = 0.5 + 1 / 64 + 4 / (64 * 256)
    adapters = 4 * llama_1b.lora_params(16, None)
    norms = P - linear - V * H
    bf16 = cfg(lora_r=16, load_in_4bit=True, dtype="bfloat16", trl_version="0.23.1", mixed_precision="bf16")
    assert m.weight_bytes(llama_1b, bf16) == pytest.approx(linear * per_weight + V * H * 2 + norms * 4 + adapters)
    plain = cfg(lora_r=16, load_in_4bit=True, dtype="bfloat16", trl_version="0.23.1", mixed_precision="no")
    assert m.weight_bytes(llama_1b, plain) == pytest.approx(linear * per_weight + (P - linear) * 4 + adapters)
    assert (m.sizes(plain).compute, m.sizes(plain).residual) == (4, 4)
    assert m.sizes(cfg(lora_r=16, load_in_4bit=True, dtype="bfloat16", trl_version="0.26.2",
                       mixed_precision="no")).compute == 2


def test_reference_model_only_with_beta_and_without_peft(llama_1b):
    assert m.reference_weight_bytes(llama_1b, cfg()) == 0  # beta 0: no reference model
    assert m.reference_weight_bytes(llama_1b, cfg(beta=0.04)) == 4 * P + ROTARY
    assert m.reference_weight_bytes(llama_1b, cfg(beta=0.04, lora_r=8)) == 0  # adapter disabled instead


def test_kv_cache_bf16(llama_1b):
    train = cfg(dtype="bfloat16")
    # 2 (k and v) x n x kv heads x d x 2 bytes x sequences x tokens
    assert m.kv_cache_bytes(llama_1b, train, 8, 768) == 2 * N_LAYERS * KV_WIDTH * 2 * 8 * 768


@pytest.mark.parametrize(("transformers_version", "value_bytes"), [("4.48.0", 2), ("5.23.0", 4), ("5.24.0", 2)])
def test_kv_cache_of_fp32_weights_under_autocast_follows_the_transformers_release(llama_1b, transformers_version,
                                                                                  value_bytes):
    # rotary's cos/sin follow the fp32 residual stream, so keys are fp32; values leave v_proj in bf16, and
    # DynamicLayer started them in the keys' dtype from 4.56 to 5.23
    train = cfg(transformers_version=transformers_version)
    assert m.kv_cache_bytes(llama_1b, train, 8, 768) == N_LAYERS * KV_WIDTH * (4 + value_bytes) * 8 * 768
    no_autocast = cfg(mixed_precision="no", transformers_version=transformers_version)
    assert m.kv_cache_bytes(llama_1b, no_autocast, 8, 768) == N_LAYERS * KV_WIDTH * (4 + 4) * 8 * 768
    lora = cfg(lora_r=16, transformers_version=transformers_version)  # LoRA generates without autocast
    assert m.kv_cache_bytes(llama_1b, lora, 8, 768) == N_LAYERS * KV_WIDTH * (4 + 4) * 8 * 768


def test_autocast_copies_fp32_weights_but_not_bf16_or_sharded_ones(llama_1b):
    linear = N_LAYERS * (4 * H * H // 1 - 2 * H * (H - KV_WIDTH) + 3 * H * I)  # q, o: h x h; k, v: h x 512
    assert llama_1b.linear_params == linear
    assert m.layer_weight_cast_bytes(llama_1b, cfg()) == 2 * linear
    assert m.lm_head_cast_bytes(llama_1b, cfg()) == 2 * V * H
    for no_copies in (cfg(dtype="bfloat16"), cfg(mixed_precision="no"),
                      cfg(num_gpus=2, zero_stage=2, per_device_train_batch_size=4)):
        assert m.layer_weight_cast_bytes(llama_1b, no_copies) == 0
    assert m.adapter_cast_bytes(llama_1b, cfg(lora_r=16)) == 2 * llama_1b.lora_params(16, None)








def test_fused_lm_head_never_materialises_logits(llama_1b):
    train = cfg(dtype="bfloat16", max_completion_length=512)
    release = trl_release("1.16.0")
    head = lm_head_memory(llama_1b, train, release, sequences=4, with_grad=True)
    scored, tokens = 4 * 512, 4 * 768
    tile = min(scored, 4096) * 32768 * 2
    # the backbone's [B, L, h] output, the gathered completion rows, seven fp32 statistics per row, one tile, the
    # label mask (bool, L - 1 a sequence) and the scored labels (int64); after the tile loop, with the entropy TRL
    # asks the policy for, four more fp32 values per row (log_z, the log-probs, x_sum_exp / sum_exp, the entropy)
    selection = 3072 + scored * 8  # 4 x 767 booleans, in whole 512-byte blocks
    assert head.forward_transient == tokens * H * 2 + scored * H * 2 + scored * 28 + tile + selection + scored * 16
    scoring = lm_head_memory(llama_1b, train, release, sequences=4, with_grad=False)
    # the reference's pass (no old log-probs here) asks for log-probs alone: log(sum_exp) and log_z, then log_z and
    # the log-probs
    assert scoring.forward_transient == head.forward_transient - scored * 8
    # int64 target, fp32 log-normaliser and entropy, the (N, 2) int64 positions of the gather, and the rows
    assert head.saved == scored * H * 2 + scored * (8 + 8 + 16)
    # all through backward: fp32 grad_hidden and grad_weight, the tile, fp32 logprob grads (bf16 weights need no
    # casts in the loop); on return both fp32 gradients are cast to bf16 while they and the loop's locals still exist
    throughout = scored * H * 4 + V * H * 4 + tile + scored * 4
    assert head.backward_transient == throughout + scored * H * 2 + V * H * 2
    lora = lm_head_memory(llama_1b, cfg(lora_r=8, dtype="bfloat16", max_completion_length=512), release,
                          sequences=4, with_grad=True)
    assert lora.backward_transient == scored * H * 4 + tile + scored * 4 + scored * H * 2  # frozen: no grad_weight


def test_fused_lm_head_casts_two_vocabulary_chunks_of_fp32_weights_in_backward(llama_1b):
    head = lm_head_memory(llama_1b, cfg(max_completion_length=512), trl_release("1.16.0"), sequences=4,
                          with_grad=True)
    scored = 4 * 512
    # the tile stays a whole 32768-column chunk wide; the previous chunk's bf16 weight is alive with the next one's
    # (fp32 gradients need no cast on return)
    assert head.backward_transient == (scored * H * 4 + V * H * 4 + scored * 32768 * 2 + 2 * 32768 * H * 2
                                       + scored * H * 2 + scored * 4)
    small_vocab = lm_head_memory(llama_1b.__class__(**{**llama_1b.__dict__, "vocab_size": 40000}),
                                 cfg(max_completion_length=512), trl_release("1.16.0"), sequences=4, with_grad=True)
    assert small_vocab.backward_transient == (scored * H * 4 + 40000 * H * 4 + scored * 32768 * 2 + 40000 * H * 2
                                              + scored * H * 2 + scored * 4)


# Logits of 4 sequences of 1,000 completion tokens: the model's output covers c + 1 = 1,001 positions, the log-probs
# read the completion's 1,000; the entropies (TRL 0.23-1.13) take 128 of those rows at a time
OUT, SCORED, CHUNK = 4 * 1001 * V, 4 * 1000 * V, 128 * V


@pytest.mark.parametrize(("version", "expected"), [
    # bf16 logits + accelerate's fp32 copy; the per-sequence logsumexp keeps the copy; backward's three gradients
    # are of the completion's positions, the view the log-probs read
    ("0.15.0", (6 * OUT, 4 * OUT, 12 * SCORED)),
    # `logits / temperature` of the completion's positions: a second fp32 copy, the one kept (the loop keeps the
    # model's output too); the entropies' log_softmax, exp and product of a chunk beside both
    ("1.13.0", (4 * OUT + 4 * SCORED + 3 * 4 * CHUNK, 4 * SCORED, 12 * SCORED)),
    # `logits.div_(temperature)` in place (1.0-1.9): no second copy, but the entropies reshape a view of the output,
    # which copies the completion's rows first
    ("1.5.0", (4 * OUT + 4 * SCORED + 3 * 4 * CHUNK, 4 * OUT, 12 * SCORED)),
    ("1.14.0", (6 * OUT, 4 * OUT, 4 * OUT)),  # the Triton kernel keeps the fp32 logits and makes one gradient
])
def test_old_trl_materialises_full_logits(llama_1b, version, expected):
    # bytes as the trace counts them (benchmarks/results/trl_matrix.json)
    train = cfg(dtype="bfloat16", max_completion_length=1000, mixed_precision="bf16")
    head = lm_head_memory(llama_1b, train, trl_release(version), sequences=4, with_grad=True)
    logits = OUT
    assert (head.forward_transient, head.saved, head.backward_transient) == expected
    # the seeds' OOM: 1.90 GiB for one fp32 copy of ~1000 tokens x 4 sequences of Llama's vocabulary
    assert logits * 4 / 2**30 == pytest.approx(1.91, abs=0.01)


@pytest.mark.parametrize("version", ["0.19.0", "1.5.0", "1.13.0", "1.14.0"])
def test_a_scoring_pass_over_several_chunks_keeps_the_previous_chunks_logits(llama_1b, version):
    # TRL 0.17 on scores the generation batch in chunks of B in one loop: the previous chunk's fp32 logits (4 B per
    # logit) stay in its loop variable until the next chunk's forward returns, next to that chunk's bf16 logits and
    # accelerate's fp32 copy (6 B): 10 B per logit, as the trace counts it on Llama-3.2-1B (TRL 1.0 and 1.14)
    one_chunk = cfg(dtype="bfloat16", max_completion_length=512, mixed_precision="bf16", per_device_train_batch_size=4,
                    num_generations=4, gradient_accumulation_steps=1, trl_version=version)
    two_chunks = cfg(dtype="bfloat16", max_completion_length=512, mixed_precision="bf16", per_device_train_batch_size=4,
                     num_generations=4, gradient_accumulation_steps=2, trl_version=version)
    logits = 4 * 513 * V
    heads = [lm_head_memory(llama_1b, t, trl_release(version), sequences=4, with_grad=False) for t in (one_chunk,
                                                                                                     two_chunks)]
    assert heads[0].forward_transient in (6 * logits, 8 * logits)
    # 1.10-1.13 keep the previous chunk's model output (its fp32 copy) beside its scaled copy: 4 B more (TRL 1.12)
    assert heads[1].forward_transient == (14 if version == "1.13.0" else 10) * logits


def test_ddp_keeps_a_bucket_copy_of_the_gradients(llama_1b):
    assert m.gradient_bytes(llama_1b, cfg(num_gpus=2, per_device_train_batch_size=4)) == 2 * 4 * P


def test_zero_stages_shard_as_the_zero_paper_says(llama_1b):
    def per_gpu(stage):
        train = cfg(num_gpus=4, zero_stage=stage, per_device_train_batch_size=2)
        return (m.weight_bytes(llama_1b, train), m.gradient_bytes(llama_1b, train),
                m.optimizer_state_bytes(llama_1b, train))
    assert per_gpu(1) == (2 * P, 2 * P, 12 * P / 4)
    assert per_gpu(2) == (2 * P, 2 * P / 4, 12 * P / 4)
    # ZeRO-3 holds its largest layer (the embedding) gathered, and that layer's full gradient (model/zero.py)
    assert per_gpu(3) == (2 * P / 4 + 2 * V * H, 2 * P / 4 + 2 * V * H, 12 * P / 4)
    for stage in (1, 2, 3):  # DeepSpeed's fp32 copy of the gradient partition, made in its step (model/zero.py)
        train = cfg(num_gpus=4, zero_stage=stage, per_device_train_batch_size=2)
        assert m.fp32_gradient_bytes(llama_1b, train) == 0
        # beside the 16-bit gradients and their flat copy; ZeRO-3 flattens its partition (one sub-group) out of its
        # kept gradient partition, its gathered layers released
        assert m.step_gradient_bytes(llama_1b, train) >= (2 + 2 + 4) * P / 4 * 0.999
    train = cfg(num_gpus=4, zero_stage=3, per_device_train_batch_size=2)
    assert m.step_gradient_bytes(llama_1b, train) == pytest.approx((2 + 2 + 4) * P / 4, rel=1e-3)
    assert m.step_weight_bytes(llama_1b, train) == 2 * P / 4
    # stage 0's BF16_Optimizer keeps an fp32 gradient of every parameter
    assert m.fp32_gradient_bytes(llama_1b, cfg(num_gpus=4, zero_stage=0, per_device_train_batch_size=2)) == 4 * P
    assert m.fp32_gradient_bytes(llama_1b, cfg(num_gpus=4, fsdp=True, per_device_train_batch_size=2)) == 0
    gathered = m.generation_weight_bytes(llama_1b, cfg(num_gpus=4, zero_stage=3, per_device_train_batch_size=2))
    assert gathered == 2 * P + 2 * P / 4  # ds3_gather_for_generation: the whole model beside the partitions
    layered = m.generation_weight_bytes(llama_1b, cfg(num_gpus=4, zero_stage=3, per_device_train_batch_size=2,
                                                      ds3_gather_for_generation=False))
    # layer by layer: the partitions and what the coordinator prefetches from the second decoding step on, up to
    # max_live_parameters (under Llama-3.2-1B's 1.24e9) passed by an MLP matrix, with the round in use twice, a
    # decoder layer's worth (model/zero.py)
    mlp = H * llama_1b.intermediate_size
    assert layered == 2 * P / 4 + 2 * (zero.MAX_LIVE_PARAMETERS + mlp + llama_1b.layer_params)


def test_fsdp_shards_everything(llama_1b):
    train = cfg(num_gpus=8, fsdp=True, per_device_train_batch_size=1)
    assert m.weight_bytes(llama_1b, train) == 4 * P / 8 + blocks.rotary_buffer_bytes(llama_1b, train)
    tensors = len(blocks.trainable_tensors(llama_1b, train))  # the shards' moments in whole blocks, the steps not
    assert 8 * P / 8 + tensors * 512 <= m.optimizer_state_bytes(llama_1b, train) < 8 * P / 8 + tensors * 1536



