"""The local CUDA device for `--gpu auto`, read through nvidia-smi so the planner never imports torch."""

from __future__ import annotations

import shutil
import subprocess

from vram_planner.errors import VramPlanError


def detect_local_gpu() -> tuple[str, str]:
    """The first local CUDA device's name and memory.total in MiB, as nvidia-smi prints them."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise VramPlanError("--gpu auto needs an NVIDIA driver (nvidia-smi not found); name the card, "
                            "e.g. --gpu rtx3080-mobile, or give its size, e.g. --gpu 16GiB")
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise VramPlanError(f"--gpu auto: nvidia-smi failed ({exc}); name the card with --gpu") from exc
    first = out.strip().splitlines()[0] if out.strip() else ""
    try:
        name, total_mib = (part.strip() for part in first.rsplit(",", 1))
        float(total_mib)
    except ValueError as exc:
        raise VramPlanError(f"--gpu auto: cannot read nvidia-smi's answer {first!r}; name the card with --gpu") from exc
    return name, total_mib
