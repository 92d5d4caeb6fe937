"""Byte units. Bytes inside the library, GiB in what people read."""

from __future__ import annotations

import re

from vram_planner.errors import VramPlanError

KiB = 1024
MiB = 1024**2
GiB = 1024**3

_UNITS = {
    "b": 1, "": 1,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": 1024**4,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "k": KiB, "m": MiB, "g": GiB,
}
_SIZE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size_bytes(text: str) -> int:
    """Parse '24GiB', '16 GB', '15.73G' (G means GiB, as nvidia-smi and PyTorch print it) into bytes."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise VramPlanError(f"cannot read {text!r} as a memory size; write it like 24GiB, 16GB or 15.73GiB")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise VramPlanError(f"memory size {text!r} must be positive")
    return size


def binary_spelling(text: str) -> str | None:
    """A size in the SI's units (kB, MB, GB, TB: powers of 1000, which cards' memory is not sold in) spelled in the
    binary ones ('16GB' -> '16GiB'); None for any other text."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if unit not in ("kb", "mb", "gb", "tb"):
        return None
    return f"{match.group(1)}{unit[0].upper()}iB"


def looks_like_size(text: str) -> bool:
    match = _SIZE.match(text)
    return bool(match) and match.group(2).lower() in _UNITS and match.group(2) != ""


def gib(n_bytes: float) -> float:
    return n_bytes / GiB


def format_gib(n_bytes: float, digits: int = 2) -> str:
    return f"{n_bytes / GiB:.{digits}f} GiB"
