"""The loss phase's allocator reserve (and expandable segments' patterns), fitted on whole steps' needs on the grid.

    python benchmarks/boundary.py          # first: the needs, each phase's traced tensors, the phase that decides
    python benchmarks/reserve_fit.py       # the fit, in-sample and leaving each model out, beside the shipped one
    python benchmarks/reserve_fit.py --write   # also store it in profiles/calibrations/default.json
    python benchmarks/reserve_fit.py --from-needs   # on the committed needs, whatever code made them
    python benchmarks/reserve_fit.py --write --keep-loss   # store generation's refit, the loss phase's as shipped
    python benchmarks/reserve_fit.py --write --keep-default   # store expandable segments' refit alone

Writes benchmarks/results/reserve_fit.txt (each point's error with the shipped, the fitted and the left-out
coefficients) and reserve_fit.json (the coefficients and errors).

benchmarks/allocator_fit.py fits each phase's reserve on its own, with what earlier phases cached freed; what decides a
verdict is the whole step's need (benchmarks/boundary.py), where most steps run out in the loss backward. There the
reserve is mostly memory that allocation patterns strand (vram_planner.model.fragmentation): the checkpointed layer
inputs pinned in the segments of the MLP's projections, the embedding's gradient made last in a cache cut into smaller
pieces, the partly used 20 MiB segments, a later micro-batch's inputs cut from the blocks the previous backward freed,
full fine-tuning's layer gradients cut from the intermediates' blocks, the score segment eager attention's forward adds
once the kept inputs overflow the half-score segments, the embedding's first optimizer state cut from the fused LM
head's tile segment, the first optimizer step's states cut from the segments generation's prefill left. For every point
of the boundary grid whose step runs out in the loss phase (torch's default allocator), the reserve is the need less the
cuBLAS workspaces and the traced tensor peak of that phase; it is fitted as a non-negative linear function of the
analytic activations and the patterns' bytes. The loss is relative to the need (a miss matters as a share of the card),
a reserve predicted short weighs UNDER_WEIGHT times one predicted long (short is a "fits" that runs out), and residuals
beyond HUBER of the need weigh less (Huber), so that the one mechanism not modelled (eager attention at long context,
whose score blocks the inputs pin) does not set the rest. A pattern the mechanism describes fully comes out near 1 byte
per byte.

Whether a pattern strands its block at a given point is all or nothing (a smaller tensor cuts the block or does not), so
a linear function of the patterns is short at some points whatever its coefficients: UNDER_WEIGHT sets where it stands
between the issue's two targets on the boundary grid (no point more than 1% under its need, median |error| under 2%).
With the patterns of 2026-11-26 the grid's count of points more than 1% under and its median were 15 and 1.34% at 4, 5
and 1.62% at 15, 3 and 1.92% at 30, 1 and 2.12% at 40 (the one left in the generation phase, which allocator_fit.py
fits); with generation's pattern of 2026-11-28, 2 and 1.92% at 30, none but 2.11% (and 17.2% over, against 16.6%) at 40.
With eager attention's overflow (2026-11-28, later) one was left, Llama-3.2-1B's float32 full fine-tuning with 8-bit
AdamW, until 60 (0.98% under, a median of 1.97%). TRL's plain defaults (float32, fused AdamW) then joined the grid, ten
points, with the pattern of the embedding's first optimizer state cut from the fused LM head's tile segment
(SmolLM2-135M's and phi-2's were 3.9% and 1.9% under before): 2 points more than 1% under and a median of 1.90% at 25, 1
(Llama-3.2-1B's 8-bit AdamW, 1.02% under) and 1.93% at 30, none from 31 (0.99% under, 1.94%), 0.95% under and 1.96% at
33, 0.90% and 1.98% at 35, a median of 2.02% at 40 and 2.11% at 60. (What Llama-3.2-1B's 8-bit point strands beyond
the others: its 8-bit states, made in the first optimizer step, are cut from the free segment of the tied embedding's
second gradient, and 501 of its 1,002 MiB stay beside them; a pattern for that alone took so much from the embedding's
gradient's coefficient that TRL's defaults fell under their needs.) That fit leaned on its points: each model's points
under the others' fit were 10 more than 1% under, the worst 4.1%. With the first step's states in the prefill's
segments (2026-11-28, later: Mistral-7B's and phi-2's full fine-tuning held 0.6 to 1.9 GiB that way) the weight falls
to 28 (the least with no point more than 1% under: 1 at 25 and 26, none from 27; the worst over stays within the
+14.83% before up to 28, +14.84% at 29, +14.90% at 33; the median 1.86% at 28, 1.93% at 33, 2.01% at 40) and the
left-out points to 7 more than 1% under, the worst 2.5% (6 from 33 on). The loaded weights' segments
(stranding.loaded_weight_segment_bytes, 2026-11-29: what the 2 MiB rounding of each weight's segment leaves, 99 MiB for
Qwen2.5-0.5B in float32, 147 MiB for Qwen2.5-1.5B in bfloat16, none for Llama or Mistral) are exact and added to every
phase's reserve outside the fit: the reserve fitted here is the need's less them. Refitted so, the weight rises to 30,
the least that leaves a single point more than 1% under beside the three before (Llama-3.2-1B's float32 full
fine-tuning with 8-bit AdamW, 1.4%; it needs 65, and a median of 2.10%), with eager attention's overflow held (HELD):
the grid's median 1.94%, and over the held-out sweeps 23 points more than 1% under where there were 29, none new
in a window (the 24 GiB sweep's 6 -> 3, as the weights' rests were what its Qwen2.5 and gemma steps missed).

Under expandable segments the loss phase's reserve is the per-phase shares allocator_fit.py fits plus expandable_pages'
patterns (the partial pages that islands of live tensors keep mapped once the whole free pages are released), whose
coefficients are fitted here with the same loss on the grid's expandable points that run out in the loss phase: the
reserve beyond the phase's estimate with the shares alone, against the patterns' bytes. The grid had expandable
segments only with bfloat16 LoRA and checkpointing until 2026-11-28, when the held-out sweep (boundary_heldout.py) found
five configs more than 1% under with them (full fine-tuning, 8-bit AdamW, checkpointing off); four expandable configs
joined the grid then, and the held-out points were read to find the patterns (no longer a clean hold-out).

Generation's patterns (generation_patterns.GENERATION_PATTERNS: the KV cache's growing blocks cut from the segments
the previous step's loss left, counted for the whole generation batch and, as a block's envelope, for one
micro-batch's; from the segments generation's prefill left; the first step's states in the segments the decoding left;
the prefill's largest request beside the segment a smaller tensor pins) are weighed on top of the per-phase shares
allocator_fit.py fits, the prefill's at its moments and the others at the decoding's. Their coefficients are fitted
with the same loss over every point's error under torch's defaults, the estimate being the largest phase (and, within
generation, the larger of its prefill and decoding): a generation reserve too large shows at the steps decided
elsewhere, one too small at those that run out generating. With the 20 generation-bound points of 2026-11-28
(256 or 512 sequences at once) the loss segments' pattern comes out 0, the micro-batch's envelope covering it. Those
points put 5 more steps in the loss phase, all over their needs (+0.8% to +10.3%); refitted on them the loss phase's
coefficients leave the grid's median at 2.09% with a point 1.1% under (2.12% and none at 32), so --keep-loss stores
the shipped ones and refits generation's alone. The 20 prefill-bound points (512 prompts for a micro-batch of 8,
2026-11-28, later) set the prefill's largest request at its bound, 1 byte a byte (a segment's rest, less than the
request, strands), and move the decoding's (the prefill segments' 1.08 to 0.70, the micro-batch's block 1.74 to
2.47); allowed 2, the fit takes 1.17 and the over-estimates grow (gemma-3-1b-it's eager LoRA +19.3%) while the one
window left (Qwen3-0.6B's eager LoRA, decided at the decoding) moves from -6.3% to -5.1% only. That window's decoding
ran in the segments of eager attention's float32 scores, which the prefill's pattern counts since 2026-11-29 where
they outgrow the MLP's tensors: refitted, the window closes (-3.6%, no window left; the median 1.97% -> 1.95%, 4
points more than 1% under, against 3 and the window). The prefill segments' coefficient is bounded at 1: the pattern
is a rest the last step's blocks leave, which strands no more than itself, and above 1 the reserve can fall faster
than the cache grows with the completion (allowed 2, the fit took 1.46, and a Phi-3-mini LoRA generation needed less
for 2 completion tokens than for 1). Where that point ran out, eager attention's decoding asked for its copy of a
layer's keys for the 16 query heads (766 MiB); with that request as a pattern (bounded at 2, the keys' and the
values' copies alive at once; the fit takes 1.34) it is 0.1% under, held-out seed 2's gemma-2-2b, which ran out at
the same copy, 3.9% -> 0.8%, and the grid's median 1.93% with 3 points more than 1% under.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from allocator_fit import bounded_least_squares  # noqa: E402
from accuracy import save_atomically  # noqa: E402
from boundary import CARD, MODELS, RESULTS, committed_needs, points  # noqa: E402

from vram_planner import engine  # noqa: E402
from vram_planner.model.calibration import Calibration, default_calibration  # noqa: E402
from vram_planner.model.expandable_pages import EXPANDABLE_PATTERNS, expandable_patterns  # noqa: E402
from vram_planner.model.fragmentation import EAGER_OVERFLOW, PATTERNS, reserve_patterns  # noqa: E402
from vram_planner.model.generation_patterns import (CACHE_IN_LOSS_SEGMENTS,  # noqa: E402
                                                    CACHE_IN_MICRO_BATCH_SEGMENTS, CACHE_IN_PREFILL_SEGMENTS,
                                                    DECODING_REPEATED_KV, GENERATION_PATTERNS,
                                                    PREFILL_LARGEST_REQUEST, PREFILL_PATTERNS,
                                                    STATES_IN_DECODING_SEGMENTS, cache_in_prefill_segment_bytes)
from vram_planner.model.phases import (PREFILL_MOMENTS, TENSOR_COMPONENTS, generation_moments,  # noqa: E402
                                       persistent_bytes, with_overheads)
from vram_planner.model.stranding import loaded_weight_segment_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CALIBRATION = ROOT / "profiles" / "calibrations" / "default.json"
FEATURES = ("activations", *PATTERNS)
UNDER_WEIGHT = 30.0
# Held at the shipped calibration's value when the loss phase is refitted: few grid steps bind on eager attention's
# overflow, and a refit moves it for reasons of other points (the loaded weights' rests, 2026-11-29, made eager points
# of models that leave them over their needs, and the fit took it from 0.42 to 0.18, which put the 24 GiB sweep's
# SmolLM2-135M eager LoRA, a step its overflow decides, 5.7% under its need)
HELD = (EAGER_OVERFLOW,)
HUBER = 0.05
MAX_RESERVE_PER_BYTE = 4.0  # a pattern strands at most a few times its own bytes
# Generation's patterns per byte at most: the rest beside the cache's blocks falls as the completion grows, by less
# than the cache grows where the blocks outnumber the segments a few times, and strands no more than itself (the
# loss's and the prefill's segments: generation_patterns.cache_in_loss_segment_bytes, cache_in_prefill_segment_bytes);
# the states strand at most what they are; a block stands for the loss's segments that hold one (about ten at the
# grid's needs); the prefill's largest request strands at most its segment less the smaller tensor cut from it; eager
# attention's copies of the keys and of the values are two requests alive at once
GENERATION_BOUNDS = {CACHE_IN_LOSS_SEGMENTS: 1.0, CACHE_IN_PREFILL_SEGMENTS: 1.0, STATES_IN_DECODING_SEGMENTS: 1.0,
                     CACHE_IN_MICRO_BATCH_SEGMENTS: 12.0, PREFILL_LARGEST_REQUEST: 1.0, DECODING_REPEATED_KV: 2.0}
# generation's patterns weighed at the decoding's moments
DECODING = tuple(name for name in GENERATION_PATTERNS if name not in PREFILL_PATTERNS)


def rows(cache: dict) -> list[dict]:
    """The points whose step runs out in the loss phase under torch's default allocator, with the analytic
    features of that phase and the reserve the allocator model needed beyond its traced tensors."""
    out = []
    for label, model, settings in points(list(MODELS), quick=False):
        entry = cache.get(label)
        if entry is None or entry.get("binding_phase") != "training":
            continue
        verdict = engine.check(model, CARD, settings, calibration=default_calibration())
        if verdict.train.expandable_segments:
            continue
        phase = next(p for p in verdict.estimate.phases if p.name == "training")
        features = {**phase.components, **reserve_patterns(verdict.context.arch, verdict.train, "training")}
        workspaces, context = phase.components["cublas_workspaces"], phase.components["cuda_context"]
        exact = loaded_weight_segment_bytes(verdict.context.arch, verdict.train)  # not fitted: on top of the fit
        out.append({"point": label, "model": model,
                    "features": {name: float(features.get(name, 0.0)) for name in (*TENSOR_COMPONENTS, *PATTERNS)},
                    "reserve_bytes": (entry["allocator_need_bytes"] - workspaces
                                      - entry["tensor_peak_bytes"]["training"] - exact),
                    "need_bytes": entry["allocator_need_bytes"] + context,
                    "without_reserve_bytes": phase.tensor_bytes + workspaces + context + exact})
    return out


def fit(points_: list[dict], features: tuple[str, ...] = FEATURES,
        held: dict[str, float] | None = None) -> dict[str, float]:
    """Non-negative coefficients per feature: asymmetric, Huber-weighted least squares relative to the need, by
    iteratively reweighting; the `held` features keep their coefficients and the others are fitted beside them."""
    held = held or {}
    fitted = tuple(name for name in features if name not in held)
    if len(fitted) < len(features):
        out = fit([{**p, "reserve_bytes": p["reserve_bytes"] - sum(v * p["features"][n] for n, v in held.items())}
                   for p in points_], fitted)
        return {name: out[name] if name in out else held[name] for name in features}
    x = np.array([[p["features"][name] for name in features] for p in points_])
    y = np.array([p["reserve_bytes"] for p in points_], dtype=float)
    need = np.array([p["need_bytes"] for p in points_], dtype=float)
    weights = np.ones(len(points_))
    for _ in range(100):
        scale = np.sqrt(weights) / need
        a = bounded_least_squares(x * scale[:, None], y * scale, MAX_RESERVE_PER_BYTE)
        residual = (x @ a - y) / need
        renewed = (np.where(residual < 0, UNDER_WEIGHT, 1.0)
                   * np.minimum(1.0, HUBER / np.maximum(np.abs(residual), 1e-12)))
        if np.allclose(renewed, weights, rtol=1e-9):
            break
        weights = renewed
    return {name: round(float(v), 4) for name, v in zip(features, a)}


def error(point: dict, coefficients: dict[str, float]) -> float:
    """(analytic peak - need) / need with these coefficients."""
    reserve = sum(coefficients.get(name, 0.0) * value for name, value in point["features"].items())
    return (point["without_reserve_bytes"] + reserve - point["need_bytes"]) / point["need_bytes"]


def left_out_errors(points_: list[dict], features: tuple[str, ...] = FEATURES,
                    held: dict[str, float] | None = None) -> dict[str, float]:
    """Each point's error under the fit of every other model's points."""
    out = {}
    for model in sorted({p["model"] for p in points_}):
        coefficients = fit([p for p in points_ if p["model"] != model], features, held)
        out.update({p["point"]: error(p, coefficients) for p in points_ if p["model"] == model})
    return out


def bare_calibration(setting: str, phase: str, patterns: tuple[str, ...],
                     loss: dict[str, float] | None = None) -> Calibration:
    """The default calibration with `patterns` taken out of `setting`'s reserve for `phase`: the estimate their fit
    stands on; with `loss`, those coefficients for the loss phase under torch's defaults (the ones being stored)."""
    shipped = default_calibration().allocator_reserve
    kept = {name: value for name, value in shipped[setting][phase].items() if name not in patterns}
    reserve = {**shipped, setting: {**shipped[setting], phase: kept}}
    if loss is not None:
        reserve["default"] = {**reserve["default"], "training": loss}
    return replace(default_calibration(), allocator_reserve=reserve)


def generation_rows(cache: dict, loss: dict[str, float] | None = None) -> list[dict]:
    """Every point with a need under torch's default allocator, with what the analytic step needs outside
    generation, generation's heaviest prefill and decoding moments without its patterns, and the patterns' bytes: a
    generation reserve that overshoots raises the estimate of a step decided elsewhere, so every point has a say.
    The prefill's patterns weigh on its moments, the decoding's on theirs (phases._reserve)."""
    bare = bare_calibration("default", "generation", GENERATION_PATTERNS, loss)
    out = []
    for label, model, settings in points(list(MODELS), quick=False):
        entry = cache.get(label)
        if entry is None:
            continue
        verdict = engine.check(model, CARD, settings, calibration=bare)
        if verdict.train.expandable_segments:
            continue
        arch, train = verdict.context.arch, verdict.train
        generation = next(p for p in verdict.estimate.phases if p.name == "generation")
        context, workspaces = generation.components["cuda_context"], generation.components["cublas_workspaces"]
        moments = [(moment.moment in PREFILL_MOMENTS,
                    with_overheads(moment, bare, 0.0, train, context, workspaces, arch).total_bytes)
                   for moment in generation_moments(arch, train, bare, persistent_bytes(arch, train))]
        assert abs(max(total for _, total in moments) - generation.total_bytes) < 1, label  # the phase's moments
        # the need was traced with prompts of max_prompt_length: what they strand, not what shorter ones would
        patterns = {**reserve_patterns(arch, train, "generation"),
                    CACHE_IN_PREFILL_SEGMENTS: cache_in_prefill_segment_bytes(arch, train, shorter_prompts=False)}
        out.append({"point": label, "need_bytes": entry["allocator_need_bytes"] + context,
                    "others_bytes": max((p.total_bytes for p in verdict.estimate.phases if p.name != "generation"),
                                        default=0.0),
                    "prefill_bytes": max((total for prefill, total in moments if prefill), default=0.0),
                    "decoding_bytes": max((total for prefill, total in moments if not prefill), default=0.0),
                    "patterns": {name: float(patterns.get(name, 0.0)) for name in GENERATION_PATTERNS}})
    return out


def expandable_rows(cache: dict) -> list[dict]:
    """The points under expandable segments whose step runs out in the loss phase, with the analytic features of
    that phase (expandable_pages' patterns) and the reserve the allocator model needed beyond that phase's estimate
    with the per-phase shares alone (allocator_fit.py's): the patterns are fitted on top of the shares, as
    generation's are."""
    bare = bare_calibration("expandable_segments", "training", EXPANDABLE_PATTERNS)
    out = []
    for label, model, settings in points(list(MODELS), quick=False):
        entry = cache.get(label)
        if entry is None or entry.get("binding_phase") != "training":
            continue
        verdict = engine.check(model, CARD, settings, calibration=bare)
        if not verdict.train.expandable_segments:
            continue
        phase = next(p for p in verdict.estimate.phases if p.name == "training")
        patterns = expandable_patterns(verdict.context.arch, verdict.train, "training")
        need = entry["allocator_need_bytes"] + phase.components["cuda_context"]
        out.append({"point": label, "model": model, "need_bytes": need, "without_reserve_bytes": phase.total_bytes,
                    "reserve_bytes": need - phase.total_bytes,
                    "features": {name: float(patterns.get(name, 0.0)) for name in EXPANDABLE_PATTERNS}})
    return out


def generation_error(point: dict, coefficients: dict[str, float]) -> float:
    """(analytic peak - need) / need with these coefficients of generation's patterns."""
    def weighed(names: tuple[str, ...]) -> float:
        return sum(coefficients.get(name, 0.0) * point["patterns"][name] for name in names)

    generation = max(point["prefill_bytes"] + weighed(PREFILL_PATTERNS), point["decoding_bytes"] + weighed(DECODING))
    return (max(point["others_bytes"], generation) - point["need_bytes"]) / point["need_bytes"]


def fit_generation(points_: list[dict]) -> dict[str, float]:
    """The coefficients of generation's patterns (GENERATION_PATTERNS) that minimise the loss phase's fit's loss over
    the whole steps' errors (UNDER_WEIGHT, HUBER), the peak being a maximum over the phases and over generation's
    prefill and decoding: each coefficient in turn searched over 0.01 steps up to its bound (GENERATION_BOUNDS), the
    others held, until none moves."""
    patterns = np.array([[p["patterns"][name] for name in GENERATION_PATTERNS] for p in points_])
    at_prefill = np.array([name in PREFILL_PATTERNS for name in GENERATION_PATTERNS])
    prefill = np.array([p["prefill_bytes"] for p in points_])
    decoding = np.array([p["decoding_bytes"] for p in points_])
    others = np.array([p["others_bytes"] for p in points_])
    need = np.array([p["need_bytes"] for p in points_])

    def loss(coefficients: np.ndarray) -> np.ndarray:  # [candidates, patterns] -> [candidates]
        generation = np.maximum(prefill + (coefficients * at_prefill) @ patterns.T,
                                decoding + (coefficients * ~at_prefill) @ patterns.T)
        residual = (np.maximum(others, generation) - need) / need
        size = np.abs(residual)
        huber = np.where(size <= HUBER, residual ** 2, 2 * HUBER * size - HUBER ** 2)
        return np.sum(np.where(residual < 0, UNDER_WEIGHT, 1.0) * huber, axis=1)

    best = np.zeros(len(GENERATION_PATTERNS))
    for _ in range(50):
        before = best.copy()
        for i, name in enumerate(GENERATION_PATTERNS):
            candidates = np.round(np.arange(0, GENERATION_BOUNDS[name] + 0.005, 0.01), 2)
            trials = np.repeat(best[None, :], len(candidates), axis=0)
            trials[:, i] = candidates
            best[i] = candidates[int(np.argmin(loss(trials)))]  # the first of equal losses: the smallest
        if np.array_equal(best, before):
            break
    return {name: float(v) for name, v in zip(GENERATION_PATTERNS, best)}


def describe(errors: list[float]) -> str:
    return (f"median |error| {statistics.median(abs(e) for e in errors):.2%}, worst under {min(errors):+.1%}, "
            f"worst over {max(errors):+.1%}, {sum(e < -0.01 for e in errors)} more than 1% under")


def point_lines(points_: list[dict], shipped: dict, fitted: dict, left_out: dict[str, float]) -> list[str]:
    """Each point's error with the shipped, the fitted and the left-out coefficients."""
    return [f"{'point':50} {'shipped':>8} {'fitted':>8} {'left out':>9}",
            *(f"{p['point']:50} {error(p, shipped):+8.1%} {error(p, fitted):+8.1%} {left_out[p['point']]:+9.1%}"
              for p in points_)]


def fit_summary(points_: list[dict], shipped: dict, fitted: dict, left_out: dict[str, float]) -> list[str]:
    """The fitted coefficients, and the errors over the points with each set."""
    return ["coefficients (reserve bytes per byte): " + ", ".join(f"{k} {v}" for k, v in fitted.items()),
            "shipped:   " + describe([error(p, shipped) for p in points_]),
            "fitted:    " + describe([error(p, fitted) for p in points_]),
            "left out:  " + describe(list(left_out.values()))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"store the fit in {CALIBRATION.name}")
    parser.add_argument("--from-needs", action="store_true", help="the committed needs, whatever code made them")
    parser.add_argument("--keep-loss", action="store_true",
                        help="store the loss phase's shipped coefficients as they are, refitting generation's only")
    parser.add_argument("--keep-default", action="store_true",
                        help="store the shipped coefficients under torch's default allocator (the loss phase's and "
                             "generation's) as they are, refitting expandable segments' only")
    args = parser.parse_args()
    cache, key = committed_needs(args.from_needs, RESULTS / "boundary-needs.json")
    grid = rows(cache)
    if not grid:
        print("no cached need decided in the loss phase: run benchmarks/boundary.py first", file=sys.stderr)
        return 2
    shipped = default_calibration().allocator_reserve.get("default", {}).get("training", {})
    held = {name: shipped.get(name, 0.0) for name in HELD}
    coefficients = fit(grid, held=held)
    left_out = left_out_errors(grid, held=held)
    lines = [*point_lines(grid, shipped, coefficients, left_out),
             "", f"{len(grid)} steps that run out in the loss phase (torch's default allocator)",
             *fit_summary(grid, shipped, coefficients, left_out)]
    lines[-1] += " (each model's points under the others' fit)"
    if args.keep_loss or args.keep_default:  # the refit above is shown, the shipped coefficients stay
        coefficients = dict(shipped)
        kept = "--keep-default" if args.keep_default else "--keep-loss"
        lines.append(f"stored:    the shipped coefficients ({kept})")
    generating = generation_rows(cache, coefficients)  # beside the loss phase's coefficients stored
    generation = fit_generation(generating)
    if args.keep_default:
        shown = generation
        generation = {name: default_calibration().allocator_reserve["default"]["generation"].get(name, 0.0)
                      for name in GENERATION_PATTERNS}
        lines.append("generation's refit: " + ", ".join(f"{k} {v}" for k, v in shown.items())
                     + "; stored: the shipped coefficients (--keep-default)")
    moved = [p for p in generating if abs(generation_error(p, generation) - generation_error(p, {})) >= 0.0005]
    lines += ["", f"generation's patterns, over the {len(generating)} steps under torch's default allocator: "
              + ", ".join(f"{k} {v}" for k, v in generation.items()),
              *(f"{p['point']:50} {generation_error(p, {}):+8.1%} without, {generation_error(p, generation):+8.1%} "
                "with them" for p in moved)]
    expandable = expandable_rows(cache)
    expandable_fit = fit(expandable, EXPANDABLE_PATTERNS)
    shipped_expandable = default_calibration().allocator_reserve["expandable_segments"]["training"]
    expandable_left_out = left_out_errors(expandable, EXPANDABLE_PATTERNS)
    lines += ["", f"{len(expandable)} steps under expandable segments that run out in the loss phase, the "
              "patterns on top of the per-phase shares:",
              *point_lines(expandable, shipped_expandable, expandable_fit, expandable_left_out),
              *fit_summary(expandable, shipped_expandable, expandable_fit, expandable_left_out)]
    print("\n".join(lines))
    save_atomically(RESULTS / "reserve_fit.txt", "\n".join(lines) + "\n")
    document = {"key": key, "coefficients": {k: v for k, v in coefficients.items() if v > 0},
                "generation_coefficients": generation,  # a pattern the others cover is stored at 0
                "errors": {p["point"]: {"fitted": error(p, coefficients), "left_out": left_out[p["point"]]}
                           for p in grid},
                "expandable_coefficients": {k: v for k, v in expandable_fit.items() if v > 0},
                "expandable_errors": {p["point"]: {"fitted": error(p, expandable_fit),
                                                   "left_out": expandable_left_out[p["point"]]} for p in expandable}}
    save_atomically(RESULTS / "reserve_fit.json", json.dumps(document, indent=1) + "\n")
    if args.write:
        calibration = json.loads(CALIBRATION.read_text())
        calibration["allocator_reserve"]["default"]["training"] = document["coefficients"]
        shipped = calibration["allocator_reserve"]["default"]["generation"]
        calibration["allocator_reserve"]["default"]["generation"] = {
            **{k: v for k, v in shipped.items() if k not in GENERATION_PATTERNS}, **document["generation_coefficients"]}
        shipped = calibration["allocator_reserve"]["expandable_segments"]["training"]
        calibration["allocator_reserve"]["expandable_segments"]["training"] = {
            **{k: v for k, v in shipped.items() if k not in EXPANDABLE_PATTERNS}, **document["expandable_coefficients"]}
        save_atomically(CALIBRATION, json.dumps(calibration, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
