"""Every shipped data file loads and validates; names resolve; user profiles extend the catalogs."""

from __future__ import annotations

import json
import tomllib

import pytest

from vram_planner import profiles
from vram_planner.errors import ProfileError, UnknownNameError
from vram_planner.model.resolve import catalog_architecture, resolve_model
from vram_planner.profiles import GpuProfile, gpus, models, profile_dirs
from vram_planner.units import GiB

SHIPPED = profile_dirs()[0]


def test_gpu_catalog_is_broad_and_valid():
    cards = gpus()
    assert len(cards) >= 30
    segments = {g.segment for g in cards}
    assert {"consumer", "laptop", "datacenter"} <= segments
    raw = tomllib.loads((SHIPPED / "gpus.toml").read_text())["gpu"]
    keys = [k.lower() for row in raw for k in [row["name"], *row.get("aliases", [])]]
    assert len(keys) == len(set(keys)), "a name or alias is used twice"
    for card in cards:
        assert 2 < card.total_memory_gib < 200
        if card.marketed_memory_gb:
            # CUDA reports less than the box says, never more (GB on the box may be GiB-sized)
            assert card.capacity_bytes <= card.marketed_memory_gb * GiB


def test_the_seeds_laptop_card():
    card = GpuProfile.from_name("rtx3080-mobile")
    assert card.total_memory_gib == 15.73 and card.bf16
    assert GpuProfile.from_name("rtx3080-mobile-8gb").total_memory_gib < 8


@pytest.mark.parametrize("name", ["t4", "l4", "a10g", "a100-40gb", "a100-80gb", "h100", "h200", "rtx4090",
                                  "rtx3090", "rtx5090", "rtx2080-ti"])
def test_common_cards_resolve(name):
    GpuProfile.from_name(name)


def test_t4_has_no_bf16_and_no_flash_attention():
    t4 = GpuProfile.from_name("t4")
    assert not t4.bf16 and not t4.flash_attention_2


def test_unknown_gpu_suggests_close_names():
    with pytest.raises(UnknownNameError) as info:
        GpuProfile.from_name("rtx3080-mobil")
    assert "rtx3080-mobile" in str(info.value)


@pytest.mark.parametrize("card", sorted({g.name for g in profiles.gpus()}))
def test_every_card_resolves_however_users_spell_it(card):
    gpu = GpuProfile.from_name(card)
    for spelled in [card.upper().replace("-", " "), f"NVIDIA GeForce {card.replace('-', ' ')} GPU",
                    *[alias.replace("-", " ").title() for alias in gpu.aliases]]:
        assert GpuProfile.from_name(spelled) == gpu, spelled
    if gpu.cuda_name:  # nvidia-smi's name: a card of that name (an alias picks one of several memory sizes)
        assert GpuProfile.from_name(gpu.cuda_name).cuda_name == gpu.cuda_name


@pytest.mark.parametrize(("spelled", "card"), [("rtx-4060-laptop", "rtx4060-mobile-8gb"), ("RTX 4090", "rtx4090"),
                                               ("NVIDIA GeForce RTX 4060 Laptop GPU", "rtx4060-mobile-8gb"),
                                               ("Tesla T4", "t4"), ("A100 80GB", "a100-80gb")])
def test_the_names_users_paste(spelled, card):
    assert GpuProfile.from_name(spelled).name == card


def test_a_cuda_name_of_two_memory_sizes_that_no_alias_settles_is_refused_naming_both(tmp_path, monkeypatch):
    (tmp_path / "gpus.toml").write_text(
        '[[gpu]]\nname = "x1-8gb"\ncuda_name = "NVIDIA X1"\ntotal_memory_gib = 7.6\n'
        '[[gpu]]\nname = "x1-16gb"\ncuda_name = "NVIDIA X1"\ntotal_memory_gib = 15.6\n')
    monkeypatch.setenv(profiles.PROFILES_ENV, str(tmp_path))
    profiles.gpu_catalog.cache_clear()
    with pytest.raises(ProfileError, match="names 2 catalog cards of different memory: x1-8gb, x1-16gb; name one"):
        GpuProfile.from_name("NVIDIA X1")
    assert GpuProfile.from_name("nvidia x1 16gb").name == "x1-16gb"


def test_a_misspelt_laptop_card_suggests_the_laptop_card():
    with pytest.raises(UnknownNameError) as info:
        GpuProfile.from_name("rtx4060-labtop")
    assert info.value.suggestions[0] == "rtx4060-mobile-8gb"


@pytest.mark.parametrize("name", ["---", "NVIDIA", "GeForce GPU"])
def test_a_name_that_spells_no_card_suggests_none_at_random(name):
    with pytest.raises(UnknownNameError) as info:
        GpuProfile.from_name(name)
    assert info.value.suggestions == []


def test_sizes_work_for_any_card():
    assert GpuProfile.from_name("24GiB").capacity_bytes == 24 * GiB
    assert GpuProfile.from_name("16GB").capacity_bytes == 16 * 10**9


@pytest.mark.parametrize("size, binary", [("16GB", "16GiB"), ("24 gb", "24GiB"), ("0.5TB", "0.5TiB"),
                                          ("12000MB", "12000MiB")])
def test_a_size_in_gb_is_read_as_written_and_the_verdict_says_what_a_card_sold_so_has(size, binary):
    # cards are sold in binary gigabytes: a 16 GB card has 16 GiB, not 16 x 10^9 bytes; the reading stands (it is
    # what was written), and the verdict's notes say so once, with the spelling that means the card
    from vram_planner import api

    note = GpuProfile.from_name(size).note
    assert f"has {binary} (CUDA reports a little less)" in note and f"or {binary}" in note
    notes = api.check("Qwen2.5-0.5B", size).notes
    assert notes.count(note) == 1
    for other in ("16GiB", "15.7G", "rtx4090"):
        assert GpuProfile.from_name(other).note == "" and not any("powers of 1000" in n
                                                                  for n in api.check("Qwen2.5-0.5B", other).notes)


def test_model_catalog_is_broad():
    names = {m.name for m in models()}
    assert len(names) >= 20
    for family in ("Llama-3.2-1B", "Qwen2.5-1.5B", "Qwen3-0.6B", "gemma-2-2b", "SmolLM2-135M",
                   "Phi-3-mini-4k-instruct", "Mistral-7B-v0.3", "DeepSeek-R1-Distill-Qwen-1.5B"):
        assert family in names


def test_every_catalog_model_loads():
    for entry in models():
        arch = catalog_architecture(entry)
        assert arch.exact, f"{entry.name}: model_type {arch.model_type} unknown to vram-plan"
        assert arch.params > 10**8


def test_models_resolve_by_name_alias_hub_id_and_path(llama_1b_file):
    assert resolve_model("Llama-3.2-1B").params == 1_235_814_400
    assert resolve_model("llama-3.2-1b").params == 1_235_814_400
    assert resolve_model("meta-llama/Llama-3.2-1B").params == 1_235_814_400
    assert resolve_model(str(llama_1b_file)).params == 1_235_814_400
    assert resolve_model(str(llama_1b_file.parent)).params == 1_235_814_400


def test_unknown_model_suggests():
    with pytest.raises(UnknownNameError) as info:
        resolve_model("Lama-3.2-1B")
    assert "Llama-3.2-1B" in str(info.value)


def test_user_profiles_extend_the_catalog(tmp_path, monkeypatch):
    (tmp_path / "gpus.toml").write_text('[[gpu]]\nname = "my-card"\ntotal_memory_gib = 11.5\n')
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "Tiny.json").write_text(json.dumps(
        {"model_type": "llama", "vocab_size": 100, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 1, "num_attention_heads": 2}))
    (tmp_path / "models.toml").write_text('[[model]]\nname = "Tiny"\nhub_id = "me/tiny"\n')
    monkeypatch.setenv(profiles.PROFILES_ENV, str(tmp_path))
    profiles.gpu_catalog.cache_clear()
    profiles.model_catalog.cache_clear()
    assert GpuProfile.from_name("my-card").total_memory_gib == 11.5
    assert GpuProfile.from_name("rtx3080-mobile").total_memory_gib == 15.73  # shipped ones stay
    assert resolve_model("me/tiny").hidden_size == 16


def test_malformed_user_profile_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "gpus.toml").write_text('[[gpu]]\nname = "bad"\ntotal_memory_gib = -1\n')
    monkeypatch.setenv(profiles.PROFILES_ENV, str(tmp_path))
    profiles.gpu_catalog.cache_clear()
    with pytest.raises(ProfileError, match="total_memory_gib"):
        GpuProfile.from_name("bad")



def fake_nvidia_smi(tmp_path, monkeypatch, answer: str) -> None:
    """An nvidia-smi on an otherwise empty PATH that prints `answer` as its CSV line."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{answer}'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))


def test_gpu_auto_finds_a_catalog_card_by_its_cuda_name(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, "Tesla T4, 15360")
    assert GpuProfile.from_name("auto") == GpuProfile.from_name("t4")  # CUDA's capacity, not nvidia-smi's total


def test_gpu_auto_takes_a_card_missing_from_the_catalog_at_a_share_of_its_total(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, "Mystery Card 9000, 10240")
    gpu = GpuProfile.from_name("auto")
    assert gpu.name == "Mystery Card 9000" and gpu.capacity_source == "estimated"
    assert gpu.total_memory_gib == pytest.approx(10 * profiles.UNKNOWN_CARD_USABLE_FRACTION)
    assert gpu.source == f"nvidia-smi memory.total 10240 MiB x {profiles.UNKNOWN_CARD_USABLE_FRACTION}"
