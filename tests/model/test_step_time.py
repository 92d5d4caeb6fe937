"""The step-time model: each phase answers to its bound, and the knobs move time the way their mechanism says."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vram_planner.errors import ConfigError, ProfileError
from vram_planner.model import step_work as w
from vram_planner.model.spec import Optimizer, training_config, with_changes
from vram_planner.model.step_time import (Efficiency, NoSpeedFigures, card_tflops, efficiency_from, step_time)
from vram_planner.profiles import GpuProfile, gpus

H100 = GpuProfile.from_name("h100-80gb")
H200 = GpuProfile.from_name("h200")
RTX4090 = GpuProfile.from_name("rtx4090")


def cfg(**kw):
    return training_config({"per_device_train_batch_size": 8, "num_generations": 8, "max_prompt_length": 128,
                            "max_completion_length": 256, **kw})


def test_every_catalog_card_has_speed_figures():
    for gpu in gpus():
        assert gpu.memory_bandwidth_gb_s and gpu.fp16_tflops and gpu.fp32_tflops and gpu.interconnect_gb_s, gpu.name
        assert (gpu.bf16_tflops is not None) == gpu.bf16, gpu.name  # a bf16 figure exactly where the card has bf16
        # dense 16-bit tensor throughput is above FP32's on every card since Volta; the P100 runs FP16 at 2x
        assert gpu.fp16_tflops >= 2 * gpu.fp32_tflops * 0.99, gpu.name


def test_the_matmul_dtype_picks_the_datasheet_figure(llama_1b):
    assert card_tflops(H100, cfg()) == H100.bf16_tflops  # autocast bf16
    assert card_tflops(H100, cfg(mixed_precision="no")) == H100.fp32_tflops
    assert card_tflops(H100, cfg(mixed_precision="no", dtype="bfloat16")) == H100.bf16_tflops
    t4 = GpuProfile.from_name("t4")
    assert card_tflops(t4, cfg(mixed_precision="fp16")) == t4.fp16_tflops


def test_a_card_without_figures_says_so_in_one_line(llama_1b):
    card = GpuProfile(name="24GiB", total_memory_gib=24)
    with pytest.raises(NoSpeedFigures, match="no memory bandwidth"):
        step_time(llama_1b, cfg(), card)


def test_phases_are_those_the_config_runs(llama_1b):
    plain = step_time(llama_1b, cfg(), H100)
    assert set(plain.seconds) == {"generation", "training", "optimizer"}
    assert plain.step_seconds == pytest.approx(sum(plain.seconds.values()))
    scored = step_time(llama_1b, cfg(beta=0.04), H100)
    assert scored.seconds["scoring"] > 0
    two = step_time(llama_1b, cfg(num_gpus=2), H100)
    assert two.seconds["communication"] > 0 and two.completions_per_step == 2 * plain.completions_per_step
    rewarded = step_time(llama_1b, cfg(), H100, reward_seconds=0.1)
    assert rewarded.seconds["rewards"] == pytest.approx(0.1 * 8)


def test_decoding_is_bandwidth_bound_and_a_faster_memory_decodes_faster(llama_1b):
    """The H200 has the H100's tensor throughput and 1.43x its bandwidth: decoding a large batch (past the launch
    bound) speeds up, the compute-bound loss does not."""
    train = cfg(per_device_train_batch_size=64, use_vllm=True)
    h100, h200 = step_time(llama_1b, train, H100), step_time(llama_1b, train, H200)
    assert h100.bounds["generation"] == "memory"
    assert h200.seconds["generation"] < h100.seconds["generation"]
    assert h200.seconds["training"] == pytest.approx(h100.seconds["training"])


def test_small_batches_in_eager_transformers_are_launch_bound(llama_1b):
    assert step_time(llama_1b, cfg(per_device_train_batch_size=8), H100).bounds["generation"] == "launch"


def test_vllm_decodes_faster_than_eager_transformers(llama_1b):
    eager = step_time(llama_1b, cfg(), RTX4090)
    vllm = step_time(llama_1b, cfg(use_vllm=True), RTX4090)
    assert vllm.seconds["generation"] < eager.seconds["generation"] / 2


def test_checkpointing_recomputes_a_forward(llama_1b):
    """Full fine-tuning: forward 1 + backward 2 + recompute 1 = 4/3 of the FLOPs without checkpointing."""
    on = w.training_work(llama_1b, cfg(), 8, 128, 256)
    off = w.training_work(llama_1b, cfg(gradient_checkpointing=False), 8, 128, 256)
    assert on.flops / off.flops == pytest.approx(4 / 3)
    lora_on = w.training_work(llama_1b, cfg(lora_r=16, dtype="bfloat16"), 8, 128, 256)
    lora_off = w.training_work(llama_1b, cfg(lora_r=16, dtype="bfloat16", gradient_checkpointing=False), 8, 128, 256)
    assert lora_on.flops / lora_off.flops == pytest.approx(3 / 2)  # frozen weights: backward is one forward
    h100 = step_time(llama_1b, cfg(per_device_train_batch_size=64), H100)
    h100_off = step_time(llama_1b, cfg(per_device_train_batch_size=64, gradient_checkpointing=False), H100)
    assert h100.seconds["training"] / h100_off.seconds["training"] == pytest.approx(4 / 3)


def test_training_flops_follow_six_n_per_token(llama_1b):
    """Kaplan et al.'s 6N per token for forward and backward, plus attention and the LM head of the completions."""
    train = cfg(gradient_checkpointing=False)
    work = w.training_work(llama_1b, train, 1, 128, 256)
    linear = 6 * llama_1b.linear_params * 384
    head = 6 * 2 * llama_1b.hidden_size * llama_1b.vocab_size / 2 * 256
    assert linear < work.flops < 1.2 * (linear + head + 3 * w.attention_flops(llama_1b, 384, 192))


def test_eight_bit_and_fused_optimizers_move_fewer_bytes(llama_1b):
    fused = w.optimizer_bytes(llama_1b, cfg())
    foreach = w.optimizer_bytes(llama_1b, cfg(optim="adamw_torch"))
    eight = w.optimizer_bytes(llama_1b, cfg(optim="adamw_8bit"))
    assert eight < fused < foreach
    clip = llama_1b.params * 4 * w.CLIP_GRAD_ACCESSES
    assert fused == pytest.approx(llama_1b.params * 4 * 7 + clip)
    zero = w.optimizer_bytes(llama_1b, cfg(num_gpus=4, zero_stage=2))
    assert zero < fused / 3  # each GPU steps its quarter


def test_four_bit_weights_move_their_dequantized_copy(llama_1b):
    qlora = w.weight_pass_bytes(llama_1b, cfg(lora_r=16, load_in_4bit=True, dtype="bfloat16"))
    lora = w.weight_pass_bytes(llama_1b, cfg(lora_r=16, dtype="bfloat16"))
    assert qlora > lora  # QLoRA saves memory, not time: every pass dequantizes


def test_communication_grows_with_sharding(llama_1b):
    times = {kind: step_time(llama_1b, cfg(num_gpus=4, **extra), H100).seconds["communication"]
             for kind, extra in (("ddp", {}), ("zero2", {"zero_stage": 2}), ("zero3", {"zero_stage": 3}))}
    assert times["ddp"] < times["zero3"] and times["zero2"] < times["zero3"]
    pcie = replace(H100, interconnect="pcie4", interconnect_gb_s=32)
    assert step_time(llama_1b, cfg(num_gpus=4), pcie).seconds["communication"] > times["ddp"] * 10


def test_efficiency_factors_scale_their_phase(llama_1b):
    train = cfg(per_device_train_batch_size=64, gradient_accumulation_steps=1)
    base = step_time(llama_1b, train, H100)
    assert base.bounds["training"] == "compute"
    half = step_time(llama_1b, train, H100, Efficiency(matmul=Efficiency().matmul / 2))
    assert half.seconds["training"] == pytest.approx(2 * base.seconds["training"])


def test_a_calibration_names_only_known_positive_factors():
    assert efficiency_from({"matmul": 0.3}).matmul == 0.3
    for bad in ({"matmull": 0.3}, {"matmul": 0}, {"matmul": float("nan")}, {"matmul": "fast"}):
        with pytest.raises(ProfileError, match="step_time"):
            efficiency_from(bad)


def test_epochs_and_tokens(llama_1b):
    time = step_time(llama_1b, cfg(gradient_accumulation_steps=2), H100)
    assert time.completions_per_step == 16 and time.prompts_per_step == 2
    assert time.epoch_seconds(100) == pytest.approx(50 * time.step_seconds)
    assert time.completion_tokens_per_second == pytest.approx(16 * 256 / time.step_seconds)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.sampled_from([1, 2, 4, 8, 16, 64]), completion=st.integers(1, 4096), prompt=st.integers(1, 4096),
       lora=st.booleans(), vllm=st.booleans(), beta=st.sampled_from([0.0, 0.04]), gpus=st.sampled_from([1, 2, 8]),
       optim=st.sampled_from(list(Optimizer)), card=st.sampled_from(gpus()))
def test_every_step_time_is_finite_positive_and_grows_with_completions(llama_1b, batch, completion, prompt, lora,
                                                                       vllm, beta, gpus, optim, card):
    try:
        train = training_config({"per_device_train_batch_size": batch, "num_generations": 2 if batch == 1 else batch,
                                 "gradient_accumulation_steps": 2 if batch == 1 else 1,
                                 "max_completion_length": completion, "max_prompt_length": prompt,
                                 "lora_r": 16 if lora else None, "use_vllm": vllm, "beta": beta, "num_gpus": gpus,
                                 "optim": optim.value, "mixed_precision": "bf16" if card.bf16 else "fp16"})
    except ConfigError:  # a combination TRL refuses
        return
    time = step_time(llama_1b, train, card)
    assert all(math.isfinite(s) and s >= 0 for s in time.seconds.values())
    assert time.step_seconds > 0
    longer = step_time(llama_1b, with_changes(train, max_completion_length=completion + 64), card)
    assert longer.seconds["generation"] > time.seconds["generation"]
    assert longer.seconds["training"] >= time.seconds["training"]


def test_eager_decoding_moves_the_cache_several_times(llama_1b):
    """Llama-3.2-1B has 32 query heads on 8 KV heads: under GRPO's padding mask SDPA repeats each KV head 4 times,
    and the cache is concatenated every step; FlashAttention-2 only reads it."""
    assert w.eager_kv_passes(llama_1b, cfg()) == 2 + 1 + 2 * 4
    assert w.eager_kv_passes(llama_1b, cfg(attn_implementation="flash_attention_2")) == 3
    long = cfg(per_device_train_batch_size=64, max_completion_length=4096)
    sdpa = step_time(llama_1b, long, H100).seconds["generation"]
    flash = step_time(llama_1b, with_changes(long, attn_implementation="flash_attention_2"), H100)
    assert flash.seconds["generation"] < sdpa
