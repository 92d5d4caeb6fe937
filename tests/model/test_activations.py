"""What a decoder layer keeps for backward, worked out tensor by tensor for Llama-3.2-1B.

h 2048, 32 query heads and 8 key/value heads of 64 (q width 2048, kv width 512), MLP width 8192. The counts were
read off `vram-plan trace` runs of the real modeling code (see vram_planner/model/activations.py for the why).
"""

from __future__ import annotations

import pytest

from vram_planner.model import activations as act
from vram_planner.model.calibration import Calibration
from vram_planner.model.spec import training_config

H, Q, I, HEADS, LAYERS = 2048, 2048, 8192, 32, 16
L = 256 + 512  # TRL's prompt and completion lengths


def cfg(**kw):
    return training_config(kw)


def sdpa_core(compute_bytes=2):
    # q, k and v repeated to all 32 heads, the output; fp32 log-sum-exp per head; a float mask row of L per token
    return compute_bytes * 4 * Q + 4 * HEADS + compute_bytes * L


def test_bf16_weights_full_fine_tuning(llama_1b):
    norms = 2 * (4 * H + 4 + 2 * H)  # fp32 upcast of the input, rsqrt, bf16 normalised tensor (weight trains)
    readers = 2 * H + 2 * H  # q/k/v share the bf16 norm output; gate/up share the other
    mlp = 3 * 2 * I + 2 * I  # gate, up, act(gate); down's input
    per_token = norms + readers + sdpa_core() + mlp
    assert act.layer_saved_bytes(llama_1b, cfg(dtype="bfloat16"), 10) == 10 * per_token
    assert per_token == 16 * H + 8 * Q + 8 * I + 8 + 4 * HEADS + 2 * L


def test_fp32_weights_under_autocast_cast_the_norm_output_per_linear(llama_1b):
    norms = 2 * (4 * H + 4 + 4 * H)  # the fp32 input itself, rsqrt, the fp32 normalised tensor
    readers = 3 * 2 * H + 2 * 2 * H  # one bf16 cast per reading linear
    per_token = norms + readers + sdpa_core() + 3 * 2 * I + 2 * I
    assert act.layer_saved_bytes(llama_1b, cfg(), 10) == 10 * per_token
    assert per_token == 26 * H + 8 * Q + 8 * I + 8 + 4 * HEADS + 2 * L


def test_lora_keeps_casts_for_the_adapters_and_nothing_for_frozen_linears(llama_1b):
    norms = 2 * (4 * H + 4)  # frozen norm weights: no normalised tensor
    readers = 3 * 2 * H + 2 * 2 * H + 2 * Q + 2 * I  # lora_A of q, k, v, gate, up, o and down keeps a bf16 copy
    rank = 7 * 16 * 2  # x @ A per adapter
    per_token = norms + readers + sdpa_core() + 3 * 2 * I + rank
    assert act.layer_saved_bytes(llama_1b, cfg(lora_r=16), 10) == 10 * per_token
    only_q_v = cfg(lora_r=16, lora_target_modules="q_proj,v_proj")
    assert act.layer_saved_bytes(llama_1b, only_q_v, 10) == 10 * (norms + 2 * 2 * H + sdpa_core() + 3 * 2 * I
                                                                   + 2 * 16 * 2)


def test_lora_dropout_adds_a_mask_per_adapter(llama_1b):
    plain = act.layer_saved_bytes(llama_1b, cfg(lora_r=16, dtype="bfloat16"), 10)
    dropout = act.layer_saved_bytes(llama_1b, cfg(lora_r=16, dtype="bfloat16", lora_dropout=0.05), 10)
    assert dropout - plain == 10 * (5 * H + Q + I)  # one byte per element each adapter reads


def test_eager_attention_keeps_the_probabilities_instead_of_the_mask(llama_1b):
    sdpa = act.layer_saved_bytes(llama_1b, cfg(dtype="bfloat16"), 10)
    eager = act.layer_saved_bytes(llama_1b, cfg(dtype="bfloat16", attn_implementation="eager"), 10)
    assert eager - sdpa == 10 * (HEADS * L * (4 + 2) - 4 * HEADS - 2 * L)


def test_checkpointing_keeps_each_layer_input_and_the_final_norm(llama_1b):
    tokens = 4 * L
    final_norm = tokens * (4 * H + 4 + 2 * H)
    saved = act.decoder_saved_bytes(llama_1b, cfg(dtype="bfloat16"), Calibration(), tokens)
    assert saved == LAYERS * tokens * H * 2 + final_norm
    no_checkpointing = cfg(dtype="bfloat16", gradient_checkpointing=False)
    assert act.decoder_saved_bytes(llama_1b, no_checkpointing, Calibration(), tokens) == (
        LAYERS * act.layer_saved_bytes(llama_1b, no_checkpointing, tokens) + final_norm)


def test_liger_keeps_less_than_the_plain_layer(llama_1b):
    plain = act.one_layer_saved_bytes(llama_1b, cfg(dtype="bfloat16"), Calibration(), 1000)
    liger = act.one_layer_saved_bytes(llama_1b, cfg(dtype="bfloat16", use_liger_kernel=True), Calibration(), 1000)
    assert liger < plain


def test_one_key_value_head_repeats_as_a_view():
    from vram_planner.model.resolve import resolve_model

    gemma = resolve_model("gemma-3-1b-it")  # 4 query heads, 1 key/value head of 256
    q_width, kv_width = 4 * 256, 256
    # bf16 weights: k and v reach SDPA as expanded views of their kv-wide tensors
    assert act._repeated_kv_saved_bytes(gemma, cfg(dtype="bfloat16")) == 2 * 2 * kv_width
    # fp32 weights: k comes out of rotary in fp32, and autocast's cast of the expanded view is q wide
    assert act._repeated_kv_saved_bytes(gemma, cfg()) == 2 * q_width + 2 * kv_width


def test_gemma_norms_keep_the_normalised_tensor_in_fp32():
    from vram_planner.model.resolve import resolve_model

    gemma = resolve_model("gemma-3-1b-it")
    assert act.norm_saved_bytes(gemma, 1152, 2, trainable=True) == 4 * 1152 + 4 + 4 * 1152
    llama = resolve_model("Llama-3.2-1B")
    assert act.norm_saved_bytes(llama, 2048, 2, trainable=True) == 4 * 2048 + 4 + 2 * 2048


def _phi3_and_its_llama_twin():
    """Phi-3-mini-4k-instruct, and the same sizes laid out as Llama (separate q/k/v and gate/up projections)."""
    from vram_planner.model.architecture import ModelArchitecture
    from vram_planner.profiles import model_config

    config, _, _ = model_config("Phi-3-mini-4k-instruct")
    twin = {**config, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    return ModelArchitecture.from_config(config), ModelArchitecture.from_config(twin), config


def test_phi3_reads_each_normalised_input_once_and_its_v_keeps_the_fused_qkv_output():
    phi3, llama, _ = _phi3_and_its_llama_twin()
    h, q, kv = 3072, 32 * 96, 32 * 96
    fused_qkv_rest = 2 * (q + kv)  # v is a slice of qkv_proj's output: the q and k columns stay alive with it
    # bf16 weights: every reader shares the norm output, so only the fused output differs
    assert act.layer_saved_bytes(phi3, cfg(dtype="bfloat16"), 10) - act.layer_saved_bytes(
        llama, cfg(dtype="bfloat16"), 10) == 10 * fused_qkv_rest
    # fp32 weights: autocast casts the norm output once per reading linear, one (qkv_proj, gate_up_proj) not 3 and 2
    assert act.layer_saved_bytes(phi3, cfg(), 10) - act.layer_saved_bytes(llama, cfg(), 10) == 10 * (
        fused_qkv_rest - (2 + 1) * 2 * h)


@pytest.mark.slow
def test_phi3_layer_activations_match_the_trace():
    # Four of Phi-3-mini's layers with LoRA and no checkpointing: every layer keeps its tensors until the LM head
    from vram_planner.model.architecture import ModelArchitecture
    from vram_planner.model.phases import estimate
    from vram_planner.model.spec import TrainingConfig
    from vram_planner.model.trl_releases import trl_release
    from vram_planner.tracing.step import compare_with_estimate, trace_step

    pytest.importorskip("trl")
    *_, config = _phi3_and_its_llama_twin()
    config = {**config, "num_hidden_layers": 4}
    train = TrainingConfig(per_device_train_batch_size=2, num_generations=2, max_prompt_length=64,
                           max_completion_length=64, lora_r=16, gradient_checkpointing=False)
    analytic = estimate(ModelArchitecture.from_config(config), train, trl_release(), Calibration(), 80 * 2**30)
    training = next(r for r in compare_with_estimate(trace_step(config, train), analytic) if r.name == "training")
    traced, modelled = training.components["activations"]
    assert abs(modelled - traced) / traced < 0.005, (traced, modelled)
