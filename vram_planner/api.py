"""The library API: `check` and `plan` from names, the same calls the CLI makes.

    >>> from vram_planner import api
    >>> result = api.plan("Llama-3.2-1B", "rtx3080-mobile")
    >>> result.fits, result.chosen.train.per_device_train_batch_size
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vram_planner.errors import ConfigError, VramPlanError, short_repr
from vram_planner.model.calibration import Calibration, calibration_for
from vram_planner.model.resolve import resolve_model
from vram_planner.model.search import Plan, best_plan
from vram_planner.model.spec import TrainingConfig, as_settings, knob_names, release_config, training_config
from vram_planner.model.trl_semantics import release_defaults
from vram_planner.model.trl_releases import trl_release
from vram_planner.model.verdict import (DEFAULT_SAFETY_MARGIN, Context, Verdict, adapt_to_gpu, adapt_to_model,
                                        check_safety_margin, check_training, judge)
from vram_planner.profiles import GpuProfile, gpus, model_config

if TYPE_CHECKING:  # `plan` and `check` do not search for a largest value: the module loads when one is asked for
    from vram_planner.model.maximize import Maximized


def make_context(model: str, gpu: str | GpuProfile, *, trl_version: str | None = None,
                 calibration: Calibration | Path | None = None,
                 safety_margin: float = DEFAULT_SAFETY_MARGIN) -> Context:
    """Resolve the model, the GPU, the TRL release and the calibration to judge configs against."""
    check_safety_margin(safety_margin)  # before a hub id is fetched for nothing
    if trl_version is not None and not isinstance(trl_version, str):
        raise ConfigError([f"--trl-version should be a version like 1.16.0, as a string (got {trl_version!r:.60})"])
    gpu_profile = gpu if isinstance(gpu, GpuProfile) else GpuProfile.from_name(gpu)
    if not isinstance(calibration, Calibration):
        calibration = calibration_for(gpu_profile.name, calibration)
    return Context(arch=resolve_model(model), gpu=gpu_profile, release=trl_release(trl_version),
                   calibration=calibration, safety_margin=safety_margin, model_id=model)


def make_training(context: Context, settings: dict[str, Any] | TrainingConfig | None = None) -> TrainingConfig:
    """Validate the knobs, fill the TRL release's defaults and adapt unset defaults to the GPU."""
    if isinstance(settings, TrainingConfig):
        # a config object is the user's too: validated whole; its knobs at their defaults count as unset
        unset = as_settings(TrainingConfig())
        explicit = {name for name, value in as_settings(settings).items() if value != unset[name]}
        train = training_config({**as_settings(settings), "trl_version": context.release.version})
    elif settings is not None and not isinstance(settings, dict):
        raise ConfigError([f"settings should be a mapping of GRPOConfig-style knobs to values (got {settings!r:.60})"])
    else:
        # None means "not given" for a knob; an unknown name is reported whatever its value (a typo'd YAML key
        # left empty must not vanish silently)
        values = {k: v for k, v in (settings or {}).items() if v is not None or k not in knob_names()}
        explicit = set(values)
        given = values.get("trl_version")
        if given is not None and given != context.release.version:
            raise ConfigError([f"trl_version {short_repr(given)} in the settings differs from the context's TRL "
                               f"{context.release.version}; give the release once (--trl-version, or trl_version "
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


def check(model: str, gpu: str | GpuProfile, settings: dict[str, Any] | TrainingConfig | None = None,
          **context_options: Any) -> Verdict:
    """The verdict for exactly this configuration."""
    context = make_context(model, gpu, **context_options)
    return judge(context, make_training(context, settings))


def plan(model: str, gpu: str | GpuProfile, settings: dict[str, Any] | TrainingConfig | None = None,
         **context_options: Any) -> Plan:
    """The best configuration that fits, starting from these settings."""
    context = make_context(model, gpu, **context_options)
    return best_plan(context, make_training(context, settings))


# Without --gpu a trace judges against the local card, and on a machine without one (where traces usually run)
# against the card of the command-line contract's first example: the tensors it counts do not depend on the card.
FALLBACK_TRACE_GPU = "rtx3080-mobile"


@dataclass(frozen=True)
class TraceOutcome:
    """A traced step judged like `check`, but on what the caching allocator model reserves for the traced events
    (plus the CUDA context, which the trace cannot see), and the analytic verdict for the same config."""

    traced: Verdict
    analytic: Verdict
    result: Any  # vram_planner.tracing.step.TraceResult: tensor bytes only, per phase and component
    reserved: Any = None  # vram_planner.tracing.reserve.ReservedMemory: the allocator model's reserved bytes

    @property
    def fits(self) -> bool:
        return self.traced.fits

    @property
    def seconds(self) -> float:
        """The trace's wall time and the allocator replay's."""
        return self.result.seconds + (self.reserved.seconds if self.reserved is not None else 0.0)

    def comparison(self) -> list[Any]:
        """Per phase: traced against analytic tensor bytes (vram_planner.tracing.step.PhaseComparison)."""
        from vram_planner.tracing.step import compare_with_estimate

        return compare_with_estimate(self.result, self.analytic.estimate)


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
    extras), next to the analytic verdict. `progress` is called with what the trace is doing. The verdict takes
    each phase's reserved bytes from the caching allocator model, configured by the settings' `allocator_conf` (a
    PYTORCH_CUDA_ALLOC_CONF text; when not given, that environment variable, as torch reads it)."""
    from vram_planner.model.cublas import workspace_bytes
    from vram_planner.model.phases import Estimate
    from vram_planner.tracing.events import with_workspaces
    from vram_planner.tracing.reserve import reserved_memory
    from vram_planner.tracing.step import check_traceable, trace_step

    notes: tuple[str, ...] = ()
    if gpu is None:
        gpu, note = default_trace_gpu()
        notes += (note,) if note else ()
    context = make_context(model, gpu, **context_options)
    train = make_training(context, settings)
    from vram_planner.allocator import parse_allocator_conf

    conf = parse_allocator_conf(train.allocator_conf, "--allocator-conf")
    check_traceable(train, context.release)  # before model_config: a hub id is not fetched twice for nothing
    config, _, _ = model_config(model)
    result = trace_step(config, train, context.release, progress)
    if progress is not None:
        progress("replaying the allocations through the caching allocator model")
    # cudaMalloc hands out what the CUDA context leaves of the card (the context as `check` takes it: from the
    # calibration when it measured one, else from the GPU catalog).
    context_bytes = context.cuda_context.bytes
    stream = with_workspaces(result.steady_stream(), workspace_bytes(context.gpu.compute_capability))
    reserved = reserved_memory(stream, conf, max(int(context.capacity_bytes - context_bytes), 0))
    phases = tuple(_traced_phase(p, reserved.by_phase, context, train) for p in result.phases)
    traced = Estimate(phases=phases, params=result.params, trainable_params=result.trainable_params,
                      notes=tuple(result.notes) + notes + reserved.notes)
    return TraceOutcome(traced=Verdict(context, train, traced), analytic=judge(context, train), result=result,
                        reserved=reserved)


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
                           train, context.cuda_context.bytes, workspaces)
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
    first = make_context(model, gpus()[0], trl_version=trl_version, calibration=calibration,
                         safety_margin=safety_margin)
    shared_calibration = first.calibration if calibration is not None else None
    cards, errors, memos, answers = [], [], {}, {}
    for gpu in sorted(gpus(), key=lambda g: g.capacity_bytes):  # a card fits at least what a smaller one fits
        context = replace(first, gpu=gpu, calibration=shared_calibration or calibration_for(gpu.name))
        try:
            train = make_training(context, settings)
        except ConfigError as error:  # what this card cannot run, or bad knobs (then no card can)
            cards.append(CardFit(gpu, None, problem=str(error)))
            errors.append((gpu.capacity_bytes, error))
            continue
        if field is None:
            cards.append(CardFit(gpu, judge(context, train)))
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
