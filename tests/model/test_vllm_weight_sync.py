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


TINY = json.loads((FIXTURES / "tiny-llama-bias.json").read_text())


def _peft_tiny(targets, dtype_name: str):
    """The fixture with PEFT's LoRA (r 8) on `targets` (None: every linear)."""
    torch = pytest.importorskip("torch")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**{k: v for k, v in TINY.items() if k != "architectures"})
    return get_peft_model(AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, dtype_name)),
                          LoraConfig(r=8, target_modules=targets or "all-linear"))


def _merge_and_unmerge_held(model) -> list[int]:
    """What PEFT's own merge_adapter and unmerge_adapter hold at their peaks beyond the parameters, counted by the
    trace's live-bytes counter on the CPU."""
    from vram_planner.tracing.counter import LiveBytes

    held = []
    with LiveBytes() as counter:
        for parameter in model.parameters():  # made before the counter: known, not counted as new
            counter.track(parameter)
        for step in (model.merge_adapter, model.unmerge_adapter):
            counter.reset_peak()
            before = counter.total
            step()
            held.append(counter.peak - before)
    return held


@pytest.mark.parametrize("targets", [None, ["gate_proj"], ["q_proj", "v_proj"]], ids=["all", "gate", "qv"])
def test_peft_merge_holds_two_delta_weights_of_the_largest_adapted_linear(targets):
    model = _peft_tiny(targets, "bfloat16")
    train = training_config({"dtype": "bfloat16", "lora_r": 8, "lora_target_modules": targets, "use_vllm": True})
    expected = m.vllm_weight_sync_bytes(ModelArchitecture.from_config(TINY), train)
    assert _merge_and_unmerge_held(model) == [expected] * 2


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


@pytest.mark.parametrize("targets", [["up_proj"], None], ids=["up", "all"])
def test_peft_merges_each_adapter_into_its_own_shard_under_fsdp2(targets):
    # TRL 1.16 merges with FSDP2's parameters sharded (its gather_params is a no-op under FSDP): PEFT's own
    # merge_adapter and unmerge_adapter on fully_shard's DTensors, rank 0 of 4 on torch's fake process group
    pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vram_planner.model import fsdp

    model = _peft_tiny(targets, "float32")
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (4,))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        held = _merge_and_unmerge_held(model)
    finally:
        dist.destroy_process_group()
    train = training_config({"dtype": "float32", "lora_r": 8, "lora_target_modules": targets, "use_vllm": True,
                             "fsdp": True, "num_gpus": 4})
    # the widest adapted linear's product and its scaled copy, a quarter of the weight's rows each, not the whole
    assert held == [fsdp.peft_merge_bytes(ModelArchitecture.from_config(TINY), train)] * 2
    assert held[0] == 2 * 176 // 4 * 64 * 4


def test_fsdp2_pushes_each_parameter_whole_in_its_shards_dtype_beside_the_one_before():
    # _iter_fsdp2_params' full_tensor() of each parameter, one at a time, while sync_weights' loop holds the last
    v, h = 128256, 2048  # Llama-3.2-1B: its embedding, then the first layer's q_proj
    for gpus in (2, 8):
        assert _sync("Llama-3.2-1B", num_gpus=gpus, fsdp=True) == (v * h + h * h) * 4  # float32 masters
        assert _sync("Llama-3.2-1B", num_gpus=gpus, fsdp=True, lora_r=16) == (v * h + h * h) * 2  # the frozen base
