"""Coefficients that real runs set: CUDA context, allocator overhead, activation constants.

The defaults come from public measurements and from the modeling code, each with its source. `vram-plan probe`
fits them on a real GPU and writes a profile that replaces the defaults for that GPU.
"""

from __future__ import annotations

from pathlib import Path

from dataclasses import dataclass, field
from typing import Annotated

from vram_planner.errors import ProfileError, field_name
from vram_planner.profile_cache import cached
from vram_planner.profiles import data_home, profile_dirs, read_json, validated
from vram_planner.validation import Rules


@dataclass(frozen=True)
class Calibration:
    """Memory-model coefficients. Bytes are bytes; `*_bytes_per_*` are per element of the named size."""

    __pydantic_config__ = {"extra": "forbid", "allow_inf_nan": False}

    name: str = "default"
    gpu: str | None = None  # catalog name this calibration was measured on; None for the defaults
    source: str = ""
    measured: dict[str, str] = field(default_factory=dict)  # versions of GPU, driver, CUDA, torch, ...

    # CUDA context and kernels: outside torch's allocator, seen by mem_get_info. None: the GPU catalog's figure for
    # the card (profiles/cuda_context.toml, vram_planner.model.cuda_context); a probe writes what it measured.
    cuda_context_bytes: Annotated[int | None, Rules(ge=0, le=2**50)] = None  # at most a PiB: a typo beyond
    # The caching allocator's reserve beyond the tensors, per allocator setting ("default", "expandable_segments")
    # and phase: bytes of reserve per byte of each tensor component (each its own allocation pattern) and of each
    # pattern that strands cached memory (vram_planner.model.fragmentation), fitted over replays of traced steps
    # through the allocator model (benchmarks/allocator_fit.py per phase; the loss phase's under torch's defaults,
    # and generation's patterns, on whole steps' needs, benchmarks/reserve_fit.py).
    allocator_reserve: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    # A flat reserve, as a fraction of the tensors, in place of the fitted function (None: the fitted one). Probes
    # wrote it before they scaled the fitted function to their measurements; a hand-made calibration may set it.
    allocator_overhead_fraction: Annotated[float | None, Rules(ge=0, lt=1)] = None
    # The step-time model's efficiency factors that a probe fitted on this card (vram_planner/model/step_time.py,
    # Efficiency: matmul, decode_bandwidth, op_seconds, ...); the priors for the factors left out.
    step_time: dict[str, float] = field(default_factory=dict)

    # What a layer keeps for backward is counted tensor by tensor (vram_planner/model/activations.py, checked against
    # the trace engine); only Liger's kernels, which the CPU trace cannot run, and the transient working sets below
    # are coefficients.
    # With use_liger_kernel (layer kernels: RMSNorm, SwiGLU, RoPE): RMSNorm keeps only its input and a per-row
    # rstd, SwiGLU keeps gate and up and recomputes the activation, RoPE works in place (Liger-Kernel's
    # ops/rms_norm.py, ops/swiglu.py, ops/rope.py). Per element, for a 2-byte residual stream.
    liger_act_hidden_bytes: Annotated[float, Rules(ge=0)] = 8.0
    liger_act_query_bytes: Annotated[float, Rules(ge=0)] = 4.0
    liger_act_kv_bytes: Annotated[float, Rules(ge=0)] = 4.0
    liger_act_mlp_bytes: Annotated[float, Rules(ge=0)] = 6.0
    # Generation's prefill at the MLP's product (vram_planner/model/inference.py), per token, per element of a 2-byte
    # tensor: hidden-wide and MLP-wide tensors alive (the defaults are the 4 and 3 counted there, which the scoring
    # pass uses as they are); with Liger's kernels, the whole no-grad working set of both.
    inference_hidden_bytes: Annotated[float, Rules(ge=0)] = 8.0
    inference_mlp_bytes: Annotated[float, Rules(ge=0)] = 6.0
    # Gradient buffers alive at the peak of one layer's backward, per token: fitted by least squares to the
    # trace engine over benchmarks/accuracy.py's grid (the peak moves inside the MLP's backward).
    backward_hidden_bytes: Annotated[float, Rules(ge=0)] = 2.0
    backward_mlp_bytes: Annotated[float, Rules(ge=0)] = 4.0


def default_calibration() -> Calibration:
    return load_calibration_file(_shipped("default"))


def _shipped(name: str) -> Path:
    for folder in reversed(profile_dirs()):
        path = folder / "calibrations" / f"{name}.json"
        if path.is_file():
            return path
    raise ProfileError(f"no calibration named {name!r}")


def load_calibration_file(path: Path | str) -> Calibration:
    """A calibration profile from a JSON file; ProfileError in one line naming the file, the field and the problem."""
    if not isinstance(path, (str, Path)):
        raise ProfileError(f"{field_name('calibration')} should be a calibration file's path (got {path!r:.60})")
    try:
        return cached(Path(path), _calibration)
    except OSError as exc:
        raise ProfileError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _calibration(path: Path) -> Calibration:
    return validated(Calibration, read_json(path), f"{path} is not a valid calibration")


def calibration_for(gpu_name: str, explicit: Path | str | None = None) -> Calibration:
    """An explicit file, else a probe's calibration for this GPU, else a shipped one for it, else the defaults."""
    if explicit is not None:
        return load_calibration_file(explicit)
    candidates = [data_home() / "calibrations" / f"{gpu_name}.json"]
    candidates += [folder / "calibrations" / f"{gpu_name}.json" for folder in reversed(profile_dirs())]
    for path in candidates:
        if path.is_file():
            return load_calibration_file(path)
    return default_calibration()


# What a phase falls back to when the fit has no coefficients for it: the seeds' laptop OOM reserved 17% beyond
# its tensors (2.41 of 14.23 GiB), public reports about 11%.
UNFITTED_RESERVE_FRACTION = 0.12


def allocator_reserve_bytes(cal: Calibration, phase: str, tensor_bytes: dict[str, float], expandable: bool,
                            pattern_bytes: dict[str, float] | None = None, exact_bytes: float = 0.0) -> float:
    """What the caching allocator holds beyond a phase's tensors: a probe's measured fraction, else the fitted
    function of the phase's components and of its allocation patterns (vram_planner.model.fragmentation, bytes the
    pattern strands) under the run's allocator setting, on top of `exact_bytes`, what the allocator's rules strand
    exactly (vram_planner.model.stranding.loaded_weight_segment_bytes), which no fit weighs."""
    if cal.allocator_overhead_fraction is not None:
        return cal.allocator_overhead_fraction * sum(tensor_bytes.values())
    coefficients = cal.allocator_reserve.get("expandable_segments" if expandable else "default", {}).get(phase)
    if coefficients is None:
        return UNFITTED_RESERVE_FRACTION * sum(tensor_bytes.values())
    weighed = {**tensor_bytes, **(pattern_bytes or {})}
    return exact_bytes + sum(coefficients.get(name, 0.0) * n_bytes for name, n_bytes in weighed.items())
