"""Generation under accelerate's autocast with full fine-tuning, without it with LoRA, as TRL 1.16 runs them.

accelerate wraps the `forward` of the model it prepares (the PeftModel with LoRA) in autocast. GRPOTrainer calls
`generate()` on that model: a transformers model's generate() calls that wrapped forward, PEFT's generate() calls
the base model's generate() and its own, unwrapped forward. The H100 snapshots agree (tests/fixtures/snapshots/h100:
a bf16 copy of the output projection per decoding step with full fine-tuning, none with LoRA).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from helpers import FIXTURES
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.calibration import Calibration
from vram_planner.model.phases import estimate
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.trl_releases import trl_release
from vram_planner.tracing.step import trace_step
from vram_planner.units import GiB

pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

TINY = json.loads((FIXTURES / "tiny-llama-headdim.json").read_text())
ARCH = ModelArchitecture.from_config(TINY)
SEQUENCES = 2
SHORT = {"per_device_train_batch_size": SEQUENCES, "num_generations": SEQUENCES, "max_prompt_length": 16,
         "max_completion_length": 16}
HEAD_CAST_BYTES = ARCH.vocab_size * ARCH.hidden_size * 2  # a bf16 copy of the (tied) output projection
BF16_LOGITS_BYTES = SEQUENCES * ARCH.vocab_size * 2  # one decoding step's last-token logits in bf16
FP32_LOGITS_BYTES = SEQUENCES * ARCH.vocab_size * 4


@pytest.fixture(scope="module")
def traced():
    """fp32 weights under bf16 mixed precision (TRL's defaults), full fine-tuning and LoRA."""
    return {name: trace_step(TINY, TrainingConfig(**SHORT, **extra))
            for name, extra in (("full", {}), ("lora", {"lora_r": 8}))}


def generation_allocations(result) -> Counter[int]:
    """How many storages of each size the generation phase allocates."""
    return Counter(e.size_bytes for e in result.events if e.phase == "generation" and e.kind == "alloc")


def test_full_fine_tuning_generates_under_autocast(traced):
    made = generation_allocations(traced["full"])
    # the prefill and the last decoding step each cast the output projection and return bf16 logits
    assert made[HEAD_CAST_BYTES] == 2
    assert made[BF16_LOGITS_BYTES] == 2
    generation, optimizer = (traced["full"].phase(p).components["weights"] for p in ("generation", "optimizer"))
    assert generation > optimizer  # autocast's cached bf16 copies of the trainable weights


def test_lora_generates_without_autocast(traced):
    made = generation_allocations(traced["lora"])
    assert made[HEAD_CAST_BYTES] == 0
    assert made[BF16_LOGITS_BYTES] == 0  # the logits keep the weights' float32
    assert made[FP32_LOGITS_BYTES] >= 2
    generation, optimizer = (traced["lora"].phase(p).components["weights"] for p in ("generation", "optimizer"))
    assert generation == optimizer  # no weight, frozen or adapter, is cast


def test_lora_generation_with_bf16_weights_runs_the_adapters_in_float32():
    # Without autocast PEFT's fp32 adapters take an fp32 copy of their bf16 input and compute in fp32 until the sum
    # is cast back to bf16; under autocast their linears would cast the input back to bf16 and return bf16.
    result = trace_step(TINY, TrainingConfig(**SHORT, lora_r=8, dtype="bfloat16"))
    made = Counter(e.size_bytes for e in result.events
                   if e.phase == "generation" and e.kind == "alloc" and e.moment.startswith("prefill"))
    tokens = SEQUENCES * SHORT["max_prompt_length"]
    mlp_fp32_bytes = tokens * ARCH.intermediate_size * 4
    # Per layer: down_proj's fp32 input copy; gate_proj's and up_proj's lora_B output, its product with the scaling
    # and its sum with the base layer's output, each in fp32.
    assert made[mlp_fp32_bytes] == ARCH.num_layers * (1 + 2 * 3)


# The tiny fixtures widened to a real decoder's proportions, where the calibrated per-token working set holds, and
# two shapes: a long prompt (the prefill is the peak) and a large vocabulary (the last decoding step's LM head is).
WIDE = {"hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 64}
SHAPES = {"prefill": ({}, {"per_device_train_batch_size": 8, "num_generations": 8, "max_prompt_length": 256,
                           "max_completion_length": 4}),
          "last decoding step: LM head": ({"vocab_size": 32000}, {"per_device_train_batch_size": 8,
                                                                  "num_generations": 8, "max_prompt_length": 8,
                                                                  "max_completion_length": 16})}


@pytest.mark.parametrize(("fixture", "dtype", "moment"), [
    ("tiny-llama-headdim", "float32", "prefill"), ("tiny-llama-headdim", "bfloat16", "prefill"),
    ("tiny-qwen2", "float32", "prefill"), ("tiny-gemma", "bfloat16", "prefill"),
    ("tiny-mistral", "float32", "last decoding step: LM head"),
    ("tiny-qwen3", "bfloat16", "last decoding step: LM head"),
])
def test_lora_generation_in_the_analytic_model_is_the_traced_one(fixture, dtype, moment):
    changes, shape = SHAPES[moment]
    config = json.loads((FIXTURES / f"{fixture}.json").read_text()) | WIDE | changes
    train = TrainingConfig(**shape, lora_r=8, dtype=dtype)
    traced = trace_step(config, train).phase("generation")
    analytic = next(p for p in estimate(ModelArchitecture.from_config(config), train, trl_release(), Calibration(),
                                        80 * GiB).phases if p.name == "generation")
    assert traced.moment == analytic.moment == moment
    # what is left: 512-byte rounding of the adapters' optimizer states
    assert abs(analytic.tensor_bytes - traced.peak_bytes) / traced.peak_bytes < 0.012
