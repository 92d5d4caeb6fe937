"""The step-time model: each phase answers to its bound, and the knobs move time the way their mechanism says."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vram_planner.errors import ConfigError, ProfileError
from vram_planner.model import optimizer_work as o
from vram_planner.model import step_work as w
from vram_planner.model.components import BNB_FUSED_MAX_ROWS
from vram_planner.model.spec import Optimizer, training_config, with_changes
from vram_planner.model.step_time import (Card, Efficiency, NoSpeedFigures, card_tflops, efficiency_from,
                                          optimizer_step_seconds, step_time)
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
    bound) speeds up, the compute-bound loss only by the share of its bytes."""
    train = cfg(per_device_train_batch_size=64, use_vllm=True)
    h100, h200 = step_time(llama_1b, train, H100), step_time(llama_1b, train, H200)
    assert h100.bounds["generation"] == "memory" and h100.bounds["training"] == "compute"
    assert h200.seconds["generation"] < h100.seconds["generation"]
    bandwidths = H100.memory_bandwidth_gb_s / H200.memory_bandwidth_gb_s
    assert h100.seconds["training"] * bandwidths < h200.seconds["training"] < h100.seconds["training"]


def test_small_batches_in_eager_transformers_are_launch_bound(llama_1b):
    assert step_time(llama_1b, cfg(per_device_train_batch_size=8), H100).bounds["generation"] == "launch"


def test_vllm_decodes_faster_than_eager_transformers(llama_1b):
    eager = step_time(llama_1b, cfg(), RTX4090)
    vllm = step_time(llama_1b, cfg(use_vllm=True), RTX4090)
    assert vllm.seconds["generation"] < eager.seconds["generation"] / 2


def test_checkpointing_recomputes_each_layers_forward(llama_1b):
    """Checkpointing adds one more forward of the decoder layers: not the model's ops around them nor the LM head,
    which TRL's fused head recomputes in its own backward with or without checkpointing."""
    for train in (cfg(), cfg(lora_r=16, dtype="bfloat16")):
        on = w.training_work(llama_1b, train, 8, 128, 256)
        off = w.training_work(llama_1b, with_changes(train, gradient_checkpointing=False), 8, 128, 256)
        layers = w.forward_work(llama_1b, train, 8, 384, 192, 0)
        assert on.flops - off.flops == pytest.approx(layers.flops)
        assert on.ops - off.ops == w.layer_ops(llama_1b, train, cache=False) - w.MODEL_OPS_PER_FORWARD
    h100 = step_time(llama_1b, cfg(per_device_train_batch_size=64), H100)
    h100_off = step_time(llama_1b, cfg(per_device_train_batch_size=64, gradient_checkpointing=False), H100)
    assert 1.2 < h100.seconds["training"] / h100_off.seconds["training"] < 4 / 3


def test_the_fused_head_recomputes_its_logits_in_the_backward(llama_1b):
    """TRL's fused LM head keeps no logits: its backward projects them again, then takes the hidden states' gradient
    and, where the head trains, the weight's; it launches a few kernels per [4096, 32768] tile."""
    tokens = 8 * 256
    for train, grads in ((cfg(), 3), (cfg(lora_r=16, dtype="bfloat16"), 2)):
        forward, backward = w.fused_head_work(llama_1b, train, tokens)
        assert forward.flops == 2 * tokens * llama_1b.hidden_size * llama_1b.vocab_size
        assert backward.flops == grads * forward.flops
    tiles = math.ceil(llama_1b.vocab_size / w.FUSED_HEAD_VOCAB)  # one token chunk
    forward, _ = w.fused_head_work(llama_1b, cfg(dtype="bfloat16"), tokens)
    assert forward.ops == tiles * w.FUSED_HEAD_FORWARD_OPS_PER_TILE + w.FUSED_HEAD_FORWARD_OPS
    more, _ = w.fused_head_work(llama_1b, cfg(dtype="bfloat16"), 4 * w.FUSED_HEAD_TOKENS + 1)
    assert more.ops - forward.ops == 4 * tiles * w.FUSED_HEAD_FORWARD_OPS_PER_TILE


def test_a_pass_is_the_longer_of_its_launches_and_its_device_work(llama_1b):
    """The host launches ahead of the device: a pass takes its launches or its kernels' time on the device, whichever
    is longer, and the device's is its matmuls' and its other kernels' bytes one after the other."""
    card = Card.of(H200, cfg(dtype="bfloat16"))
    compute = 1e12 / (card.flops_per_s * card.eff.matmul)
    memory = 1e9 / (card.bytes_per_s * card.eff.bandwidth)
    device = w.Work(flops=1e12, bytes_moved=1e9, ops=10)
    assert card.seconds(device, card.eff.bandwidth, card.eff.op_seconds) == (pytest.approx(compute + memory),
                                                                           "compute")
    host = w.Work(flops=1e12, bytes_moved=1e9, ops=1e5)
    assert card.seconds(host, card.eff.bandwidth, card.eff.op_seconds) == (1e5 * card.eff.op_seconds, "launch")


def test_training_flops_follow_six_n_per_token(llama_1b):
    """Kaplan et al.'s 6N per token for forward and backward, plus attention and the LM head of the completions."""
    train = cfg(gradient_checkpointing=False)
    work = w.training_work(llama_1b, train, 1, 128, 256)
    linear = 6 * llama_1b.linear_params * 384
    head = 6 * 2 * llama_1b.hidden_size * llama_1b.vocab_size / 2 * 256
    assert linear < work.flops < 1.2 * (linear + head + 3 * w.attention_flops(llama_1b, 384, 192))


def test_eight_bit_and_fused_optimizers_move_fewer_bytes(llama_1b):
    fused = o.optimizer_bytes(llama_1b, cfg())
    foreach = o.optimizer_bytes(llama_1b, cfg(optim="adamw_torch"))
    eight = o.optimizer_bytes(llama_1b, cfg(optim="adamw_8bit"))
    assert eight < fused < foreach
    clip = llama_1b.params * 4 * o.CLIP_GRAD_ACCESSES
    assert fused == pytest.approx(llama_1b.params * 4 * 7 + clip)
    zero = o.optimizer_bytes(llama_1b, cfg(num_gpus=4, zero_stage=2))
    assert zero < fused / 3  # each GPU steps its quarter


def test_multi_tensor_apply_launches_per_chunk_of_tensors():
    """torch packs up to 252 tensors (param, grad and two states) or 2240 chunks of 65536 elements per launch."""
    assert o.mta_launches(252, 252 * 100, 4) == 1
    assert o.mta_launches(253, 253 * 100, 4) == 2
    assert o.mta_launches(10, 2240 * 65536, 4) == 2  # the chunks fill first
    assert o.mta_launches(0, 0, 1) == 0


def test_loras_optimizer_step_is_host_bound_per_tensor(llama_1b):
    """LoRA's adapters are two small tensors per adapted linear: optimizer.step() is its Python loop over them, and a
    full model's is its bytes."""
    lora = cfg(lora_r=16, dtype="bfloat16")
    assert o.trainable_tensors(llama_1b, lora) == 2 * 7 * llama_1b.num_layers
    # Llama's decoder layers hold seven linears and two norms; the embedding (tied to the head) and the final norm
    assert o.parameter_tensors(llama_1b) == llama_1b.num_layers * 9 + 2
    card = Card.of(H200, lora)
    host = step_time(llama_1b, lora, H200)
    assert host.bounds["optimizer"] == "host" and step_time(llama_1b, cfg(), H200).bounds["optimizer"] == "memory"
    slower = Card.of(H200, lora, Efficiency(tensor_seconds=2 * Efficiency().tensor_seconds))
    one, two = optimizer_step_seconds(llama_1b, lora, card), optimizer_step_seconds(llama_1b, lora, slower)
    visits = o.optimizer_work(llama_1b, lora).step_visits
    assert two - one == pytest.approx(visits * Efficiency().tensor_seconds)
    # bitsandbytes' 8-bit AdamW launches one kernel per tensor from its Python loop
    eight = o.optimizer_work(llama_1b, cfg(lora_r=16, dtype="bfloat16", optim="adamw_8bit"))
    assert eight.step_launches == o.trainable_tensors(llama_1b, lora)


def test_four_bit_weights_move_their_dequantized_copy_where_bitsandbytes_dequantizes(llama_1b):
    """Up to 512 rows, bitsandbytes 0.50 multiplies in its fused kernel from the packed weight (decoding's batches);
    above them it writes and reads a 16-bit copy (the prefill, the log-prob passes and the loss)."""
    qlora, lora = cfg(lora_r=16, load_in_4bit=True, dtype="bfloat16"), cfg(lora_r=16, dtype="bfloat16")
    decoding, loss = BNB_FUSED_MAX_ROWS, BNB_FUSED_MAX_ROWS + 1
    assert w.weight_pass_bytes(llama_1b, qlora, loss) > w.weight_pass_bytes(llama_1b, lora, loss)
    assert w.weight_pass_bytes(llama_1b, qlora, decoding) < w.weight_pass_bytes(llama_1b, lora, decoding) / 2
    assert w.weight_pass_bytes(llama_1b, qlora, loss) - w.weight_pass_bytes(llama_1b, qlora, decoding) == \
        llama_1b.linear_params * w.DEQUANT_BYTES_PER_PARAM


def test_a_four_bit_linear_makes_eight_host_crossings_where_a_16_bit_one_makes_one(llama_1b, monkeypatch):
    """QLoRA decoding is launch-bound: the H200 decoded Llama-3.2-1B 60% slower with 4-bit weights than with 16-bit
    ones (call 5), where the model had counted fewer ops for it than for LoRA."""
    qlora, lora = cfg(lora_r=16, load_in_4bit=True, dtype="bfloat16"), cfg(lora_r=16, dtype="bfloat16")
    gen = {name: step_time(llama_1b, c, H200).seconds["generation"] for name, c in (("qlora", qlora), ("lora", lora))}
    assert gen["qlora"] > 1.3 * gen["lora"]
    crossings = w.layer_ops(llama_1b, qlora, rows=4)
    monkeypatch.setattr(w, "BNB_4BIT_CALL_OPS", 1)
    assert crossings - w.layer_ops(llama_1b, qlora, rows=4) == 7 * 7 * llama_1b.num_layers


def test_the_loss_passes_move_their_activations(llama_1b):
    """Norms, rotary, the MLP's product and PEFT's casts read and write the activations: bytes per token that grow
    with the model's widths, more with float32 adapters than with the 16-bit ones TRL keeps over a 4-bit base, and
    twice over in the backward."""
    lora, qlora = cfg(lora_r=16, dtype="bfloat16"), cfg(lora_r=16, dtype="bfloat16", load_in_4bit=True)
    full = cfg(dtype="bfloat16")
    assert w.elementwise_bytes_per_token(llama_1b, lora) > w.elementwise_bytes_per_token(llama_1b, qlora) > \
        w.elementwise_bytes_per_token(llama_1b, full) > llama_1b.num_layers * 10 * llama_1b.hidden_size
    one, eight = (w.training_passes(llama_1b, full, b, 128, 256) for b in (1, 8))
    head_one, head_eight = (w.fused_head_work(llama_1b, full, b * 256) for b in (1, 8))
    per_sequence = 384 * w.elementwise_bytes_per_token(llama_1b, full)
    for passes, times in ((0, 1), (1, 3)):  # the backward's twice the forward's, and checkpointing's forward again
        head = head_eight[passes].bytes_moved - head_one[passes].bytes_moved
        assert eight[passes].bytes_moved - one[passes].bytes_moved - head == pytest.approx(times * 7 * per_sequence)


def test_four_bit_weights_are_dequantized_at_every_use_above_the_fused_kernels_rows(llama_1b):
    """Forward, checkpointing's second forward and the backward each dequantize every 4-bit linear again, with
    double quantization's absmax first (three kernels a use, one without it); decoding's few rows take the fused
    kernel, which reads the packed weight and its absmax itself."""
    double = cfg(lora_r=16, load_in_4bit=True, dtype="bfloat16")
    single = cfg(lora_r=16, load_in_4bit=True, dtype="bfloat16", bnb_4bit_use_double_quant=False)
    linears = 7 * llama_1b.num_layers
    many = BNB_FUSED_MAX_ROWS + 1
    assert w.layer_ops(llama_1b, double, rows=many) - w.layer_ops(llama_1b, single, rows=many) == 2 * linears
    assert w.layer_ops(llama_1b, double, rows=8) == w.layer_ops(llama_1b, single, rows=8)
    assert w.backward_ops(llama_1b, double) - w.backward_ops(llama_1b, single) == 2 * linears
    uses = w.training_work(llama_1b, double, 8, 128, 256).ops - w.training_work(llama_1b, single, 8, 128, 256).ops
    assert uses == 3 * 2 * linears  # forward, recompute, backward


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
    # the matmuls take twice as long; the bytes beside them do not
    assert 1.5 < half.seconds["training"] / base.seconds["training"] < 2


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


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj"]], ids=["hashable", "a-list-of-targets"])
def test_remembered_work_is_the_work_worked_out_afresh(llama_1b, targets):
    """The passes' work is remembered per model and config (a probe's fit weighs it under thousands of factor sets);
    a config holding a list, which cannot be a key, is worked out each time."""
    train = cfg(lora_r=16, lora_target_modules=targets)
    for work, args in ((w.training_passes, (llama_1b, train, 4, 64, 128)),
                       (w.forward_work, (llama_1b, train, 16, 1, 96.0, 1)), (o.optimizer_work, (llama_1b, train))):
        assert work(*args) == work(*args) == work.__wrapped__(*args)


@pytest.mark.parametrize("card", ["t4", "v100-16gb", "rtx2080-ti"])
def test_bf16_on_a_card_without_it_is_judged_emulated_at_float32_speed(card):
    """torch emulates bf16 before Ampere (is_bf16_supported() is True there; transformers and TRL run it): the config
    is judged, with a note, its matmuls at the card's float32 throughput; fp16 at its tensor cores' rate."""
    from vram_planner import engine
    from vram_planner.model.step_time import card_tflops
    from vram_planner.profiles import GpuProfile

    gpu = GpuProfile.from_name(card)
    bf16 = engine.check("Llama-3.2-1B", card, {"dtype": "bfloat16", "lora_r": 16, "mixed_precision": "bf16"})
    assert bf16.train.mixed_precision == "bf16" and not gpu.bf16
    assert any("no native bf16: torch emulates it" in note for note in bf16.estimate.notes)
    assert card_tflops(gpu, bf16.train) == gpu.fp32_tflops
    fp16 = engine.check("Llama-3.2-1B", card, {"dtype": "float16", "lora_r": 16})  # the default becomes fp16 there
    assert fp16.train.mixed_precision == "fp16" and card_tflops(gpu, fp16.train) == gpu.fp16_tflops
    assert not any("no native bf16" in note for note in fp16.estimate.notes)
    assert fp16.estimate.peak_bytes == pytest.approx(bf16.estimate.peak_bytes, rel=0.01)  # two bytes either way
