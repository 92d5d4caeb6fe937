"""The words both faces say of a report (the command line in rich text, the web page in Markdown): the first
micro-batch, the boundary, a small saving, the footer's assumptions. Fields are named as errors name them
(vram_planner.errors.field_name), for each face to spell."""

from __future__ import annotations

from vram_planner.errors import field_name
from vram_planner.model.phases import PHASE_TITLES
from vram_planner.model.verdict import NEED_ABOVE_ESTIMATE, NEED_BELOW_ESTIMATE
from vram_planner.report.document import ChangeReport, Report
from vram_planner.units import GiB, KiB, MiB


def _g(n_bytes: float) -> str:
    return f"{n_bytes / GiB:.2f}"


def first_micro_batch_line(first) -> str:  # first: vram_planner.report.document.FirstMicroBatchReport
    """The first micro-batch of the run judged on its own, in words."""
    where = f"{PHASE_TITLES.get(first.peak_phase, first.peak_phase)}, {first.peak_moment}".rstrip(", ")
    if first.fits:
        return (f"The first micro-batch fits ({_g(first.peak_bytes)} GiB in {where}, before any optimizer state "
                "exists): the run gets past it and runs out once the optimizer states (or accumulated gradients) "
                "exist")
    return (f"Dies before its first optimizer step: the first micro-batch alone, with no optimizer state yet, needs "
            f"{_g(first.peak_bytes)} GiB in {where}")


def sentence(words: str) -> str:
    """Words that start lower-case in a list (notes, JSON) as a sentence of their own."""
    return f"{words[:1].upper()}{words[1:]}."


def copy_verdict(report: Report) -> str:
    """Why a verdict the kept copy of the exact engine decided says what it says (report.copy is set)."""
    ran = "runs" if report.copy.runs else "runs out"
    return (f"the exact engine's copy of this step {ran} on this card, replayed through the caching allocator model "
            f"(estimated peak {_g(report.peak_bytes)} GiB; `--exact` traces it for its need)")


def near_boundary_reason(report: Report) -> str:
    """Why the estimate's verdict could be the other way round (the web page says it too)."""
    if report.fits and report.decoding_holes_bytes and not _within_band_of_peak(report):
        return (f"generation's growing keys and values under expandable segments can leave up to "
                f"{saving(report.decoding_holes_bytes)} mapped beyond the estimate (a page a layer; the allocator "
                "model's replays of the decoding stay under it), and this card would not hold that")
    if report.fits:
        above = report.need_above_estimate or NEED_ABOVE_ESTIMATE
        steps = report.need_above_steps or "steps"
        return (f"{steps} have needed up to {above:.0%} more than the estimate (the most measured), and this card "
                "would not hold that")
    return (f"steps have needed up to {NEED_BELOW_ESTIMATE:.0%} less than the estimate (the most measured), and "
            "this card would hold that")


def _within_band_of_peak(report: Report) -> bool:
    """Whether the share band on the peak flags the step on its own (Verdict.near_boundary's first reason)."""
    above = report.need_above_estimate or NEED_ABOVE_ESTIMATE
    return report.peak_bytes * (1 + above) > report.capacity_bytes


# Why the allocator holds more than the step needs, as nvidia-smi shows it: the question users ask.
def saving(n_bytes: float) -> str:
    """GiB to two decimals, or a smaller unit where that would read 0.00."""
    return f"{_g(n_bytes)} GiB" if n_bytes >= GiB / 200 else small_amount(n_bytes)


def change_effect(change: ChangeReport) -> str:
    """What a plan's change does to the peak, in words: a cost, a saving, or nothing (vLLM's shorter context where
    the share stays: it is made so that vLLM starts in that share, and its reason says so)."""
    if change.cost_bytes > 0:
        return f"costs {_g(change.cost_bytes)} GiB"
    return f"saves {saving(change.saved_bytes)}" if change.saved_bytes > 0 else "peak unchanged"


def small_amount(n_bytes: float) -> str:
    """A few bytes in the unit that shows them: one token more can need a fraction of a MiB."""
    unit, size = next(((u, s) for u, s in (("GiB", GiB), ("MiB", MiB)) if n_bytes >= s), ("KiB", KiB))
    return f"{n_bytes / size:.1f} {unit}"


def footer_lines(report: Report) -> list[str]:
    """What was assumed and noted, a line each (the notes say flags: they are the JSON document's)."""
    prompt = report.assumptions["max_prompt_length"]
    if report.assumptions.get("prompts_truncated"):
        assumed = f"prompts of {prompt} tokens (TRL {report.trl_version} truncates longer ones to max_prompt_length)"
    else:
        assumed = (f"the longest prompt is {prompt} tokens (set {field_name('max_prompt_length')}; TRL no longer "
                   "truncates prompts)")
    lines = [f"Assumed: {assumed}. Calibration: {report.calibration}."]
    lines += [f"Note: {n}" for n in report.notes]
    if not report.grpo_config_valid:
        lines += [f"GRPOConfig would reject this: {p}" for p in report.grpo_config_problems]
    return lines
