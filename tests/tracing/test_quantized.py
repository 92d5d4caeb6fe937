"""4-bit weights in the trace: the model loaded as transformers' bitsandbytes quantizer and bitsandbytes' own
`quantize_4bit` leave it, PEFT's 4-bit LoRA layers over it with TRL's bfloat16 adapters, and the matmuls allocating
what bitsandbytes' CUDA kernels allocate."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from helpers import FIXTURES
from vram_planner.model.spec import TrainingConfig
from vram_planner.tracing.step import trace_step

pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

# Qwen3's shapes, whose MLP weights (320 x 64, whole blocks of 64 either way) dequantize to a size no other tensor
# of these steps has: a prompt of 24 tokens and a completion of 9 make no 64 rows of 320, nor a KV cache of as many
TINY = {**json.loads((FIXTURES / "tiny-qwen3.json").read_text()), "intermediate_size": 320}
QLORA = {"lora_r": 8, "load_in_4bit": True, "dtype": "bfloat16", "num_generations": 4, "max_prompt_length": 24,
         "max_completion_length": 9}
BLOCK = 512
BLOCKSIZE = 64  # the weights' quantization blocks (BitsAndBytesConfig's default)


def rounded(n_bytes: int) -> int:
    return -(-n_bytes // BLOCK) * BLOCK


def linear_shapes(config: dict) -> list[tuple[int, int]]:
    """(out, in) of every linear layer of a Llama-like decoder, the LM head aside."""
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, inter = config["head_dim"], config["intermediate_size"]
    layer = [(heads * head_dim, hidden), (kv * head_dim, hidden), (kv * head_dim, hidden), (hidden, heads * head_dim),
             (inter, hidden), (inter, hidden), (hidden, inter)]
    return layer * config["num_hidden_layers"]


def quantized_bytes(out_features: int, in_features: int) -> int:
    """What bitsandbytes keeps on the GPU for one double-quantized NF4 weight: the packed weight (two a byte), one
    8-bit absmax a block of 64, their offset, the 16 NF4 values, and the absmax's own state (one float32 absmax per
    256 blocks and the 256-value dynamic map), each its own storage."""
    n = out_features * in_features
    blocks = -(-n // BLOCKSIZE)
    return (rounded(n // 2) + rounded(blocks) + rounded(4) + rounded(16 * 4) + rounded(-(-blocks // 256) * 4)
            + rounded(256 * 4))


def test_the_loaded_model_is_what_bitsandbytes_quantizes_beside_bfloat16_adapters():
    """Every linear layer but the (tied) LM head is packed and quantized; the embedding, the norms and the rotary
    frequencies stay as loaded, and TRL casts the adapters to bfloat16 over a quantized model."""
    train = TrainingConfig(**QLORA, per_device_train_batch_size=4)
    loading = [e for e in trace_step(TINY, train).events if e.phase == "loading"]
    freed = {e.block for e in loading if e.kind == "free"}
    kept = [e for e in loading if e.kind == "alloc" and e.block not in freed]
    shapes = linear_shapes(TINY)
    hidden, head_dim, layers = TINY["hidden_size"], TINY["head_dim"], TINY["num_hidden_layers"]
    quantized = sum(quantized_bytes(o, i) for o, i in shapes)
    adapters = sum(rounded(8 * i * 2) + rounded(o * 8 * 2) for o, i in shapes)
    norms = layers * (2 * rounded(hidden * 2) + 2 * rounded(head_dim * 2)) + rounded(hidden * 2)
    rotary = 2 * rounded(head_dim // 2 * 4)  # inv_freq and original_inv_freq, float32
    as_loaded = rounded(TINY["vocab_size"] * hidden * 2) + norms + rotary
    assert sum(rounded(e.size_bytes) for e in kept) == quantized + adapters + as_loaded


def test_each_weight_is_quantized_on_the_card_from_its_checkpoint_copy_one_at_a_time():
    """transformers puts each 4-bit layer's weight on the card in the checkpoint's dtype, bitsandbytes packs it there,
    and the copy is freed before the next weight comes: one 16-bit copy per linear layer, never two alive at once,
    in the checkpoint's key order (the embedding first, then layer by layer: within one, the MLP's projections before
    the attention's, each group by name), every adapter after the whole model."""
    train = TrainingConfig(**QLORA, per_device_train_batch_size=4)
    loading = [e for e in trace_step(TINY, train).events if e.phase == "loading"]
    freed = {e.block for e in loading if e.kind == "free"}
    hidden, inter = TINY["hidden_size"], TINY["intermediate_size"]
    copies = [e for e in loading if e.kind == "alloc" and e.block in freed and e.size_bytes >= hidden * hidden]
    shapes = linear_shapes(TINY)
    assert sorted(e.size_bytes for e in copies) == sorted(o * i * 2 for o, i in shapes)
    alive, most = 0, 0
    for e in loading:
        if e.block in {c.block for c in copies}:
            alive += 1 if e.kind == "alloc" else -1
            most = max(most, alive)
    assert most == 1
    assert loading[0].size_bytes == TINY["vocab_size"] * hidden * 2
    q, kv = TINY["num_attention_heads"] * TINY["head_dim"], TINY["num_key_value_heads"] * TINY["head_dim"]
    # down, gate, up; then k, o, q, v
    layer_order = [inter * hidden * 2] * 3 + [kv * hidden * 2, q * hidden * 2, q * hidden * 2, kv * hidden * 2]
    assert [e.size_bytes for e in copies] == layer_order * TINY["num_hidden_layers"]
    assert [e.layer for e in copies] == [i for i in range(TINY["num_hidden_layers"]) for _ in layer_order]
    after = loading[1 + max(i for i, e in enumerate(loading) if e.kind == "free"):]
    adapters = sum(rounded(8 * i * 2) + rounded(o * 8 * 2) for o, i in shapes)
    rotary = 2 * rounded(TINY["head_dim"] // 2 * 4)
    assert sum(rounded(e.size_bytes) for e in after) == rounded(hidden * 2) + adapters + rotary  # the final norm


def _dequantized_mlp_weights(settings: dict, config: dict = TINY) -> Counter:
    """Per phase, how many bfloat16 copies of a whole MLP weight the step allocates."""
    size = config["intermediate_size"] * config["hidden_size"] * 2
    events = trace_step(config, TrainingConfig(**QLORA, **settings)).steady_stream().events
    return Counter(e.phase for e in events if e.kind == "alloc" and e.size_bytes == size)


def test_bitsandbytes_dequantizes_a_weight_where_its_cuda_kernel_would_not_fuse():
    """Up to 512 rows bitsandbytes multiplies in its fused kernel, reading the packed weight (generation's prefill of
    4 x 24 tokens and its decoding, a loss forward of 4 x 33); above them (16 x 33 rows) it dequantizes the whole
    weight first, in the loss's forward and in the checkpointed layers' recompute; every backward dequantizes."""
    fused = _dequantized_mlp_weights({"per_device_train_batch_size": 4})
    dequantized = _dequantized_mlp_weights({"per_device_train_batch_size": 16})
    assert fused["generation"] == dequantized["generation"] == 0
    assert fused["training"] > 0
    assert dequantized["training"] == 3 * fused["training"]


def test_a_weight_of_partial_blocks_is_dequantized_at_any_number_of_rows():
    """An MLP of 160 (two and a half blocks of 64): the down projection's rows are no whole blocks, so bitsandbytes
    falls back to dequantizing it even for the four rows of a decoding step, which the estimate counts as well."""
    from vram_planner.model.architecture import ModelArchitecture
    from vram_planner.model.components import dequantized_weight_bytes

    partial = {**TINY, "intermediate_size": 160}
    assert _dequantized_mlp_weights({"per_device_train_batch_size": 4}, partial)["generation"] > 0
    train = TrainingConfig(**QLORA, per_device_train_batch_size=4)
    assert dequantized_weight_bytes(ModelArchitecture.from_config(partial), train, 4) == 160 * 64 * 2
    assert dequantized_weight_bytes(ModelArchitecture.from_config(TINY), train, 4) == 0


def test_check_exact_of_4bit_weights_answers_from_the_need(capsys):
    """`check --exact --load-in-4bit`: the traced need, and `trace` the same step, where the CPU trace once refused
    4-bit weights."""
    from helpers import json_of

    flags = ["--gpu", "24GiB", "--model", str(FIXTURES / "tiny-qwen3.json"), "--lora-r", "8", "--load-in-4bit",
             "--dtype", "bfloat16", "--per-device-train-batch-size", "4", "--num-generations", "4",
             "--max-prompt-length", "24", "--max-completion-length", "9"]
    code, doc = json_of(capsys, "check", "--exact", *flags)
    assert code == 0 and doc["fits"] and 0 < doc["exact"]["tensor_peak_bytes"] < doc["exact"]["need_bytes"]
    code, traced = json_of(capsys, "trace", *flags)
    assert code == 0 and traced["exact"]["need_bytes"] == doc["exact"]["need_bytes"]


def test_without_bitsandbytes_tracing_4bit_weights_says_how_to_install_it(monkeypatch):
    import importlib.util

    from vram_planner.errors import VramPlanError
    from vram_planner.tracing.step import check_traceable

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else found(name, *a))
    with pytest.raises(VramPlanError, match=r"tracing 4-bit weights \(load_in_4bit\) needs bitsandbytes.*pip install"):
        check_traceable(TrainingConfig(**QLORA))


@pytest.mark.parametrize("sharding", [{"zero_stage": 2}, {"zero_stage": 3}, {"fsdp": True}])
def test_sharded_4bit_weights_are_refused_in_one_line(sharding):
    from vram_planner.errors import VramPlanError
    from vram_planner.tracing.step import check_traceable

    with pytest.raises(VramPlanError, match="4-bit weights .* are traced on one GPU, not sharded"):
        check_traceable(TrainingConfig(**QLORA, num_gpus=2, **sharding))


@pytest.mark.parametrize("fixture", ["tiny-llama-headdim", "tiny-qwen2", "tiny-gemma2", "tiny-phi"])
def test_over_float32_weights_the_mlp_keeps_float32_tensors_as_bitsandbytes_hands_them_back(fixture):
    """Float32 weights in 4 bits under bf16 autocast (TRL's default mixed precision), no checkpointing: Linear4bit
    casts its output back to its input's dtype, so the MLP's tensors are float32 where a 16-bit linear under autocast
    makes them bfloat16. The estimate's kept activations meet the trace's (it counted them in bfloat16: 25% short on
    Qwen2.5-1.5B, 8 x 192 tokens)."""
    from vram_planner import engine

    config = json.loads((FIXTURES / f"{fixture}.json").read_text())
    settings = {**QLORA, "dtype": "float32", "per_device_train_batch_size": 8, "num_generations": 8,
                "max_completion_length": 64, "gradient_checkpointing": False}
    outcome = engine.check(config, "24GiB", settings, exact=True)
    training = next(c for c in outcome.comparison() if c.name == "training")
    traced, counted = training.components["activations"]
    assert counted == pytest.approx(traced, rel=0.03)
