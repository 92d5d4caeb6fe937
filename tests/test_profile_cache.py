"""The profile cache: a file is loaded (parsed and validated) once per version of the file and of its loader's code;
a changed file or loader is loaded again, a broken or foreign entry is passed by, a failed load stores nothing."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

from vram_planner import profile_cache, profiles
from vram_planner.errors import ProfileError
from vram_planner.model import calibration, cuda_context, trl_releases
from vram_planner.profiles import profile_dirs, read_toml

SHIPPED = profile_dirs()[0]
LOADERS = {"gpus.toml": profiles._catalog_gpus, "models.toml": profiles._catalog_models,
           "trl.toml": trl_releases._release_rows, "cuda_context.toml": cuda_context._table,
           "calibrations/default.json": calibration._calibration}


def entries(cache: Path) -> list[Path]:
    return sorted((cache / "validated").glob("*.pickle"))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("VRAM_PLAN_CACHE", str(folder))
    return folder


def counting(load):
    calls = []

    def counted(path):
        calls.append(path)
        return load(path)

    counted.__module__, counted.__qualname__ = load.__module__, load.__qualname__
    return counted, calls


@pytest.mark.parametrize("name", list(LOADERS))
def test_every_shipped_profile_reads_back_from_the_cache_as_loaded(cache, name):
    load, calls = counting(LOADERS[name])
    first = profile_cache.cached(SHIPPED / name, load)
    second = profile_cache.cached(SHIPPED / name, load)
    assert first == second == LOADERS[name](SHIPPED / name) and first is not second
    assert calls == [SHIPPED / name] and len(entries(cache)) == 1


def write_catalog(path: Path, name: str) -> None:
    path.write_text(f'[[gpu]]\nname = "{name}"\ntotal_memory_gib = 8.0\n')


def test_a_changed_file_is_loaded_again_and_its_old_entry_dropped(cache, tmp_path):
    load, calls = counting(profiles._catalog_gpus)
    path = tmp_path / "gpus.toml"
    write_catalog(path, "a")
    assert [g.name for g in profile_cache.cached(path, load)] == ["a"]
    old = entries(cache)
    write_catalog(path, "bb")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert [g.name for g in profile_cache.cached(path, load)] == ["bb"]
    assert len(calls) == 2 and len(entries(cache)) == 1 and entries(cache) != old


def test_a_file_elsewhere_with_the_same_text_has_its_own_entry(cache, tmp_path):
    for folder in ("one", "two"):
        (tmp_path / folder).mkdir()
        write_catalog(tmp_path / folder / "gpus.toml", "a")
        profile_cache.cached(tmp_path / folder / "gpus.toml", profiles._catalog_gpus)
    assert len(entries(cache)) == 2


def test_a_changed_loader_loads_again(cache, tmp_path, monkeypatch):
    """Objects read back were validated by the code that reads them: editing the loader's module is a new key."""
    module = tmp_path / "catalog_loader.py"
    module.write_text("def load(path):\n    return path.read_text().upper()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    loader = importlib.import_module("catalog_loader")
    data = tmp_path / "data.txt"
    data.write_text("a")
    assert profile_cache.cached(data, loader.load) == "A"
    module.write_text("def load(path):\n    return path.read_text().lower() * 2\n")
    os.utime(module, ns=(module.stat().st_atime_ns, module.stat().st_mtime_ns + 1_000_000))
    importlib.reload(loader)
    profile_cache._code_version.cache_clear()
    assert profile_cache.cached(data, loader.load) == "aa"
    sys.modules.pop("catalog_loader")


def test_two_keys_with_one_entry_name_never_read_each_other(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(profile_cache, "digest", lambda text: "same")
    for name in ("a", "b", "a"):
        (tmp_path / name).mkdir(exist_ok=True)
        write_catalog(tmp_path / name / "gpus.toml", name)
        assert [g.name for g in profile_cache.cached(tmp_path / name / "gpus.toml", profiles._catalog_gpus)] == [name]


@pytest.mark.parametrize("damage", [b"", b"not a pickle", b"\x80\x05K"])
def test_a_damaged_entry_is_loaded_again(cache, tmp_path, damage):
    load, calls = counting(profiles._catalog_gpus)
    path = tmp_path / "gpus.toml"
    write_catalog(path, "a")
    profile_cache.cached(path, load)
    entries(cache)[0].write_bytes(damage)
    assert [g.name for g in profile_cache.cached(path, load)] == ["a"]
    assert len(calls) == 2


def test_an_entry_someone_else_owns_is_never_unpickled(cache, tmp_path, monkeypatch):
    load, calls = counting(profiles._catalog_gpus)
    path = tmp_path / "gpus.toml"
    write_catalog(path, "a")
    profile_cache.cached(path, load)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(entries(cache)[0]).st_uid + 1)
    monkeypatch.setattr(profile_cache.pickle, "load", lambda fh: pytest.fail("a foreign entry was unpickled"))
    assert [g.name for g in profile_cache.cached(path, load)] == ["a"]
    assert len(calls) == 2


def test_a_cache_that_cannot_be_written_costs_only_the_load(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("VRAM_PLAN_CACHE", str(blocker / "cache"))  # under a file: no folder can be made there
    load, calls = counting(profiles._catalog_gpus)
    path = tmp_path / "gpus.toml"
    write_catalog(path, "a")
    assert profile_cache.cached(path, load) == profile_cache.cached(path, load)
    assert len(calls) == 2


def test_a_failed_load_stores_nothing(cache, tmp_path):
    broken = tmp_path / "gpus.toml"
    broken.write_text('[[gpu]]\nname = "a"\ntotal_memory_gib = -1\n')
    for _ in range(2):
        with pytest.raises(ProfileError, match=r"gpus.toml gpu #1: total_memory_gib: Input should be greater than 0"):
            profile_cache.cached(broken, profiles._catalog_gpus)
    assert not entries(cache)


def test_a_broken_or_missing_file_is_one_profile_error(cache, tmp_path):
    broken = tmp_path / "gpus.toml"
    broken.write_text("[[gpu]\nname = 'a'\n")
    with pytest.raises(ProfileError, match="cannot read .*gpus.toml"):
        read_toml(broken)
    with pytest.raises(ProfileError, match="cannot read .*missing.toml"):
        read_toml(tmp_path / "missing.toml")
    with pytest.raises(ProfileError, match="cannot read .*missing.json"):
        calibration.load_calibration_file(tmp_path / "missing.json")
    assert not entries(cache)


def test_the_installed_trl_version_is_read_again_when_the_import_path_changes(cache, tmp_path, monkeypatch):
    reads = []
    monkeypatch.setattr(trl_releases, "_read_installed_version",
                        lambda name: reads.append(name) or f"1.16.{len(reads)}")
    folder = tmp_path / "site-packages"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    assert trl_releases.installed_trl_version() == trl_releases.installed_trl_version() == "1.16.1"
    (folder / "trl-1.16.2.dist-info").mkdir()  # what installing a release does to its folder
    os.utime(folder, ns=(folder.stat().st_atime_ns, folder.stat().st_mtime_ns + 1_000_000))
    assert trl_releases.installed_trl_version() == "1.16.2" and len(reads) == 2


def test_each_import_path_keeps_its_own_trl_version(cache, tmp_path, monkeypatch):
    """The `vram-plan` script and `python -m vram_planner` see different import paths; taking turns must not make
    each read the metadata again."""
    reads = []
    monkeypatch.setattr(trl_releases, "_read_installed_version", lambda name: reads.append(name) or "1.16.0")
    original = list(sys.path)
    for folder in (tmp_path / "bin", tmp_path / "work"):
        folder.mkdir()
    for _ in range(2):
        for first in (tmp_path / "bin", tmp_path / "work"):
            monkeypatch.setattr(sys, "path", [str(first), *original])
            assert trl_releases.installed_trl_version() == "1.16.0"
    assert len(reads) == 2


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("VRAM_PLAN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert profile_cache.cache_home() == tmp_path / "xdg" / "vram-plan"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert profile_cache.cache_home() == tmp_path / "home" / ".cache" / "vram-plan"


def test_a_sources_version_changes_with_each_python_file_it_names(tmp_path):
    package, module = tmp_path / "package", tmp_path / "module.py"
    package.mkdir()
    (package / "a.py").write_text("A = 1\n")
    module.write_text("B = 2\n")

    def version() -> str:
        profile_cache.sources_version.cache_clear()
        return profile_cache.sources_version(package, module)

    seen = [version()]
    (package / "notes.txt").write_text("not code\n")
    assert version() == seen[-1]
    for change in (lambda: (package / "a.py").write_text("A = 10\n"), lambda: (package / "b.py").write_text(""),
                   lambda: module.write_text("B = 20\n")):
        change()
        assert version() not in seen
        seen.append(version())


def test_a_sources_content_is_what_the_files_say_whenever_they_were_written(tmp_path):
    """A kept step copy survives a reinstall or a fresh clone of the same code (new files, new times), and no change
    of the code."""
    import os

    package = tmp_path / "package"
    package.mkdir()
    (package / "a.py").write_text("A = 1\n")

    def content() -> str:
        profile_cache.sources_content.cache_clear()
        return profile_cache.sources_content(package)

    before = content()
    os.utime(package / "a.py", ns=(1, 1))
    (package / "notes.txt").write_text("not code\n")
    assert content() == before
    (package / "a.py").write_text("A = 10\n")
    assert content() != before
    (package / "a.py").write_text("A = 1\n")
    (package / "b.py").write_text("")
    assert content() != before
