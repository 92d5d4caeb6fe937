"""TOML files parsed once per version of the file, as Python keeps the bytecode of a module.

Every `plan` reads the catalogs (GPUs, models, TRL releases, CUDA contexts: about 90 KB of TOML with their sources
in comments), and Python's TOML parser is pure Python: parsing the same bytes again cost `plan` about 20 ms, a
twentieth of its time. The parse is kept as JSON (which Python reads in C) in the user's cache folder, under a key
made of the file's resolved path, size and modification time; a changed file gets a new key. The values are
validated after reading either way: the cache only skips the parse.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

CACHE_ENV = "VRAM_PLAN_CACHE"
# Part of every key: a change to what is stored (or to how TOML is read) must not read an older entry.
FORMAT = "toml-json-1"


def cache_home() -> Path:
    """$VRAM_PLAN_CACHE, else $XDG_CACHE_HOME/vram-plan, else ~/.cache/vram-plan."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vram-plan"


def load_toml(path: Path) -> dict[str, Any]:
    """The parsed TOML file, from the cache when this version of the file was parsed before.

    OSError and tomllib.TOMLDecodeError from the file itself propagate, as from tomllib.load; a cache that cannot be
    read or written is passed by.
    """
    status = path.stat()
    file_key, version_key = _digest(FORMAT, path.resolve()), _digest(status.st_size, status.st_mtime_ns)
    entry = cache_home() / "toml" / f"{file_key}-{version_key}.json"
    try:
        cached = json.loads(entry.read_bytes())
    except (OSError, ValueError):
        cached = None
    if isinstance(cached, dict):
        return cached
    import tomllib  # only on a miss: importing it costs as much as parsing a catalog

    with path.open("rb") as fh:
        parsed = tomllib.load(fh)
    _store(entry, parsed)
    return parsed


def _digest(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:24]


def _store(entry: Path, parsed: dict[str, Any]) -> None:
    """Write the entry; drop the entries of the file's earlier versions, which no key reaches again."""
    from vram_planner.files import write_atomically

    try:
        text = json.dumps(parsed, allow_nan=True)  # TOML's inf and nan come back as floats; dates cannot be stored
    except (TypeError, ValueError):
        return
    try:
        for stale in entry.parent.glob(f"{entry.name.split('-')[0]}-*.json"):
            stale.unlink(missing_ok=True)
        write_atomically(entry, text)
    except OSError:  # a read-only or full home: parse next time too
        pass
