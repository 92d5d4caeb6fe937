"""Parameter counts and layer layouts against what transformers builds from the same config."""

from __future__ import annotations

import json

import pytest

from helpers import LLAMA_1B, build_on_meta, family_fixture_files, linear_names, parameter_count
from vram_planner.errors import ProfileError
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.resolve import catalog_architecture
from vram_planner.profiles import models


@pytest.mark.parametrize("path", family_fixture_files(), ids=lambda p: p.stem)
def test_family_layouts_match_transformers(path):
    config = json.loads(path.read_text())
    arch = ModelArchitecture.from_config(config)
    model = build_on_meta(config)
    assert arch.exact
    assert arch.params == parameter_count(model)
    assert {lin.name for lin in arch.layer_linears()} == linear_names(model)


@pytest.mark.slow
@pytest.mark.parametrize("entry", models(), ids=lambda e: e.name)
def test_catalog_parameter_counts_equal_transformers(entry):
    config = json.loads(entry.config_path.read_text())
    assert catalog_architecture(entry).params == parameter_count(build_on_meta(config))


def test_llama_1b_by_hand(llama_1b):
    h, i, n, v, kv = 2048, 8192, 16, 128256, 8 * 64
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * i + 2 * h
    assert llama_1b.params == v * h + n * per_layer + h == 1_235_814_400
    assert llama_1b.lm_head_params == 0  # tied to the embedding
    assert llama_1b.linear_params == n * (2 * h * h + 2 * h * kv + 3 * h * i)


def test_lora_params_by_hand(llama_1b):
    r, h, i, kv = 16, 2048, 8192, 512
    all_linear = r * ((h + h) * 2 + (h + kv) * 2 + (h + i) * 2 + (i + h)) * 16
    assert llama_1b.lora_params(r, None) == all_linear
    assert llama_1b.lora_params(r, ["q_proj", "v_proj"]) == r * ((h + h) + (h + kv)) * 16
    assert llama_1b.lora_params(r, ["not_a_layer"]) == 0


def test_sliding_window_layers_keep_only_the_window():
    gemma3 = ModelArchitecture.from_config(json.loads(
        (family_fixture_files()[0].parent / "tiny-gemma3.json").read_text()))
    assert (gemma3.sliding_window, gemma3.sliding_layers) == (16, 5)  # 5 of every 6 layers slide
    assert gemma3.kv_layers_tokens(100) == 1 * 100 + 5 * 16
    assert gemma3.kv_layers_tokens(10) == 6 * 10


def test_multimodal_config_uses_its_text_config():
    wrapped = {"model_type": "some_vlm", "text_config": {**LLAMA_1B}}
    assert ModelArchitecture.from_config(wrapped).params == 1_235_814_400
    unknown_tower = {**wrapped, "vision_config": {"model_type": "some_vit"}}
    assert not ModelArchitecture.from_config(unknown_tower).exact


def test_unknown_model_type_is_read_as_llama_and_flagged():
    arch = ModelArchitecture.from_config({**LLAMA_1B, "model_type": "brand_new"})
    assert not arch.exact and arch.params == 1_235_814_400


def test_config_without_sizes_is_rejected():
    with pytest.raises(ProfileError, match="lacks hidden_size"):
        ModelArchitecture.from_config({"model_type": "llama", "vocab_size": 10, "num_hidden_layers": 2,
                                       "num_attention_heads": 2})
