"""LoRA's generation in the analytic model: without accelerate's autocast, in the weights' dtype.

accelerate wraps the forward of the model it prepares in autocast; PEFT's generate() calls the base model's own
generate() and forward, so LoRA generates without it in every TRL release (each generates through
unwrap_model_for_generation(...).generate). Full fine-tuning generates under autocast. tests/tracing/
test_generation_autocast.py holds the trace to the same and the two engines to each other.
"""

from __future__ import annotations

import pytest

from vram_planner.model import components as m
from vram_planner.model.calibration import Calibration
from vram_planner.model.phases import estimate
from vram_planner.model.spec import training_config
from vram_planner.model.trl_releases import trl_release
from vram_planner.units import GiB

V, H, I = 128256, 2048, 8192  # Llama-3.2-1B's vocabulary, hidden and MLP sizes
# Many sequences of one prompt token: the last decoding step's LM head is the largest moment.
HEAD_HEAVY = {"per_device_train_batch_size": 64, "num_generations": 64, "max_prompt_length": 1,
              "max_completion_length": 2}
# A long prompt and a short completion: the prefill is.
PREFILL_HEAVY = {"per_device_train_batch_size": 8, "num_generations": 8, "max_prompt_length": 2048,
                 "max_completion_length": 2}


def generation(arch, release="1.16.0", **kw):
    train = training_config(kw)
    est = estimate(arch, train, trl_release(release), Calibration(), 80 * GiB)
    return train, next(p for p in est.phases if p.name == "generation")


@pytest.mark.parametrize("release", ["0.14.0", "0.19.0", "0.26.0", "1.0.0", "1.16.0"])
@pytest.mark.parametrize("shape", [HEAD_HEAVY, PREFILL_HEAVY], ids=["head", "prefill"])
def test_lora_casts_no_weight_while_generating(llama_1b, release, shape):
    train, gen = generation(llama_1b, release, lora_r=16, **shape)
    assert gen.components["weights"] == m.weight_bytes(llama_1b, train)


def test_full_fine_tuning_generates_with_bf16_copies(llama_1b):
    train, gen = generation(llama_1b, **HEAD_HEAVY)
    assert gen.moment == "last decoding step: LM head"
    casts = 2 * llama_1b.linear_params + 2 * V * H  # every decoder linear's, and the output projection's
    assert gen.components["weights"] == m.weight_bytes(llama_1b, train) + casts
    # bf16 logits, their fp32 copy, the probabilities and multinomial's exponential noise
    assert gen.components["lm_head_buffers"] == 64 * V * (2 + 4 + 4 + 4)


@pytest.mark.parametrize(("dtype", "logit_bytes"), [("float32", 4), ("bfloat16", 2)])
def test_lora_logits_keep_the_weights_dtype(llama_1b, dtype, logit_bytes):
    _, gen = generation(llama_1b, lora_r=16, dtype=dtype, **HEAD_HEAVY)
    assert gen.moment == "last decoding step: LM head"
    assert gen.components["lm_head_buffers"] == 64 * V * (logit_bytes + 4 + 4 + 4)


def test_lora_prefill_with_float32_weights_runs_in_float32(llama_1b):
    _, gen = generation(llama_1b, lora_r=16, **PREFILL_HEAVY)
    assert gen.moment == "prefill"
    tokens, cal = 8 * 2048, Calibration()
    plain = tokens * (cal.inference_hidden_bytes * H * 4 / 2 + cal.inference_mlp_bytes * I * 4 / 2)
    # At the up projection: the gate's activation, the base output, lora_B's output and its scaled copy, all fp32
    # (the plain forward's peak has three MLP-wide tensors)
    adapters = tokens * I * 4
    mask = 8 * 2048 * 2048  # the boolean mask (SDPA's fp32 copy of it lives inside attention only)
    rotary = tokens * 2 * 64 * 4  # cos and sin per token: generate() passes position ids per sequence
    inputs = tokens * 4 * 8  # generate()'s int64 ids, mask, position ids and the ids' copy
    assert gen.components["activations"] == plain + adapters + mask + rotary + inputs


def test_lora_prefill_with_bf16_weights_runs_the_adapters_in_float32(llama_1b):
    _, gen = generation(llama_1b, lora_r=16, dtype="bfloat16", **PREFILL_HEAVY)
    tokens, cal = 8 * 2048, Calibration()
    plain = tokens * (cal.inference_hidden_bytes * H * 2 / 2 + cal.inference_mlp_bytes * I * 2 / 2)
    # lora_B's fp32 output and its scaled copy in place of one bf16 MLP-wide tensor, after an fp32 copy of the input
    adapters = tokens * (I * (2 * 4 - 2) + H * 4)
    mask = 8 * 2048 * 2048
    assert gen.components["activations"] == plain + adapters + mask + tokens * (2 * 64 * 2 + 4 * 8)
