"""Profile files validated once per version of the file, as Python keeps the bytecode of a module.

Every `plan` reads the catalogs (GPUs, models, TRL releases, CUDA contexts: about 90 KB of TOML with their sources
in comments) and the default calibration. Parsing them (Python's TOML parser is pure Python) and validating them
(pydantic, which then has to be imported and build its validators) was most of what `plan` did before it planned.
What a loader makes of a file, its validated objects, is kept as a pickle in the user's cache folder under a key
made of the file's resolved path, size and modification time and of the loader's code (its module's and
vram_planner/validation.py's size and modification time): a changed file or a changed loader gets a new key, so
every object read back was validated by the code that reads it. The cache holds only what vram-plan wrote there,
and only files the user owns are read back.
"""

from __future__ import annotations

import os
import pickle
import sys
import zlib
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import TypeVar

CACHE_ENV = "VRAM_PLAN_CACHE"
# Part of every key: a change to what is stored must not read an older entry.
FORMAT = "validated-1"
Loaded = TypeVar("Loaded")


def cache_home() -> Path:
    """$VRAM_PLAN_CACHE, else $XDG_CACHE_HOME/vram-plan, else ~/.cache/vram-plan."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vram-plan"


def cached(path: Path, load: Callable[[Path], Loaded]) -> Loaded:
    """What `load` makes of the file at `path`, from the cache when this version of the file was loaded before by this
    version of `load`'s code.

    OSError from the file itself and whatever `load` raises propagate (nothing is stored then); a cache that cannot
    be read or written is passed by.
    """
    status = path.stat()
    return remembered((path.resolve(), load.__module__, load.__qualname__),
                      (status.st_size, status.st_mtime_ns, _code_version(load.__module__)), lambda: load(path))


def remembered(what: tuple[object, ...], version: tuple[object, ...], compute: Callable[[], Loaded]) -> Loaded:
    """`compute()`, kept under `what` for as long as `version` (the state of whatever it depends on) stays the same."""
    key = _text(FORMAT, *what), _text(*version)
    entry = cache_home() / "validated" / f"{digest(key[0])}-{digest(key[1])}.pickle"
    found, value = _read(entry, key)
    if found:
        return value  # type: ignore[return-value]
    value = compute()
    _store(entry, key, value)
    return value


def _text(*parts: object) -> str:
    return "\0".join(map(str, parts))


def digest(text: str) -> str:
    """A short name for a key: the entry holds the whole key, so two keys with one name only cost a load (hashlib,
    which loads OpenSSL, would cost every start more than that ever will)."""
    data = text.encode("utf-8", "surrogateescape")
    return f"{zlib.crc32(data):08x}{zlib.adler32(data):08x}"


@lru_cache(maxsize=None)
def sources_version(*paths: Path) -> str:
    """The Python files at `paths` (files, or folders whose .py files count), as they are now: a `version` for
    `remembered` where what it keeps is worked out by their code alone."""
    return _text(*((f.name, s.st_size, s.st_mtime_ns) for f, s in ((f, f.stat()) for f in _python_files(paths))))


@lru_cache(maxsize=None)
def sources_content(*paths: Path) -> str:
    """`sources_version` by what the files say rather than when they were written: the same for a reinstall or a
    fresh clone of the same code, for what is costly to make again (a kept step copy: 10-70 s of tracing)."""
    return _text(*((f.name, digest(f.read_text("utf-8", "surrogateescape"))) for f in _python_files(paths)))


def _python_files(paths: tuple[Path, ...]) -> list[Path]:
    return sorted(f for path in paths for f in (path.glob("*.py") if path.is_dir() else [path]))


@lru_cache(maxsize=None)
def _code_version(module: str) -> str:
    """The loader's module and the validation rules' module, as their files are now."""
    files = [sys.modules[module].__file__, sys.modules["vram_planner.validation"].__file__]
    return _text(*((s.st_size, s.st_mtime_ns) for s in (os.stat(f) for f in files if f)))


def _read(entry: Path, key: tuple[str, str]) -> tuple[bool, object]:
    try:
        with entry.open("rb") as fh:
            if hasattr(os, "getuid") and os.fstat(fh.fileno()).st_uid != os.getuid():
                return False, None  # someone else's file in a shared cache folder: never unpickled
            stored_key, value = pickle.load(fh)
    except Exception:  # noqa: BLE001 - missing, unreadable or damaged (pickle raises many kinds): load the file again
        return False, None
    return (True, value) if stored_key == key else (False, None)


def _store(entry: Path, key: tuple[str, str], value: object) -> None:
    """Write the entry; drop the entries of the file's earlier versions, which no key reaches again."""
    from vram_planner.files import write_atomically

    try:
        data = pickle.dumps((key, value), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - an object pickle cannot hold: load the file every time
        return
    try:
        for stale in entry.parent.glob(f"{entry.name.split('-')[0]}-*.pickle"):
            stale.unlink(missing_ok=True)
        write_atomically(entry, data)
    except OSError:  # a read-only or full home: load the file next time too
        pass
