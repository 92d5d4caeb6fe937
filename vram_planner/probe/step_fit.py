"""The step-time model's efficiency factors, fitted to the phase times a probe measured on one card.

The probe times each phase of its points (CUDA-synchronized wall time): the loss forward and backward of a micro-batch
(two when gradients accumulate), the no-grad scoring forwards of a micro-batch, the optimizer step, and generate()
decoding a few tokens for real (its memory phase runs only the prefill and the last decoding step); a run that kept
no phases gives whole optimizer steps (`step`). Each is the model's prediction for the same work under some factors
(vram_planner/model/step_time.py); coordinate descent over a geometric grid finds the factors with the least squared
log error, each sample's weighed by its seconds: a step's time is what is predicted, and a phase of milliseconds (the
optimizer's) should not pull the factors that seconds of generation depend on. Whole steps fit only where no phase
was timed: they cannot say which phase is off. A factor that bounds no measured phase
under the factors fitted keeps its prior and is not written.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import product
from typing import Any

from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.step_time import (Card, Efficiency, generation_round_seconds, micro_batch_seconds,
                                          optimizer_step_seconds, scoring_pass_seconds, step_time)
from vram_planner.profiles import GpuProfile

FITTED_FACTORS = ("op_seconds", "matmul", "bandwidth", "decode_bandwidth", "train_op_seconds", "tensor_seconds",
                  "optimizer_bandwidth")
# Shares of a peak cannot pass 1; the host time per op has no such bound.
SHARES = ("matmul", "bandwidth", "decode_bandwidth", "optimizer_bandwidth")
# Candidate values: the prior times 2^(k/16) from 1/16 to 16 times it (steps of 4.4%).
GRID = tuple(2 ** (k / 16) for k in range(-64, 65))
STEP = GRID[1] / GRID[0]
MAX_VALLEY_STEPS = 60
MAX_PASSES = 10  # coordinate descent sweeps, until none moves a factor (decoding's launches and bytes interact)
TIMED_PHASES = ("training", "scoring", "optimizer", "decoding", "step")


@dataclass(frozen=True)
class TimedPhase:
    """One phase a probe timed: `decoding` is generate() with `new_tokens` new tokens for the generation batch,
    `step` a whole optimizer step."""

    arch: ModelArchitecture
    train: TrainingConfig
    phase: str
    seconds: float
    new_tokens: int = 0


def predicted_seconds(sample: TimedPhase, gpu: GpuProfile, eff: Efficiency) -> float:
    """The model's seconds for the work the probe timed."""
    train, card = sample.train, Card.of(gpu, sample.train, eff)
    if sample.phase == "training":  # the probe runs two micro-batches when gradients accumulate
        return (2 if train.gradient_accumulation_steps > 1 else 1) * micro_batch_seconds(sample.arch, train, card)[0]
    if sample.phase == "scoring":
        passes = int(train.computes_old_logps) + int(train.computes_ref_logps)
        return passes * scoring_pass_seconds(sample.arch, train, card)[0]
    if sample.phase == "optimizer":
        return optimizer_step_seconds(sample.arch, train, card)
    if sample.phase == "decoding":
        return generation_round_seconds(sample.arch, train, card, new_tokens=sample.new_tokens)[0]
    if sample.phase == "step":
        return step_time(sample.arch, train, gpu, eff).step_seconds
    raise ValueError(f"no prediction for a timed phase named {sample.phase!r}; known: {', '.join(TIMED_PHASES)}")


def log_errors(samples: Iterable[TimedPhase], gpu: GpuProfile, eff: Efficiency) -> list[float]:
    """log(predicted / measured) of each sample."""
    return [math.log(predicted_seconds(s, gpu, eff) / s.seconds) for s in samples]


def fit_step_time(samples: list[TimedPhase], gpu: GpuProfile) -> dict[str, float]:
    """The factors that best predict the samples' times on `gpu`; only those some sample depends on."""
    samples = [s for s in samples if s.seconds > 0 and s.phase in TIMED_PHASES]
    # a whole step mixes every phase, and its seconds of generation outweigh the milliseconds of the optimizer whose
    # factors it would move to make up for generation's error: where phases were timed, they alone fit
    phased = [s for s in samples if s.phase != "step"]
    samples = phased or samples
    if not samples:
        return {}

    weights = [s.seconds for s in samples]

    def loss(e: Efficiency) -> float:
        return sum(weight * err * err for weight, err in zip(weights, log_errors(samples, gpu, e)))

    def moves(e: Efficiency, name: str) -> bool:  # some sample's time moves with the factor's next grid step
        here = loss(e)
        return any(loss(replace(e, **{name: getattr(e, name) * g})) != here for g in (STEP, 1 / STEP))

    prior, eff = Efficiency(), Efficiency()
    used: list[str] = []
    for _ in range(MAX_PASSES):
        before = eff
        # a factor joins where a bound it sets binds a sample under the factors fitted so far: one bound nowhere
        # near would otherwise go to the grid's edge to make up for what the model misses elsewhere (the H200's
        # launch-bound training pulled matmul to 0.05 of the peak and decoding's bandwidth to 0.04)
        used += [name for name in FITTED_FACTORS if name not in used and moves(eff, name)]
        for name in used:
            start = getattr(prior, name)
            values = [start * g for g in GRID if name not in SHARES or start * g <= 1.0]
            losses = {v: loss(replace(eff, **{name: v})) for v in values}
            least = min(losses.values())
            # where the samples do not pin a factor down (a bound none of them reaches), the prior stays
            tied = [v for v, value in losses.items() if value <= least * (1 + 1e-9) + 1e-12]
            eff = replace(eff, **{name: min(tied, key=lambda v: abs(math.log(v / start)))})
        if eff == before:
            break
    eff = _along_valleys(eff, used, loss)
    return {name: float(f"{getattr(eff, name):.4g}") for name in FITTED_FACTORS if name in used}


def _on_grid(eff: Efficiency, name: str) -> bool:
    """Within the grid's range around the prior (and at most 1 for a share of a peak)."""
    value, prior = getattr(eff, name), getattr(Efficiency(), name)
    return prior * GRID[0] * 0.999 <= value <= prior * GRID[-1] * 1.001 and (name not in SHARES or value <= 1.0)


def _along_valleys(eff: Efficiency, used: list[str], loss: Any) -> Efficiency:
    """Steps of one grid spacing in several factors at once, while one lowers the loss: coordinate descent stalls
    where two factors trade off (decoding's launches against its bytes), and these diagonal steps go on along the
    valley."""
    current = loss(eff)
    for _ in range(MAX_VALLEY_STEPS):
        moves = [dict(zip(used, signs)) for signs in product((-1, 0, 1), repeat=len(used)) if any(signs)]
        candidates = [replace(eff, **{n: getattr(eff, n) * STEP ** d for n, d in move.items()}) for move in moves]
        candidates = [c for c in candidates if all(_on_grid(c, n) for n in used)]
        best = min(candidates, key=loss)
        if loss(best) >= current:
            return eff
        eff, current = best, loss(best)
    return eff


def timed_phases(record: Any) -> list[TimedPhase]:
    """The timed phases of a probe record's points (vram_planner.probe.fit.ProbeRecord); none from older records,
    which kept no phase times."""
    from vram_planner.model.resolve import resolve_model

    samples = []
    for point in record.points:
        arch, train = resolve_model(point.model), TrainingConfig(**point.settings)
        samples += [TimedPhase(arch, train, phase.name, phase.seconds) for phase in point.phases
                    if phase.seconds is not None and phase.name in TIMED_PHASES]
        if point.decode_seconds is not None:
            samples.append(TimedPhase(arch, train, "decoding", point.decode_seconds, point.decode_tokens))
    return samples
