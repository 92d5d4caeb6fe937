"""The JSON document `check` and `plan` print with --json: bytes throughout, one schema."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from vram_planner.model.grpo_config import (grpo_config_kwargs, grpo_config_problems, lora_config_kwargs,
                                            quantization_config_kwargs)
from vram_planner.model.phases import COMPONENTS, Phase
from vram_planner.model.search import Plan, smallest_config
from vram_planner.model.verdict import Context, Verdict, judge
from vram_planner.profiles import GpuProfile, gpus


class PhaseReport(BaseModel):
    name: str
    peak_moment: str
    total_bytes: int
    components: dict[str, int]
    # `trace` only: the analytic model's tensor bytes for the same phase, and its error against the trace
    tensor_bytes: int | None = None
    analytic_tensor_bytes: int | None = None
    analytic_relative_error: float | None = None


class ChangeReport(BaseModel):
    knob: str
    before: Any
    after: Any
    saved_bytes: int
    reason: str


class Report(BaseModel):
    """What `vram-plan check/plan --json` prints."""

    command: str
    fits: bool
    model: str
    gpu: str
    capacity_bytes: int
    safety_margin_bytes: int
    peak_bytes: int
    peak_phase: str
    spare_bytes: int
    params: int
    trainable_params: int
    phases: list[PhaseReport]
    config: dict[str, Any]
    peft_config: dict[str, Any] | None
    quantization_config: dict[str, Any] | None
    grpo_config_valid: bool
    grpo_config_problems: list[str]
    assumptions: dict[str, Any]
    calibration: str
    trl_version: str
    notes: list[str]
    changes: list[ChangeReport] = []
    requested_peak_bytes: int | None = None
    smallest_config_peak_bytes: int | None = None
    smallest_fitting_gpu: str | None = None
    # `trace` only. engine "trace": each phase's tensor_bytes were counted on fake tensors; its components add the
    # calibration's CUDA context and allocator reserve, so total_bytes, peak_bytes and fits judge the card as check.
    engine: Literal["analytic", "trace"] = "analytic"
    seconds: float | None = None  # wall time of the trace, model building included
    trace_counts: str | None = None  # what tensor_bytes include and what they do not, in words


def _phase(p: Phase) -> PhaseReport:
    return PhaseReport(name=p.name, peak_moment=p.moment, total_bytes=round(p.total_bytes),
                       components={c: round(p.components.get(c, 0)) for c in COMPONENTS})


def verdict_report(verdict: Verdict, command: str = "check") -> Report:
    ctx, train, est = verdict.context, verdict.train, verdict.estimate
    kwargs = grpo_config_kwargs(train)
    problems = grpo_config_problems(kwargs, num_processes=train.num_gpus, release=train.release)
    cal = ctx.calibration
    return Report(
        command=command, fits=verdict.fits, model=ctx.model_id or ctx.arch.name, gpu=ctx.gpu.name,
        capacity_bytes=ctx.capacity_bytes, safety_margin_bytes=round(ctx.margin_bytes),
        peak_bytes=round(est.peak_bytes), peak_phase=est.peak_phase.name, spare_bytes=round(verdict.spare_bytes),
        params=est.params, trainable_params=est.trainable_params, phases=[_phase(p) for p in est.phases],
        config=kwargs, peft_config=lora_config_kwargs(train), quantization_config=quantization_config_kwargs(train),
        grpo_config_valid=not problems, grpo_config_problems=problems,
        assumptions={"max_prompt_length": train.max_prompt_length,
                     "prompts_truncated": train.release.truncates_prompts, "num_gpus": train.num_gpus,
                     "distributed": train.distributed, "generation_batch_size": train.generation_batch_size},
        calibration=cal.name if cal.gpu is None else f"{cal.name} ({cal.gpu})",
        trl_version=ctx.release.version, notes=list(est.notes),
    )


def plan_report(plan: Plan) -> Report:
    shown = plan.chosen or plan.smallest
    report = verdict_report(shown, command="plan")
    report.fits = plan.fits
    report.changes = [ChangeReport(knob=c.knob, before=c.before, after=c.after, saved_bytes=round(c.saved_bytes),
                                   reason=c.reason) for c in plan.changes]
    report.requested_peak_bytes = round(plan.requested.estimate.peak_bytes)
    if not plan.fits:
        report.smallest_config_peak_bytes = round(plan.smallest.estimate.peak_bytes)
        gpu = smallest_fitting_gpu(plan.requested.context, plan.requested.train)
        report.smallest_fitting_gpu = gpu.name if gpu else None
    return report


def smallest_fitting_gpu(context: Context, user_train: Any) -> GpuProfile | None:
    """The smallest larger catalog card on which the bottom rung of the ladder (micro-batch 1) fits."""
    for gpu in gpus():
        if gpu.capacity_bytes <= context.capacity_bytes:
            continue
        other = Context(context.arch, gpu, context.release, context.calibration, context.safety_margin,
                        context.model_id)
        if judge(other, smallest_config(user_train, gpu.bf16)).fits:
            return gpu
    return None


TRACE_COUNTS = ("tensor_bytes are the live tensor bytes of the traced step, as torch.cuda.memory_allocated counts "
                "them (512-byte blocks); they do not include the CUDA context or the caching allocator's reserve, "
                "which components cuda_context and allocator_overhead (and so total_bytes, peak_bytes and fits) "
                "take from the calibration")


def trace_report(outcome: Any) -> Report:  # outcome: vram_planner.api.TraceOutcome
    """`vram-plan trace --json`: the traced verdict in check's shape, with the analytic tensor bytes beside it."""
    report = verdict_report(outcome.traced, command="trace")
    report.engine, report.seconds, report.trace_counts = "trace", round(outcome.seconds, 2), TRACE_COUNTS
    comparisons = {row.name: row for row in outcome.comparison()}
    for phase, traced in zip(report.phases, outcome.result.phases, strict=True):
        phase.tensor_bytes = traced.peak_bytes
        row = comparisons.get(phase.name)
        if row is not None:
            phase.analytic_tensor_bytes = round(row.analytic_bytes)
            phase.analytic_relative_error = row.relative_error
    return report
