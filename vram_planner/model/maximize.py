"""`plan --maximize`: the largest value of one knob that fits the card, every other knob as given (or as the plan's
savers make it), searched over the values TRL accepts for that knob.

Memory never falls as these knobs grow (tests/model/test_maximize.py holds the model to that; where a shorter prompt
needs more, a run meets it too and the longer one counts it: generation_patterns.cache_in_prefill_segment_bytes), so
"fits" is True, ..., True, False, ... along the valid values: the search brackets the answer by doubling and closes
in where the line through two known peaks meets the budget, bisecting when the line misses. That costs a handful of
estimates (peaks are close to linear in these knobs) and never more than about 4 x log2(answer), however large the
answer. One exception, found by that test: with the savers under TRL 0.15-0.16 on several GPUs, a micro-batch must hold
whole groups (micro-batch x GPUs divisible by num_generations), so the smallest micro-batch the savers can reach is
num_generations / gcd(num_generations, GPUs): 3 for 3 generations on 2 GPUs, but 2 for 4. Memory then rises and
falls with num_generations, and the few values TRL accepts there (divisors of the global batch) are all tried.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vram_planner.errors import ConfigError, UnknownNameError, field_name
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.divisors import divisors
from vram_planner.model.search import (BATCH_FIELDS, Plan, best_plan, describe_changes, ladder_runs,
                                       smallest_micro_batch, vllm_tuned, with_micro_batch)
from vram_planner.model.spec import MAX_COUNT, TrainingConfig, knob_names, with_changes
from vram_planner.model.verdict import Context, Verdict, judge

MAXIMIZABLE = ("max_completion_length", "max_prompt_length", "num_generations", "per_device_train_batch_size",
               "lora_r")
# What a value of each knob counts, for people.
UNITS = {"max_completion_length": "tokens", "max_prompt_length": "tokens", "num_generations": "generations per prompt",
         "per_device_train_batch_size": "sequences per micro-batch", "lora_r": ""}
# What the ladder's semantic rungs change: a saver leaves all of them as they are.
SEMANTIC_FIELDS = ("max_completion_length", "num_generations", *BATCH_FIELDS)
LENGTHS = ("max_completion_length", "max_prompt_length")
# Peaks that differ only in the last bits of a float sum are the same peak.
FLOAT_NOISE = 1e-12


def maximizable_field(name: object) -> str:
    """The knob `--maximize` names, spelled as a GRPOConfig field or as its flag; one clear error otherwise."""
    text = name.strip().lstrip("-").replace("-", "_") if isinstance(name, str) else ""
    if text in MAXIMIZABLE:
        return text
    if text in knob_names():
        raise ConfigError([f"{field_name('maximize')} {text} is not supported: it maximizes one of "
                           f"{', '.join(MAXIMIZABLE)}"])
    raise UnknownNameError(f"{field_name('maximize')} field", str(name), MAXIMIZABLE,
                           hint=f"(choose from {', '.join(MAXIMIZABLE)})")


@dataclass(frozen=True)
class ValidValues:
    """The values TRL accepts for a knob, ascending: start, start + step, ... (count of them), or those listed."""

    count: int
    bound: str  # why no larger value is valid, in words
    start: int = 1
    step: int = 1
    listed: tuple[int, ...] = ()

    def at(self, index: int) -> int:
        return self.listed[index] if self.listed else self.start + index * self.step

    def index(self, value: int) -> int:
        """The index of a valid value."""
        return bisect.bisect_left(self.listed, value) if self.listed else (value - self.start) // self.step


def valid_values(context: Context, train: TrainingConfig, field: str) -> ValidValues:
    """The values `field` may take with every other knob of `train` as it is (ConfigError when there are none)."""
    largest = f"the largest count vram-plan accepts ({MAX_COUNT})"
    if field in LENGTHS:
        return _lengths(context, train, field, largest)
    if field == "lora_r":
        if not train.uses_lora:
            raise ConfigError([f"{field_name('maximize')} lora_r needs LoRA: give {field_name('lora_r')} (any rank, "
                               f"e.g. {field_name('lora_r')} 16) to train "
                               f"adapters, and {field_name('maximize')} finds the largest rank that fits"])
        width = _adapted_width(context, train)
        return ValidValues(width, f"the width of the adapted layers ({width}): a larger rank adds nothing")
    if field == "per_device_train_batch_size":
        spacing = _batch_spacing(train)
        why = "" if spacing == 1 else f" in steps of {spacing} (so that num_generations divides the batch)"
        return ValidValues(MAX_COUNT // spacing, largest + why, start=spacing, step=spacing)
    batch = _grouped_batch(train)
    if batch is None:  # TRL 0.14: B counts prompts, each with its own num_generations completions
        return ValidValues(MAX_COUNT - 1, largest, start=2)
    listed = tuple(sorted(d for d in divisors(batch, at_most=MAX_COUNT) if d >= 2))
    return ValidValues(len(listed), f"the batch num_generations must divide ({batch} completions)", listed=listed)


def _lengths(context: Context, train: TrainingConfig, field: str, largest: str) -> ValidValues:
    """Whole tokens, up to the model's context less the other length (rotary models run past it, but no longer
    as trained), and up to vLLM's context less the other length when --vllm-max-model-length sets it (vLLM cannot
    generate past it: vram_planner/model/vllm.py context_problem)."""
    other = train.max_prompt_length if field == "max_completion_length" else train.max_completion_length
    contexts = [(train.vllm_max_model_length, "vLLM's context", "--vllm-max-model-length")] if (
        train.use_vllm and train.vllm_max_model_length is not None) else []
    if context.arch.max_position_embeddings is not None:
        contexts.append((context.arch.max_position_embeddings, "the model's context", "max_position_embeddings"))
    if not contexts:
        return ValidValues(MAX_COUNT, largest)
    tokens, whose, source = min(contexts, key=lambda found: found[0])
    if other >= tokens:
        raise ConfigError([f"{field_name(_other(field))} {other} already fills {whose} of {tokens} tokens "
                           f"({source}): no "
                           f"{field} is left to maximize"])
    return ValidValues(min(tokens - other, MAX_COUNT),
                       f"{whose} of {tokens} tokens ({source}) less the "
                       f"{other}-token {_other(field).removeprefix('max_').removesuffix('_length')}")


def _other(field: str) -> str:
    return "max_prompt_length" if field == "max_completion_length" else "max_completion_length"


def _adapted_width(context: Context, train: TrainingConfig) -> int:
    """The largest rank any adapted linear layer can use: min(in, out) of the widest."""
    targets = train.lora_targets
    linears = [lin for lin in context.arch.layer_linears() if targets is None or lin.name in targets]
    return max((min(lin.in_features, lin.out_features) for lin in linears), default=context.arch.hidden_size)


def _grouped_batch(train: TrainingConfig) -> int | None:
    """The batch the release makes num_generations divide (spec.generation_batch_problems), None when it makes it
    divide nothing."""
    rule = train.release.num_generations_rule
    if rule == "none":
        return None
    if rule == "global_batch":
        return train.per_device_train_batch_size * train.num_gpus
    return train.generation_batch_size


def _batch_spacing(train: TrainingConfig) -> int:
    """The micro-batches TRL accepts are the multiples of this (the grouped batch is B times the other factors)."""
    batch = _grouped_batch(train)
    if batch is None:
        return 1
    others = batch // train.per_device_train_batch_size
    return train.num_generations // math.gcd(train.num_generations, others)


@dataclass(frozen=True)
class Maximized:
    """The largest value of `field` that fits, the plan at it, and what the next valid value would need."""

    field: str
    value: int | None  # None: even the smallest valid value does not fit
    plan: Plan  # at `value` (at the smallest valid value, not fitting, when there is none)
    peak_bytes: float | None
    next_value: int | None  # the next valid value above `value` (None: `value` is the largest valid one)
    next_peak_bytes: float | None  # the least peak it needs (with the savers: the least they make it need)
    limited_by: str  # "memory"; else why no larger value is valid, or why the next one cannot run
    allow_savers: bool
    notes: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return self.value is not None


def maximize(context: Context, train: TrainingConfig, field: str, allow_savers: bool = False,
             memo: dict[tuple[int, bool, int], Verdict | None] | None = None,
             at_least: int | None = None, describe: bool = True) -> Maximized:
    """The largest value of `field` that fits with every other knob of `train` as given (or as the plan's savers
    make it). `memo` keeps the configs judged, for contexts that share peak_memo_key; `at_least` is a value known to
    fit (the answer on a smaller card of the same key); without `describe` the plan leaves out its changes (each
    costs an estimate)."""
    values = valid_values(context, train, field)
    peaks = SaverPeaks(context, train, field, allow_savers, memo)
    monotone = not (allow_savers and field == "num_generations" and train.num_gpus > 1
                    and train.release.num_generations_rule == "global_batch")
    start = -1 if at_least is None else values.index(at_least)
    best = _largest_fitting(values, peaks, context.budget_bytes, start) if monotone else next(
        (i for i in reversed(range(values.count)) if peaks.least(values.at(i)) <= context.budget_bytes), -1)
    following = best + 1 if best + 1 < values.count else None
    next_value = None if following is None else values.at(following)
    above = None if next_value is None else peaks.lowest(next_value)
    next_peak = None if above is None else above.estimate.peak_bytes
    limit = values.bound if above is None else _why_not(above)
    if best < 0:
        plan = Plan(peaks.verdict((0, False), next_value), None, (), above, None)
        return Maximized(field, None, plan, None, next_value, next_peak, limit, allow_savers)
    value = values.at(best)
    plan = _plan_at(context, peaks, value, describe)
    notes = ()
    # lengths, batches and ranks always cost memory; the group size often does not (TRL 0.15 and later)
    if field == "num_generations" and best > 0 and (
            peaks.least(value) <= peaks.least(values.at(0)) * (1 + FLOAT_NOISE)):
        notes = ("the peak does not change with num_generations on this config (the generation batch is the same "
                 "number of completions whatever the group size): the largest valid value fits",)
    return Maximized(field, value, plan, plan.chosen.estimate.peak_bytes, next_value, next_peak, limit,
                     allow_savers, notes)


def _why_not(verdict: Verdict) -> str:
    """Why the next value does not fit: "memory", or the reason it cannot run although the peak would fit."""
    if verdict.estimate.peak_bytes > verdict.context.budget_bytes:
        return "memory"
    vllm = verdict.estimate.vllm
    return vllm.problem if vllm is not None and vllm.problem else "it cannot run (vram-plan check says why)"


def _largest_fitting(values: ValidValues, peaks: SaverPeaks, budget_bytes: float, best: int = -1) -> int:
    """The index of the largest value some candidate fits at (-1: none), above `best` when that one is known to fit.
    Each candidate's peak grows with the value, so each is searched from just above the best found so far, the
    likeliest lowest first: a candidate that cannot beat it costs one estimate."""
    for candidate in peaks.candidates:
        start = best + 1
        if start >= values.count or peaks.peak(candidate, values.at(start)) > budget_bytes:
            continue
        best = start + largest_within(values.count - start, lambda i: peaks.peak(candidate, values.at(start + i)),
                                      budget_bytes)
    return best


# A candidate config at a value: (which saver rung, whether at its smallest micro-batch).
Candidate = tuple[int, bool]


class SaverPeaks:
    """The configs the plan's savers make of `train` with `field` set to a value (without savers: that config),
    each judged once: every saver rung, with the vLLM share the plan gives it, at its own micro-batch and, unless
    the micro-batch is what is maximized, at its smallest (between them memory grows with the micro-batch). Rung 0
    is the config as given."""

    def __init__(self, context: Context, train: TrainingConfig, field: str, allow_savers: bool,
                 memo: dict[tuple[int, bool, int], Verdict | None] | None = None) -> None:
        self.context, self.train, self.field, self.allow_savers = context, train, field, allow_savers
        self.savers = _saver_changes(train, context.gpu.bf16, context.arch, field) if allow_savers else [{}]
        self.micro_batch_choices = (True, False) if allow_savers and field != "per_device_train_batch_size" else (
            False,)
        # the ladder's last rung at its smallest micro-batch usually needs the least: searched first
        self.candidates: list[Candidate] = [(k, s) for k in reversed(range(len(self.savers)))
                                            for s in self.micro_batch_choices]
        self.memo = {} if memo is None else memo

    def config(self, candidate: Candidate, value: int) -> TrainingConfig | None:
        """The candidate's config at this value; None when TRL refuses it there."""
        rung_index, at_smallest = candidate
        try:
            rung = with_changes(self.train, **{self.field: value}, **self.savers[rung_index])
        except ConfigError:
            return None
        rung = vllm_tuned(self.context, rung) if self.allow_savers else rung  # as the plan judges each rung
        return with_micro_batch(rung, smallest_micro_batch(rung)) if at_smallest else rung

    def verdict(self, candidate: Candidate, value: int) -> Verdict | None:
        """The candidate judged at this value in this context (None when TRL refuses it there)."""
        key = (*candidate, value)
        if key not in self.memo:
            config = self.config(candidate, value)
            self.memo[key] = None if config is None else judge(self.context, config)
        found = self.memo[key]
        if found is None or found.context is self.context:
            return found
        return Verdict(self.context, found.train, found.estimate)  # judged in a context with the same peaks

    def peak(self, candidate: Candidate, value: int) -> float:
        """The peak the budget is held against: infinite where the config cannot run for another reason (TRL
        refuses it, or vLLM cannot start in its share of the card), whatever the trainer's peak."""
        found = self.verdict(candidate, value)
        return math.inf if found is None else self.peak_of(found)

    def least(self, value: int) -> float:
        """The least peak the savers reach at this value (infinite: none of them can run)."""
        return min(self.peak(candidate, value) for candidate in self.candidates)

    def lowest(self, value: int) -> Verdict:
        """The candidate that needs the least at this value, judged (one that runs, when one does)."""
        found = [v for v in (self.verdict(c, value) for c in self.candidates) if v is not None]
        return min(found, key=lambda v: (self.peak_of(v), v.estimate.peak_bytes))

    def peak_of(self, verdict: Verdict) -> float:
        """A judged config's peak as `peak` holds it against the budget."""
        peak = verdict.estimate.peak_bytes
        return peak if verdict.fits or peak > self.context.budget_bytes else math.inf


def largest_within(count: int, peak_at: Callable[[int], float], budget_bytes: float) -> int:
    """The largest index below `count` whose peak is within the budget, for peaks that never fall (-1: none).

    Peaks are close to linear in lengths, batches and ranks, so each probe is where the line through two known peaks
    meets the budget, checked with its neighbour; bracketing at least doubles the index and every step at least
    halves the bracket (bisecting when the line did not), so a search costs at most about 4 x log2(answer)
    estimates, and a handful where the peaks are linear."""
    if count == 0 or peak_at(0) > budget_bytes:
        return -1
    low, high = 0, count  # peak_at(low) is within the budget, peak_at(high) beyond it (count: past the last index)
    while high == count and low < count - 1:  # bracket: jump to the line through 0 and low, at least doubling
        probe = min(max(_crossing(0, low, peak_at, budget_bytes), 2 * low + 1), count - 1)
        low, high = (probe, high) if peak_at(probe) <= budget_bytes else (low, probe)
    while high - low > 1:
        width = high - low
        guess = min(max(_crossing(low, high, peak_at, budget_bytes), low + 1), high - 1)
        for probe in (guess, guess + 1 if peak_at(guess) <= budget_bytes else guess - 1):
            if low < probe < high:
                low, high = (probe, high) if peak_at(probe) <= budget_bytes else (low, probe)
        if high - low > width // 2 and high - low > 1:  # the line missed: bisect once
            middle = (low + high) // 2
            low, high = (middle, high) if peak_at(middle) <= budget_bytes else (low, middle)
    return low


def _crossing(left: int, right: int, peak_at: Callable[[int], float], budget_bytes: float) -> int:
    """Where the line through the peaks at two indices meets the budget (past `right` when the peaks are equal)."""
    rise = peak_at(right) - peak_at(left)
    if left == right or rise <= 0:
        return 2 * right + 1
    return left + math.floor((budget_bytes - peak_at(left)) / rise * (right - left))


def _saver_changes(train: TrainingConfig, gpu_bf16: bool, arch: ModelArchitecture,
                   field: str) -> list[dict[str, Any]]:
    """The plan's rungs before it changes the training semantics, each as the fields it sets (the first: none).
    Which savers apply does not depend on the knobs maximized, so they are found once and applied to every value."""
    changes = []
    for run in ladder_runs(train, gpu_bf16, arch):
        for rung in run:
            if any(getattr(rung, f) != getattr(train, f) for f in SEMANTIC_FIELDS):
                return changes
            changes.append({f: getattr(rung, f) for f in knob_names()
                            if f != field and getattr(rung, f) != getattr(train, f)})
    return changes


def _plan_at(context: Context, peaks: SaverPeaks, value: int, describe: bool = True) -> Plan:
    """The plan at the answer: the config as given, or the first saver rung that fits at its largest micro-batch that
    fits (the plan's own choice; at its own micro-batch when that is what was maximized), with the changes."""
    requested = peaks.verdict((0, False), value)
    train = requested.train
    if requested.fits:
        return Plan(requested, requested, (), requested, (0, -train.per_device_train_batch_size))
    for rung_index in range(len(peaks.savers)):
        if all(peaks.peak((rung_index, s), value) > context.budget_bytes for s in peaks.micro_batch_choices):
            continue
        own = peaks.verdict((rung_index, False), value)
        rung = own.train
        if peaks.field == "per_device_train_batch_size":
            chosen = smallest = own
        else:  # the plan from this rung: it fits there, at the largest micro-batch that does
            from_rung = best_plan(context, rung)
            chosen, smallest = from_rung.chosen, from_rung.smallest
        changes = describe_changes(context, train, rung, chosen.train) if describe else ()
        return Plan(requested, chosen, changes, smallest,
                    (rung_index, -chosen.train.per_device_train_batch_size))
    raise AssertionError("the search found a value no saver rung fits")  # unreachable: the search judged them


def peak_memo_key(context: Context, train: TrainingConfig) -> tuple[Any, ...]:
    """Contexts with equal keys give every config the same estimate: the card enters it through its CUDA context,
    NCCL's buffers on it, vLLM's budget on it, and (for the savers) its bf16 support."""
    vllm_card = repr(context.gpu) if train.use_vllm else None  # its budget and messages follow the card
    return (repr(train), repr(context.calibration), context.cuda_context.bytes, context.nccl(train).bytes,
            context.gpu.bf16, vllm_card)


def verdict_at(maximized: Maximized) -> Verdict:
    """The verdict the answer stands on: the chosen config, else the least the savers make of the smallest value."""
    return maximized.plan.chosen or maximized.plan.smallest
