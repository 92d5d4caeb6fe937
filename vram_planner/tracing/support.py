"""Which installed (TRL, transformers) pairs the trace runs, checked before anything is imported.

The trace drives the installed TRL's own step on the installed transformers' models, so what it can run is a pair of
releases, not a TRL release alone. Each range below was traced end to end by benchmarks/trl_matrix.py (its table is
benchmarks/results/trl_matrix.json); a pair outside them is refused in one line that names what is installed and what
works. Pure Python: no torch, so `check` and the CLI's bad-input path stay fast.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from vram_planner.errors import VramPlanError, field_name
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.trl_releases import parse_version, version_tuple


@dataclass(frozen=True)
class SupportedPairs:
    """TRL releases [trl_min, trl_below) traced with transformers releases [transformers_min, transformers_below)."""

    trl_min: str
    trl_below: str
    transformers_min: str
    transformers_below: str

    def covers(self, trl: tuple[int, int, int], transformers: tuple[int, int, int]) -> bool:
        return (version_tuple(self.trl_min) <= trl < version_tuple(self.trl_below)
                and version_tuple(self.transformers_min) <= transformers < version_tuple(self.transformers_below))

    def words(self) -> str:
        return (f"TRL {self.trl_min} to {_before(self.trl_below)} with transformers {self.transformers_min} to "
                f"{_before(self.transformers_below)}")


# The trace reads the installed transformers through the row of the TRL release's own transformers generation
# (profiles/trl.toml transformers_major: 4 up to TRL 0.27.1, 5 from 0.27.2), so a pair of two generations is refused:
# TRL 0.14 does not import under transformers 5, and 1.16's trace under 4.57 would read 5.x's cache argument.
# transformers 4.48 is the oldest that runs on torch 2.13 with TRL 0.14's requirements (TRL 0.14 asks for >= 4.46).
SUPPORTED = (
    SupportedPairs("0.14.0", "0.27.2", "4.48.0", "5.0.0"),
    SupportedPairs("0.27.2", "2.0.0", "5.0.0", "6.0.0"),
)


def _before(below: str) -> str:
    """The last release before `below`: '0.27.2' -> '0.27.1', '5.0.0' -> '4.x', '1.15.0' -> '1.14.x'."""
    major, minor, patch = version_tuple(below)
    if patch:
        return f"{major}.{minor}.{patch - 1}"
    return f"{major}.{minor - 1}.x" if minor else f"{major - 1}.x"


def check_supported_pair(trl: str, transformers: str) -> None:
    """Raise VramPlanError, in one line, when the installed `trl` and `transformers` are not a pair the trace runs."""
    parsed = (_release(trl), _release(transformers))
    if any(p is None for p in parsed) or not any(s.covers(*parsed) for s in SUPPORTED):  # type: ignore[arg-type]
        raise VramPlanError(f"the trace cannot run TRL {trl} with transformers {transformers} (installed); it runs "
                            + "; ".join(s.words() for s in SUPPORTED)
                            + " (`vram-plan check` gives the analytic estimate)")


def pair_for(trl: str) -> str:
    """The transformers releases the trace runs TRL `trl` with, in words ('transformers 4.48 to 5.x')."""
    parsed = _release(trl)
    for pairs in SUPPORTED:
        if parsed is not None and version_tuple(pairs.trl_min) <= parsed < version_tuple(pairs.trl_below):
            return f"transformers {pairs.transformers_min} to {_before(pairs.transformers_below)}"
    return "; ".join(s.words() for s in SUPPORTED)


def _release(version: str) -> tuple[int, int, int] | None:
    parsed = parse_version(version)
    return parsed[0] if parsed else None


def check_kernels_importable(trl: str, kernels: Path | None = None) -> None:
    """Raise VramPlanError, in one line, when the installed TRL's fused LM head cannot load: TRL 1.15 imports triton
    at the top of trl/kernels/chunked_logprob.py (1.16 guards it), so without triton neither a run nor the trace
    gets past it. `kernels`: that file (default: the installed TRL's, read without importing TRL)."""
    if kernels is None:
        spec = importlib.util.find_spec("trl")
        folders = list(spec.submodule_search_locations or []) if spec else []
        kernels = Path(folders[0]) / "kernels" / "chunked_logprob.py" if folders else None
    if kernels is None or not kernels.is_file() or importlib.util.find_spec("triton") is not None:
        return
    if re.search(r"^import triton\b", kernels.read_text(), re.MULTILINE):
        raise VramPlanError(f"the trace cannot run TRL {trl} (installed): its fused LM head imports triton, which "
                            "is not installed (`pip install triton`, whose import needs no GPU; TRL 1.16 or later "
                            "runs without it) (`vram-plan check` gives the analytic estimate)")


def zero_problems(train: TrainingConfig) -> list[str]:
    """What the ZeRO trace (vram_planner.tracing.zero: DeepSpeed's own engine, one rank of N) cannot run."""
    problems = []
    if train.zero_stage not in (1, 2, 3):
        problems.append(f"the ZeRO trace runs {field_name('zero_stage')} 1, 2 or 3, not stage {train.zero_stage} "
                        "(DeepSpeed's data parallelism without partitioning)")
    if train.offloaded:
        problems.append(f"the ZeRO trace runs without ZeRO-Offload ({field_name('offload_optimizer')}, "
                        f"{field_name('offload_param')}): check plans it")
    if importlib.util.find_spec("deepspeed") is None:
        problems.append("the ZeRO trace runs DeepSpeed's own engine, which is not installed (pip install "
                        "'vram-plan[deepspeed]')")
    return problems
