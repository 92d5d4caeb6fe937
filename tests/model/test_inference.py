"""What a no-grad forward holds at its widest moment (vram_planner/model/inference.py), worked out by hand for
Llama-3.2-1B and held to the trace engine.

h 2048, 32 query heads and 8 key/value heads of 64 (q width 2048, kv width 512), MLP width 8192. The moments were
read off `vram-plan trace` runs of the real modeling code, listing the live tensors at each phase's peak.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vram_planner.model import components, inference
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.calibration import Calibration
from vram_planner.model.spec import training_config

H, I, HEADS, Q, KV = 2048, 8192, 32, 2048, 512
MODELS = Path(__file__).resolve().parents[2] / "profiles" / "models"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def cfg(**kw):
    return training_config(kw)


def rotary(length, stream_bytes):
    return 2 * length * 64 * stream_bytes  # the scoring forward's cos and sin, per position


def test_the_reference_pass_of_lora_runs_no_adapter(llama_1b):
    # beta with LoRA: the reference is the policy with its adapters disabled, so the MLP's product is the widest
    # moment: four bf16 stream tensors and three MLP-wide ones, and the boolean mask; no float32 input copy
    train = cfg(lora_r=16, dtype="bfloat16", beta=0.04)
    assert inference.scoring_bytes(llama_1b, train, 8, 768, adapters=False) == 8 * 768 * (4 * H * 2 + 3 * I * 2) \
        + 8 * 768 * 768 + rotary(768, 2)


def test_float32_adapters_peak_at_the_up_projections_add(llama_1b):
    # bf16 weights under autocast: at up's adapter the gate's activation, the base output, lora_B's output and its
    # scaled copy (bf16), and PEFT's float32 copy of the norm output
    train = cfg(lora_r=16, dtype="bfloat16", beta=0.04)
    per_token = 4 * H * 2 + 4 * I * 2 + H * 4
    assert inference.scoring_bytes(llama_1b, train, 8, 768, adapters=True) == 8 * 768 * per_token + 8 * 768 * 768 \
        + rotary(768, 2)


def test_float32_weights_under_autocast_peak_at_the_down_projections_adapter(llama_1b):
    # the norm output is float32 already (no copy at up); down's bf16 input is copied to float32 and cast back
    train = cfg(lora_r=16, beta=0.04)
    # stream, product, base output, the copy, autocast's cast of it while lora_A runs and lora_A's output
    per_token = 4 * H * 4 + I * 2 + H * 2 + I * 4 + I * 2 + 16 * 2
    assert inference.scoring_bytes(llama_1b, train, 8, 768, adapters=True) == 8 * 768 * per_token + 8 * 768 * 768 \
        + rotary(768, 4)


def test_eager_attention_peaks_inside_softmax(llama_1b):
    train = cfg(dtype="bfloat16", beta=0.04, attn_implementation="eager")
    length = 4096  # long enough that the scores outweigh the MLP
    held = 3 * H * 2 + 2 * (Q + 2 * KV) + 2 * 2 * Q  # stream, q k v after rotary, k and v repeated
    scores = HEADS * length * (2 + 4 + 4)  # masked bf16 scores, softmax's float32 copy and output
    mask = length * length * 2  # eager's float mask in the embeddings' dtype
    assert inference.scoring_bytes(llama_1b, train, 1, length, adapters=False) == length * (held + scores) + mask \
        + rotary(length, 2)


def test_eager_scores_under_a_float32_stream_take_the_masks_dtype(llama_1b):
    # float32 weights under autocast: the bf16 scores plus the float32 mask are float32, which softmax takes as is
    train = cfg(beta=0.04, attn_implementation="eager")
    length = 4096
    # q and k leave rotary in float32 (cos and sin follow the stream), v and the repeated v in bf16
    held = 3 * H * 4 + 4 * (Q + KV) + 2 * KV + (4 + 2) * Q
    scores = HEADS * length * (4 + 4)
    assert inference.scoring_bytes(llama_1b, train, 1, length, adapters=False) == length * (held + scores) \
        + length * length * 4 + rotary(length, 4)


def test_the_prefill_keeps_the_fitted_coefficients(llama_1b):
    run = cfg(dtype="bfloat16")
    fitted = Calibration(inference_hidden_bytes=10, inference_mlp_bytes=8)
    tokens = 8 * 1024
    assert inference.prefill_bytes(llama_1b, run, fitted, 8, 1024) - inference.prefill_bytes(
        llama_1b, run, Calibration(), 8, 1024) == tokens * ((10 - 8) / 2 * H * 2 + (8 - 6) / 2 * I * 2)


def _no_grad_phases(config, **knobs):
    """{phase: (trace bytes, analytic bytes, trace moment, analytic moment)} of generation and scoring."""
    from vram_planner.model.phases import estimate
    from vram_planner.model.trl_releases import trl_release
    from vram_planner.tracing.step import compare_with_estimate, trace_step

    pytest.importorskip("trl")
    train = cfg(**knobs)
    traced = trace_step(config, train)
    analytic = estimate(ModelArchitecture.from_config(config), train, trl_release(), Calibration(), 80 * 2**30)
    moments = {p.name: p.moment for p in analytic.phases}
    return {r.name: (r.trace_bytes, r.analytic_bytes, traced.phase(r.name).moment, moments[r.name])
            for r in compare_with_estimate(traced, analytic) if r.name in ("generation", "scoring")}


# Llama-3.2-1B's layer with a small vocabulary and two layers, so that the decoder's moments decide both phases
DECODER_HEAVY = {"vocab_size": 1024, "num_hidden_layers": 2}


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [{"lora_r": 16, "dtype": "bfloat16"},
                                   {"lora_r": 16, "dtype": "bfloat16", "attn_implementation": "eager"},
                                   {"dtype": "bfloat16", "attn_implementation": "eager"}],
                         ids=["lora-bf16", "lora-bf16-eager", "full-bf16-eager"])
def test_scoring_and_prefill_match_the_trace(knobs):
    # old and reference log-probs (steps_per_generation 2, beta); prompts long enough that the prefill outweighs the
    # decoding steps. Before the moments were counted the model added PEFT's float32 input copy to the MLP's product
    # (scoring +5.6% here) and eager attention's scores to it, while missing softmax's float32 copy and the
    # probabilities the layer keeps (scoring -8.1% with LoRA, generation -13% in full).
    config = {**json.loads((MODELS / "Llama-3.2-1B.json").read_text()), **DECODER_HEAVY}
    phases = _no_grad_phases(config, per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=1,
                             steps_per_generation=2, beta=0.04, max_prompt_length=768, max_completion_length=32,
                             **knobs)
    _assert_matches(phases)


@pytest.mark.slow
def test_phi3s_fused_projections_match_the_trace():
    # float32 weights under autocast: the widest moment is down's adapter, beside gate_up's output (its halves
    # keep it) and the product; attention keeps the fused qkv output its v slices
    config = {**json.loads((FIXTURES / "tiny-phi3.json").read_text()), "hidden_size": 1024,
              "intermediate_size": 4096, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 1024}
    _assert_matches(_no_grad_phases(config, per_device_train_batch_size=4, num_generations=4,
                                    gradient_accumulation_steps=1, steps_per_generation=2, beta=0.04,
                                    max_prompt_length=768, max_completion_length=32, lora_r=16))


def _assert_matches(phases):
    for name, (traced, modelled, traced_moment, moment) in phases.items():
        assert abs(modelled - traced) / traced < 0.01, (name, traced, modelled)
        assert modelled >= 0.999 * traced, (name, traced, modelled)
    assert phases["generation"][2:] == ("prefill", "prefill")
    assert phases["scoring"][2:] == ("scoring forward", "decoder forward")


def _gemma3(**overrides):
    config = json.loads((FIXTURES / "tiny-gemma3.json").read_text())
    return {**config, **overrides}


@pytest.mark.parametrize(("release", "sliding_tokens"), [("5.24.0", 512), ("4.56.0", 512), ("4.55.0", 16)])
def test_the_prefill_leaves_sliding_layers_the_whole_prompt_from_4_56(release, sliding_tokens):
    # DynamicSlidingWindowLayer.update (4.56 on) keeps a view of the prompt's concatenated keys and values, which
    # holds their storage until the first decoding step: a 512-token prompt over a 16-token window
    arch = ModelArchitecture.from_config(_gemma3())
    train = cfg(transformers_version=release, dtype="bfloat16")
    full = arch.num_layers - arch.sliding_layers
    per_token_layer = arch.num_kv_heads * arch.head_dim * 2 * 2
    assert 0 < arch.sliding_layers < arch.num_layers and arch.sliding_window == 16
    assert components.kv_cache_bytes(arch, train, 4, 512, prefill=True) == \
        4 * (full * 512 + arch.sliding_layers * sliding_tokens) * per_token_layer
    # decoding steps hold the window alone in every release
    assert components.kv_cache_bytes(arch, train, 4, 512) == 4 * (full * 512 + arch.sliding_layers * 16) * \
        per_token_layer


@pytest.mark.slow
def test_gemma3_prefill_of_prompts_longer_than_the_window_matches_the_trace():
    # gemma-3-1b-it (a 512-token window on 22 of its 26 layers) with 2048-token prompts: the prefill's cache decides
    # the generation phase (analytic before the row: -6.5%)
    pytest.importorskip("trl")
    from vram_planner.model.phases import estimate
    from vram_planner.model.trl_releases import trl_release
    from vram_planner.tracing.step import compare_with_estimate, trace_step

    config = json.loads((MODELS / "gemma-3-1b-it.json").read_text())
    train = cfg(per_device_train_batch_size=2, num_generations=2, max_prompt_length=2048, max_completion_length=8,
                dtype="bfloat16", lora_r=8)
    traced = trace_step(config, train)
    analytic = estimate(ModelArchitecture.from_config(config), train, trl_release(), Calibration(), 80 * 2**30)
    generation = next(r for r in compare_with_estimate(traced, analytic) if r.name == "generation")
    assert abs(generation.analytic_bytes / generation.trace_bytes - 1) < 0.005, generation
