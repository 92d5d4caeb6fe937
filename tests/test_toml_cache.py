"""The TOML cache: a file is parsed once per version, a changed file is read again, a broken cache is passed by."""

from __future__ import annotations

import math
import os
import tomllib
from pathlib import Path

import pytest

from vram_planner import toml_cache
from vram_planner.errors import ProfileError
from vram_planner.profiles import profile_dirs, read_toml

SHIPPED = profile_dirs()[0]


def entries(cache: Path) -> list[Path]:
    return sorted((cache / "toml").glob("*.json"))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("VRAM_PLAN_CACHE", str(folder))
    return folder


@pytest.fixture
def counted_parses(monkeypatch) -> list[Path]:
    parsed = []
    real = tomllib.load

    def load(fh):
        parsed.append(Path(fh.name))
        return real(fh)

    monkeypatch.setattr(tomllib, "load", load)
    return parsed


@pytest.mark.parametrize("name", ["gpus.toml", "models.toml", "trl.toml", "cuda_context.toml"])
def test_every_shipped_catalog_reads_back_from_the_cache_as_parsed(cache, counted_parses, name):
    path = SHIPPED / name
    first = toml_cache.load_toml(path)
    second = toml_cache.load_toml(path)
    assert first == second == tomllib.loads(path.read_text())
    assert counted_parses == [path] and len(entries(cache)) == 1


def test_a_changed_file_is_parsed_again_and_its_old_entry_dropped(cache, counted_parses, tmp_path):
    path = tmp_path / "gpus.toml"
    path.write_text('[[gpu]]\nname = "a"\n')
    assert toml_cache.load_toml(path) == {"gpu": [{"name": "a"}]}
    old = entries(cache)
    path.write_text('[[gpu]]\nname = "bb"\n')
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert toml_cache.load_toml(path) == {"gpu": [{"name": "bb"}]}
    assert len(counted_parses) == 2 and len(entries(cache)) == 1 and entries(cache) != old


def test_a_file_elsewhere_with_the_same_text_has_its_own_entry(cache, tmp_path):
    for folder in ("one", "two"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "trl.toml").write_text("x = 1\n")
        toml_cache.load_toml(tmp_path / folder / "trl.toml")
    assert len(entries(cache)) == 2


def test_values_json_cannot_hold_are_parsed_every_time(cache, counted_parses, tmp_path):
    path = tmp_path / "dates.toml"
    path.write_text("day = 2026-11-23\nbig = inf\n")
    for _ in range(2):
        assert toml_cache.load_toml(path) == tomllib.loads(path.read_text())
    assert len(counted_parses) == 2 and not entries(cache)


def test_infinities_and_nan_come_back_as_floats(cache, tmp_path):
    path = tmp_path / "floats.toml"
    path.write_text("a = inf\nb = -inf\nc = nan\nd = 1.0\ne = 1\n")
    toml_cache.load_toml(path)
    got = toml_cache.load_toml(path)
    assert got["a"] == math.inf and got["b"] == -math.inf and math.isnan(got["c"])
    assert type(got["d"]) is float and type(got["e"]) is int


@pytest.mark.parametrize("damage", [b"", b"{not json", b"[1, 2]"])
def test_a_damaged_entry_is_parsed_again(cache, counted_parses, tmp_path, damage):
    path = tmp_path / "gpus.toml"
    path.write_text('[[gpu]]\nname = "a"\n')
    toml_cache.load_toml(path)
    entries(cache)[0].write_bytes(damage)
    assert toml_cache.load_toml(path) == {"gpu": [{"name": "a"}]}
    assert len(counted_parses) == 2


def test_a_cache_that_cannot_be_written_costs_only_the_parse(monkeypatch, counted_parses, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("VRAM_PLAN_CACHE", str(blocker / "cache"))  # under a file: no folder can be made there
    path = tmp_path / "gpus.toml"
    path.write_text('[[gpu]]\nname = "a"\n')
    assert toml_cache.load_toml(path) == toml_cache.load_toml(path) == {"gpu": [{"name": "a"}]}
    assert len(counted_parses) == 2


def test_a_broken_or_missing_file_is_one_profile_error(cache, tmp_path):
    broken = tmp_path / "gpus.toml"
    broken.write_text("[[gpu]\nname = 'a'\n")
    with pytest.raises(ProfileError, match="cannot read .*gpus.toml"):
        read_toml(broken)
    with pytest.raises(ProfileError, match="cannot read .*missing.toml"):
        read_toml(tmp_path / "missing.toml")
    assert not entries(cache)


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("VRAM_PLAN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert toml_cache.cache_home() == tmp_path / "xdg" / "vram-plan"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert toml_cache.cache_home() == tmp_path / "home" / ".cache" / "vram-plan"
