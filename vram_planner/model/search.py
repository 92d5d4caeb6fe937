"""`plan`: the best configuration that fits, found by walking a ladder of memory savers.

Rungs keep the user's training semantics first and add savers in order of least cost to quality and speed:
gradient checkpointing, an 8-bit optimizer, bf16 weights, LoRA, QLoRA, then a smaller generation batch, shorter
completions and fewer generations. On every rung the largest micro-batch that fits wins (the same generation
batch and optimizer batch, reached with more accumulation). A plan is ranked by (rung, -micro-batch), so more
memory can only keep or improve the rank.

The search does not grow with the batch or the lengths. The semantic rungs halve what they shrink, so there are
logarithmically many, and they come in runs along which memory only falls: bisection finds the first rung of a run
on which something fits. The micro-batches of a rung are the divisors of its batches (found by factoring,
vram_planner/model/divisors.py), and bisection finds the largest that fits.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vram_planner.errors import ConfigError
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.divisors import divisors, prime_factors
from vram_planner.model.spec import MAX_COUNT, Optimizer, TrainingConfig, knob_names, plain_value, with_changes
from vram_planner.model.verdict import Context, Verdict, cast_lm_head_arch_problems, judge, qlora_generation_problems
from vram_planner.units import GiB

if TYPE_CHECKING:
    from vram_planner.model.vllm import VllmBudget

LORA_DEFAULT_RANK = 16  # common GRPO recipes (TRL docs, Unsloth notebooks) use r=16, alpha=2r, all linear layers
SHORTEST_COMPLETION = 64
SHORTEST_COMPLETION_BEFORE_FEWER_GENERATIONS = 256
FEWEST_GENERATIONS = 2

# What each change does, said for the way it goes: the memory plan's savers one way, `--optimize speed` may undo them
# (checkpointing off, 32-bit states, full fine-tuning, vLLM off) and grow the micro-batch. Per knob: whether the
# change goes the saver's way (before, after), the reason that way, and the reason the other way.
REASONS: dict[str, tuple[Callable[[Any, Any], bool], str, str]] = {
    "per_device_train_batch_size": (lambda before, after: after < before,
                                    "same generation and optimizer batch, more accumulation",
                                    "same generation and optimizer batch, fewer and fuller passes"),
    "gradient_checkpointing": (lambda before, after: bool(after),
                               "keep layer inputs, recompute the rest (~20% slower)",
                               "no recomputation (~20% faster): every layer's activations kept for the backward"),
    "optim": (lambda before, after: "8bit" in str(after),
              "bitsandbytes 8-bit states: 2 bytes/param, not 8",
              "32-bit optimizer states: no quantization in the optimizer step"),
    "dtype": (lambda before, after: after != "float32",
              "16-bit weights: half the bytes of weights, grads, states",
              "float32 weights: twice the bytes of 16-bit ones"),
    "allocator_conf": (lambda before, after: "expandable_segments:True" in str(after),
                       "PYTORCH_CUDA_ALLOC_CONF: PyTorch's cache grows segments in place and fragments less (free)",
                       "PYTORCH_CUDA_ALLOC_CONF: PyTorch's cache in fixed segments"),
    "lora_r": (lambda before, after: after is not None,
               "train LoRA adapters, not every weight",
               "full fine-tuning: every weight trained, with its gradients and optimizer states"),
    "load_in_4bit": (lambda before, after: bool(after),
                     "4-bit base weights under the adapters (QLoRA)",
                     "16-bit base weights under the adapters: no dequantization in every matmul"),
    "generation_batch_size": (lambda before, after: after < before,
                              "smaller generation batch: fewer prompts per optimizer step",
                              "larger generation batch: more prompts per optimizer step"),
    "max_completion_length": (lambda before, after: after < before, "shorter completions", "longer completions"),
    "num_generations": (lambda before, after: after < before, "smaller groups per prompt", "larger groups per prompt"),
    "use_vllm": (lambda before, after: bool(after),
                 "generate in vLLM (CUDA graphs, paged KV cache) beside the trainer: faster decoding, a share of the "
                 "card",
                 "generate in the trainer with transformers: no vLLM share of the card, slower decoding"),
    # vLLM's share and context are set to what it needs, whichever way they go
    "vllm_max_model_length": (lambda before, after: True,
                              "vLLM's context: prompt + completion (the model's whole context needs a larger share "
                              "to start)", ""),
    "vllm_gpu_memory_utilization": (lambda before, after: True,
                                    "vLLM's share: its start-up needs and a whole generation round's KV cache, "
                                    "the smallest multiple of 0.05 of the card", ""),
}


def reason(knob: str, before: Any, after: Any) -> str:
    """Why a change of `knob` from `before` to `after` is made, for the way it goes ("" for a knob without one)."""
    if knob not in REASONS:
        return ""
    saver_way, saver, other = REASONS[knob]
    return saver if saver_way(before, after) else other


@dataclass(frozen=True)
class Change:
    """One step from the user's config to the plan's, with what it does to the peak: it saves bytes or it costs
    them, never both, and neither is ever negative (a negative saving reads as a saving to people and programs)."""

    knob: str
    before: Any
    after: Any
    saved_bytes: float
    settings: dict[str, Any] = field(default_factory=dict)  # every field the change sets, to its new value
    # What the change adds to the peak. Only a larger vLLM share costs: the trainer's changes that cost where they
    # are made are reported with the change that pays for them (describe_changes).
    cost_bytes: float = 0.0

    reasons: tuple[str, ...] = ()  # each knob's, for the way it goes (reason())

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)

    @property
    def net_saved_bytes(self) -> float:
        """Saved less cost: what the change takes off the peak (negative when it adds to it)."""
        return self.saved_bytes - self.cost_bytes


def change(knob: str, before: Any, after: Any, net_saved_bytes: float, settings: dict[str, Any],
           reasons: tuple[str, ...]) -> Change:
    """A change that takes `net_saved_bytes` off the peak, said as a saving or as a cost."""
    return Change(knob, before, after, max(net_saved_bytes, 0.0), settings, max(-net_saved_bytes, 0.0), reasons)


@dataclass(frozen=True)
class Plan:
    requested: Verdict
    chosen: Verdict | None
    changes: tuple[Change, ...]
    # the last rung tried, at its smallest micro-batch (1 for any countable batch): when nothing fits, what the tool can do at best on this card
    smallest: Verdict
    rank: tuple[int, int] | None  # (rung, -micro-batch) of the chosen config; lower is better

    @property
    def fits(self) -> bool:
        return self.chosen is not None


def rungs(user: TrainingConfig, gpu_bf16: bool, arch: ModelArchitecture) -> Iterator[TrainingConfig]:
    """Configs from the user's own down to the smallest, each with more savers than the last."""
    for run in ladder_runs(user, gpu_bf16, arch):
        yield from run


def ladder_runs(user: TrainingConfig, gpu_bf16: bool, arch: ModelArchitecture) -> Iterator[list[TrainingConfig]]:
    """The rungs in runs along which memory can only fall (each rung halves what the one before it halved), so that
    a run can be bisected; the user's config and each saver are runs of one. A saver TRL cannot run on this model
    (LoRA under cast_lm_head_to_fp32 over tied embeddings) is left out."""
    yield [user]
    if not user.expandable_segments:
        # Free, but the answer only where it alone makes the config fit: the savers below keep the user's allocator.
        expandable = _try(user, {"allocator_conf": with_expandable_segments(user.allocator_conf)})
        if expandable is not None:
            yield [expandable]
    current = user
    steps: list[dict[str, Any]] = [{"gradient_checkpointing": True}]
    if not user.uses_lora and user.optim in (Optimizer.adamw_torch_fused, Optimizer.adamw_torch):
        steps.append({"optim": Optimizer.adamw_8bit})
    if not user.uses_lora and gpu_bf16 and user.dtype == "float32" and user.zero_stage is None:
        steps.append({"dtype": "bfloat16"})  # DeepSpeed's bf16 engine holds 16-bit weights whatever is loaded
    if not user.uses_lora:
        # adapters are small: the user's optimizer is back, and the base is loaded in 16 bits
        steps.append({"lora_r": LORA_DEFAULT_RANK, "optim": user.optim,
                      "dtype": "bfloat16" if gpu_bf16 else "float16"})
    if not user.load_in_4bit:
        steps.append({"load_in_4bit": True, "dtype": "bfloat16" if gpu_bf16 else "float16"})
    for step in steps:
        candidate = _try(current, step)
        if (candidate is not None and candidate != current and not cast_lm_head_arch_problems(candidate, arch)
                and not qlora_generation_problems(candidate)):
            current = candidate
            yield [current]
    yield from _semantic_runs(current)


def with_expandable_segments(allocator_conf: str) -> str:
    """The PYTORCH_CUDA_ALLOC_CONF text with expandable_segments:True in place of any setting of it."""
    kept = [part for part in allocator_conf.split(",") if part.strip() and
            part.split(":")[0].strip() != "expandable_segments"]
    return ",".join([*kept, "expandable_segments:True"])


def _semantic_runs(current: TrainingConfig) -> Iterator[list[TrainingConfig]]:
    """Halve the generation batch, then the completion length, then the group size (and the generation batch with
    each), then the completion length again."""
    for halve in (_halve_generation_batch, _shorten_completions(SHORTEST_COMPLETION_BEFORE_FEWER_GENERATIONS)):
        if run := _halvings(current, halve):
            yield run
            current = run[-1]
    while current.num_generations > FEWEST_GENERATIONS:
        fewer = _try(current, {"num_generations": max(current.num_generations // 2, FEWEST_GENERATIONS)})
        if fewer is None:
            break
        # the group size alone does not change memory: it starts the run of the generation batches it allows
        run = [fewer, *_halvings(fewer, _halve_generation_batch)]
        yield run
        current = run[-1]
    if run := _halvings(current, _shorten_completions(SHORTEST_COMPLETION)):
        yield run


def _halvings(train: TrainingConfig, halve: Callable[[TrainingConfig], TrainingConfig | None]) -> list[TrainingConfig]:
    """`halve` applied again and again while it can."""
    run: list[TrainingConfig] = []
    while (smaller := halve(run[-1] if run else train)) is not None:
        run.append(smaller)
    return run


def _shorten_completions(shortest: int) -> Callable[[TrainingConfig], TrainingConfig | None]:
    def halve(train: TrainingConfig) -> TrainingConfig | None:
        if train.max_completion_length <= shortest:
            return None
        return with_changes(train, max_completion_length=max(train.max_completion_length // 2, shortest))
    return halve


def _halve_generation_batch(train: TrainingConfig) -> TrainingConfig | None:
    """About half the completions per generation round (B x S x GPUs): fewer steps per generation, else half the
    micro-batch, each rounded down to what TRL allows (a generation batch divisible by num_generations)."""
    s, b, gpus = train.steps_per_generation_resolved, train.per_device_train_batch_size, train.num_gpus
    groups = 1 if train.release.num_generations_rule == "none" else train.num_generations  # TRL 0.14: any B
    if train.steps_per_generation is None:  # S follows gradient_accumulation_steps
        fewer_steps = {"gradient_accumulation_steps": _halved(s, _spacing(groups, b * gpus))}
    elif train.computes_old_logps:
        fewer_steps = {"steps_per_generation": _halved(s, _spacing(groups, b * gpus))}
    else:
        # on-policy (gradient_accumulation_steps a multiple of S x num_iterations) stays so only when the new S divides
        # S: off-policy, TRL would add the old log-probs' memory, and memory would no longer fall along the run
        fewer_steps = {"steps_per_generation": _divided(s, _spacing(groups, b * gpus))}
    for changes in (fewer_steps, {"per_device_train_batch_size": _halved(b, _spacing(groups, s * gpus))}):
        if all(changes.values()) and (smaller := _try(train, changes)) is not None:
            return smaller
    return None


def _spacing(num_generations: int, other_factors: int) -> int:
    """The spacing of the values one factor of the generation batch may take: the product stays a multiple of
    num_generations."""
    return num_generations // math.gcd(num_generations, other_factors)


def _halved(value: int, spacing: int) -> int:
    """Half of `value` rounded down to a multiple of `spacing` (0: none is left)."""
    return value // 2 // spacing * spacing


def _divided(value: int, spacing: int) -> int:
    """The largest proper divisor of `value` that is a multiple of `spacing` (which divides it), or 0."""
    rest = value // spacing
    return value // min(prime_factors(rest)) if rest > 1 else 0


def micro_batch_sizes(train: TrainingConfig, at_most: int | None = None) -> list[int]:
    """The micro-batches that keep this config's generation and optimizer batches, largest (its own) first; only
    those up to `at_most` when given."""
    b = train.per_device_train_batch_size
    # a micro-batch divides both B x gradient_accumulation_steps and B x S, that is B x gcd(GA, S)
    shared = math.gcd(train.gradient_accumulation_steps, train.steps_per_generation_resolved)
    sizes = divisors(b * shared, at_most=b if at_most is None else min(at_most, b))
    if train.release.num_generations_rule == "global_batch":  # TRL 0.15-0.16: each micro-batch holds whole groups
        sizes = [size for size in sizes if size * train.num_gpus % train.num_generations == 0]
    lowest = _lowest_micro_batch(train)
    return sizes if lowest == 1 else [size for size in sizes if size >= lowest]


def _lowest_micro_batch(train: TrainingConfig) -> int:
    """The smallest micro-batch whose accumulation steps stay countable (spec.MAX_COUNT): 1 but for absurd batches."""
    most_steps = max(train.gradient_accumulation_steps, train.steps_per_generation_resolved)
    return max(1, -(-train.per_device_train_batch_size * most_steps // MAX_COUNT))


def smallest_micro_batch(train: TrainingConfig) -> int:
    """The smallest micro-batch of this config's batches (1, unless the batches are beyond counting)."""
    return micro_batch_sizes(train)[-1]


def with_micro_batch(train: TrainingConfig, size: int) -> TrainingConfig:
    """The same generation and optimizer batches in micro-batches of `size` (one of micro_batch_sizes)."""
    b = train.per_device_train_batch_size
    changes: dict[str, Any] = {"per_device_train_batch_size": size,
                               "gradient_accumulation_steps": b * train.gradient_accumulation_steps // size}
    if train.steps_per_generation is not None:
        changes["steps_per_generation"] = b * train.steps_per_generation // size
    return with_changes(train, **changes)


def micro_batch_variants(train: TrainingConfig) -> Iterator[TrainingConfig]:
    """The same generation and optimizer batches with micro-batches from the largest down to 1."""
    return (with_micro_batch(train, size) for size in micro_batch_sizes(train))


def ladder_below(train: TrainingConfig, gpu_bf16: bool, arch: ModelArchitecture) -> Iterator[TrainingConfig]:
    """The configs a run falls back to, nearest first: smaller micro-batches with the same generation and optimizer
    batches, then the ladder's rungs below the config itself."""
    yield from (v for v in micro_batch_variants(train)
                if v.per_device_train_batch_size < train.per_device_train_batch_size)
    yield from itertools.islice(rungs(train, gpu_bf16, arch), 1, None)


def smallest_config(user: TrainingConfig, gpu_bf16: bool, arch: ModelArchitecture) -> TrainingConfig:
    """The bottom of the ladder: the last rung at its smallest micro-batch."""
    *_, bottom = rungs(user, gpu_bf16, arch)
    return with_micro_batch(bottom, smallest_micro_batch(bottom))


def _try(train: TrainingConfig, changes: dict[str, Any]) -> TrainingConfig | None:
    try:
        return with_changes(train, **changes)
    except (ConfigError, ValueError):
        return None


def best_plan(context: Context, user: TrainingConfig) -> Plan:
    """The highest-ranked config that fits, the changes that lead to it and what each saved."""
    requested = judge(context, user)
    smallest, rungs_before = requested, 0
    for run in ladder_runs(user, context.gpu.bf16, context.arch):
        run = [vllm_tuned(context, rung) for rung in run]  # each rung with the vLLM share it needs
        own = requested if rungs_before == 0 and run[0] == user else None  # tuning vLLM makes another config
        first, (verdict, bottom) = _first_fitting_rung(context, run, own)
        if verdict is not None:
            return Plan(requested, verdict, describe_changes(context, user, run[first], verdict.train), bottom,
                        (rungs_before + first, -verdict.train.per_device_train_batch_size))
        smallest, rungs_before = bottom, rungs_before + len(run)
    return Plan(requested, None, (), smallest, None)


def vllm_tuned(context: Context, train: TrainingConfig) -> TrainingConfig:
    """The config with colocated vLLM's share as plan recommends it: vllm_max_model_length prompt + completion where
    TRL would take the model's whole context (0.26 and later), and the smallest multiple of 0.05 of the card that
    holds vLLM's start-up needs and a whole generation round's KV cache (the user's value when none does)."""
    if not train.use_vllm:
        return train
    from vram_planner.model.vllm import colocated_budget

    budget = colocated_budget(context.arch, train, context.capacity_bytes, context.cuda_context.bytes,
                              context.gpu.label, context.gpu.bf16)
    if budget is None:
        return train
    if train.vllm_max_model_length is None and budget.max_model_len > train.sequence_length:
        shorter = _try(train, {"vllm_max_model_length": train.sequence_length})
        short = shorter and colocated_budget(context.arch, shorter, context.capacity_bytes, context.cuda_context.bytes,
                                             context.gpu.label, context.gpu.bf16)
        if short is not None and _shorter_context_matters(budget, short):
            train, budget = shorter, short
    utilization = budget.recommended_gpu_memory_utilization
    if utilization is None or utilization == train.vllm_gpu_memory_utilization:
        return train
    return _try(train, {"vllm_gpu_memory_utilization": utilization}) or train


def _shorter_context_matters(whole: VllmBudget, short: VllmBudget) -> bool:
    """Whether prompt + completion as vLLM's context changes what vLLM needs: a smaller recommended share (one
    sequence of the model's whole context outweighs the round's KV cache, or older TRL's profile run takes
    max_model_len tokens at once), or a start the whole context has none for. Otherwise the change would save nothing
    and the plan leaves TRL's default."""
    return (short.recommended_gpu_memory_utilization != whole.recommended_gpu_memory_utilization
            or (whole.problem is not None and short.problem is None))


def vllm_fallback_note(plan: Plan) -> str | None:
    """When nothing fits beside colocated vLLM: what sleep mode or server mode would make of the smallest config."""
    smallest = plan.smallest
    train, budget = smallest.train, smallest.estimate.vllm
    if budget is None or budget.mode != "colocate":
        return None
    server = "--vllm-mode server --vllm-server-gpu CARD moves generation to another card"
    if budget.problem:  # sleep mode starts vLLM whole all the same
        return f"colocated vLLM cannot start beside even the smallest config ({budget.problem}): {server}"
    asleep = None if train.vllm_enable_sleep_mode else _try(train, {"vllm_enable_sleep_mode": True})
    if asleep is None:
        return f"vLLM's share and the trainer do not fit together: {server}"
    verdict = judge(smallest.context, asleep)
    return (f"vLLM's share and the trainer do not fit together: --vllm-enable-sleep-mode frees vLLM's weights and KV "
            f"cache outside generation (the smallest config then needs {verdict.estimate.peak_bytes / GiB:.2f} GiB"
            + (": it fits" if verdict.fits else ", still too much") + f"), or {server}")


def _first_fitting_rung(context: Context, run: list[TrainingConfig],
                        own_first: Verdict | None) -> tuple[int, tuple[Verdict | None, Verdict]]:
    """The first rung of a run on which something fits, with its largest micro-batch that fits and its micro-batch
    1 (the last rung, with None, when nothing fits)."""
    outcomes: dict[int, tuple[Verdict | None, Verdict]] = {}

    def fits_on(index: int) -> bool:
        if index not in outcomes:
            outcomes[index] = _largest_fitting_micro_batch(context, run[index], own_first if index == 0 else None)
        return outcomes[index][0] is not None

    # memory only falls along a run (tests/model/test_properties.py holds the model to that):
    # False, ..., False, True, ...
    index = min(bisect.bisect_left(range(len(run)), True, key=fits_on), len(run) - 1)
    fits_on(index)
    return index, outcomes[index]


# Smaller micro-batches are listed up to this many sequences first, then up to its square and so on while the
# largest listed fits: the list stays as long as what fits the card needs, however many divisors a huge batch has.
FIRST_LISTED_MICRO_BATCH = 2**10


def _largest_fitting_micro_batch(context: Context, rung: TrainingConfig,
                                 own: Verdict | None) -> tuple[Verdict | None, Verdict]:
    """The rung at its largest micro-batch that fits (or None), and the rung at its smallest micro-batch.

    The rung's own micro-batch is judged first: when it does not accumulate gradients, smaller ones (which do) may
    need more memory. Every smaller micro-batch accumulates, and there memory grows with the micro-batch
    (tests/model/test_properties.py holds the model to that), so bisection finds the largest that fits."""
    own = own or judge(context, rung)
    b, lowest = rung.per_device_train_batch_size, smallest_micro_batch(rung)
    if own.fits or b == lowest:
        return (own if own.fits else None), own
    verdicts: dict[int, Verdict] = {}

    def fits(size: int) -> bool:
        if size not in verdicts:
            verdicts[size] = judge(context, with_micro_batch(rung, size))
        return verdicts[size].fits

    if not fits(lowest):
        return None, verdicts[lowest]
    listed_up_to = max(FIRST_LISTED_MICRO_BATCH, lowest)
    while True:
        smaller = micro_batch_sizes(rung, at_most=min(listed_up_to, b - 1))
        if listed_up_to >= b - 1 or not fits(smaller[0]):
            break
        listed_up_to **= 2
    # `smaller` runs from large to small, so fits() is False, ..., False, True, ...: find the first True
    first = bisect.bisect_left(smaller, True, hi=len(smaller) - 1, key=fits)
    return verdicts[smaller[first]], verdicts[lowest]


def largest_fitting(context: Context, rung: TrainingConfig) -> Verdict | None:
    """The rung at its largest micro-batch that fits, or None (what each speed variant is ranked at)."""
    return _largest_fitting_micro_batch(context, rung, None)[0]


# The ladder's changes in the order it makes them, each with the fields it sets. The generation batch, which the
# ladder halves between the other semantic changes, comes after the group size: a halved group still divides the
# requested generation batch, while the halved generation batch may not be a multiple of the requested group.
BATCH_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation")
LADDER_CHANGES = (("use_vllm", ("use_vllm",)), ("vllm_max_model_length", ("vllm_max_model_length",)),
                  ("vllm_gpu_memory_utilization", ("vllm_gpu_memory_utilization",)),
                  ("allocator_conf", ("allocator_conf",)),
                  ("gradient_checkpointing", ("gradient_checkpointing",)), ("optim", ("optim",)),
                  ("dtype", ("dtype",)), ("lora_r", ("lora_r",)), ("load_in_4bit", ("load_in_4bit",)),
                  ("max_completion_length", ("max_completion_length",)), ("num_generations", ("num_generations",)),
                  ("generation_batch_size", BATCH_FIELDS))


def describe_changes(context: Context, user: TrainingConfig, rung: TrainingConfig,
                     chosen: TrainingConfig, join_costs: bool = True) -> tuple[Change, ...]:
    """The changes from the user's config to the chosen one, each with the peak bytes it saved, in the order the
    ladder makes them: its savers and semantic changes up to the chosen rung, then the micro-batch of that rung.

    Each change is measured applied after the ones before it, so the savings less the costs add up to the requested
    peak minus the chosen one. A change that is not valid on its own (float16 weights without LoRA, say) is made
    together with the next one. The ladder reaches the chosen micro-batch only because the rung's own did not fit, so the micro-batch
    change, last, always saves; but a change can cost memory where it is made (a smaller micro-batch turns on
    gradient accumulation, which keeps every gradient through the forward; checkpointing a model of one layer): such
    a change is reported together with the change after it that pays for it (the one before it, when it is the
    last), so that every reported change of the trainer saves more than zero (one that saves nothing, such as 16-bit
    weights under DeepSpeed, is joined the same way) and says truthfully what the pair saves.
    vLLM's share is set to what vLLM needs, not to save: a larger share is reported as the cost it is.
    Without `join_costs` (a config chosen for speed, whose changes may cost memory) each change stands alone.
    """
    steps: list[Change] = []
    current, before_peak = user, judge(context, user).estimate.peak_bytes
    targets = [(knob, fields, rung) for knob, fields in LADDER_CHANGES]
    pending: list[tuple[str, tuple[str, ...], TrainingConfig]] = []
    for knob, fields, target in [*targets, ("per_device_train_batch_size", BATCH_FIELDS, chosen)]:
        if _value(current, knob) == _value(target, knob):
            continue
        pending.append((knob, fields, target))
        step = _try(current, {f: getattr(t, f) for _, fs, t in pending for f in fs})
        if step is None:
            continue
        knobs = [k for k, _, _ in pending]
        after_peak = judge(context, step).estimate.peak_bytes
        settings = {f: getattr(step, f) for f in knob_names() if getattr(step, f) != getattr(current, f)}
        steps.append(change(" + ".join(knobs), _values(current, knobs), _values(step, knobs),
                            before_peak - after_peak, settings,
                            tuple(reason(k, _value(current, k), _value(step, k)) for k in knobs)))
        current, before_peak, pending = step, after_peak, []
    # vLLM's share is set, not saved: raising it costs the trainer memory and is reported as it is
    # a vLLM step that neither saves nor costs (a shorter context, which lets vLLM start in the share the next step
    # sets) is joined with the next, so that the row says what the pair does to the peak
    vllm = _joined_with_the_next([step for step in steps if step.knob.startswith(("vllm_", "use_vllm"))],
                                 lambda step: step.saved_bytes == step.cost_bytes == 0)
    trainer = [step for step in steps if not step.knob.startswith(("vllm_", "use_vllm"))]
    return tuple(vllm) + (_paid_for(trainer) if join_costs else tuple(trainer))


def _joined_with_the_next(steps: list[Change], needs_the_next: Callable[[Change], bool]) -> list[Change]:
    """The steps, each for which `needs_the_next` holds joined with the step after it (the last left as it is)."""
    joined: list[Change] = []
    for step in steps:
        if joined and needs_the_next(joined[-1]):
            step = _join(joined.pop(), step)
        joined.append(step)
    return joined


def _paid_for(steps: list[Change]) -> tuple[Change, ...]:
    """The steps, each one that costs memory or saves none (16-bit weights under DeepSpeed, which holds 16-bit
    weights anyway, before LoRA) joined with the next (with the previous when it is last)."""
    joined = _joined_with_the_next(steps, lambda step: step.net_saved_bytes <= 0)
    while len(joined) > 1 and joined[-1].net_saved_bytes <= 0:
        last = joined.pop()
        joined.append(_join(joined.pop(), last))
    return tuple(joined)


def _join(first: Change, second: Change) -> Change:
    return change(f"{first.knob} + {second.knob}", f"{first.before}, {second.before}",
                  f"{first.after}, {second.after}", first.net_saved_bytes + second.net_saved_bytes,
                  {**first.settings, **second.settings}, first.reasons + second.reasons)


def _value(train: TrainingConfig, knob: str) -> Any:
    """The value a person compares."""
    value = getattr(train, knob)
    if knob == "allocator_conf" and not value:
        return "unset"
    return plain_value(value)


def _values(train: TrainingConfig, knobs: list[str]) -> Any:
    values = [_value(train, k) for k in knobs]
    return values[0] if len(values) == 1 else ", ".join(str(v) for v in values)
