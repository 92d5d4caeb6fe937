"""Copies kept in the user's cache folder, one per model, knob set and fused-head tile count, for `check` to replay
near the boundary without torch ("exact once, then instant").

A copy is the traces of the libraries installed when it was made: its key names what it is a copy of (the model's
architecture, the training config with its lengths left out, the lengths it would be traced at, which stand for the
fused head's tiles and the sliding windows' regime) and the version it was made by (torch, transformers, TRL, PEFT,
the trace's and the copy's own code), so a copy made by other code is never read; one file per copy of the same
thing, which a copy made by newer code replaces. Files are gzipped JSON (pydantic-validated on reading; a damaged one
is passed by), written atomically.
"""

from __future__ import annotations

import gzip
import json
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from pydantic import ValidationError

from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.spec import TrainingConfig, as_settings
from vram_planner.model.trl_releases import TrlRelease
from vram_planner.profile_cache import cache_home, digest, sources_content
from vram_planner.step_copy.document import FORMAT, StepCopy
from vram_planner.step_copy.lengths import lengths_to_trace

FOLDER = "step-copies"
LIBRARIES = ("torch", "transformers", "trl", "peft")


def copy_key(arch: ModelArchitecture, train: TrainingConfig, release: TrlRelease | None) -> tuple[str, str]:
    """(what a copy of `train`'s step is a copy of, the version of the code that makes it), as text. ValueError where
    no copy can be made of it (lengths.lengths_to_trace)."""
    windows = frozenset([arch.sliding_window]) if arch.sliding_layers and arch.sliding_window else frozenset()
    traced, completion_range = lengths_to_trace(train, release, windows)
    here = Path(__file__).parent
    knobs = sorted((name, value) for name, value in as_settings(train).items()
                   if name not in ("max_prompt_length", "max_completion_length"))
    what = "\n".join([f"format {FORMAT}", repr(arch), repr(knobs), repr((traced[0], completion_range))])
    return what, "\n".join([_installed(), sources_content(here, here.parent / "tracing")])


def _installed() -> str:
    versions = []
    for name in LIBRARIES:
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name} missing")
    return ", ".join(versions)


def copy_path(key: tuple[str, str]) -> Path:
    return cache_home() / FOLDER / f"{digest(key[0])}.json.gz"


def keep(copy: StepCopy, key: tuple[str, str]) -> Path:
    """Write the copy under its key (atomically, replacing a copy of the same thing by other code); the path."""
    from vram_planner.files import write_atomically

    document = {"key": list(key), "made": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "copy": copy.model_dump(mode="json")}
    return write_atomically(copy_path(key), gzip.compress(json.dumps(document, separators=(",", ":")).encode()))


def kept(key: tuple[str, str]) -> tuple[StepCopy, str] | None:
    """(the copy kept under `key`, when it was made) or None: none kept, another key's, or damaged."""
    path = copy_path(key)
    try:
        document = json.loads(gzip.decompress(path.read_bytes()))
        if document["key"] != list(key):
            return None
        return StepCopy.model_validate(document["copy"]), str(document["made"])
    except (OSError, EOFError, ValueError, KeyError, TypeError, ValidationError):
        return None
