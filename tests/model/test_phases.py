"""Which phases exist and what is alive in each, for the behaviours of the installed TRL."""

from __future__ import annotations

import math

import pytest

from vram_planner.model import components as m
from vram_planner.model.calibration import Calibration
from vram_planner.model.phases import estimate
from vram_planner.model.spec import training_config
from vram_planner.model.trl_releases import trl_release
from vram_planner.units import GiB

CAPACITY = 16 * GiB
# Beside Llama-3.2-1B's parameters (all whole 512-byte blocks): the rotary embedding's inv_freq and, from
# transformers 5.0, its original_inv_freq clone, a block each; fused AdamW's step scalar per tensor, a block each
ROTARY = 2 * 512
STEPS = (16 * 9 + 2) * 512


def run(arch, **kw):
    return estimate(arch, training_config(kw), trl_release("1.16.0"), Calibration(), CAPACITY)


def phase(est, name):
    return next(p for p in est.phases if p.name == name)


def test_default_step_has_no_scoring_pass(llama_1b):
    # beta 0 and gradient_accumulation_steps % (steps_per_generation x num_iterations) == 0
    assert [p.name for p in run(llama_1b).phases] == ["generation", "training", "optimizer"]


@pytest.mark.parametrize("kw", [{"beta": 0.04}, {"num_iterations": 2}, {"steps_per_generation": 2},
                                {"use_vllm": True}])
def test_scoring_pass_when_trl_computes_old_or_reference_logps(llama_1b, kw):
    assert "scoring" in [p.name for p in run(llama_1b, **kw).phases]


def test_optimizer_states_persist_in_every_phase_and_gradients_do_not(llama_1b):
    est = run(llama_1b, dtype="bfloat16")
    states = m.optimizer_state_bytes(llama_1b, training_config({"dtype": "bfloat16"}))
    assert all(p.components["optimizer_states"] == states for p in est.phases)
    assert phase(est, "generation").components["gradients"] == 0
    assert phase(est, "optimizer").components["gradients"] == 2 * llama_1b.params


def test_generation_holds_the_kv_cache_of_the_whole_generation_batch(llama_1b):
    est = run(llama_1b, dtype="bfloat16", per_device_train_batch_size=2, gradient_accumulation_steps=8)
    # the last decoding step feeds the last token with p + c - 1 tokens cached
    full = m.kv_cache_bytes(llama_1b, training_config({"dtype": "bfloat16"}), 16, 256 + 512 - 1)
    gen = phase(est, "generation").components["kv_cache"]
    assert full <= gen <= full * (1 + 1 / 16)  # plus one layer's growth copy


def test_accumulation_keeps_all_gradients_during_backward(llama_1b):
    single = phase(run(llama_1b, dtype="bfloat16"), "training")
    accumulating = phase(run(llama_1b, dtype="bfloat16", per_device_train_batch_size=4,
                             gradient_accumulation_steps=2), "training")
    assert accumulating.components["gradients"] == 2 * llama_1b.params
    assert single.components["gradients"] <= accumulating.components["gradients"]


def test_overheads_are_added_to_every_phase(llama_1b):
    cal = Calibration(cuda_context_bytes=123, allocator_overhead_fraction=0.5)
    est = estimate(llama_1b, training_config({}), trl_release("1.16.0"), cal, CAPACITY)
    for p in est.phases:
        assert p.components["cuda_context"] == 123
        assert p.components["allocator_overhead"] == pytest.approx(0.5 * p.tensor_bytes)
    assert est.peak_bytes == max(p.total_bytes for p in est.phases)


def test_vllm_colocate_reserves_its_share_unless_asleep(llama_1b):
    awake = run(llama_1b, use_vllm=True, vllm_gpu_memory_utilization=0.25, dtype="bfloat16")
    assert all(p.components["vllm_reservation"] == 0.25 * CAPACITY for p in awake.phases)
    assert phase(awake, "generation").components["kv_cache"] == 0  # vLLM's cache is inside its reservation
    asleep = run(llama_1b, use_vllm=True, vllm_enable_sleep_mode=True, dtype="bfloat16")
    # vLLM asks for ceil(utilization x total) (vllm/v1/worker/utils.py request_memory)
    assert phase(asleep, "generation").components["vllm_reservation"] == math.ceil(0.3 * CAPACITY)
    # asleep, its weights and KV cache are gone; its CUDA graphs and non-torch memory stay (tests/model/test_vllm.py)
    assert phase(asleep, "optimizer").components["vllm_reservation"] == asleep.vllm.asleep_bytes
    assert 0 < asleep.vllm.asleep_bytes < 0.3 * CAPACITY / 4
    server = run(llama_1b, use_vllm=True, vllm_mode="server", dtype="bfloat16")
    assert all(p.components["vllm_reservation"] == 0 for p in server.phases)


def test_longer_completions_never_need_less(llama_1b):
    peaks = [run(llama_1b, max_completion_length=c).peak_bytes for c in (128, 256, 512, 1024, 2048)]
    assert peaks == sorted(peaks)


def test_checkpointing_saves_activation_memory(llama_1b):
    on = phase(run(llama_1b, dtype="bfloat16"), "training").components["activations"]
    off = phase(run(llama_1b, dtype="bfloat16", gradient_checkpointing=False), "training").components["activations"]
    assert off > 4 * on


def test_prompt_longer_than_the_model_is_noted(llama_1b):
    est = run(llama_1b, max_prompt_length=200_000)
    assert any("max_position_embeddings" in n for n in est.notes)


def test_generation_phase_by_hand(llama_1b):
    # B=8, S=1, p=256, c=512, float32 weights under bf16 autocast: fp32 keys, bf16 values (transformers 5.24)
    gen = phase(run(llama_1b, transformers_version="5.24.0"), "generation")
    kv = 8 * 767 * 16 * (8 * 64) * (4 + 2)
    assert gen.moment == "last decoding step: LM head"
    assert gen.components["kv_cache"] == kv
    # autocast's cached bf16 copies of every decoder linear and of the output projection
    assert gen.components["weights"] == (4 * llama_1b.params + ROTARY + 2 * llama_1b.linear_params
                                         + 2 * 128256 * 2048)
    assert gen.components["lm_head_buffers"] == 8 * 128256 * (2 + 4 + 4 + 4)  # logits, fp32 copy, probs, noise
    assert gen.components["gradients"] == 0 and gen.components["activations"] == 0


def test_scoring_phase_by_hand(llama_1b):
    # beta 0.04: one no-grad pass of the reference model for its log-probs, in chunks of B=8 sequences of 768 tokens
    scoring = phase(run(llama_1b, beta=0.04), "scoring")
    tokens, scored = 8 * 768, 8 * 512
    kept_ref_logps = scored * 4 + 2 * 8 * tokens  # and the batch's int64 ids and attention mask
    # at the MLP's product: four fp32 tensors of the residual stream (embeddings, layer input, residual, norm
    # output) and three bf16 MLP-wide ones (the gate's activation, up, the product); the boolean mask (SDPA's bf16
    # copy of it lives inside attention only)
    per_token = 4 * 2048 * 4 + 3 * 8192 * 2
    decoder = tokens * per_token + 8 * 768 * 768 + 2 * 768 * 64 * 4  # and rotary's fp32 cos and sin per position
    fused_head = (tokens * 2048 * 4  # the backbone's fp32 output
                  + scored * 2048 * 4  # the gathered completion hidden states
                  + scored * 28  # seven fp32 statistics per token
                  + 4096 * 32768 * 2  # one bf16 logits tile
                  + 32768 * 2048 * 2  # a bf16 cast of one vocabulary chunk of the fp32 head
                  + 4096 * 2048 * 2)  # a bf16 cast of one token chunk of hidden states
    assert scoring.tensor_bytes - scoring.components["reference_weights"] - (4 * llama_1b.params + ROTARY) \
        - (8 * llama_1b.params + STEPS) == kept_ref_logps + max(decoder, fused_head)
    # the reference's weights require grad, so autocast caches their casts as the policy's
    assert scoring.components["reference_weights"] == 4 * llama_1b.params + ROTARY + 2 * llama_1b.linear_params


def test_four_bit_layers_hold_bitsandbytes_dequantized_weight_where_it_dequantizes(llama_1b):
    """bitsandbytes writes a 16-bit copy of a 4-bit weight to multiply more rows than its fused kernel takes, and in
    every backward: the largest (Llama-3.2-1B's 2,048 x 8,192 MLP weights, 32 MiB in bfloat16) is there inside a
    layer, beside the layer's tensors; decoding's few rows multiply from the packed weight, and the LM head is
    16-bit."""
    from vram_planner.model.phases import generation_moments, persistent_bytes, training_moments

    kw = {"dtype": "bfloat16", "lora_r": 16, "per_device_train_batch_size": 4, "num_generations": 4,
          "max_prompt_length": 256, "max_completion_length": 128, "load_in_4bit": True}
    qlora, largest = training_config(kw), 2048 * 8192 * 2
    assert m.dequantized_weight_bytes(llama_1b, qlora, m.BNB_FUSED_MAX_ROWS) == 0
    assert m.dequantized_weight_bytes(llama_1b, qlora, m.BNB_FUSED_MAX_ROWS + 1) == largest
    assert m.dequantized_weight_bytes(llama_1b, qlora, None) == largest
    assert m.dequantized_weight_bytes(llama_1b, training_config({**kw, "load_in_4bit": False}), None) == 0
    release, cal = trl_release("1.16.0"), Calibration()
    persistent = persistent_bytes(llama_1b, qlora, False)

    def weights() -> dict[str, float]:
        found = [*generation_moments(llama_1b, qlora, cal, persistent),
                 *training_moments(llama_1b, qlora, release, cal, persistent, m.gradient_bytes(llama_1b, qlora))]
        return {p.moment: p.components["weights"] for p in found}

    counted = weights()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(m, "dequantized_weight_bytes", lambda *args: 0)
        uncounted = weights()
    added = {moment: counted[moment] - uncounted[moment] for moment in counted}
    # the prefill's 4 x 256 rows and every layer's backward dequantize; decoding's 4 rows and the LM head do not
    layers = ["backward through the last layer", "backward through the first layer"]
    assert {moment for moment, extra in added.items() if extra} == {
        "prefill", *layers, *(f"{moment}: its forward recomputed" for moment in layers)}
    assert set(added.values()) == {0, largest}
