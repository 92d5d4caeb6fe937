"""The loaded weights' segments (vram_planner.model.stranding.loaded_weight_segment_bytes): what the caching
allocator holds beside every weight of 10 MiB or more, the rest of its segment rounded up to 2 MiB, added as it is
to every phase's fitted reserve. Held to the allocator model replaying a traced step's loading, and swept over the
catalog."""

from __future__ import annotations

import json

import pytest

from helpers import FIXTURES
from vram_planner.allocator import CachingAllocator
from vram_planner.allocator.sizes import K_LARGE_BUFFER, K_MIN_LARGE_ALLOC, K_SMALL_SIZE, allocation_size
from vram_planner.model import blocks
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.calibration import Calibration, allocator_reserve_bytes, default_calibration
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.stranding import loaded_weight_segment_bytes, rest_beside_large_blocks
from vram_planner.profiles import model_catalog, model_config
from vram_planner.units import MiB

# Qwen2.5-0.5B's layer (896 x 4,864 MLP weights: 16.6 MiB in float32, 18 MiB segments) on a small vocabulary
WIDE = {**json.loads((FIXTURES / "tiny-qwen2.json").read_text()), "hidden_size": 896, "intermediate_size": 4864,
        "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 1}
SHORT = {"per_device_train_batch_size": 2, "num_generations": 2, "max_prompt_length": 8, "max_completion_length": 8}


@pytest.mark.parametrize("settings, copies", [({"dtype": "float32", "beta": 0.04}, 2),
                                              ({"dtype": "float32", "lora_r": 8, "beta": 0.04}, 1),
                                              ({"dtype": "bfloat16"}, 1)])
def test_the_traced_loading_leaves_what_the_pattern_counts(settings, copies):
    """The trace's loading replayed through the allocator model: the segments of the 16.6 MiB float32 MLP weights
    hold 1.375 MiB each beside them; the reference model (beta, full fine-tuning) loads its own, PEFT's disabled
    adapter none; in bfloat16 the 8.3 MiB weights share the 20 MiB segments and nothing is counted."""
    train = TrainingConfig(**SHORT, **settings)
    expected = loaded_weight_segment_bytes(ModelArchitecture.from_config(WIDE), train)
    assert _traced_loading_rest(WIDE, train) == expected
    assert expected == (copies * 3 * (18 * MiB - 896 * 4864 * 4) if settings["dtype"] == "float32" else 0)


def test_smaller_weights_loaded_later_fill_the_rests_they_fit():
    """DeepSeek-R1-Distill-Qwen-1.5B's float32 shapes: each 52.5 MiB MLP weight leaves 1.5 MiB of its 54 MiB
    segment, and the next layer's 1.5 MiB key and value projections are cut from two of the three rests."""
    config = {**WIDE, "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12, "head_dim": 128,
              "num_hidden_layers": 3}
    train = TrainingConfig(**SHORT, dtype="float32")
    rest = loaded_weight_segment_bytes(ModelArchitecture.from_config(config), train)
    assert _traced_loading_rest(config, train) == rest == (3 * 3 - 2 * 2) * 1.5 * MiB


def _traced_loading_rest(config: dict, train: TrainingConfig) -> int:
    from vram_planner.tracing.step import trace_step

    allocator, made, requested = CachingAllocator(), {}, {}
    for event in trace_step(config, train).events:
        if event.phase != "loading":
            break
        if event.kind == "alloc":
            made[event.block] = allocator.malloc(event.size_bytes)
            requested[made[event.block]] = event.size_bytes
        else:
            allocator.free(made.pop(event.block))
    return rest_beside_large_blocks(allocator, requested)


@pytest.mark.parametrize("model", sorted(model_catalog()))
def test_every_catalog_model_leaves_less_than_a_rounding_beside_each_large_weight(model):
    """For every catalog model, weight dtype and reference copy: no more than each weight of 10 MiB or more leaves
    of its 2 MiB-rounded segment (weights of 1 to 10 MiB share 20 MiB segments and may fill a rest, or leave a
    tail a large weight is cut from: gemma-3-1b-it's 15.2 MiB bfloat16 MLP weights in the 15.5 MiB its attention's
    2.25 MiB projections leave), all of it where no weight lies between the pools, and never a negative."""
    arch = ModelArchitecture.from_config(model_config(model)[0])
    for dtype, element in (("float32", 4), ("bfloat16", 2)):
        sizes = [int(blocks.blocks(n * element)) for n in blocks.parameter_tensors(arch)]
        rests = sum(allocation_size(size, K_LARGE_BUFFER) - size for size in sizes if size >= K_MIN_LARGE_ALLOC)
        shared = any(K_SMALL_SIZE < size < K_MIN_LARGE_ALLOC for size in sizes)
        for beta, copies in ((0.0, 1), (0.04, 2)):
            rest = loaded_weight_segment_bytes(arch, TrainingConfig(dtype=dtype, beta=beta))
            assert 0 <= rest <= copies * rests, (model, dtype, beta)
            assert shared or rest == copies * rests, (model, dtype, beta)


@pytest.mark.parametrize("settings", [{"allocator_conf": "expandable_segments:True"}, {"load_in_4bit": True,
                                      "lora_r": 16}, {"num_gpus": 2, "zero_stage": 2}, {"num_gpus": 2, "fsdp": True}])
def test_nothing_where_the_weights_are_not_loaded_one_segment_each(settings):
    """Expandable segments map pages end to end; 4-bit weights are packed on the way in; ZeRO and FSDP flatten and
    shard them."""
    arch = ModelArchitecture.from_config(model_config("Qwen2.5-0.5B")[0])
    assert loaded_weight_segment_bytes(arch, TrainingConfig(dtype="float32")) > 90 * MiB
    assert loaded_weight_segment_bytes(arch, TrainingConfig(dtype="float32", **settings)) == 0


def test_the_rests_are_added_to_a_fitted_reserve_as_they_are_and_not_to_a_measured_fraction():
    cal = default_calibration()
    tensors = {"weights": 2e9, "activations": 1e9}
    fitted = allocator_reserve_bytes(cal, "training", tensors, False, {})
    assert allocator_reserve_bytes(cal, "training", tensors, False, {}, exact_bytes=99 * MiB) == fitted + 99 * MiB
    measured = Calibration(allocator_overhead_fraction=0.1)
    assert allocator_reserve_bytes(measured, "training", tensors, False, {}, exact_bytes=99 * MiB) == 0.1 * 3e9


def test_a_weight_no_card_could_load_is_a_verdict_not_an_error(capsys, tmp_path):
    # a config.json typo that makes the embedding 2**31 x 2**31: cudaMalloc is never asked for more than 1 EB (torch
    # refuses first), so the loading's replay stops there; the estimate is the weights' bytes, and check says it does
    # not fit instead of printing the allocator model's out-of-memory error
    from vram_planner.cli import main

    huge = {**json.loads((FIXTURES / "tiny-llama-headdim.json").read_text()), "vocab_size": 2**31 - 1,
            "hidden_size": 2**31 - 4}
    arch = ModelArchitecture.from_config(huge)
    assert loaded_weight_segment_bytes(arch, TrainingConfig(dtype="float32")) == 0
    assert loaded_weight_segment_bytes(ModelArchitecture.from_config(WIDE), TrainingConfig(dtype="float32")) > 0
    path = tmp_path / "config.json"
    path.write_text(json.dumps(huge))
    assert main(["check", "--gpu", "80GiB", "--model", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "does not fit" in out and err == ""
