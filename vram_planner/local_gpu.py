"""The local CUDA device for `--gpu auto`, read through nvidia-smi so the planner never imports torch."""

from __future__ import annotations

import shutil
import subprocess

from vram_planner.errors import VramPlanError
from vram_planner.units import GiB, MiB

# The CUDA runtime reports less than nvidia-smi's memory.total (the driver keeps some back); on cards we know
# the gap was 1-2%, so a card missing from the catalog is taken at 98% of what nvidia-smi reports.
UNKNOWN_CARD_USABLE_FRACTION = 0.98


def detect_local_gpu():  # -> GpuProfile (import cycle kept out of the signature)
    """The first local CUDA device, matched to the catalog by name and memory size."""
    from vram_planner.profiles import GpuProfile, gpus

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
        total_bytes = float(total_mib) * MiB
    except ValueError as exc:
        raise VramPlanError(f"--gpu auto: cannot read nvidia-smi's answer {first!r}; name the card with --gpu") from exc
    same_name = [g for g in gpus() if g.cuda_name.lower() == name.lower()]
    if same_name:
        return min(same_name, key=lambda g: abs(g.capacity_bytes - total_bytes))
    return GpuProfile(name=name, cuda_name=name, total_memory_gib=total_bytes * UNKNOWN_CARD_USABLE_FRACTION / GiB,
                      source=f"nvidia-smi memory.total {total_mib} MiB x {UNKNOWN_CARD_USABLE_FRACTION}",
                      capacity_source="estimated")
