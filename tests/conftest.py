"""Shared fixtures: a private data home, a Llama-3.2-1B config and architecture, a tiny model folder with weights and
a tokenizer (helpers.py holds the shared functions and constants)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import FIXTURES, LLAMA_1B
from vram_planner import profiles
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.tracing import step_need


@pytest.fixture(scope="session")
def _session_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vram-plan-cache")


@pytest.fixture(autouse=True)
def _private_home(tmp_path_factory, monkeypatch, _session_cache):
    """Keep every test away from the user's own calibrations, profiles and cache (one cache for the session: the
    catalogs are parsed once), and from the traces an earlier test made in this process."""
    home = tmp_path_factory.mktemp("vram-plan-home")
    monkeypatch.setenv("VRAM_PLAN_HOME", str(home))
    monkeypatch.setenv("VRAM_PLAN_CACHE", str(_session_cache))
    monkeypatch.delenv("VRAM_PLAN_PROFILES", raising=False)
    profiles.gpu_catalog.cache_clear()
    profiles.model_catalog.cache_clear()
    step_need.forget_traces()  # a test that patches what a trace runs traces afresh
    yield home
    profiles.gpu_catalog.cache_clear()
    profiles.model_catalog.cache_clear()
    step_need.forget_traces()


@pytest.fixture
def llama_1b_file(tmp_path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_1B))
    return path


@pytest.fixture
def llama_1b() -> ModelArchitecture:
    return ModelArchitecture.from_config(LLAMA_1B, name="Llama-3.2-1B")


@pytest.fixture(scope="module")
def tiny_model_folder(tmp_path_factory):
    """A Llama-style model with random weights and a byte-level BPE tokenizer trained here, saved as a folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers import math_sample_tokenizer

    fast = math_sample_tokenizer()
    config = json.loads((FIXTURES / "tiny-llama-headdim.json").read_text())
    config.update(vocab_size=len(fast), pad_token_id=fast.pad_token_id, eos_token_id=fast.eos_token_id,
                  bos_token_id=None)
    folder = tmp_path_factory.mktemp("tiny-model")
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


CHATTR = shutil.which("chattr")  # found before a test empties PATH


@pytest.fixture
def immutable_file(tmp_path):
    """A file `chattr +i` makes immutable, for root too; skipped where the file system or the user cannot."""
    path = tmp_path / "immutable" / "plan.png"
    path.parent.mkdir()
    path.write_bytes(b"")
    if CHATTR is None or subprocess.run([CHATTR, "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    yield path
    subprocess.run([CHATTR, "-i", str(path)], check=True)


@pytest.fixture
def installed_trl(monkeypatch):
    """Pretends another TRL is installed: its version, and so the release resolved from it, which `trl_release`
    caches for the process (a test that resolved the real one earlier would otherwise leave its answer behind)."""
    from vram_planner.model import trl_releases

    def pretend(version: str) -> None:
        monkeypatch.setattr(trl_releases, "installed_trl_version", lambda: version)
        trl_releases.trl_release.cache_clear()

    yield pretend
    trl_releases.trl_release.cache_clear()
