"""`vram-plan probe`: measure GRPO steps on a GPU, fit the calibration, and check the verdicts against what ran.

The pipeline is the same whatever measures: `CudaMeasurer` (vram_planner.probe.cuda) runs real steps with random
weights on the local CUDA device; `SimulatedMeasurer` asks the trace engine, so CI tests the whole path without a
GPU. Measured points are kept in the data directory as they come in, so an interrupted probe continues where it
stopped, and the calibration is written only at the end, atomically. This module imports no torch.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError

from vram_planner.errors import VramPlanError
from vram_planner.files import check_writable, write_atomically
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.calibration import Calibration, default_calibration
from vram_planner.model.cublas import cublas_workspace_bytes
from vram_planner.model.phases import Estimate, estimate
from vram_planner.model.resolve import resolve_model
from vram_planner.model.spec import TrainingConfig, changed_settings
from vram_planner.model.stranding import loaded_weight_segment_bytes
from vram_planner.model.transformers_releases import known_transformers_version
from vram_planner.model.trl_releases import trl_release
from vram_planner.profiles import HOME_ENV, GpuProfile, data_home, read_json
from vram_planner.units import GiB
from vram_planner.validation import to_json

# Coefficients of the analytic model that real runs set and the probe fits (the rest of it is counted exactly).
FITTED_COEFFICIENTS = ("inference_hidden_bytes", "inference_mlp_bytes", "backward_hidden_bytes", "backward_mlp_bytes")
# The CUDA context of the simulated device (its allocations are the trace engine's, its reserve the allocator model's).
SIMULATED_CONTEXT_BYTES = int(0.5 * GiB)


@dataclass(frozen=True)
class ProbePoint:
    """One configuration of one model to run (or trace), named by what differs from TRL's defaults."""

    model: str
    train: TrainingConfig

    @property
    def label(self) -> str:
        t = self.train
        kind = f"lora{t.lora_r}" if t.uses_lora else "full"
        shown = {"lora_r", "gradient_checkpointing", "max_prompt_length", "max_completion_length",
                 "per_device_train_batch_size", "num_generations", "gradient_accumulation_steps"}
        extra = "".join(f" {k}={v}" for k, v in _settings(t).items() if k not in shown)
        return (f"{self.model} {kind} gc={'on' if t.gradient_checkpointing else 'off'} "
                f"p={t.max_prompt_length} c={t.max_completion_length} B={t.per_device_train_batch_size} "
                f"G={t.num_generations} GA={t.gradient_accumulation_steps}{extra}")


def label_settings(label: str) -> tuple[str, dict[str, Any]]:
    """The model and knobs a ProbePoint label names (its inverse, for the labels of the default knobs' points that
    `probe_grid` and `boundary_points` make), as a validation table lists them."""
    model, kind, checkpointing, *rest = label.split()
    values = dict(item.split("=", 1) for item in rest)
    return model, {"lora_r": int(kind.removeprefix("lora")) if kind.startswith("lora") else None,
                   "gradient_checkpointing": checkpointing == "gc=on", "max_prompt_length": int(values["p"]),
                   "max_completion_length": int(values["c"]), "per_device_train_batch_size": int(values["B"]),
                   "num_generations": int(values["G"]), "gradient_accumulation_steps": int(values["GA"])}


def probe_grid(models: Iterable[str] = ("Qwen2.5-0.5B", "Llama-3.2-1B"), completions: Iterable[int] = (128, 512),
               batch: int = 4) -> list[ProbePoint]:
    """Two sequence lengths, LoRA and full, checkpointing on and off, for each model."""
    points = []
    for model in models:
        for completion in completions:
            for lora in (None, 16):
                for checkpointing in (True, False):
                    train = TrainingConfig(per_device_train_batch_size=batch, num_generations=batch,
                                           max_prompt_length=128, max_completion_length=completion,
                                           gradient_checkpointing=checkpointing, lora_r=lora)
                    points.append(ProbePoint(model, train))
    return points


class PhaseMeasurement(BaseModel):
    name: str
    allocated_bytes: int  # torch.cuda.max_memory_allocated over the phase
    reserved_bytes: int  # torch.cuda.max_memory_reserved over the phase
    seconds: float | None = None  # CUDA-synchronized wall time of the phase (None: a record of before issue 30)


class PointMeasurement(BaseModel):
    label: str
    model: str
    settings: dict[str, Any]
    phases: list[PhaseMeasurement]
    seconds: float
    # Probes before 2026-11-23 generated LoRA under autocast, which TRL never does (PEFT's generate() bypasses
    # accelerate's autocast wrapper); a point that does not say otherwise was measured so, and the fit leaves its
    # LoRA generation out. New points say False.
    lora_generation_autocast: bool = True
    # generate() timed for real on the generation batch: `decode_tokens` new tokens in `decode_seconds`
    decode_seconds: float | None = None
    decode_tokens: int = 0


class ProbeRecord(BaseModel):
    """What the probe has measured on one device so far (kept between runs)."""

    device: dict[str, str]
    context_bytes: int
    points: list[PointMeasurement] = []


class Measurer(Protocol):
    simulated: bool

    def device(self) -> dict[str, str]: ...

    def context_bytes(self) -> int: ...

    def measure(self, point: ProbePoint) -> PointMeasurement: ...

    def run_within(self, point: ProbePoint, capacity_bytes: int) -> tuple[bool, int]:
        """Run one step with the process limited to `capacity_bytes`: (did it run, peak reserved bytes)."""
        ...


class SimulatedMeasurer:
    """A device whose allocations are the trace engine's, with the cuBLAS workspaces a card of its compute capability
    allocates, replayed through the caching allocator model for its reserved bytes, and a fixed context."""

    simulated = True

    def __init__(self, gpu_name: str, context_bytes: int = SIMULATED_CONTEXT_BYTES) -> None:
        self.gpu_name, self._context = gpu_name, context_bytes

    def device(self) -> dict[str, str]:
        from vram_planner.tracing.step import engine_versions

        return {"gpu": self.gpu_name, "simulated": "trace engine", **engine_versions()}

    def context_bytes(self) -> int:
        return self._context

    def measure(self, point: ProbePoint) -> PointMeasurement:
        from vram_planner.allocator import parse_allocator_conf
        from vram_planner.model.cublas import workspace_bytes
        from vram_planner.tracing.events import with_workspaces
        from vram_planner.tracing.reserve import reserved_memory
        from vram_planner.tracing.step import trace_step

        result = trace_step(_config_json(point.model), point.train)
        workspaces = workspace_bytes(compute_capability(self.gpu_name))
        stream = with_workspaces(result.steady_stream(), workspaces)
        reserved = reserved_memory(stream, parse_allocator_conf("", "the simulated device"))
        held = 2 * workspaces  # step 2 runs with both threads' workspaces
        phases = [PhaseMeasurement(name=p.name, allocated_bytes=p.peak_bytes + held,
                                   reserved_bytes=reserved.by_phase.get(p.name, p.peak_bytes + held))
                  for p in result.phases]
        return PointMeasurement(label=point.label, model=point.model, settings=_settings(point.train),
                                lora_generation_autocast=False,
                                phases=phases, seconds=result.seconds)

    def run_within(self, point: ProbePoint, capacity_bytes: int) -> tuple[bool, int]:
        peak = max(p.reserved_bytes for p in self.measure(point).phases) + self._context
        return peak <= capacity_bytes, peak


def _settings(train: TrainingConfig) -> dict[str, Any]:
    return changed_settings(train)


def _config_json(model: str) -> dict[str, Any]:
    """The config.json of a catalog model, or of a config.json file / model folder."""
    from vram_planner.profiles import model_catalog

    entry = model_catalog().get(model.lower())
    path = entry.config_path if entry else Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise VramPlanError(f"the probe needs a catalog model or a config.json, not {model!r}")
    return read_json(path)


def record_path(gpu_name: str) -> Path:
    return data_home() / "probe" / f"{gpu_name}.json"


def load_record(path: Path, device: dict[str, str], context_bytes: int) -> ProbeRecord:
    """The points measured earlier on the same device and software; a fresh record otherwise."""
    if path.is_file():
        try:
            record = ProbeRecord.model_validate(read_json(path))
        except (VramPlanError, ValidationError):
            record = None  # unreadable: measure again rather than fail
        if record is not None and record.device == device:
            return record
    return ProbeRecord(device=device, context_bytes=context_bytes)


Progress = Callable[[int, int, str], None]


def measure_points(measurer: Measurer, points: list[ProbePoint], path: Path,
                   progress: Progress | None = None) -> ProbeRecord:
    """Measure every point not measured yet, saving the record after each one."""
    record = load_record(path, measurer.device(), measurer.context_bytes())
    done = {p.label for p in record.points}
    for n, point in enumerate(points, 1):
        if progress:
            progress(n, len(points), point.label + (" (measured before)" if point.label in done else ""))
        if point.label in done:
            continue
        record.points.append(measurer.measure(point))
        # Lazy module loading brings a step's kernels in on first use: the context grows past its start-up size.
        record.context_bytes = max(record.context_bytes, measurer.context_bytes())
        write_atomically(path, record.model_dump_json(indent=1))
    return record


@functools.cache
def _architecture(model: str) -> ModelArchitecture:
    # the fit evaluates the model hundreds of times; read each config.json once
    return resolve_model(model)


def compute_capability(gpu_name: str) -> str:
    """The catalog's compute capability of the probed card ("" for a card the catalog does not know)."""
    from vram_planner.profiles import gpu_catalog

    gpu = gpu_catalog().get(gpu_name)
    return gpu.compute_capability if gpu is not None else ""


def _point_estimate(point: PointMeasurement, cal: Calibration, capability: str = "", allocator_conf: str = ""
                    ) -> Estimate:
    """The point's estimate; `allocator_conf` is the setting the probe ran under (the record's, not the point's: one
    process measures every point), which decides the reserve."""
    return estimate(_architecture(point.model), _point_train(point, allocator_conf), trl_release(), cal, 80 * GiB,
                    compute_capability=capability)


def _point_train(point: PointMeasurement, allocator_conf: str = "") -> TrainingConfig:
    return TrainingConfig(**{"allocator_conf": allocator_conf, **point.settings})


def _generated_under_autocast(point: PointMeasurement) -> bool:
    return point.lora_generation_autocast and TrainingConfig(**point.settings).uses_lora


def _as_trl_runs(record: ProbeRecord) -> ProbeRecord:
    """The record less what was measured of a step TRL does not run: the allocated peak of LoRA generation under
    autocast."""
    def kept(point: PointMeasurement) -> list[PhaseMeasurement]:
        return [p for p in point.phases if p.name != "generation"] if _generated_under_autocast(point) else point.phases

    return record.model_copy(update={"points": [point.model_copy(update={"phases": kept(point)})
                                                for point in record.points]})


def _under_its_transformers(record: ProbeRecord) -> ProbeRecord:
    """The record with each point planned under the transformers release it ran (the device's, where the release
    table knows it and the point names none): the analytic model follows the installed transformers, and a record
    made under another (5.25's kernelized norms keep less in the loss than 5.24) is held to its own."""
    try:
        ran = known_transformers_version(record.device.get("transformers") or "")
    except ValueError:
        return record
    return record.model_copy(update={"points": [
        point.model_copy(update={"settings": {"transformers_version": ran, **point.settings}})
        for point in record.points]})


def _reserved_as_trl_runs(record: ProbeRecord) -> ProbeRecord:
    """The points whose reserved bytes are TRL's: after LoRA generation under autocast, every later phase's reserved
    bytes still hold what that generation left cached."""
    return record.model_copy(update={"points": [p for p in record.points if not _generated_under_autocast(p)]})


def _estimated_phases(point: PointMeasurement, cal: Calibration, capability: str, allocator_conf: str) -> list:
    """The estimate's phases that were measured at the point."""
    measured = {p.name for p in point.phases}
    return [p for p in _point_estimate(point, cal, capability, allocator_conf).phases if p.name in measured]


def _ran_under(record: ProbeRecord) -> str:
    return record.device.get("allocator_conf") or ""


def _phase_bytes(point: PointMeasurement, cal: Calibration) -> dict[str, float]:
    return {p.name: p.tensor_bytes for p in _point_estimate(point, cal).phases}


def fit_calibration(record: ProbeRecord, gpu_name: str, base: Calibration | None = None) -> Calibration:
    """Least-squares fit of the working-set coefficients to the measured allocated peaks (less the cuBLAS
    workspaces, which the device allocates beside the tensors), and a scale of the base's fitted allocator reserve to
    the steps' measured peaks of reserved memory; the context is what the device reported."""
    from vram_planner.allocator import parse_allocator_conf

    base = base or default_calibration()
    if not any(point.phases for point in record.points):
        raise VramPlanError("the probe has no measured points to fit")
    record = _under_its_transformers(record)
    capability = compute_capability(gpu_name)
    fitted = replace(base, **_fit_coefficients(_as_trl_runs(record), base, cublas_workspace_bytes(capability)))
    ran_under = parse_allocator_conf(_ran_under(record), "the probe's PYTORCH_CUDA_ALLOC_CONF")
    setting = "expandable_segments" if ran_under.expandable_segments else "default"
    trl_reserved = _reserved_as_trl_runs(record)
    scale, compared = _reserve_scale(trl_reserved, fitted, capability), len(trl_reserved.points)
    reserve = {name: ({phase: {c: round(v * scale, 4) for c, v in per.items()} for phase, per in phases.items()}
                      if name == setting else phases) for name, phases in base.allocator_reserve.items()}
    device = record.device
    return replace(fitted, **{
        "name": "simulated probe" if "simulated" in device else "probe",
        "gpu": gpu_name,
        "source": f"vram-plan probe: {len(record.points)} GRPO steps; the {setting} allocator reserve scaled by "
                  f"{scale:.3f} to the measured peaks"
                  + (f" of the {compared} steps not LoRA generated under autocast (as probes before 2026-11-23 did "
                     "and TRL never does)" if compared < len(record.points) else "")
                  + (", simulated with the trace engine (no GPU measured it: used only when passed with "
                     "--calibration)" if "simulated" in device else ""),
        "measured": device,
        "cuda_context_bytes": record.context_bytes,
        "allocator_reserve": reserve,
        "allocator_overhead_fraction": None,
        "step_time": _step_time_factors(record, gpu_name) or base.step_time,
    })


def _step_time_factors(record: ProbeRecord, gpu_name: str) -> dict[str, float]:
    """The step-time model's efficiency factors fitted to the record's phase times, on a catalog card with speed
    figures (none for a simulated record, which has no times)."""
    from vram_planner.probe.step_fit import fit_step_time, timed_phases
    from vram_planner.profiles import gpu_catalog

    gpu = gpu_catalog().get(gpu_name)
    if gpu is None or gpu.memory_bandwidth_gb_s is None:
        return {}
    return fit_step_time(timed_phases(record), gpu)


def _fit_coefficients(record: ProbeRecord, base: Calibration, workspaces: int) -> dict[str, float]:
    """The working-set coefficients that best predict each phase's allocated peak."""
    import numpy as np

    pairs = [(point, phase) for point in record.points for phase in point.phases]
    theta = np.array([getattr(base, c) for c in FITTED_COEFFICIENTS], dtype=float)
    measured = np.array([phase.allocated_bytes - workspaces for _, phase in pairs], dtype=float)

    def predicted(values: np.ndarray) -> np.ndarray:
        cal = replace(base, **dict(zip(FITTED_COEFFICIENTS, values.tolist(), strict=True)))
        by_point = {point.label: _phase_bytes(point, cal) for point in record.points}
        return np.array([by_point[point.label].get(phase.name, 0.0) for point, phase in pairs])

    # The model is piecewise linear in the coefficients (each phase is its largest moment): damped Gauss-Newton
    # with one-byte finite differences, halving a step until it lowers the squared error; coefficients no
    # measured phase depends on keep their value.
    now = predicted(theta)
    for _ in range(30):
        jacobian = np.stack([predicted(theta + np.eye(len(theta))[k]) - now for k in range(len(theta))], axis=1)
        used = np.abs(jacobian).sum(axis=0) > 0
        if not used.any():
            break
        step = np.zeros_like(theta)
        step[used], *_ = np.linalg.lstsq(jacobian[:, used], measured - now, rcond=None)
        for scale in 0.5 ** np.arange(12):
            trial = np.maximum(theta + scale * step, 0.0)
            after = predicted(trial)
            if ((measured - after) ** 2).sum() < ((measured - now) ** 2).sum():
                theta, now = trial, after
                break
        else:
            break
    return {c: round(float(v), 3) for c, v in zip(FITTED_COEFFICIENTS, theta, strict=True)}


# The reserve's scale is searched on this grid (then refined): the allocator reserves from nothing extra up to five
# times what the replays of traced steps predict.
RESERVE_SCALES = (0.0, 5.0, 5001)


def _reserve_scale(record: ProbeRecord, cal: Calibration, capability: str) -> float:
    """The factor on the fitted reserve that best predicts each step's measured peak reserved bytes (relative least
    squares). The probe reads reserved memory per phase, but a phase's reserved bytes hold what earlier phases
    cached, so only the step's peak is compared, as `fit_quality` does."""
    import numpy as np

    estimates = [_estimated_phases(point, cal, capability, _ran_under(record)) for point in record.points]
    if not estimates:  # no step measured as TRL runs it: the fitted reserve as it is
        return 1.0
    # the loaded weights' rests are the allocator's rules, not the fit's: held as they are, never scaled
    exact = [loaded_weight_segment_bytes(_architecture(point.model), _point_train(point, _ran_under(record)))
             for point in record.points]
    # points without a scoring phase have a phase fewer: the padding holds nothing and reserves nothing
    held, reserve = (np.zeros((len(estimates), max(map(len, estimates)))) for _ in range(2))
    for i, phases in enumerate(estimates):
        for j, p in enumerate(phases):
            reserve[i, j] = p.components["allocator_overhead"] - exact[i]
            held[i, j] = p.total_bytes - reserve[i, j] - p.components["cuda_context"]
    measured = np.array([max(p.reserved_bytes for p in point.phases) for point in record.points], dtype=float)
    scales = np.linspace(*RESERVE_SCALES)
    predicted = (held[None] + scales[:, None, None] * reserve[None]).max(axis=2)
    loss = (((predicted - measured) / measured) ** 2).sum(axis=1)
    return float(scales[int(np.argmin(loss))])


class FitQuality(BaseModel):
    """Peak reserved memory (plus context) predicted by a calibration against what was measured, per point."""

    label: str
    measured_bytes: int
    predicted_bytes: float

    @property
    def error(self) -> float:
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


def fit_quality(record: ProbeRecord, cal: Calibration) -> list[FitQuality]:
    """Per point whose reserved bytes are TRL's, the peak over its phases."""
    rows, capability = [], compute_capability(cal.gpu or "")
    record = _reserved_as_trl_runs(_under_its_transformers(record))
    for point in record.points:
        measured = max(p.reserved_bytes for p in point.phases) + record.context_bytes
        predicted = max(p.total_bytes for p in _estimated_phases(point, cal, capability, _ran_under(record)))
        rows.append(FitQuality(label=point.label, measured_bytes=measured, predicted_bytes=predicted))
    return rows


def summary(rows: list[FitQuality]) -> dict[str, float]:
    errors = [abs(r.error) for r in rows]
    if not errors:  # a record whose every step generated LoRA under autocast has no step to compare
        return {"median_error": math.nan, "worst_error": math.nan}
    return {"median_error": statistics.median(errors), "worst_error": max(errors)}


def is_simulated(cal: Calibration) -> bool:
    """Whether the calibration was fitted to the trace engine rather than measured on a GPU."""
    return "simulated" in cal.measured


def calibration_path(gpu_name: str, simulated: bool = False) -> Path:
    """Where plan/check look for this GPU's calibration (calibration_for). A simulated one is no measurement of the
    card: it goes beside it under a name that says so, and is used only when passed with --calibration."""
    return data_home() / "calibrations" / (f"{gpu_name}.simulated.json" if simulated else f"{gpu_name}.json")


def check_targets(gpu_name: str, simulated: bool, out: Path | None = None) -> None:
    """Refuse, before anything is measured, a probe whose record or calibration could not be written."""
    if out is not None:
        check_writable(out, "--out")
    hint = f"set {HOME_ENV} to a writable folder"
    check_writable(record_path(gpu_name), "the probe's record", hint)
    check_writable(calibration_path(gpu_name, simulated), "the calibration", hint)


def save_calibration(cal: Calibration, gpu_name: str, out: Path | None = None) -> list[Path]:
    """Write the calibration where plan/check look for this GPU's, or for a simulated one beside it under its own
    name (and to `out`), atomically."""
    text = to_json(cal, indent=2) + "\n"
    targets = [calibration_path(gpu_name, is_simulated(cal))] + ([out] if out else [])
    return [write_atomically(path, text) for path in targets]


class ValidationRow(BaseModel):
    """One config run on an emulated smaller card: what the planner said and what happened."""

    capacity_bytes: int
    label: str
    predicted_fits: bool
    ran: bool
    predicted_bytes: float
    measured_bytes: int | None  # peak reserved plus context; None when it ran out of memory

    @property
    def wrong_fit(self) -> bool:
        return self.predicted_fits and not self.ran

    @property
    def error(self) -> float | None:
        if self.measured_bytes is None:
            return None
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


def emulated_card(capacity_bytes: int, capability: str) -> GpuProfile:
    """A card of `capacity_bytes`, as `--validate` emulates it on the probed one (its compute capability)."""
    return GpuProfile(name=f"{capacity_bytes / GiB:.2f}GiB", total_memory_gib=capacity_bytes / GiB,
                      source="emulated with torch.cuda.set_per_process_memory_fraction", capacity_source="user",
                      compute_capability=capability)


def boundary_points(model: str, capacity_bytes: int, cal: Calibration, lora_r: int | None = None,
                    batches: Iterable[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256), completion: int = 256,
                    prompt: int = 128) -> list[tuple[ProbePoint, bool, float]]:
    """The largest micro-batch the planner says fits on a card of `capacity_bytes` and the next one up."""
    from vram_planner.model.verdict import Context, judge

    gpu = emulated_card(capacity_bytes, compute_capability(cal.gpu or ""))
    context = Context(arch=resolve_model(model), gpu=gpu, release=trl_release(), calibration=cal, model_id=model)
    judged = []
    for batch in batches:
        # one sequence per micro-batch takes two micro-batches per group of two completions
        train = TrainingConfig(per_device_train_batch_size=batch, num_generations=max(batch, 2),
                               gradient_accumulation_steps=max(2 // batch, 1), lora_r=lora_r,
                               max_prompt_length=prompt, max_completion_length=completion)
        verdict = judge(context, train)
        judged.append((ProbePoint(model, train), verdict.fits, verdict.estimate.peak_bytes))
    last_fit = max((i for i, (_, fits, _) in enumerate(judged) if fits), default=-1)
    return judged[max(last_fit, 0):last_fit + 2]


def validate_verdicts(measurer: Measurer, cal: Calibration, model: str, capacities: Iterable[int],
                      lora_ranks: Iterable[int | None] = (None, 16),
                      progress: Progress | None = None) -> list[ValidationRow]:
    """Run the configs around each emulated card's boundary and compare what happened with the verdicts."""
    todo = [(capacity, point, fits, predicted) for capacity in capacities for lora in lora_ranks
            for point, fits, predicted in boundary_points(model, capacity, cal, lora)]
    rows = []
    for n, (capacity, point, fits, predicted) in enumerate(todo, 1):
        if progress:
            progress(n, len(todo), f"{point.label} on {capacity / GiB:.1f} GiB")
        ran, peak = measurer.run_within(point, capacity)
        rows.append(ValidationRow(capacity_bytes=capacity, label=point.label, predicted_fits=fits, ran=ran,
                                  predicted_bytes=predicted, measured_bytes=peak if ran else None))
    return rows
