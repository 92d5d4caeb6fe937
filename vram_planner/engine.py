"""The engine under the API: names resolved into a context, knobs into a training config, and the memory model's
own answers (Verdict, Plan, Maximized, TraceOutcome, CardFit). vram_planner.api turns them into reports.

    >>> from vram_planner import engine
    >>> result = engine.plan("Llama-3.2-1B", "rtx3080-mobile")
    >>> result.fits, result.chosen.train.per_device_train_batch_size
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from vram_planner.errors import ConfigError, VramPlanError, field_name, flag, short_repr
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.calibration import Calibration, calibration_for
from vram_planner.model.resolve import resolve_model
from vram_planner.model.search import Plan, best_plan
from vram_planner.model.spec import TrainingConfig, as_settings, knob_names, release_config, training_config
from vram_planner.model.trl_semantics import release_defaults
from vram_planner.model.trl_releases import trl_release
from vram_planner.model.verdict import (DEFAULT_SAFETY_MARGIN, Context, Verdict, adapt_to_gpu, adapt_to_model,
                                        check_safety_margin, check_training, judge)
from vram_planner.profiles import GpuProfile, gpus, model_config
from vram_planner.units import format_gib

if TYPE_CHECKING:  # `plan` and `check` do not search for a largest value: the module loads when one is asked for
    from vram_planner.model.maximize import Maximized


def make_context(model: str | dict[str, Any], gpu: str | GpuProfile, *, trl_version: str | None = None,
                 calibration: Calibration | Path | None = None,
                 safety_margin: float = DEFAULT_SAFETY_MARGIN) -> Context:
    """Resolve the model (a name, or a config.json's dict), the GPU, the TRL release and the calibration to judge
    configs against."""
    check_safety_margin(safety_margin)  # before a hub id is fetched for nothing
    if trl_version is not None and not isinstance(trl_version, str):
        raise ConfigError([f"{field_name('trl_version')} should be a version like 1.16.0, as a string (got "
                           f"{trl_version!r:.60})"])
    gpu_profile = gpu if isinstance(gpu, GpuProfile) else GpuProfile.from_name(gpu)
    if not isinstance(calibration, Calibration):
        calibration = calibration_for(gpu_profile.name, calibration)
    arch = resolve_model(model) if not isinstance(model, dict) else given_architecture(model)
    return Context(arch=arch, gpu=gpu_profile, release=trl_release(trl_version), calibration=calibration,
                   safety_margin=safety_margin, model_id=model if isinstance(model, str) else arch.name)


# each face spells the two fields its own way (--keep-copy, keep_copy)
KEEP_COPY_WITHOUT_EXACT = f"{field_name('keep_copy')} keeps the copy that {field_name('exact')} makes: pass both"
GIVEN_CONFIG = "the given config.json"  # what a config passed as a dict is called where it names no hub id


def given_architecture(config: dict[str, Any]) -> ModelArchitecture:
    """A config.json's dict as a model, named by its `_name_or_path` where it has one."""
    name = config.get("_name_or_path")
    name = name.strip() if isinstance(name, str) and name.strip() else None
    return ModelArchitecture.from_config(config, name=name or GIVEN_CONFIG, hub_id=name)


def make_training(context: Context, settings: dict[str, Any] | TrainingConfig | None = None) -> TrainingConfig:
    """Validate the knobs, fill the TRL release's defaults and adapt unset defaults to the GPU."""
    if isinstance(settings, TrainingConfig):
        # a config object is the user's too: validated whole; its knobs at their defaults count as unset
        unset = as_settings(TrainingConfig())
        explicit = {name for name, value in as_settings(settings).items() if value != unset[name]}
        train = training_config({**as_settings(settings), "trl_version": context.release.version})
    elif settings is not None and not isinstance(settings, dict):
        raise ConfigError([f"settings should be a mapping of GRPOConfig-style knobs to values (got {settings!r:.60})"])
    elif _auto_gpus(settings):
        raise ConfigError(["--num-gpus auto is answered by plan, check (without --exact) and gpus --model; give a "
                           "count here"])
    else:
        # None means "not given" for a knob; an unknown name is reported whatever its value (a typo'd YAML key
        # left empty must not vanish silently)
        values = {k: v for k, v in (settings or {}).items() if v is not None or k not in knob_names()}
        explicit = set(values)
        given = values.get("trl_version")
        if given is not None and given != context.release.version:
            raise ConfigError([f"trl_version {short_repr(given)} in the settings differs from the context's TRL "
                               f"{context.release.version}; give the release once ({field_name('trl_version')}, or "
                               "trl_version "
                               "in a --config file)"])
        values["trl_version"] = context.release.version
        if values.get("allocator_conf") is None:  # as torch does: the environment's, unless the run says otherwise
            values["allocator_conf"] = _environment_allocator_conf()
        defaults = release_defaults(context.release, use_vllm=values.get("use_vllm") is True)
        if explicit - {"trl_version"}:  # the user's knobs: validated at the edge
            train = training_config({**defaults, **values})
        else:
            train = release_config({**defaults, **values})
    train = adapt_to_model(adapt_to_gpu(train, context.gpu, explicit), context.arch, explicit)
    check_training(train, context)
    return train


def _auto_gpus(settings: Any) -> bool:
    value = settings.get("num_gpus") if isinstance(settings, dict) else None
    return isinstance(value, str) and value.strip().lower() == "auto"


def make_training_auto(context: Context, settings: dict[str, Any] | None = None) -> tuple[TrainingConfig, Any]:
    """As `make_training`, where num_gpus may be "auto": then the fewest GPUs of the card and the strategy on which
    the config fits (or, where none does, the closest try on a whole node), and the search (model/fewest_gpus.py)."""
    if not _auto_gpus(settings):
        return make_training(context, settings), None
    from vram_planner.model.fewest_gpus import fewest_gpus, strategies_named

    given = {k: v for k, v in settings.items() if k != "num_gpus"}
    strategies = strategies_named(given)
    found = fewest_gpus(context, _search_base(context, given, strategies), strategies=strategies)
    return found.closest.train, found


def _search_base(context: Context, settings: dict[str, Any], strategies: list[dict[str, Any]]) -> TrainingConfig:
    """The user's knobs as a valid config for the search to change: as given, else under the first strategy that
    takes them (an offload, or DeepSpeed's buckets, need a ZeRO stage); the knobs' own error where none does."""
    try:
        return make_training(context, settings)
    except ConfigError as refused:
        for knobs in strategies:
            try:
                return make_training(context, {**settings, **knobs})
            except ConfigError:
                continue
        raise refused


@overload
def check(model: str, gpu: str | GpuProfile, settings: dict[str, Any] | TrainingConfig | None = None, *,
          exact: Literal[False] = False, progress: Callable[[str], None] | None = None,
          **context_options: Any) -> Verdict: ...
@overload
def check(model: str, gpu: str | GpuProfile, settings: dict[str, Any] | TrainingConfig | None = None, *,
          exact: Literal[True], progress: Callable[[str], None] | None = None, keep_copy: bool = False,
          **context_options: Any) -> TraceOutcome: ...
def check(model: str, gpu: str | GpuProfile, settings: dict[str, Any] | TrainingConfig | None = None, *,
          exact: bool = False, progress: Callable[[str], None] | None = None, keep_copy: bool = False,
          **context_options: Any) -> Verdict | TraceOutcome:
    """The verdict for exactly this configuration: the estimate's, or near the boundary a kept copy of the exact
    engine's (`judged`). With `exact`, the step traced and judged by its need (`trace`'s outcome: `.fits` is
    `need_bytes <= capacity`, `.analytic` the verdict without `exact`); needs the train extra, and `progress` is
    called with what it is doing; with `keep_copy` too, the step's copy made and kept for later checks
    (`keep_step_copy`)."""
    if keep_copy and not exact:
        raise ConfigError([KEEP_COPY_WITHOUT_EXACT])
    if exact:
        _require_tracing("an exact verdict (--exact)")
    context = make_context(model, gpu, **context_options)
    train = make_training(context, settings)
    if not exact:
        return judged(context, train)
    outcome = _traced(model, context, train, progress)
    return replace(outcome, kept_copy=keep_step_copy(model, context, train, progress)) if keep_copy else outcome


def judged(context: Context, train: TrainingConfig) -> Verdict:
    """The estimate's verdict; near the boundary, where a copy of the exact engine is kept for this model and these
    knobs (`keep_step_copy`), the copy's, replayed on the card at the config's lengths (and at a batch of shorter
    prompts where the estimate says they may need more, as `check --exact` traces them) without torch."""
    verdict = judge(context, train)
    if not verdict.near_boundary:
        return verdict
    from vram_planner.step_copy.judge import replayed

    shorter = heavier_prompt_length(context, train)
    return replayed(verdict, [train.max_prompt_length] + ([shorter] if shorter is not None else []))


def keep_step_copy(model: str | dict[str, Any], context: Context, train: TrainingConfig,
                   progress: Callable[[str], None] | None = None) -> str:
    """Make the copy of the step (vram_planner.step_copy.make: seven traces of a shallow copy of the model) and keep
    it in the user's cache, where `judged` finds it for this model and these knobs at other lengths; what was done,
    in words (why not, where the step cannot be copied)."""
    import time

    from vram_planner.step_copy.make import make_copy
    from vram_planner.step_copy.store import copy_key, keep

    start = time.perf_counter()
    try:
        key = copy_key(context.arch, train, context.release)
        config = model if isinstance(model, dict) else model_config(model)[0]
        copy = make_copy(config, train, context.release, progress)
    except ValueError as error:
        return f"no copy of the step kept: {error}"
    path = keep(copy, key)
    answers = ("any completion length" if copy.completion_range is None else
               f"completions of {copy.completion_range[0]} to {copy.completion_range[1]} tokens")
    windows = sorted({w for w in copy.windows if w})
    if windows:
        answers += f" that fill the {windows[0]}-token sliding window as these do"
    return (f"kept the exact engine's copy of this step in {path} ({len(copy.lattice) + 1} traces of "
            f"{copy.layers} layers, {time.perf_counter() - start:.0f} s): `check` of this model and these knobs at "
            f"other prompt lengths and {answers} replays it where the estimate lies near the boundary")


@overload
def plan(model: str, gpu: str | GpuProfile, settings: dict[str, Any] | TrainingConfig | None = None, *,
         exact: Literal[False] = False, progress: Callable[[str], None] | None = None,
         **context_options: Any) -> Plan: ...
@overload
def plan(model: str, gpu: str | GpuProfile, settings: dict[str, Any] | TrainingConfig | None = None, *,
         exact: Literal[True], progress: Callable[[str], None] | None = None,
         **context_options: Any) -> ExactPlan: ...
def plan(model: str, gpu: str | GpuProfile, settings: dict[str, Any] | TrainingConfig | None = None, *,
         exact: bool = False, progress: Callable[[str], None] | None = None,
         **context_options: Any) -> Plan | ExactPlan:
    """The best configuration that fits, starting from these settings. With `exact`, the plan's choice and the
    config ranked just above it traced and judged by their needs (`ExactPlan`)."""
    if exact:
        _require_tracing("an exact plan (--exact)")
    context = make_context(model, gpu, **context_options)
    user = make_training(context, settings)
    return _exact_plan(model, context, user, progress) if exact else planned(context, user)


def planned(context: Context, user: TrainingConfig) -> Plan:
    """best_plan, with the config as given judged as `check` judges it (`judged`): where a kept copy of the exact
    engine decides it near the boundary, the plan follows the copy: the config as given where the copy runs it, else
    the first config down the plan's ladder (a smaller micro-batch first) that fits as `check` judges it."""
    from vram_planner.model.rung_above import ladder, plan_choosing
    from vram_planner.model.search import micro_batch_sizes, with_micro_batch

    plan = best_plan(context, user)
    own = judged(context, user)
    if own.replayed is None or own.fits == plan.requested.fits:
        return replace(plan, requested=own, chosen=own if plan.chosen is plan.requested else plan.chosen)
    rungs = ladder(context, user)
    if own.fits:
        return replace(plan_choosing(context, user, plan, rungs[0], 0, user), requested=own, chosen=own)
    if plan.rank is not None and plan.rank[0] > 0:  # the estimate's choice is already below the config as given
        return replace(plan, requested=own)
    for index, rung in enumerate(rungs):
        for size in micro_batch_sizes(rung)[1 if index == 0 else 0:]:
            verdict = judged(context, with_micro_batch(rung, size))
            if verdict.fits:
                return replace(plan_choosing(context, user, plan, rung, index, verdict.train), requested=own,
                               chosen=verdict)
    return Plan(own, None, (), plan.smallest, None)


# Without --gpu a trace judges against the local card, and on a machine without one (where traces usually run)
# against the card of the command-line contract's first example: the tensors it counts do not depend on the card.
FALLBACK_TRACE_GPU = "rtx3080-mobile"


@dataclass(frozen=True)
class TraceOutcome:
    """A traced step, the analytic verdict for the same config, and the verdict by the step's need: the least card
    on which the caching allocator model replays the traced events without running out. `traced` is judged like
    `check`, on what the allocator model holds on this card (plus the CUDA context, which the trace cannot see)."""

    traced: Verdict
    analytic: Verdict
    result: Any  # vram_planner.tracing.step.TraceResult: tensor bytes only, per phase and component
    reserved: Any = None  # vram_planner.tracing.reserve.ReservedMemory: the allocator model's reserved bytes
    need: Any = None  # vram_planner.allocator.need.Need: the least capacity the step runs in, bisected
    elapsed_seconds: float | None = None  # the answer's wall time, every step traced for it included
    kept_copy: str | None = None  # with keep_copy: the copy kept for later checks (or why none), in words

    @property
    def fits(self) -> bool:
        """Whether the step runs on the card: its need within the capacity, without a safety margin (the margin is
        for the analytic answer's error; here the allocator model replays the step itself)."""
        return self.traced.fits if self.need is None else self.need_bytes <= self.traced.context.capacity_bytes

    @property
    def need_bytes(self) -> int:
        """The least card on which the step runs: the CUDA context, and what cudaMalloc must be able to hand out
        for the traced tensors, the cuBLAS workspaces and the allocator's rounding and fragmentation."""
        return self.need.capacity_bytes + self._outside_allocator_bytes

    @property
    def held_bytes(self) -> int:
        """The most the allocator reserves at once on this card (or, where the step runs out there, on a card with
        room), with the CUDA context: what nvidia-smi shows."""
        return self.need.held_bytes + self._outside_allocator_bytes

    @property
    def _outside_allocator_bytes(self) -> int:
        """The CUDA context and NCCL's buffers (multi-GPU): device memory cudaMalloc cannot hand out."""
        context = self.traced.context
        return round(context.cuda_context.bytes) + context.nccl(self.traced.train).bytes

    @property
    def seconds(self) -> float:
        """The trace's wall time, the allocator replay's and the need's bisection's (of every step traced for
        the answer, where a batch of shorter prompts was traced too)."""
        if self.elapsed_seconds is not None:
            return self.elapsed_seconds
        return self.result.seconds + sum(part.seconds for part in (self.reserved, self.need) if part is not None)

    def comparison(self) -> list[Any]:
        """Per phase: traced against analytic tensor bytes (vram_planner.tracing.step.PhaseComparison), both of the
        traced rank under ZeRO where the planner counts another in a phase and knows the difference."""
        from vram_planner.model.components import zero_rank_excess_bytes
        from vram_planner.tracing.step import compare_with_estimate

        context, train = self.analytic.context, self.analytic.train
        excess = {p.name: zero_rank_excess_bytes(context.arch, train, p.name, self.result.zero_rank)
                  for p in self.result.phases}
        return compare_with_estimate(self.result, self.analytic.estimate, excess)


def default_trace_gpu() -> tuple[GpuProfile, str | None]:
    """The local card, else the fallback card with a note saying so."""
    try:
        return GpuProfile.from_name("auto"), None
    except VramPlanError:
        gpu = GpuProfile.from_name(FALLBACK_TRACE_GPU)
        return gpu, f"no --gpu given and no local NVIDIA card: judged against the {gpu.label} (pass --gpu)"


def trace(model: str, gpu: str | GpuProfile | None = None, settings: dict[str, Any] | TrainingConfig | None = None,
          progress: Callable[[str], None] | None = None, **context_options: Any) -> TraceOutcome:
    """Trace one GRPO step of this config on fake tensors (needs torch, transformers, TRL and PEFT: the `train`
    extras), next to the analytic verdict. `progress` is called with what the trace is doing. Each phase's reserved
    bytes come from the caching allocator model, configured by the settings' `allocator_conf` (a
    PYTORCH_CUDA_ALLOC_CONF text; when not given, that environment variable, as torch reads it), and the verdict
    from the step's need, bisected with the same model."""
    notes: tuple[str, ...] = ()
    if gpu is None:
        gpu, note = default_trace_gpu()
        notes += (note,) if note else ()
    context = make_context(model, gpu, **context_options)
    return _traced(model, context, make_training(context, settings), progress, notes)


def heavier_prompt_length(context: Context, train: TrainingConfig) -> int | None:
    """A prompt length shorter than max_prompt_length at which the analytic model says the step may need more (a
    run's batches are as long as their longest prompt, so it meets it): where the prefill's segments strand more
    there (vram_planner.model.generation_patterns.cache_in_prefill_segment_bytes) and the decoding decides the
    estimate. None where the longest prompt needs the most."""
    from vram_planner.model.generation_patterns import cache_in_prefill_segment_bytes, heaviest_prompt_length
    from vram_planner.model.phases import PREFILL_MOMENTS

    arch = context.arch
    if train.expandable_segments:  # pages mapped to fit each request: no segment strands a rest
        return None
    counted = cache_in_prefill_segment_bytes(arch, train)
    if counted <= cache_in_prefill_segment_bytes(arch, train, shorter_prompts=False):
        return None
    peak = judge(context, train).estimate.peak_phase
    if peak.name != "generation" or peak.moment in PREFILL_MOMENTS:  # the decoding's moments weigh the pattern
        return None
    length = heaviest_prompt_length(arch, train)
    return length if length < train.max_prompt_length else None


def _traced(model: str, context: Context, train: TrainingConfig, progress: Callable[[str], None] | None,
            notes: tuple[str, ...] = ()) -> TraceOutcome:
    """The step traced, replayed through the allocator model on this card, and its need bisected; where a batch of
    shorter prompts may need more (heavier_prompt_length), that step too, alongside where a second core allows, and
    the run's need is the larger."""
    import time

    from vram_planner.allocator import parse_allocator_conf
    from vram_planner.tracing.step import check_traceable
    from vram_planner.tracing.step_need import step_needs

    start = time.perf_counter()
    say = progress or (lambda what: None)
    parse_allocator_conf(train.allocator_conf, "--allocator-conf")  # a bad one is one line before anything is traced
    check_traceable(train, context.release)  # before model_config: a hub id is not fetched twice for nothing
    shorter = heavier_prompt_length(context, train)
    trains = [train] if shorter is None else [train, replace(train, max_prompt_length=shorter)]
    if shorter is not None:
        say(f"tracing a batch of {shorter}-token prompts too, which may need more")
    needs = step_needs(steps_to_trace(model, context, trains), progress)
    outcomes = [_outcome(context, each, step, notes) for each, step in zip(trains, needs)]
    outcome, heavier = outcomes[0], outcomes[-1]  # the same outcome where no shorter prompt was traced
    elapsed = time.perf_counter() - start
    if heavier.need_bytes <= outcome.need_bytes:
        return replace(outcome, elapsed_seconds=elapsed)
    # the step that needs more is the one the run must survive: its figures, with the config as given
    said = (f"a batch whose longest prompt is {shorter} tokens needs {format_gib(heavier.need_bytes)}, more than "
            f"{format_gib(outcome.need_bytes)} with {train.max_prompt_length} (the prefill's segments strand more "
            f"there), and a run meets such batches: the traced figures are that step's",)
    estimate = replace(heavier.traced.estimate, notes=heavier.traced.estimate.notes + said)
    return replace(heavier, traced=Verdict(context, train, estimate), analytic=outcome.analytic,
                   elapsed_seconds=elapsed)


def steps_to_trace(model: str | dict[str, Any], context: Context, trains: list[TrainingConfig]) -> list[Any]:
    """The steps `check --exact` traces on this card (vram_planner.tracing.step_need.StepToTrace), one per config, all
    of the model's config.json read once; under ZeRO, each on the rank the planner counts in the phase its estimate
    peaks in (ZeRO-1/2's partitions differ from rank to rank)."""
    from vram_planner.model.cublas import workspace_bytes
    from vram_planner.tracing.step_need import StepToTrace

    config = model if isinstance(model, dict) else model_config(model)[0]
    workspace = workspace_bytes(context.gpu.compute_capability)
    return [StepToTrace(config, train, context.release, context.allocatable_bytes(train), workspace,
                        _zero_rank(context, train))
            for train in trains]


def _zero_rank(context: Context, train: TrainingConfig) -> int:
    """Under ZeRO on several GPUs, the rank the planner counts in the phase its estimate peaks in; 0 otherwise."""
    from vram_planner.model.components import zero_heaviest_rank, zero_on_several_ranks

    if not zero_on_several_ranks(train):  # no estimate made for nothing
        return 0
    return zero_heaviest_rank(context.arch, train, judge(context, train).estimate.peak_phase.name)


def _outcome(context: Context, train: TrainingConfig, step: Any, notes: tuple[str, ...]) -> TraceOutcome:
    """A traced step (vram_planner.tracing.step_need.StepNeed) judged, beside the analytic verdict."""
    from vram_planner.model.phases import Estimate

    result, reserved = step.result, step.reserved
    phases = tuple(_traced_phase(p, reserved.by_phase, context, train) for p in result.phases)
    traced = Estimate(phases=phases, params=result.params, trainable_params=result.trainable_params,
                      notes=tuple(result.notes) + notes + reserved.notes)
    return TraceOutcome(traced=Verdict(context, train, traced), analytic=judge(context, train), result=result,
                        reserved=reserved, need=step.need)


@dataclass(frozen=True)
class ExactPlan:
    """`plan(exact=True)`: the analytic plan, its choice moved one rank up where the config there runs by its
    traced need, and the traced outcomes that decided it. The trace cannot run every config the ladder offers (vLLM's
    generation, a paged optimizer): where it cannot trace the shown one, `outcome` is None, `problem` says why, and
    the verdict is the estimate's."""

    plan: Plan  # what is shown: the analytic plan, or the same with the config ranked above it as its choice
    analytic: Plan  # best_plan's answer
    outcome: TraceOutcome | None  # the shown config traced: the choice, or the smallest config when none was chosen
    problem: str | None = None  # why the shown config could not be traced
    above_config: TrainingConfig | None = None  # the config ranked just above the analytic choice; None: none
    above: TraceOutcome | None = None  # that config traced
    above_problem: str | None = None  # why it could not be traced

    @property
    def fits(self) -> bool:
        return self.plan.fits if self.outcome is None else self.outcome.fits


def _exact_plan(model: str, context: Context, user: TrainingConfig,
                progress: Callable[[str], None] | None) -> ExactPlan:
    """Trace the config above the analytic choice first: where it runs, it is the answer and the choice below it
    need not be traced."""
    from vram_planner.model.rung_above import config_above, ladder, plan_choosing

    analytic = best_plan(context, user)
    rungs = ladder(context, user)

    def traced(train: TrainingConfig, which: str) -> tuple[TraceOutcome | None, str | None]:
        say = (lambda what: progress(f"{which}: {what}")) if progress is not None else None
        try:
            return _traced(model, context, train, say), None
        except VramPlanError as error:  # what the CPU cannot run, said in the plan's words
            return None, f"{which} could not be traced: {error.worded(flag)}"  # a note: the document's words

    if analytic.chosen is None:  # nothing fits by the estimate; by its need the smallest config may
        outcome, problem = traced(analytic.smallest.train, "the smallest config")
        shown = analytic
        if outcome is not None and outcome.fits:
            shown = plan_choosing(context, user, analytic, rungs[-1], len(rungs) - 1, analytic.smallest.train)
        return ExactPlan(shown, analytic, outcome, problem)
    neighbour = config_above(rungs, analytic.rank)
    above = above_problem = above_config = None
    if neighbour is not None:
        index, above_config = neighbour
        above, above_problem = traced(above_config, "the config ranked above the choice")
        if above is not None and above.fits:
            shown = plan_choosing(context, user, analytic, rungs[index], index, above_config)
            return ExactPlan(shown, analytic, above, None, above_config, above)
    outcome, problem = traced(analytic.chosen.train, "the choice")
    return ExactPlan(analytic, analytic, outcome, problem, above_config, above, above_problem)


def _require_tracing(what: str) -> None:
    """The train extra is installed, or one line says how to install it, before a hub id is fetched for nothing."""
    from vram_planner.extras import require_train_extra

    require_train_extra(what)


def _environment_allocator_conf() -> str:
    """The allocator conf as torch would read it at the run's first CUDA allocation ("" when unset)."""
    from vram_planner.allocator.conf import environment_conf, parse_allocator_conf

    text, name = environment_conf()
    if text.strip():
        parse_allocator_conf(text, name)  # refused here in the variable's name, not the knob's
    return text.strip()


def _traced_phase(traced: Any, reserved_by_phase: dict[str, int], context: Context, train: TrainingConfig) -> Any:
    """A traced phase as the verdict judges it: its tensors, the CUDA context, the cuBLAS workspaces, and as the
    allocator's overhead what the allocator model reserves beyond them (`check` takes a share of the tensors
    instead)."""
    from vram_planner.model.cublas import cublas_workspace_bytes
    from vram_planner.model.phases import Phase, with_overheads

    workspaces = cublas_workspace_bytes(context.gpu.compute_capability)
    phase = with_overheads(Phase(traced.name, dict(traced.components), traced.moment), context.calibration, 0.0,
                           train, context.cuda_context.bytes, workspaces, nccl_bytes=context.nccl(train).bytes)
    reserve = reserved_by_phase.get(traced.name, traced.peak_bytes) - traced.peak_bytes - workspaces
    return Phase(phase.name, {**phase.components, "allocator_overhead": float(max(reserve, 0))}, phase.moment)


def maximize(model: str, gpu: str | GpuProfile, field: str, settings: dict[str, Any] | TrainingConfig | None = None,
             allow_savers: bool = False, **context_options: Any) -> Maximized:
    """The largest value of `field` (max_completion_length, max_prompt_length, num_generations,
    per_device_train_batch_size or lora_r) that fits this card with every other knob as given, or as the plan's
    savers make it with `allow_savers`; `.value` is None when even the smallest valid value does not fit."""
    from vram_planner.model.maximize import maximizable_field
    from vram_planner.model.maximize import maximize as maximize_field

    field = maximizable_field(field)  # before a hub id is fetched for nothing
    context = make_context(model, gpu, **context_options)
    return maximize_field(context, make_training(context, settings), field, allow_savers)


@dataclass(frozen=True)
class CardFit:
    """One catalog card judged for one config (or its largest value of a knob); `problem` when the card cannot run
    the config at all (no bf16, no FlashAttention-2), and then no verdict."""

    gpu: GpuProfile
    verdict: Verdict | None
    maximized: Maximized | None = None
    problem: str | None = None
    fewest: Any = None  # `--num-gpus auto`: the search (model/fewest_gpus.py) whose choice `verdict` is

    @property
    def name(self) -> str:
        return self.gpu.name

    @property
    def capacity_bytes(self) -> int:
        return self.gpu.capacity_bytes

    @property
    def fits(self) -> bool:
        if self.maximized is not None:
            return self.maximized.fits
        return self.verdict is not None and self.verdict.fits

    @property
    def peak_bytes(self) -> float | None:
        if self.maximized is not None:
            return self.maximized.peak_bytes if self.maximized.fits else self.maximized.next_peak_bytes
        return None if self.verdict is None else self.verdict.estimate.peak_bytes

    @property
    def spare_bytes(self) -> float | None:
        """Capacity left at the peak (negative: missing), before the safety margin."""
        return None if self.peak_bytes is None else self.capacity_bytes - self.peak_bytes


def fitting_gpus(model: str, settings: dict[str, Any] | None = None, maximize: str | None = None,
                 allow_savers: bool = False, *, trl_version: str | None = None,
                 calibration: Calibration | Path | None = None,
                 safety_margin: float = DEFAULT_SAFETY_MARGIN) -> list[CardFit]:
    """Every catalog card judged for this config (with `maximize`: the largest value of that knob each card fits),
    the smallest fitting card first, then the cards it does not fit, the closest first, then those that cannot run
    it. The model, the release and the calibration file are read once for all the cards; a card's maximized plan
    leaves out its changes (`maximize` on that card gives them)."""
    from vram_planner.model.maximize import maximizable_field, peak_memo_key, verdict_at
    from vram_planner.model.maximize import maximize as maximize_field

    field = None if maximize is None else maximizable_field(maximize)
    if field is not None and _auto_gpus(settings):
        raise ConfigError(["--maximize takes a number of GPUs, not --num-gpus auto: find the count first, then "
                           "maximize on it"])
    first = make_context(model, gpus()[0], trl_version=trl_version, calibration=calibration,
                         safety_margin=safety_margin)
    shared_calibration = first.calibration if calibration is not None else None
    cards, errors, memos, answers = [], [], {}, {}
    for gpu in sorted(gpus(), key=lambda g: g.capacity_bytes):  # a card fits at least what a smaller one fits
        context = replace(first, gpu=gpu, calibration=shared_calibration or calibration_for(gpu.name))
        try:
            train, fewest = make_training_auto(context, settings)
        except ConfigError as error:  # what this card cannot run, or bad knobs (then no card can)
            cards.append(CardFit(gpu, None, problem=error.worded(flag)))  # in the document's words, as notes are
            errors.append((gpu.capacity_bytes, error))
            continue
        if fewest is not None:
            cards.append(CardFit(gpu, fewest.chosen or judge(context, train), fewest=fewest))
            continue
        if field is None:
            cards.append(CardFit(gpu, judged(context, train)))  # a kept copy decides near the boundary
            continue
        key = peak_memo_key(context, train)  # cards that give every config the same peaks share what was judged
        maximized = maximize_field(context, train, field, allow_savers, memos.setdefault(key, {}), answers.get(key),
                                   describe=False)
        answers[key] = maximized.value if maximized.fits else answers.get(key)
        cards.append(CardFit(gpu, verdict_at(maximized), maximized))
    if len(errors) == len(cards):
        raise max(errors, key=lambda e: e[0])[1]  # knobs no card can run are bad input: the largest card's reason
    return sorted(cards, key=_card_order)


def _card_order(card: CardFit) -> tuple[int, float]:
    """Fitting cards by size, then the others by what they miss, then the cards that cannot run the config."""
    if card.fits:
        return 0, card.capacity_bytes
    if card.spare_bytes is not None:
        return 1, -card.spare_bytes
    return 2, card.capacity_bytes
