"""The library API: `check` and `plan` from names, the same calls the CLI makes.

    >>> from vram_planner import api
    >>> result = api.plan("Llama-3.2-1B", "rtx3080-mobile")
    >>> result.fits, result.chosen.train.per_device_train_batch_size
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from collections.abc import Callable
from dataclasses import dataclass

from vram_planner.calibration import Calibration, calibration_for
from vram_planner.errors import VramPlanError
from vram_planner.profiles import GpuProfile, model_config, resolve_model
from vram_planner.search import Plan, best_plan
from vram_planner.spec import TrainingConfig, training_config
from vram_planner.trl_releases import trl_release
from vram_planner.verdict import DEFAULT_SAFETY_MARGIN, Context, Verdict, adapt_to_gpu, check_gpu, judge


def make_context(model: str, gpu: str | GpuProfile, *, trl_version: str | None = None,
                 calibration: Calibration | Path | None = None,
                 safety_margin: float = DEFAULT_SAFETY_MARGIN) -> Context:
    """Resolve the model, the GPU, the TRL release and the calibration to judge configs against."""
    gpu_profile = gpu if isinstance(gpu, GpuProfile) else GpuProfile.from_name(gpu)
    if not isinstance(calibration, Calibration):
        calibration = calibration_for(gpu_profile.name, calibration)
    return Context(arch=resolve_model(model), gpu=gpu_profile, release=trl_release(trl_version),
                   calibration=calibration, safety_margin=safety_margin, model_id=model)


def make_training(context: Context, settings: dict[str, Any] | TrainingConfig | None = None) -> TrainingConfig:
    """Validate the knobs, fill the TRL release's defaults and adapt unset defaults to the GPU."""
    if isinstance(settings, TrainingConfig):
        train, explicit = settings, set(settings.model_fields_set)
    else:
        values = {k: v for k, v in (settings or {}).items() if v is not None}
        explicit = set(values)
        defaults = {"beta": context.release.default_beta,
                    "max_completion_length": context.release.default_max_completion_length,
                    "dtype": context.release.default_model_dtype}
        train = training_config({**defaults, **values})
    train = adapt_to_gpu(train, context.gpu, explicit)
    check_gpu(train, context.gpu)
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


@dataclass(frozen=True)
class TraceOutcome:
    """A traced step judged like `check` (traced tensors plus the calibration's overheads), and the analytic
    verdict for the same config."""

    traced: Verdict
    analytic: Verdict
    result: Any  # vram_planner.trace.TraceResult

    @property
    def fits(self) -> bool:
        return self.traced.fits


def trace(model: str, gpu: str | GpuProfile, settings: dict[str, Any] | TrainingConfig | None = None,
          progress: Callable[[str], None] | None = None, **context_options: Any) -> TraceOutcome:
    """Trace one GRPO step of this config on fake tensors (needs torch, transformers, TRL and PEFT)."""
    from vram_planner.estimate import Estimate, with_overheads
    from vram_planner.trace import check_traceable, trace_step
    from vram_planner.verdict import judge

    context = make_context(model, gpu, **context_options)
    train = make_training(context, settings)
    check_traceable(train, context.release)
    config, _, _ = model_config(model)
    try:
        result = trace_step(config, train, context.release, progress)
    except ImportError as exc:
        raise VramPlanError(f"the trace needs torch, transformers, TRL and PEFT ({exc.name} is missing): "
                            "pip install 'vram-plan[train]'") from exc
    from vram_planner.estimate import Phase

    phases = tuple(with_overheads(Phase(p.name, dict(p.components), p.moment), context.calibration, 0.0, train)
                   for p in result.phases)
    traced = Estimate(phases=phases, params=result.params, trainable_params=result.trainable_params,
                      notes=tuple(result.notes))
    return TraceOutcome(traced=Verdict(context, train, traced), analytic=judge(context, train), result=result)
