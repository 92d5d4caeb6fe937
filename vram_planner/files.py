"""Writing files so that a run that dies leaves either the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from vram_planner.errors import VramPlanError


def write_atomically(path: Path, text: str | bytes) -> Path:
    """Write `text` (or bytes) to a temporary file beside `path`, flush it to disk, then rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_writable(path: Path, what: str, hint: str = "") -> None:
    """Refuse, in one line naming `what` (a flag) and `path`, a file target that write_atomically could not write:
    checked before any work, by creating (and removing) a file where it would go, since permissions do not stop
    root. `hint` says how to fix it."""
    hint = f"; {hint}" if hint else ""
    if path.is_dir():
        raise VramPlanError(f"{what} {path} is a folder; give a file name{hint}")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:  # write_atomically creates the missing folders
        folder = folder.parent
    if not folder.is_dir():
        raise VramPlanError(f"cannot write {what} {path}: {folder} is a file, not a folder{hint}")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".vram-plan-check.")
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise VramPlanError(f"cannot write {what} {path}: no file can be created in {folder} ({reason}){hint}"
                            ) from exc
    os.close(fd)
    os.unlink(tmp)
