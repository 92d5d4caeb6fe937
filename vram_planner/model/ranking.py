"""Every config that fits, ranked by predicted seconds per optimizer step: what `plan --optimize speed` chooses from.

The memory plan (search.py) keeps the user's semantics as far as the card allows and stops at the first rung that
fits. The configs that train the same thing, on the same batches, differ in speed: with or without gradient
checkpointing, an 8-bit or a 32-bit optimizer, 16-bit or float32 weights, full fine-tuning or LoRA or QLoRA,
generation in vLLM or in transformers, and the micro-batch. Each combination of those is judged at its largest
micro-batch that fits (the fastest of its micro-batches: the same FLOPs in fewer, fuller passes), then timed by
step_time.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any

from vram_planner.errors import ConfigError
from vram_planner.model import search
from vram_planner.model.spec import Optimizer, TrainingConfig, knob_names, plain_value, with_changes
from vram_planner.model.step_time import StepTime, efficiency_from, step_time
from vram_planner.model.verdict import Context, Verdict, check_training

# The fields a speed alternative may change; the rest (what is generated and on which batches) is the memory plan's.
SPEED_KNOBS = ("gradient_checkpointing", "optim", "dtype", "lora_r", "lora_alpha", "lora_target_modules",
               "load_in_4bit", "use_vllm", "vllm_gpu_memory_utilization", "vllm_max_model_length",
               "vllm_enable_sleep_mode", "allocator_conf", "per_device_train_batch_size",
               "gradient_accumulation_steps", "steps_per_generation")
# vLLM's knobs as TrainingConfig leaves them, for a config that turns vLLM off
VLLM_OFF = {"use_vllm": False, "vllm_max_model_length": None, "vllm_enable_sleep_mode": False,
            "vllm_gpu_memory_utilization": TrainingConfig.vllm_gpu_memory_utilization}


@dataclass(frozen=True)
class Ranked:
    """One config with its verdict and its predicted step time."""

    verdict: Verdict
    time: StepTime

    @property
    def train(self) -> TrainingConfig:
        return self.verdict.train

    @property
    def step_seconds(self) -> float:
        return self.time.step_seconds


@dataclass(frozen=True)
class Ranking:
    """The configs that fit, fastest first, beside the memory plan's choice and the user's own config."""

    ranked: tuple[Ranked, ...]
    memory_choice: Ranked | None  # the memory plan's choice, timed (None: nothing fits)
    requested: Ranked

    @property
    def fastest(self) -> Ranked | None:
        return self.ranked[0] if self.ranked else None


def timed(verdict: Verdict, reward_seconds: float = 0.0) -> Ranked:
    """The verdict's config timed on its card, with the calibration's fitted efficiency factors."""
    ctx = verdict.context
    vllm = verdict.estimate.vllm
    time = step_time(ctx.arch, verdict.train, ctx.gpu, efficiency_from(ctx.calibration.step_time), reward_seconds,
                     vllm.batch_sequences if vllm is not None else None)
    return Ranked(verdict, time)


def rank_configs(context: Context, plan: search.Plan, reward_seconds: float = 0.0, try_vllm: bool = True) -> Ranking:
    """Every speed variant of the memory plan's choice that fits, fastest first (the smaller peak first among
    equals); without `try_vllm`, only those that generate as the user's config does (vLLM's model then never loads
    for a config without it). NoSpeedFigures where the card has no speed figures."""
    requested = timed(plan.requested, reward_seconds)
    if plan.chosen is None:
        return Ranking((), None, requested)
    memory_choice = timed(plan.chosen, reward_seconds)
    found = {_key(memory_choice.train): memory_choice}
    if plan.requested.fits:
        found[_key(requested.train)] = requested
    for variant in speed_variants(context, plan.requested.train, plan.chosen.train, try_vllm):
        fitting = _fastest_fitting(context, variant)
        if fitting is not None and _key(fitting.train) not in found:
            found[_key(fitting.train)] = timed(fitting, reward_seconds)
    ranked = sorted(found.values(), key=lambda r: (r.step_seconds, r.verdict.estimate.peak_bytes))
    return Ranking(tuple(ranked), memory_choice, requested)


def speed_variants(context: Context, user: TrainingConfig, chosen: TrainingConfig,
                   try_vllm: bool = True) -> list[TrainingConfig]:
    """The user's config with the memory plan's semantics (batches, lengths, group size), in every combination of
    the savers the ladder knows, checkpointing on and off, and (`try_vllm`) vLLM on and off."""
    semantic = {name: getattr(chosen, name) for name in knob_names() if name not in SPEED_KNOBS}
    base = _try(user, {name: value for name, value in semantic.items() if getattr(user, name) != value})
    if base is None:
        return []
    variants = []
    for method, checkpointing, vllm in product(_methods(base, context.gpu.bf16), (True, False),
                                               _vllm_choices(base) if try_vllm else [{}]):
        variant = _try(method, {"gradient_checkpointing": checkpointing, **vllm})
        if variant is not None and _runs_here(context, variant):
            variants.append(search.vllm_tuned(context, variant))
    return variants


def _methods(base: TrainingConfig, gpu_bf16: bool) -> list[TrainingConfig]:
    """How the weights are held and trained: as given, with an 8-bit optimizer, in 16 bits, LoRA, QLoRA."""
    half = "bfloat16" if gpu_bf16 else "float16"
    steps: list[dict[str, Any]] = [{}]
    if not base.uses_lora:
        if base.optim in (Optimizer.adamw_torch_fused, Optimizer.adamw_torch):
            steps.append({"optim": Optimizer.adamw_8bit})
        if gpu_bf16 and base.dtype == "float32" and base.zero_stage is None:
            steps += [{"dtype": "bfloat16"}, {"dtype": "bfloat16", "optim": Optimizer.adamw_8bit}]
        steps.append({"lora_r": search.LORA_DEFAULT_RANK, "dtype": half})
    if not base.load_in_4bit:
        lora = {} if base.uses_lora else {"lora_r": search.LORA_DEFAULT_RANK}
        steps.append({**lora, "load_in_4bit": True, "dtype": half})
    methods = {_key(m): m for m in (_try(base, step) for step in steps) if m is not None}
    return list(methods.values())


def _vllm_choices(base: TrainingConfig) -> list[dict[str, Any]]:
    """vLLM as the user has it, and the other way (colocated on this card, as TRL's default mode)."""
    if base.use_vllm:
        return [{}, VLLM_OFF] if base.vllm_mode == "colocate" else [{}]
    return [{}, {"use_vllm": True}]


def _runs_here(context: Context, train: TrainingConfig) -> bool:
    try:
        check_training(train, context)
    except ConfigError:
        return False
    return True


def _fastest_fitting(context: Context, variant: TrainingConfig) -> Verdict | None:
    """The variant at its largest micro-batch that fits, under its allocator setting or, where nothing fits so,
    with expandable segments (free of time)."""
    fitting = search.largest_fitting(context, variant)
    if fitting is not None or variant.expandable_segments:
        return fitting
    expandable = _try(variant, {"allocator_conf": search.with_expandable_segments(variant.allocator_conf)})
    return None if expandable is None else search.largest_fitting(context, expandable)


def _key(train: TrainingConfig) -> str:
    """A config as a dictionary key (its list of LoRA target modules makes it unhashable): its fields' values."""
    return repr(train)


def _try(train: TrainingConfig, changes: dict[str, Any]) -> TrainingConfig | None:
    try:
        return with_changes(train, **changes) if changes else train
    except (ConfigError, ValueError):
        return None


def knob_changes(before: TrainingConfig, after: TrainingConfig) -> dict[str, tuple[Any, Any]]:
    """The knobs that differ, each as (before, after), in values a person reads (optimizer names, not enums)."""
    return {name: (plain_value(getattr(before, name)), plain_value(getattr(after, name))) for name in knob_names()
            if getattr(before, name) != getattr(after, name)}

