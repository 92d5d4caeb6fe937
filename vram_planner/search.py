"""`plan`: the best configuration that fits, found by walking a ladder of memory savers.

Rungs keep the user's training semantics first and add savers in order of least cost to quality and speed:
gradient checkpointing, an 8-bit optimizer, bf16 weights, LoRA, QLoRA, then a smaller generation batch, shorter
completions and fewer generations. On every rung the largest micro-batch that fits wins (the same generation
batch and optimizer batch, reached with more accumulation). A plan is ranked by (rung, -micro-batch), so more
memory can only keep or improve the rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vram_planner.errors import ConfigError
from vram_planner.spec import Optimizer, TrainingConfig, with_changes
from vram_planner.verdict import Context, Verdict, judge

LORA_DEFAULT_RANK = 16  # common GRPO recipes (TRL docs, Unsloth notebooks) use r=16, alpha=2r, all linear layers
SHORTEST_COMPLETION = 64
SHORTEST_COMPLETION_BEFORE_FEWER_GENERATIONS = 256
FEWEST_GENERATIONS = 2

REASONS = {
    "per_device_train_batch_size": "same generation and optimizer batch, more accumulation",
    "gradient_checkpointing": "keep layer inputs, recompute the rest (~20% slower)",
    "optim": "bitsandbytes 8-bit states: 2 bytes/param, not 8",
    "dtype": "16-bit weights: half the bytes of weights, grads, states",
    "lora_r": "train LoRA adapters, not every weight",
    "load_in_4bit": "4-bit base weights under the adapters (QLoRA)",
    "steps_per_generation": "smaller generation batch: fewer prompts per optimizer step",
    "max_completion_length": "shorter completions",
    "num_generations": "smaller groups per prompt",
}


@dataclass(frozen=True)
class Change:
    knob: str
    before: Any
    after: Any
    saved_bytes: float

    @property
    def reason(self) -> str:
        return "; ".join(REASONS.get(k, "") for k in self.knob.split(" + "))


@dataclass(frozen=True)
class Plan:
    requested: Verdict
    chosen: Verdict | None
    changes: tuple[Change, ...]
    smallest: Verdict  # the last rung at micro-batch 1: what the tool can do at best on this card
    rank: tuple[int, int] | None  # (rung, -micro-batch) of the chosen config; lower is better

    @property
    def fits(self) -> bool:
        return self.chosen is not None


def rungs(user: TrainingConfig, gpu_bf16: bool) -> Iterator[TrainingConfig]:
    """Configs from the user's own down to the smallest, each with more savers than the last."""
    yield user
    current = user
    steps: list[dict[str, Any]] = [{"gradient_checkpointing": True}]
    if not user.uses_lora and user.optim in (Optimizer.adamw_torch_fused, Optimizer.adamw_torch):
        steps.append({"optim": Optimizer.adamw_8bit})
    if not user.uses_lora and gpu_bf16 and user.dtype == "float32":
        steps.append({"dtype": "bfloat16"})
    if not user.uses_lora:
        # adapters are small: the user's optimizer is back, and the base is loaded in 16 bits
        steps.append({"lora_r": LORA_DEFAULT_RANK, "optim": user.optim,
                      "dtype": "bfloat16" if gpu_bf16 else "float16"})
    if not user.load_in_4bit:
        steps.append({"load_in_4bit": True, "dtype": "bfloat16" if gpu_bf16 else "float16"})
    for step in steps:
        candidate = _try(current, step)
        if candidate is not None and candidate != current:
            current = candidate
            yield current
    yield from _semantic_rungs(current)


def _semantic_rungs(current: TrainingConfig) -> Iterator[TrainingConfig]:
    """Halve the generation batch, then the completion length, then the group size."""
    while (nxt := _halve_generation_batch(current)) is not None:
        current = nxt
        yield current
    while current.max_completion_length > SHORTEST_COMPLETION_BEFORE_FEWER_GENERATIONS:
        current = with_changes(current, max_completion_length=max(
            current.max_completion_length // 2, SHORTEST_COMPLETION_BEFORE_FEWER_GENERATIONS))
        yield current
    while current.num_generations > FEWEST_GENERATIONS:
        nxt = _try(current, {"num_generations": max(current.num_generations // 2, FEWEST_GENERATIONS)})
        if nxt is None:
            break
        current = nxt
        yield current
        while (smaller := _halve_generation_batch(current)) is not None:
            current = smaller
            yield current
    while current.max_completion_length > SHORTEST_COMPLETION:
        current = with_changes(current, max_completion_length=max(current.max_completion_length // 2,
                                                                  SHORTEST_COMPLETION))
        yield current


def _halve_generation_batch(train: TrainingConfig) -> TrainingConfig | None:
    """Half the prompts per generation round; TRL's divisibility rules decide whether that is possible."""
    s = train.steps_per_generation_resolved
    if s % 2:
        return None
    if train.steps_per_generation is None:  # S follows gradient_accumulation_steps
        return _try(train, {"gradient_accumulation_steps": s // 2})
    return _try(train, {"steps_per_generation": s // 2})


def micro_batch_variants(train: TrainingConfig) -> Iterator[TrainingConfig]:
    """The same generation and optimizer batches with micro-batches from the largest down to 1."""
    b, ga, s = train.per_device_train_batch_size, train.gradient_accumulation_steps, train.steps_per_generation_resolved
    for smaller in range(b, 0, -1):
        if (b * ga) % smaller or (b * s) % smaller:
            continue
        changes: dict[str, Any] = {"per_device_train_batch_size": smaller,
                                   "gradient_accumulation_steps": b * ga // smaller}
        if train.steps_per_generation is not None:
            changes["steps_per_generation"] = b * s // smaller
        candidate = _try(train, changes)
        if candidate is not None:
            yield candidate


def _try(train: TrainingConfig, changes: dict[str, Any]) -> TrainingConfig | None:
    try:
        return with_changes(train, **changes)
    except (ConfigError, ValueError):
        return None


def best_plan(context: Context, user: TrainingConfig) -> Plan:
    """The highest-ranked config that fits, the changes that lead to it and what each saved."""
    requested = judge(context, user)
    smallest = requested
    for rung_index, rung in enumerate(rungs(user, context.gpu.bf16)):
        for variant in micro_batch_variants(rung):
            verdict = judge(context, variant)
            if verdict.fits:
                return Plan(requested, verdict, describe_changes(context, user, variant), smallest,
                            (rung_index, -variant.per_device_train_batch_size))
            smallest = verdict
    return Plan(requested, None, (), smallest, None)


# The order in which changes are applied when measuring what each one saved.
CHANGE_ORDER = ("per_device_train_batch_size", "gradient_checkpointing", "optim", "dtype", "lora_r",
                "load_in_4bit", "steps_per_generation", "max_completion_length", "num_generations")
# Fields that move together with the one named in CHANGE_ORDER.
COUPLED = {"per_device_train_batch_size": ("gradient_accumulation_steps", "steps_per_generation"),
           "steps_per_generation": ("gradient_accumulation_steps",)}


def describe_changes(context: Context, user: TrainingConfig, chosen: TrainingConfig) -> tuple[Change, ...]:
    """Each knob that differs, in ladder order, with the peak bytes it saved when applied after the previous ones.

    A change that is not valid on its own (float16 weights without LoRA, say) is made together with the next one.
    """
    changes = []
    current = user
    before_peak = judge(context, current).estimate.peak_bytes
    chosen_values = chosen.model_dump()
    pending: list[str] = []
    for knob in CHANGE_ORDER:
        if _value(current, knob) == _value(chosen, knob):
            continue
        pending.append(knob)
        fields = [f for k in pending for f in (k, *COUPLED.get(k, ()))]
        step = _try(current, {f: chosen_values[f] for f in fields})
        if step is None:
            continue
        after_peak = judge(context, step).estimate.peak_bytes
        changes.append(Change(" + ".join(pending), _values(current, pending), _values(step, pending),
                              before_peak - after_peak))
        current, before_peak, pending = step, after_peak, []
    return tuple(changes)


def _value(train: TrainingConfig, knob: str) -> Any:
    """The value a person compares: the generation batch stands for steps_per_generation."""
    value = train.generation_batch_size if knob == "steps_per_generation" else getattr(train, knob)
    return value.value if isinstance(value, Optimizer) else value


def _values(train: TrainingConfig, knobs: list[str]) -> Any:
    values = [_value(train, k) for k in knobs]
    return values[0] if len(values) == 1 else ", ".join(str(v) for v in values)
