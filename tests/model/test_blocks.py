"""vram_planner.model.blocks: tensors in whole 512-byte blocks, tensor by tensor, as the model builds them."""

from __future__ import annotations

import json

import pytest

from helpers import build_on_meta, family_fixture_files
from vram_planner.model import blocks
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.resolve import catalog_architecture
from vram_planner.model.spec import training_config
from vram_planner.profiles import models


@pytest.mark.parametrize("entry", models(), ids=lambda e: e.name)
def test_the_tensors_add_up_to_the_parameters_of_every_catalog_model(entry):
    arch = catalog_architecture(entry)
    assert sum(blocks.parameter_tensors(arch)) == arch.params


@pytest.mark.parametrize("path", family_fixture_files(), ids=lambda p: p.stem)
def test_the_tensors_are_the_modules_parameters_one_by_one(path):
    config = json.loads(path.read_text())
    arch = ModelArchitecture.from_config(config)
    if arch.vision_params:
        pytest.skip("a vision tower (idle in GRPO) is counted as one tensor")
    model = build_on_meta(config)
    built = sorted(p.numel() for p in model.parameters())  # a tied weight once
    assert sorted(blocks.parameter_tensors(arch)) == built
    # FSDP2 shards on dim 0: the rows and what each row holds, as the modules lay them out
    shapes = sorted((p.shape[0], p.numel() // p.shape[0]) for p in model.parameters())
    assert sorted(blocks.parameter_shapes(arch)) == shapes


def test_small_tensors_take_a_block_each():
    assert (blocks.blocks(0), blocks.blocks(1), blocks.blocks(512), blocks.blocks(513)) == (0, 512, 512, 1024)
    # a 64-wide float32 norm weight is 256 bytes in a 512-byte block
    assert blocks.rounding_bytes([64, 64 * 64], 4) == 256


def test_fused_adamw_keeps_a_step_per_tensor_on_the_device_and_foreach_on_the_host(llama_1b):
    fused = training_config({"lora_r": 16})
    assert blocks.optimizer_step_scalars_bytes(llama_1b, fused) == 16 * 7 * 2 * 512  # lora_A and lora_B of 7 linears
    assert blocks.optimizer_step_scalars_bytes(llama_1b, training_config({"optim": "adamw_torch"})) == 0


@pytest.mark.parametrize(("version", "buffers"), [("4.57.3", 1), ("5.0.0", 2)])
def test_rotary_frequencies_take_a_block_per_buffer(llama_1b, version, buffers):
    train = training_config({"transformers_version": version})
    assert blocks.rotary_buffer_bytes(llama_1b, train) == buffers * 512
