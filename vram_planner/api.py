"""The library API: `check` and `plan` from names, the same calls the CLI makes.

    >>> from vram_planner import api
    >>> result = api.plan("Llama-3.2-1B", "rtx3080-mobile")
    >>> result.fits, result.chosen.train.per_device_train_batch_size
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vram_planner.errors import ConfigError, VramPlanError, short_repr
from vram_planner.model.calibration import Calibration, calibration_for
from vram_planner.model.resolve import resolve_model
from vram_planner.model.search import Plan, best_plan
from vram_planner.model.spec import TrainingConfig, training_config, with_changes
from vram_planner.model.trl_semantics import release_defaults
from vram_planner.model.trl_releases import trl_release
from vram_planner.model.verdict import (DEFAULT_SAFETY_MARGIN, Context, Verdict, adapt_to_gpu, check_safety_margin,
                                        check_training, judge)
from vram_planner.profiles import GpuProfile, model_config


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
        train, explicit = settings, set(settings.model_fields_set)
        if train.trl_version != context.release.version:  # the knobs mean what they mean in the context's release
            train = with_changes(train, trl_version=context.release.version)
    elif settings is not None and not isinstance(settings, dict):
        raise ConfigError([f"settings should be a mapping of GRPOConfig-style knobs to values (got {settings!r:.60})"])
    else:
        # None means "not given" for a knob; an unknown name is reported whatever its value (a typo'd YAML key
        # left empty must not vanish silently)
        values = {k: v for k, v in (settings or {}).items() if v is not None or k not in TrainingConfig.model_fields}
        explicit = set(values)
        given = values.get("trl_version")
        if given is not None and given != context.release.version:
            raise ConfigError([f"trl_version {short_repr(given)} in the settings differs from the context's TRL "
                               f"{context.release.version}; give the release once (--trl-version, or trl_version "
                               "in a --config file)"])
        values["trl_version"] = context.release.version
        defaults = release_defaults(context.release, use_vllm=values.get("use_vllm") is True)
        train = training_config({**defaults, **values})
    train = adapt_to_gpu(train, context.gpu, explicit)
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
    """A traced step judged like `check` (traced tensors plus the calibration's CUDA context and allocator
    reserve, which the trace cannot see), and the analytic verdict for the same config."""

    traced: Verdict
    analytic: Verdict
    result: Any  # vram_planner.tracing.step.TraceResult: tensor bytes only, per phase and component

    @property
    def fits(self) -> bool:
        return self.traced.fits

    @property
    def seconds(self) -> float:
        return self.result.seconds

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
    extras), next to the analytic verdict. `progress` is called with what the trace is doing."""
    from vram_planner.model.phases import Estimate, Phase, with_overheads
    from vram_planner.tracing.step import check_traceable, trace_step

    notes: tuple[str, ...] = ()
    if gpu is None:
        gpu, note = default_trace_gpu()
        notes += (note,) if note else ()
    context = make_context(model, gpu, **context_options)
    train = make_training(context, settings)
    check_traceable(train, context.release)  # before model_config: a hub id is not fetched twice for nothing
    config, _, _ = model_config(model)
    result = trace_step(config, train, context.release, progress)
    # The trace counts tensors; the card also holds the CUDA context and the allocator's reserve, which only a
    # real device shows, so the verdict adds them from the calibration exactly as `check` does.
    phases = tuple(with_overheads(Phase(p.name, dict(p.components), p.moment), context.calibration, 0.0, train)
                   for p in result.phases)
    traced = Estimate(phases=phases, params=result.params, trainable_params=result.trainable_params,
                      notes=tuple(result.notes) + notes)
    return TraceOutcome(traced=Verdict(context, train, traced), analytic=judge(context, train), result=result)
