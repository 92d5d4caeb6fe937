"""`vram-plan probe` from the command line: pick the device, show progress, print and save what was fitted."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from vram_planner.errors import VramPlanError
from vram_planner.extras import library_log_warnings_hidden
from vram_planner.probe import fit as p
from vram_planner.profiles import GpuProfile
from vram_planner.units import GiB
from vram_planner.validation import to_jsonable

# A short grid for --quick (and CI): one small model, one length, LoRA and full, checkpointing on and off.
QUICK_MODELS, QUICK_COMPLETIONS = ("SmolLM2-135M",), (64,)
VALIDATION_MODEL, QUICK_VALIDATION_MODEL = "Qwen2.5-0.5B", "SmolLM2-135M"
VALIDATION_CAPACITIES_GIB = (8, 12, 16, 24)
QUICK_VALIDATION_CAPACITIES_GIB = (3,)


def _measurer(simulate: bool, gpu: str | None) -> tuple[p.Measurer, str]:
    from vram_planner.extras import require_train_extra

    require_train_extra("vram-plan probe")  # real or simulated, the probe runs the training stack
    if simulate:
        if not gpu:
            raise VramPlanError("probe --simulate needs --gpu: the card whose calibration to simulate "
                                "(e.g. --gpu h100-80gb)")
        name = GpuProfile.from_name(gpu).name
        return p.SimulatedMeasurer(name), name
    from vram_planner.probe.cuda import CudaMeasurer

    measurer = CudaMeasurer()
    return measurer, GpuProfile.from_name(gpu or "auto").name


@library_log_warnings_hidden()  # the training stack's imports (bitsandbytes) log beside the progress bar
def run_probe(gpu: str | None, simulate: bool, out: Path | None, quick: bool, validate: bool,
              json_output: bool, console_out: Console | None = None) -> int:
    """Measure, fit, save (and validate); the exit code: 0, or 1 when a validated "fits" did not run. The results
    go to `console_out` (the command line's, which answers a closed pipe with its own exit code)."""
    measurer, gpu_name = _measurer(simulate, gpu)
    p.check_targets(gpu_name, measurer.simulated, out)  # before minutes of measuring
    console = Console(stderr=True)
    points = p.probe_grid(QUICK_MODELS, QUICK_COMPLETIONS, batch=2) if quick else p.probe_grid()
    with _progress(console) as progress:
        task = progress.add_task("measuring", total=len(points))

        def advance(n: int, total: int, what: str) -> None:
            progress.update(task, completed=n - 1, description=what)

        record = p.measure_points(measurer, points, p.record_path(gpu_name), advance)
        progress.update(task, completed=len(points), description="fitted")
    cal = p.fit_calibration(record, gpu_name)
    written = p.save_calibration(cal, gpu_name, out)
    quality = p.fit_quality(record, cal)
    rows: list[p.ValidationRow] = []
    if validate:
        capacities = QUICK_VALIDATION_CAPACITIES_GIB if quick else VALIDATION_CAPACITIES_GIB
        model = QUICK_VALIDATION_MODEL if quick else VALIDATION_MODEL
        with _progress(console) as progress:
            task = progress.add_task("validating", total=None)
            rows = p.validate_verdicts(measurer, cal, model, [int(c * GiB) for c in capacities],
                                       progress=lambda n, total, what: progress.update(
                                           task, total=total, completed=n - 1, description=what))
    if json_output:
        print(json.dumps({"calibration": to_jsonable(cal), "written": [str(w) for w in written],
                          "fit": [{**r.model_dump(), "error": r.error} for r in quality],
                          "validation": [{**r.model_dump(), "error": r.error, "wrong_fit": r.wrong_fit}
                                         for r in rows]}, indent=2))
    else:
        _print(console_out or Console(), cal, quality, rows, written)
    return 1 if any(r.wrong_fit for r in rows) else 0


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


def _print(console: Console, cal, quality: list[p.FitQuality], rows: list[p.ValidationRow],
           written: list[Path]) -> None:
    table = Table(title=f"Probe of {cal.gpu}: peak memory per step (GiB, reserved + context)")
    for column in ("config", "measured", "calibrated plan", "error"):
        table.add_column(column, justify="left" if column == "config" else "right")
    for row in quality:
        table.add_row(row.label, f"{row.measured_bytes / GiB:.2f}", f"{row.predicted_bytes / GiB:.2f}",
                      f"{row.error:+.1%}")
    console.print(table)
    errors = p.summary(quality)
    console.print(f"median error {errors['median_error']:.1%}, worst {errors['worst_error']:.1%} over "
                  f"{len(quality)} steps")
    fitted = ", ".join(f"{c} {getattr(cal, c):g}" for c in p.FITTED_COEFFICIENTS)
    console.print(f"fitted: CUDA context {cal.cuda_context_bytes / GiB:.2f} GiB, {fitted} ({cal.source})")
    if cal.step_time:
        console.print("step-time efficiency factors fitted to the timed phases: "
                      + ", ".join(f"{name} {value:g}" for name, value in cal.step_time.items()))
    if rows:
        check = Table(title="Verdicts on emulated smaller cards")
        for column in ("card GiB", "config", "verdict", "ran", "predicted", "measured", "error"):
            check.add_column(column, justify="left" if column == "config" else "right")
        for r in rows:
            check.add_row(f"{r.capacity_bytes / GiB:.1f}", r.label, "fits" if r.predicted_fits else "does not fit",
                          "yes" if r.ran else "OOM", f"{r.predicted_bytes / GiB:.2f}",
                          "-" if r.measured_bytes is None else f"{r.measured_bytes / GiB:.2f}",
                          "-" if r.error is None else f"{r.error:+.1%}")
        console.print(check)
        wrong = sum(r.wrong_fit for r in rows)
        console.print(f"wrong \"fits\" verdicts: {wrong} of {sum(r.predicted_fits for r in rows)}")
    console.print("calibration written to " + " and ".join(str(w) for w in written)
                  + (f"; it was simulated, so plan and check use it only when given --calibration {written[0]}"
                     if p.is_simulated(cal) else "; plan and check use it for this GPU"))
