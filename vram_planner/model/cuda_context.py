"""The CUDA context: what a training process holds on the card outside PyTorch's caching allocator.

Per GPU generation and CUDA version, from public measurements (profiles/cuda_context.toml, which explains the
figure: about 2 KiB for every thread the card can hold resident, plus the kernels a step loads). A calibration that
carries a measured figure (`vram-plan probe`, or an older file with a number) replaces the catalog's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from vram_planner.errors import ProfileError
from vram_planner.model.calibration import Calibration
from vram_planner.profile_cache import cached
from vram_planner.profiles import GpuProfile, profile_dirs, read_toml, validated
from vram_planner.units import GiB, MiB
from vram_planner.validation import Rules

_CUDA = r"^\d+(\.\d+)?$"  # major or major.minor


def cuda_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of "12.8" or "12"."""
    major, _, minor = version.partition(".")
    return int(major), int(minor or 0)


@dataclass(frozen=True, kw_only=True)
class ContextRow:
    """The figure's two terms for one generation under one range of CUDA versions."""

    __pydantic_config__ = {"extra": "forbid"}

    architecture: str
    compute_capabilities: Annotated[list[str], Rules(min_length=1)]
    cuda_min: Annotated[str, Rules(pattern=_CUDA)]
    cuda_max: Annotated[str | None, Rules(pattern=_CUDA)] = None
    module_loading: Literal["lazy", "eager"]
    resident_threads_per_sm: Annotated[int, Rules(gt=0)]
    bytes_per_resident_thread: Annotated[int, Rules(gt=0)]
    kernels_bytes: Annotated[int, Rules(ge=0)]
    basis: Literal["measured", "derived"]
    measurements: list[str]
    how: Annotated[str, Rules(min_length=1)]
    confidence: Literal["high", "medium", "low"]

    def covers(self, cuda: str) -> bool:
        """Whether torch built for this CUDA version falls in the row's range."""
        top = self.cuda_max is None or cuda_tuple(cuda) <= cuda_tuple(self.cuda_max)
        return cuda_tuple(self.cuda_min) <= cuda_tuple(cuda) and top

    def cuda_range(self) -> str:
        return f"CUDA {self.cuda_min}" + (f"-{self.cuda_max}" if self.cuda_max else " and later")


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One public measurement of what a process held outside PyTorch's allocator."""

    __pydantic_config__ = {"extra": "forbid"}

    id: str
    gpu: str
    device: str
    compute_capability: str
    sm_count: Annotated[int, Rules(ge=0)]
    cuda: Annotated[str, Rules(pattern=_CUDA)]
    torch: str
    kind: Literal["bare_context", "working_oom", "loading_oom", "kernels_increment", "eager_process",
                  "working_step", "unattributed"]
    bytes: Annotated[int, Rules(gt=0)]
    how: Annotated[str, Rules(min_length=1)]
    # a public source, or this repository's measurement
    url: Annotated[str, Rules(pattern=r"^(https://|benchmarks/results/)")]
    quote: Annotated[str, Rules(min_length=1)]
    confidence: Literal["high", "medium", "low"]


@dataclass(frozen=True, kw_only=True)
class ContextTable:
    """profiles/cuda_context.toml."""

    __pydantic_config__ = {"extra": "forbid"}

    default_cuda: Annotated[str, Rules(pattern=_CUDA)]
    unknown_card_bytes: Annotated[int, Rules(gt=0)]
    unknown_card_how: str
    context: list[ContextRow]
    measurement: list[Measurement] = field(default_factory=list)

    def row_for(self, compute_capability: str, cuda: str) -> ContextRow | None:
        return next((r for r in self.context if compute_capability in r.compute_capabilities and r.covers(cuda)),
                    None)


@lru_cache(maxsize=1)
def context_table() -> ContextTable:
    """The shipped table; a cuda_context.toml in $VRAM_PLAN_PROFILES replaces it."""
    path = next(p for p in (d / "cuda_context.toml" for d in reversed(profile_dirs())) if p.is_file())
    return cached(path, _table)


def _table(path: Path) -> ContextTable:
    return validated(ContextTable, read_toml(path), str(path))


@dataclass(frozen=True)
class ContextFigure:
    """The CUDA context a verdict adds, and where the figure comes from (in words)."""

    bytes: int
    source: str


def catalog_figure(gpu: GpuProfile, cuda: str | None = None) -> ContextFigure:
    """The GPU catalog's figure for this card under torch built for `cuda` (default: today's wheels)."""
    return _catalog_figure(gpu.compute_capability, gpu.sm_count, gpu.label, cuda or context_table().default_cuda)


@lru_cache(maxsize=256)  # `plan` judges hundreds of configs on one card
def _catalog_figure(compute_capability: str, sm_count: int | None, label: str, cuda: str) -> ContextFigure:
    table = context_table()
    if not compute_capability or not sm_count:
        return _fallback(table, "card not in the GPU catalog")
    known = [r.cuda_range() for r in table.context if compute_capability in r.compute_capabilities]
    if not known:
        return _fallback(table, f"compute capability {compute_capability} has no row")
    row = table.row_for(compute_capability, cuda)
    if row is None:  # the generation is known, the CUDA version is not one it runs under
        raise ProfileError(f"no CUDA context figure for {label} (compute capability {compute_capability}) with "
                           f"CUDA {cuda}: profiles/cuda_context.toml has " + ", ".join(known))
    resident = sm_count * row.resident_threads_per_sm
    figure = row.bytes_per_resident_thread * resident + row.kernels_bytes
    return ContextFigure(figure, (
        f"GPU catalog: {row.architecture} (compute capability {compute_capability}), {row.cuda_range()}, "
        f"{row.module_loading} module loading: {row.bytes_per_resident_thread} bytes x {sm_count} SMs x "
        f"{row.resident_threads_per_sm} resident threads + {row.kernels_bytes / MiB:.0f} MiB of kernels = "
        f"{figure / GiB:.2f} GiB, {row.basis}, {row.confidence} confidence (profiles/cuda_context.toml)"))


def _fallback(table: ContextTable, why: str) -> ContextFigure:
    return ContextFigure(table.unknown_card_bytes, f"{why}: {table.unknown_card_how} (profiles/cuda_context.toml)")


def context_figure(cal: Calibration, gpu: GpuProfile | None, cuda: str | None = None) -> ContextFigure:
    """A calibration's measured context when it has one, else the GPU catalog's figure for the card."""
    if cal.cuda_context_bytes is not None:
        where = f"{cal.name} ({cal.gpu})" if cal.gpu else cal.name
        how = "measured by vram-plan probe" if cal.measured else "its cuda_context_bytes"
        return ContextFigure(cal.cuda_context_bytes, f"calibration {where}: {how}, in place of the GPU catalog's")
    if gpu is None:
        return _catalog_figure("", None, "", cuda or context_table().default_cuda)
    return catalog_figure(gpu, cuda)


def context_bytes(cal: Calibration, gpu: GpuProfile | None = None) -> int:
    """The CUDA context a verdict adds: the calibration's measured figure, else the GPU catalog's."""
    return context_figure(cal, gpu).bytes
