"""Each component's formula against numbers worked out by hand for Llama-3.2-1B."""

from __future__ import annotations

import pytest

from vram_planner import memory as m
from vram_planner.calibration import Calibration
from vram_planner.lm_head import lm_head_memory
from vram_planner.spec import training_config
from vram_planner.trl_releases import trl_release

P = 1_235_814_400
V, H, N_LAYERS, KV_WIDTH, I = 128256, 2048, 16, 8 * 64, 8192


def cfg(**kw):
    return training_config(kw)


def test_full_fine_tuning_in_float32_is_16_bytes_per_param(llama_1b):
    train = cfg()  # TRL's default: float32 weights, AdamW
    assert m.weight_bytes(llama_1b, train) == 4 * P
    assert m.gradient_bytes(llama_1b, train) == 4 * P
    assert m.optimizer_state_bytes(llama_1b, train) == 8 * P
    assert m.optimizer_step_temporary_bytes(llama_1b, train) == 0  # fused AdamW needs no scratch


def test_bf16_weights_halve_weights_grads_and_states(llama_1b):
    train = cfg(dtype="bfloat16")
    assert (m.weight_bytes(llama_1b, train), m.gradient_bytes(llama_1b, train),
            m.optimizer_state_bytes(llama_1b, train)) == (2 * P, 2 * P, 4 * P)


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
    assert m.weight_bytes(llama_1b, train) == 2 * P + 4 * t
    assert m.gradient_bytes(llama_1b, train) == 4 * t
    assert m.optimizer_state_bytes(llama_1b, train) == 8 * t


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


def test_reference_model_only_with_beta_and_without_peft(llama_1b):
    assert m.reference_weight_bytes(llama_1b, cfg()) == 0  # beta 0: no reference model
    assert m.reference_weight_bytes(llama_1b, cfg(beta=0.04)) == 4 * P
    assert m.reference_weight_bytes(llama_1b, cfg(beta=0.04, lora_r=8)) == 0  # adapter disabled instead


def test_kv_cache_bf16(llama_1b):
    train = cfg(dtype="bfloat16")
    # 2 (k and v) x n x kv heads x d x 2 bytes x sequences x tokens
    assert m.kv_cache_bytes(llama_1b, train, 8, 768) == 2 * N_LAYERS * KV_WIDTH * 2 * 8 * 768


def test_kv_cache_fp32_weights_under_autocast_keeps_fp32_keys(llama_1b):
    assert m.kv_cache_bytes(llama_1b, cfg(), 8, 768) == N_LAYERS * KV_WIDTH * (4 + 2) * 8 * 768
    no_autocast = cfg(mixed_precision="no")
    assert m.kv_cache_bytes(llama_1b, no_autocast, 8, 768) == N_LAYERS * KV_WIDTH * (4 + 4) * 8 * 768


def test_checkpointing_keeps_one_hidden_state_per_layer(llama_1b):
    tokens = 4 * 768
    assert m.checkpoint_bytes(llama_1b, cfg(dtype="bfloat16"), tokens) == N_LAYERS * tokens * H * 2
    assert m.forward_saved_bytes(llama_1b, cfg(), Calibration(), tokens) == N_LAYERS * tokens * H * 4


def test_layer_activations_follow_the_calibration(llama_1b):
    cal = Calibration(act_hidden_bytes_bf16=10, act_query_bytes=1, act_kv_bytes=2, act_mlp_bytes=3, act_head_bytes=0)
    tokens = 100
    expected = tokens * (10 * H + 1 * 32 * 64 + 2 * KV_WIDTH + 3 * I)
    train = cfg(dtype="bfloat16", gradient_checkpointing=False)
    assert m.layer_activation_bytes(llama_1b, train, cal, tokens) == expected
    assert m.forward_saved_bytes(llama_1b, train, cal, tokens) == N_LAYERS * expected


def test_eager_attention_keeps_scores_and_probabilities(llama_1b):
    train = cfg(dtype="bfloat16", attn_implementation="eager", max_prompt_length=100, max_completion_length=100)
    sdpa = cfg(dtype="bfloat16", max_prompt_length=100, max_completion_length=100)
    cal = Calibration()
    extra = m.layer_activation_bytes(llama_1b, train, cal, 2 * 200) - m.layer_activation_bytes(llama_1b, sdpa, cal, 400)
    assert extra == 2 * 32 * 200 * 200 * 2 * 2  # sequences x heads x L^2 x 2 bytes x (scores, probs)


def test_fused_lm_head_never_materialises_logits(llama_1b):
    train = cfg(dtype="bfloat16", max_completion_length=512)
    release = trl_release("1.16.0")
    head = lm_head_memory(llama_1b, train, release, sequences=4, with_grad=True)
    scored = 4 * 512
    tile = min(scored, 4096) * 32768 * 2
    assert head.forward_transient == scored * H * 2 + scored * 28 + tile
    # fp32 grad_hidden, fp32 grad_weight (V x h) cast to bf16, the tile, and the scattered [B, L, h] gradient
    assert head.backward_transient == scored * H * 4 + V * H * 4 + V * H * 2 + tile + 4 * 768 * H * 2
    lora = lm_head_memory(llama_1b, cfg(lora_r=8, dtype="bfloat16"), release, sequences=4, with_grad=True)
    assert lora.backward_transient == head.backward_transient - V * H * 6  # frozen head: no grad_weight


def test_old_trl_materialises_full_logits(llama_1b):
    train = cfg(dtype="bfloat16", max_completion_length=1000)
    head = lm_head_memory(llama_1b, train, trl_release("1.14.0"), sequences=4, with_grad=True)
    logits = 4 * 1001 * V
    assert head.forward_transient == 6 * logits and head.backward_transient == 10 * logits
    # the seeds' OOM: 1.90 GiB for one fp32 copy of ~1000 tokens x 4 sequences of Llama's vocabulary
    assert logits * 4 / 2**30 == pytest.approx(1.91, abs=0.01)


def test_ddp_keeps_a_bucket_copy_of_the_gradients(llama_1b):
    assert m.gradient_bytes(llama_1b, cfg(num_gpus=2, per_device_train_batch_size=4)) == 2 * 4 * P


def test_zero_stages_shard_as_the_zero_paper_says(llama_1b):
    def per_gpu(stage):
        train = cfg(num_gpus=4, zero_stage=stage, per_device_train_batch_size=2)
        return (m.weight_bytes(llama_1b, train), m.gradient_bytes(llama_1b, train),
                m.optimizer_state_bytes(llama_1b, train))
    assert per_gpu(1) == (2 * P, 2 * P, 12 * P / 4)
    assert per_gpu(2) == (2 * P, 2 * P / 4, 12 * P / 4)
    assert per_gpu(3) == (2 * P / 4, 2 * P / 4, 12 * P / 4)
    gathered = m.generation_weight_bytes(llama_1b, cfg(num_gpus=4, zero_stage=3, per_device_train_batch_size=2))
    assert gathered == 2 * P  # ds3_gather_for_generation


def test_fsdp_shards_everything(llama_1b):
    train = cfg(num_gpus=8, fsdp=True, per_device_train_batch_size=1)
    assert m.weight_bytes(llama_1b, train) == 4 * P / 8
    assert m.optimizer_state_bytes(llama_1b, train) == 8 * P / 8


def test_liger_layer_kernels_keep_fewer_activations(llama_1b):
    cal = Calibration()
    plain = m.layer_activation_bytes(llama_1b, cfg(dtype="bfloat16"), cal, 1000)
    liger = m.layer_activation_bytes(llama_1b, cfg(dtype="bfloat16", use_liger_kernel=True), cal, 1000)
    expected = 1000 * (8 * H + 4 * 32 * 64 + 4 * KV_WIDTH + 6 * I + 4 * 32)
    assert liger == expected and liger < plain


def test_lora_keeps_the_rank_wide_intermediate_per_adapter(llama_1b):
    cal = Calibration()
    base = m.layer_activation_bytes(llama_1b, cfg(dtype="bfloat16"), cal, 1000)
    lora = m.layer_activation_bytes(llama_1b, cfg(dtype="bfloat16", lora_r=16), cal, 1000)
    assert lora - base == 1000 * 7 * 16 * 2  # seven adapted linears, r=16, bf16
    dropout = m.layer_activation_bytes(llama_1b, cfg(dtype="bfloat16", lora_r=16, lora_dropout=0.05), cal, 1000)
    inputs = 4 * H + 2 * H + I  # q, k, v, gate, up read h wide; o reads a*d = h; down reads i
    assert dropout - lora == 1000 * inputs * (2 + 1)  # a dropped bf16 copy and its boolean mask
