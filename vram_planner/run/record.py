"""What a run folder says about itself: `vram-plan-run.json`, written when training starts and again when it ends.

The command that started the run, the plan it followed (each phase's predicted components in bytes, the GRPOConfig,
LoraConfig and BitsAndBytesConfig keyword arguments) and the versions of everything that decides its memory, so a
folder shared with someone else says how to run it again and what to expect.
"""

from __future__ import annotations

import json
import platform
import shlex
from pathlib import Path
from typing import Any

from vram_planner.errors import VramPlanError
from vram_planner.files import write_atomically
from vram_planner.model.grpo_config import lora_config_kwargs, quantization_config_kwargs
from vram_planner.profiles import read_json

RECORD_NAME = "vram-plan-run.json"
DISTRIBUTIONS = ("vram-plan", "torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes", "vllm")


def versions() -> dict[str, str | None]:
    """The installed release of each library that decides the run's memory (None: not installed), Python's, and
    where CUDA is there, its version, the driver's and the card's name."""
    from vram_planner.model.trl_releases import installed_version

    found: dict[str, str | None] = {name: installed_version(name) for name in DISTRIBUTIONS}
    found["python"] = platform.python_version()
    found.update(_cuda_versions())
    return found


def _cuda_versions() -> dict[str, str | None]:
    import torch

    if not torch.cuda.is_available():
        return {"cuda": None, "driver": None, "gpu": None}
    driver = None
    try:
        import pynvml  # installed with torch's CUDA wheels (nvidia-ml-py)

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
    except Exception:  # no NVML on this machine: the driver stays unknown
        pass
    return {"cuda": torch.version.cuda, "driver": driver, "gpu": torch.cuda.get_device_name()}


def run_record(setup: Any, argv: list[str] | None) -> dict[str, Any]:
    """The record of a run as it starts: the command, the plan and the versions."""
    estimate = setup.verdict.estimate
    return {
        "command": shlex.join(["vram-plan", *argv]) if argv else None,
        "model": setup.model_id,
        "dataset": setup.dataset,
        "rewards": list(setup.rewards),
        "gpu": setup.verdict.context.gpu.label,
        "capacity_bytes": int(setup.verdict.context.capacity_bytes),
        "predicted_peak_bytes": round(setup.predicted_peak_bytes),
        "phases": [{"name": p.name, "moment": p.moment, "peak_bytes": round(p.total_bytes),
                    "components": {k: round(v) for k, v in p.components.items()}} for p in estimate.phases],
        "grpo_config": setup.grpo_kwargs(),
        "lora_config": lora_config_kwargs(setup.train),
        "quantization_config": quantization_config_kwargs(setup.train),
        "trl_release_planned": setup.verdict.context.release.version,
        "versions": versions(),
        "notes": list(setup.notes),
    }


def write_record(folder: Path, record: dict[str, Any]) -> Path:
    return write_atomically(folder / RECORD_NAME, json.dumps(record, indent=2, default=str) + "\n")


def record_outcome(folder: Path, outcome: dict[str, Any]) -> None:
    """Add how the run ended (steps, seconds, measured peak, or where it stopped) to the folder's record."""
    path = folder / RECORD_NAME
    try:
        record = read_json(path)
    except VramPlanError:  # the record went missing or was edited: the outcome alone
        record = {}
    write_record(folder, {**record, "outcome": outcome})
