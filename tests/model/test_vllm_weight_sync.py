"""The weights pushed to vLLM before each generation: what a training rank holds beside its weights meanwhile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from vram_planner import engine
from vram_planner.model import components as m
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.spec import training_config

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.mark.parametrize("targets", [None, ["gate_proj"], ["q_proj", "v_proj"]], ids=["all", "gate", "qv"])
def test_peft_merge_holds_two_delta_weights_of_the_largest_adapted_linear(targets):
    # PEFT's own merge_adapter and unmerge_adapter, counted by the trace's live-bytes counter on the CPU
    torch = pytest.importorskip("torch")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from vram_planner.tracing.counter import LiveBytes

    config = json.loads((FIXTURES / "tiny-llama-bias.json").read_text())
    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    model = get_peft_model(AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16),
                           LoraConfig(r=8, target_modules=targets or "all-linear"))
    train = training_config({"dtype": "bfloat16", "lora_r": 8, "lora_target_modules": targets, "use_vllm": True})
    expected = m.vllm_weight_sync_bytes(ModelArchitecture.from_config(config), train)
    with LiveBytes() as counter:
        for parameter in model.parameters():  # made before the counter: known, not counted as new
            counter.track(parameter)
        for step in (model.merge_adapter, model.unmerge_adapter):
            counter.reset_peak()
            before = counter.total
            step()
            assert counter.peak - before == expected


def _sync(model: str, **knobs) -> float:
    context = engine.make_context(model, "h100-80gb")
    train = engine.make_training(context, {"dtype": "bfloat16", "use_vllm": True, **knobs})
    return m.vllm_weight_sync_bytes(context.arch, train)


@settings(max_examples=40, deadline=None)
@given(model=st.sampled_from(["Qwen2.5-0.5B", "Llama-3.2-1B", "gemma-3-1b-it", "Qwen2.5-7B"]),
       num_gpus=st.sampled_from([2, 4, 8]), lora=st.booleans())
def test_zero3_gathers_the_whole_model_only_to_merge_adapters(model, num_gpus, lora):
    knobs = {"num_gpus": num_gpus, "zero_stage": 3, **({"lora_r": 16} if lora else {})}
    sync = _sync(model, **knobs)
    context = engine.make_context(model, "h100-80gb")
    train = engine.make_training(context, {"dtype": "bfloat16", **knobs})
    whole = context.arch.params * 2  # DeepSpeed's engine holds the model in bf16
    if lora:  # every shard gathered: the whole model in 16 bits, less this rank's own shard, and the merge
        assert sync > whole * (1 - 1 / num_gpus)
    else:  # one parameter at a time: the largest (an embedding of 152k x 896 is a third of Qwen2.5-0.5B)
        assert 0 < sync < whole / 2


def test_unsharded_weights_are_read_in_place_and_only_vllm_configs_sync():
    assert _sync("Qwen2.5-0.5B") == 0
    assert _sync("Qwen2.5-0.5B", lora_r=16) > 0
    context = engine.make_context("Qwen2.5-0.5B", "h100-80gb")
    assert m.vllm_weight_sync_bytes(context.arch, engine.make_training(context, {"lora_r": 16})) == 0


def test_the_generation_phase_peaks_where_zero3_gathers_for_the_merge():
    verdict = engine.check("Qwen2.5-7B", "h100-80gb", {"dtype": "bfloat16", "use_vllm": True, "lora_r": 16,
                                                    "num_gpus": 2, "zero_stage": 3})
    generation = next(p for p in verdict.estimate.phases if p.name == "generation")
    assert generation.moment == "weights pushed to vLLM"
