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

import hashlib
import os
import pickle
import sys
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
    entry = cache_home() / "validated" / f"{_digest(FORMAT, *what)}-{_digest(*version)}.pickle"
    found, value = _read(entry)
    if found:
        return value  # type: ignore[return-value]
    value = compute()
    _store(entry, value)
    return value


def _digest(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:24]


@lru_cache(maxsize=None)
def _code_version(module: str) -> str:
    """The loader's module and the validation rules' module, as their files are now."""
    files = [sys.modules[module].__file__, sys.modules["vram_planner.validation"].__file__]
    return _digest(*((s.st_size, s.st_mtime_ns) for s in (os.stat(f) for f in files if f)))


def _read(entry: Path) -> tuple[bool, object]:
    try:
        with entry.open("rb") as fh:
            if hasattr(os, "getuid") and os.fstat(fh.fileno()).st_uid != os.getuid():
                return False, None  # someone else's file in a shared cache folder: never unpickled
            return True, pickle.load(fh)
    except Exception:  # noqa: BLE001 - missing, unreadable or damaged (pickle raises many kinds): load the file again
        return False, None


def _store(entry: Path, value: object) -> None:
    """Write the entry; drop the entries of the file's earlier versions, which no key reaches again."""
    from vram_planner.files import write_atomically

    try:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - an object pickle cannot hold: load the file every time
        return
    try:
        for stale in entry.parent.glob(f"{entry.name.split('-')[0]}-*.pickle"):
            stale.unlink(missing_ok=True)
        write_atomically(entry, data)
    except OSError:  # a read-only or full home: load the file next time too
        pass
