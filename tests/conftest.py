"""Shared fixtures: a private data home, small architectures of every family, a Llama-3.2-1B config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vram_planner import profiles
from vram_planner.model.architecture import ModelArchitecture

FIXTURES = Path(__file__).parent / "fixtures"

# Llama-3.2-1B's config.json facts (meta-llama/Llama-3.2-1B), independent of the shipped catalog.
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "tie_word_embeddings": True, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
}


@pytest.fixture(autouse=True)
def _private_home(tmp_path_factory, monkeypatch):
    """Keep every test away from the user's own calibrations and profiles."""
    home = tmp_path_factory.mktemp("vram-plan-home")
    monkeypatch.setenv("VRAM_PLAN_HOME", str(home))
    monkeypatch.delenv("VRAM_PLAN_PROFILES", raising=False)
    profiles.gpu_catalog.cache_clear()
    profiles.model_catalog.cache_clear()
    yield home
    profiles.gpu_catalog.cache_clear()
    profiles.model_catalog.cache_clear()


@pytest.fixture
def llama_1b_file(tmp_path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_1B))
    return path


@pytest.fixture
def llama_1b() -> ModelArchitecture:
    return ModelArchitecture.from_config(LLAMA_1B, name="Llama-3.2-1B")


def family_fixture_files() -> list[Path]:
    return sorted(FIXTURES.glob("tiny-*.json"))
