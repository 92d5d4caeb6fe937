"""The JSON document `check` and `plan` print with --json: bytes throughout, one schema (pydantic writes it:
vram_planner.validation.to_json). A report is that document as an object: `to_dict()` is the document, and a
notebook shows it as a short table."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Literal

from vram_planner.model import accelerate_config as launcher
from vram_planner.model import offload
from vram_planner.model.calibration import calibration_for
from vram_planner.model.grpo_config import (grpo_config_kwargs, grpo_config_problems, lora_config_kwargs,
                                            quantization_config_kwargs)
from vram_planner.model.phases import COMPONENTS, Phase
from vram_planner.model.search import Plan, smallest_config, vllm_fallback_note, vllm_tuned
from vram_planner.model.spec import plain_value
from vram_planner.model.verdict import Context, Verdict, judge, need_above_band, qlora_left_out_note
from vram_planner.profiles import GpuProfile, gpus
from vram_planner.units import GiB


@dataclass(kw_only=True)
class PhaseReport:
    name: str
    peak_moment: str
    total_bytes: int
    components: dict[str, int]
    # `trace` only: the analytic model's tensor bytes for the same phase, and its error against the trace
    tensor_bytes: int | None = None
    reserved_bytes: int | None = None  # the most the caching allocator model reserves during the phase
    analytic_tensor_bytes: int | None = None
    analytic_relative_error: float | None = None
    seconds: float | None = None  # predicted seconds of this phase per optimizer step (plan and check)


@dataclass(kw_only=True)
class ChangeReport:
    knob: str
    before: Any
    after: Any
    saved_bytes: int  # what the change takes off the peak; never negative
    cost_bytes: int  # what it adds (vLLM's share raised so that vLLM starts and holds a round); never negative
    reason: str
    # every field of the config the change sets, to its new value, as --config files name them: a smaller
    # micro-batch sets the accumulation that keeps the batches too, so each change applied in turn gives `config`
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class VllmReport:
    """vLLM's budget on one GPU of the card it runs on (the training card in colocate mode, --vllm-server-gpu in
    server mode), as vLLM works it out at start-up (vram_planner/model/vllm.py)."""

    weights_bytes: int
    kv_cache_bytes: int  # what one generation round's sequences need at full length
    activation_bytes: int  # the profile run's peak
    cuda_graph_bytes: int
    reservation_bytes: int  # vllm_gpu_memory_utilization x the card
    max_num_seqs: int
    max_model_len: int
    kv_capacity_sequences: int  # prompt + completion sequences the KV cache holds at once
    min_gpu_memory_utilization: float | None  # the smallest with which vLLM starts and holds one max_model_len
    problem: str | None  # why vLLM cannot start in its budget, else null


def vllm_report(budget: Any) -> VllmReport | None:  # budget: vram_planner.model.vllm.VllmBudget | None
    if budget is None:
        return None
    return VllmReport(weights_bytes=round(budget.weights_bytes), kv_cache_bytes=round(budget.kv_cache_bytes),
                      activation_bytes=round(budget.activation_bytes), cuda_graph_bytes=round(budget.cuda_graph_bytes),
                      reservation_bytes=round(budget.reservation_bytes), max_num_seqs=budget.max_num_seqs,
                      max_model_len=budget.max_model_len, kv_capacity_sequences=budget.kv_capacity_sequences,
                      min_gpu_memory_utilization=budget.min_gpu_memory_utilization, problem=budget.problem)


@dataclass(kw_only=True)
class DistributedReport:
    """Several GPUs (or DeepSpeed or FSDP on one): every byte of the document is per GPU, on each of `num_gpus`."""

    num_gpus: int
    strategy: str  # ddp, zero0 to zero3, fsdp (FSDP2)
    label: str  # "2 x ZeRO-3": the headline says "per GPU, 2 x ZeRO-3"
    accelerate_config: dict[str, Any]  # TRL's accelerate config file for the strategy, as plan prints it
    accelerate_config_file: str  # the name the launch command gives that file
    launch_command: str  # starts the printed GRPOConfig code (saved as the file it names) on every GPU
    offload_optimizer: str = "none"  # cpu: ZeRO-Offload's optimizer (or FSDP2's CPU offload) on the host
    offload_param: str = "none"  # cpu: ZeRO-3's parameters, or FSDP2's shards, on the host
    host_bytes: int = 0  # the host RAM one node needs for the offloaded states (0 without offload)
    host_memory_bytes: int | None = None  # one node's RAM it is judged against (--host-memory or this machine's)
    # the DeepSpeed config file the accelerate config names, where the plan's buckets are not DeepSpeed's defaults
    deepspeed_config: dict[str, Any] | None = None
    deepspeed_config_file: str | None = None


@dataclass(kw_only=True)
class GpuCountReport:
    """`--num-gpus auto`: the count and strategy chosen, and every count and strategy judged on the way."""

    fits: bool  # whether any count up to a node's and strategy fits; the document shows the closest when none does
    num_gpus: int
    strategy: str  # single, ddp, zero2, zero3, fsdp (with the offloads beside it)
    # num_gpus, strategy, offload_optimizer, offload_param, peak_bytes, host_bytes (0 without offload), fits; in order
    tried: list[dict[str, Any]]


def distributed_report(train: Any, host_bytes: int = 0) -> DistributedReport | None:  # train: a TrainingConfig
    config, label, command = (launcher.accelerate_config(train), launcher.strategy_label(train),
                              launcher.launch_line(train))
    if config is None or label is None or command is None:
        return None
    deepspeed = launcher.deepspeed_config(train)
    return DistributedReport(num_gpus=train.num_gpus, strategy=launcher.strategy(train), label=label,
                             accelerate_config=config, accelerate_config_file=launcher.CONFIG_FILE,
                             launch_command=command, offload_optimizer=train.offload_optimizer,
                             offload_param=train.offload_param, host_bytes=host_bytes,
                             host_memory_bytes=offload.host_memory_bytes(train) if train.offloaded else None,
                             deepspeed_config=deepspeed,
                             deepspeed_config_file=None if deepspeed is None else launcher.DEEPSPEED_FILE)


def gpu_count_report(fewest: Any) -> GpuCountReport:  # fewest: vram_planner.model.fewest_gpus.Fewest
    shown = fewest.closest.train
    tried = [{"num_gpus": v.train.num_gpus, "strategy": v.train.distributed,
              "offload_optimizer": v.train.offload_optimizer, "offload_param": v.train.offload_param,
              "peak_bytes": round(v.estimate.peak_bytes), "host_bytes": v.estimate.host_bytes, "fits": v.fits}
             for v in fewest.tried]
    return GpuCountReport(fits=fewest.fits, num_gpus=shown.num_gpus, strategy=shown.distributed, tried=tried)


@dataclass(kw_only=True)
class ExactReport:
    """`--exact` and `trace`: the step traced and replayed through the caching allocator model."""

    need_bytes: int  # the least card the step runs on: CUDA context, NCCL buffers, cuBLAS workspaces included
    tensor_peak_bytes: int  # the step's tensors and cuBLAS workspaces at their peak, in 512-byte blocks
    # the most the allocator holds at once on this card (where the step runs out there: on a card with room), the
    # CUDA context and NCCL's buffers left out (nvidia-smi shows them together)
    reserved_peak_bytes: int
    seconds: float  # the trace, the replay on this card and the need's bisection


@dataclass(kw_only=True)
class CopyReport:
    """`check` near the boundary: the verdict from a kept copy of the exact engine (`check --exact --keep-copy`),
    replayed through the caching allocator model on the card."""

    runs: bool  # the step runs where cudaMalloc can hand out what the CUDA context leaves of the card
    made: str  # when the copy was made (ISO 8601, UTC)
    seconds: float  # making the step's stream from the copy and replaying it
    requests: int  # the allocations and frees replayed (two steps, and a batch of shorter prompts where traced)


@dataclass(kw_only=True)
class RungAboveReport:
    """`plan --exact`: the config ranked just above the analytic plan's choice, traced; it is the choice when it fits."""

    settings: dict[str, Any]  # its knobs that differ from the analytic choice's
    need_bytes: int | None  # null when it could not be traced
    fits: bool | None
    problem: str | None  # why it could not be traced, else null


__all__ = ["Document", "Report", "PhaseReport", "ChangeReport", "VllmReport", "DistributedReport", "ExactReport",
           "RungAboveReport", "FirstMicroBatchReport", "verdict_report", "plan_report", "exact_check_report",
           "exact_plan_report", "trace_report", "per_gpu"]


class Document:
    """A report: its fields are the JSON document (bytes as integers); `judged` keeps what it was built from."""

    # What the document describes, for the faces that render it (vram_planner.api.Judged: the context, the training
    # config shown and the engine's own answer); not part of the document.
    judged: ClassVar[Any] = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON document, as `vram-plan <command> --json` prints it."""
        from vram_planner.validation import to_jsonable

        return to_jsonable(self)

    def to_json(self, indent: int | None = 2) -> str:
        """The JSON document's text."""
        from vram_planner.validation import to_json

        return to_json(self, indent=indent)

    def summary(self) -> list[tuple[str, str]]:
        """The few facts a notebook shows: (what, value) pairs."""
        return [(f.name, str(getattr(self, f.name))) for f in fields(self)][:6]  # type: ignore[arg-type]

    def __repr__(self) -> str:
        rows = self.summary()
        width = max(len(name) for name, _ in rows)
        return "\n".join([f"<{type(self).__name__}>", *(f"  {name:<{width}}  {value}" for name, value in rows)])

    def _repr_html_(self) -> str:
        from html import escape

        rows = "".join(f"<tr><th style='text-align:left'>{escape(name)}</th><td style='text-align:left'>"
                       f"{escape(value)}</td></tr>" for name, value in self.summary())
        return f"<table><caption style='text-align:left'>{type(self).__name__}</caption>{rows}</table>"


@dataclass(kw_only=True, repr=False)
class Report(Document):
    """What `vram-plan check/plan/trace --json` prints."""

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
    cuda_context_source: str = ""  # where each phase's cuda_context figure comes from: the GPU catalog or a calibration
    trl_version: str
    notes: list[str]
    changes: list[ChangeReport] = field(default_factory=list)
    vllm: VllmReport | None = None  # null when no vLLM runs on a planned card
    distributed: DistributedReport | None = None  # null on one GPU without DeepSpeed or FSDP
    num_gpus_auto: GpuCountReport | None = None  # `--num-gpus auto` only
    requested_peak_bytes: int | None = None
    smallest_config_peak_bytes: int | None = None
    smallest_fitting_gpu: str | None = None
    # `plan --config recipe.yaml` only: the recipe's arguments to set for the plan's choice, in the recipe's own names
    # (vram_planner.recipe.recipe_edits; empty: the recipe is the choice)
    recipe_edits: dict[str, Any] | None = None
    # `trace` only. engine "trace": each phase's tensor_bytes were counted on fake tensors; its components add the
    # CUDA context and allocator reserve as check does (total_bytes, peak_bytes); fits comes from `exact`.
    engine: Literal["analytic", "trace"] = "analytic"
    seconds: float | None = None  # wall time of the trace, model building and the allocator replay included
    trace_counts: str | None = None  # what tensor_bytes include and what they do not, in words
    reserved_peak_bytes: int | None = None  # the most the allocator model reserves at any moment of the step
    allocator_conf: str | None = None  # the PYTORCH_CUDA_ALLOC_CONF it was configured by ("": torch's defaults)
    # `--exact` and `trace`: the traced step's need, which then decides `fits` (need_bytes <= capacity_bytes, no
    # safety margin); peak_bytes, spare_bytes and the phases stay the engine's own figures
    exact: ExactReport | None = None
    exact_rung_above: RungAboveReport | None = None  # `plan --exact` only
    # `check` near the boundary with a kept copy of the exact engine: its replay decided `fits`
    copy: CopyReport | None = None
    kept_copy: str | None = None  # `check --exact --keep-copy`: the copy kept for later checks (where, what for)
    # the step's need could lie on the other side of the card than the estimate's verdict, as far from the estimate
    # as needs have been measured (Verdict.near_boundary): `--exact` decides; false where the need decided
    near_boundary: bool = False
    # the most a step of this kind has been measured to need above its estimate (the band near_boundary reads), and
    # the steps it was measured on, in words
    need_above_estimate: float | None = None
    need_above_steps: str | None = None
    # generation in this process under expandable segments: a bound on what its growing keys and values keep mapped
    # beyond the estimate (bytes; a band of its own, on the generation phase)
    decoding_holes_bytes: int | None = None
    # the first micro-batch of the first step judged on its own: its phases run before any optimizer state exists
    first_micro_batch: FirstMicroBatchReport | None = None
    # Predicted seconds per optimizer step of the config shown, per GPU (vram_planner/cli/speed.py); null where
    # the card has no speed figures. `step_time` has each phase's seconds and what bounds it; `alternatives` (plan)
    # every config that fits, fastest first, with its peak, its step time and its changes from the requested one.
    step_seconds: float | None = None
    step_time: dict[str, Any] | None = None
    optimize: Literal["memory", "speed"] | None = None
    alternatives: list[dict[str, Any]] | None = None

    def summary(self) -> list[tuple[str, str]]:
        gib = lambda n_bytes: f"{n_bytes / GiB:.2f} GiB"  # noqa: E731
        rows = [("command", self.command), ("model", self.model), ("gpu", self.gpu + per_gpu(self)),
                ("fits", "yes" if self.fits else "no"), ("peak", f"{gib(self.peak_bytes)} in {self.peak_phase}"),
                ("capacity", gib(self.capacity_bytes)), ("spare", gib(self.spare_bytes))]
        rows += [(f"phase {p.name}", gib(p.total_bytes)) for p in self.phases]
        rows += [(f"change {c.knob}", f"{c.before} -> {c.after}") for c in self.changes]
        return rows


@dataclass(kw_only=True)
class FirstMicroBatchReport:
    """The phases of the first micro-batch of the run (no optimizer state, no accumulated gradient yet), judged
    against the same budget: where they do not fit, the run dies before its first optimizer step."""

    fits: bool
    peak_bytes: int
    peak_phase: str
    peak_moment: str
    phases: list[PhaseReport]


def per_gpu(report: Report) -> str:
    """', per GPU, 2 x ZeRO-3' after the card's name where the numbers are one GPU's of several; '' on one."""
    return "" if report.distributed is None else f", per GPU, {report.distributed.label}"


def first_micro_batch_report(verdict: Verdict) -> FirstMicroBatchReport:
    first = verdict.first_micro_batch
    return FirstMicroBatchReport(fits=verdict.first_micro_batch_fits, peak_bytes=round(first.peak_bytes),
                                 peak_phase=first.peak_phase.name, peak_moment=first.peak_phase.moment,
                                 phases=[_phase(p) for p in first.phases])


def _phase(p: Phase) -> PhaseReport:
    return PhaseReport(name=p.name, peak_moment=p.moment, total_bytes=round(p.total_bytes),
                       components={c: round(p.components.get(c, 0)) for c in COMPONENTS})


def verdict_report(verdict: Verdict, command: str = "check") -> Report:
    ctx, train, est = verdict.context, verdict.train, verdict.estimate
    kwargs = grpo_config_kwargs(train)
    problems = grpo_config_problems(kwargs, num_processes=train.num_gpus, release=train.release)
    cal = ctx.calibration
    above, above_steps = need_above_band(train)
    return Report(
        command=command, fits=verdict.fits, model=ctx.model_id or ctx.arch.name, gpu=ctx.gpu.name,
        capacity_bytes=ctx.capacity_bytes, safety_margin_bytes=round(ctx.margin_bytes),
        peak_bytes=round(est.peak_bytes), peak_phase=est.peak_phase.name, spare_bytes=round(verdict.spare_bytes),
        params=est.params, trainable_params=est.trainable_params, phases=[_phase(p) for p in est.phases],
        config=kwargs, peft_config=lora_config_kwargs(train), quantization_config=quantization_config_kwargs(train),
        grpo_config_valid=not problems, grpo_config_problems=problems,
        assumptions={"max_prompt_length": train.max_prompt_length,
                     "prompts_truncated": train.release.truncates_prompts, "num_gpus": train.num_gpus,
                     "distributed": train.distributed, "generation_batch_size": train.generation_batch_size,
                     "attn_implementation": train.attn_implementation,
                     "transformers_version": train.transformers.version,
                     "nccl_buffers": ctx.nccl(train).source,
                     "vllm_communicators": ctx.vllm_comm(train).source or None},
        calibration=cal.name if cal.gpu is None else f"{cal.name} ({cal.gpu})",
        cuda_context_source=ctx.cuda_context.source, trl_version=ctx.release.version,
        notes=list(est.notes) + copy_notes(verdict),
        vllm=vllm_report(est.vllm), distributed=distributed_report(train, est.host_bytes),
        near_boundary=verdict.near_boundary, need_above_estimate=above, need_above_steps=above_steps,
        decoding_holes_bytes=round(verdict.decoding_holes_bytes) or None,
        first_micro_batch=first_micro_batch_report(verdict), copy=copy_report(verdict),
    )


def copy_notes(verdict: Verdict, subject: str = "this step") -> list[str]:
    replayed = verdict.replayed
    if replayed is None:
        return []
    return [f"near the boundary, decided by the exact engine's copy of {subject} (kept {replayed.made} by `check "
            f"--exact --keep-copy`): replayed through the caching allocator model, it "
            f"{'runs' if replayed.runs else 'runs out'} on this card ({replayed.seconds:.2f} s); `--exact` traces it "
            "for its need"]


def copy_report(verdict: Verdict) -> CopyReport | None:
    replayed = verdict.replayed
    if replayed is None:
        return None
    return CopyReport(runs=replayed.runs, made=replayed.made, seconds=round(replayed.seconds, 2),
                      requests=replayed.requests)


def plan_report(plan: Plan) -> Report:
    shown = plan.chosen or plan.smallest
    report = verdict_report(shown, command="plan")
    report.fits = plan.fits
    report.changes = [ChangeReport(knob=c.knob, before=c.before, after=c.after, saved_bytes=round(c.saved_bytes),
                                   cost_bytes=round(c.cost_bytes), reason=c.reason,
                                   settings={name: plain_value(value) for name, value in c.settings.items()})
                      for c in plan.changes]
    report.requested_peak_bytes = round(plan.requested.estimate.peak_bytes)
    if plan.requested is not shown:  # why the plan moved off a config the estimate alone would keep, or onto it
        report.notes += copy_notes(plan.requested, "your config as given")
    if not plan.fits:
        report.smallest_config_peak_bytes = round(plan.smallest.estimate.peak_bytes)
        gpu = smallest_fitting_gpu(plan.requested.context, plan.requested.train)
        report.smallest_fitting_gpu = gpu.name if gpu else None
        if (offer := vllm_fallback_note(plan)) is not None:  # vLLM's share is what the card lacks
            report.notes.append(offer)
        if (left_out := qlora_left_out_note(plan.requested.train)) is not None:
            report.notes.append(left_out)
    return report


def smallest_fitting_gpu(context: Context, user_train: Any) -> GpuProfile | None:
    """The smallest larger catalog card on which the bottom rung of the ladder (micro-batch 1) fits, each judged with
    the calibration plan picks for it (a probe's measures one card), unless one was passed for all (as `gpus`)."""
    picked = context.calibration == calibration_for(context.gpu.name)
    for gpu in gpus():
        if gpu.capacity_bytes <= context.capacity_bytes:
            continue
        other = replace(context, gpu=gpu, calibration=calibration_for(gpu.name) if picked else context.calibration)
        if judge(other, vllm_tuned(other, smallest_config(user_train, gpu.bf16, other.arch))).fits:
            return gpu
    return None


TRACE_COUNTS = ("tensor_bytes are the live tensor bytes of the traced step, as torch.cuda.memory_allocated counts "
                "them (512-byte blocks); they do not include the CUDA context or the caching allocator's reserve. "
                "reserved_bytes are what a model of PyTorch's caching allocator (configured by allocator_conf) "
                "reserves for the step's allocations and frees: the most during the phase at steady state, as "
                "torch.cuda.max_memory_reserved reports it after reset_peak_memory_stats at the phase's start. "
                "Component allocator_overhead is reserved_bytes - tensor_bytes, cuda_context comes from the "
                "calibration or the GPU catalog (see cuda_context_source), nccl_buffers from NCCL's defaults (see "
                "assumptions.nccl_buffers); total_bytes and peak_bytes add them. fits "
                "is exact.need_bytes <= capacity_bytes: the least card on which the allocator model replays the step "
                "without running out, found by bisection")


def exact_report(outcome: Any) -> ExactReport:  # outcome: vram_planner.engine.TraceOutcome
    return ExactReport(need_bytes=outcome.need_bytes, tensor_peak_bytes=outcome.need.tensor_peak_bytes,
                       reserved_peak_bytes=outcome.need.held_bytes, seconds=round(outcome.seconds, 2))


def _judged_exactly(report: Report, outcome: Any) -> None:
    """The traced step's need decides the report's verdict, so no boundary is left for the estimate's error; the
    trace's notes join the estimate's."""
    report.exact, report.near_boundary = exact_report(outcome), False
    report.notes += [note for note in outcome.traced.estimate.notes if note not in report.notes]


def exact_check_report(outcome: Any) -> Report:  # outcome: vram_planner.engine.TraceOutcome
    """`check --exact`: check's document, judged by the traced step's need."""
    report = verdict_report(outcome.analytic)
    report.fits = outcome.fits
    _judged_exactly(report, outcome)
    report.kept_copy = outcome.kept_copy
    return report


def exact_plan_report(exact: Any) -> Report:  # exact: vram_planner.engine.ExactPlan
    """`plan --exact`: plan's document for the config the traced needs chose, with the need that decided it."""
    from vram_planner.model.spec import as_settings

    report = plan_report(exact.plan)
    report.fits = exact.fits
    if exact.outcome is None:  # the estimate's verdict stands, and says so
        report.notes.append(f"{exact.problem}; the verdict is the estimate's")
    else:
        _judged_exactly(report, exact.outcome)
    if exact.above_config is not None:
        below = as_settings(exact.analytic.chosen.train)
        settings = {k: v for k, v in as_settings(exact.above_config).items() if v != below[k]}
        above = exact.above
        report.exact_rung_above = RungAboveReport(settings=settings,
                                                  need_bytes=None if above is None else above.need_bytes,
                                                  fits=None if above is None else above.fits,
                                                  problem=exact.above_problem)
    return report


def trace_report(outcome: Any) -> Report:  # outcome: vram_planner.engine.TraceOutcome
    """`vram-plan trace --json`: the traced verdict in check's shape, with the analytic tensor bytes beside it, judged
    by the step's need."""
    report = verdict_report(outcome.traced, command="trace")
    report.fits = outcome.fits
    _judged_exactly(report, outcome)
    report.engine, report.seconds, report.trace_counts = "trace", round(outcome.seconds, 2), TRACE_COUNTS
    report.reserved_peak_bytes = outcome.reserved.peak_bytes
    report.allocator_conf = outcome.reserved.allocator_conf
    comparisons = {row.name: row for row in outcome.comparison()}
    for phase, traced in zip(report.phases, outcome.result.phases, strict=True):
        phase.tensor_bytes = traced.peak_bytes
        phase.reserved_bytes = outcome.reserved.by_phase.get(phase.name, traced.peak_bytes)
        row = comparisons.get(phase.name)
        if row is not None:
            phase.analytic_tensor_bytes = round(row.analytic_bytes)
            phase.analytic_relative_error = row.relative_error
    return report
