"""Predicted step times in the report: the seconds per optimizer step of the config shown, and for a plan every config
that fits ranked by them (optimize="speed" recommends the fastest; vram_planner.model.ranking ranks them)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from vram_planner.errors import ConfigError, VramPlanError, field_name

if TYPE_CHECKING:
    from vram_planner.report.document import Report

__all__ = ["check_step_time", "plan_step_times", "check_optimize", "OPTIMIZE_CHOICES"]

OPTIMIZE_CHOICES = ("memory", "speed")


def check_optimize(optimize: str, exact: bool = False, maximize: bool = False) -> None:
    """optimize is memory or speed, and speed asks nothing else: ranking the plan's configs by step time is another
    question than the traced need (exact) or the largest value of a knob (maximize)."""
    if optimize not in OPTIMIZE_CHOICES:
        raise ConfigError([f"{field_name('optimize')} should be memory or speed (got {optimize!r:.40})"])
    for name, asked in (("maximize", maximize), ("exact", exact)):
        if optimize == "speed" and asked:
            raise ConfigError([f"{field_name('optimize')} speed ranks the plan's configs by step time; "
                               f"{field_name(name)} answers another question: ask them one at a time"])


def check_step_time(report: Report, verdict: Any, reward: float = 0.0, prompts: int | None = None) -> Report:
    """The check's report with the predicted step time of its config (`verdict`, the judged config it shows).

    `reward`: seconds the reward functions take per completion; `prompts`: the dataset's, for the time of an epoch.
    """
    from vram_planner.model.ranking import timed

    with _without_speed_figures(report, "memory"):
        _add_time(report, timed(verdict, reward), prompts)
    return report


def plan_step_times(report: Report, plan: Any, context: Any, train: Any, optimize: str = "memory",
                    reward: float = 0.0, prompts: int | None = None) -> tuple[Report, Any]:
    """The plan's report (of `plan`, vram_planner.model.search.Plan, for the requested `train`) with the predicted
    step time of its config and every config that fits ranked by it; with optimize="speed" the fastest config's
    report in place of the memory plan's. Returns the report and the config it shows; `reward` and `prompts` as
    `check_step_time` takes them."""
    from vram_planner.model.ranking import knob_changes, rank_configs
    from vram_planner.model.search import Plan, describe_changes
    from vram_planner.report.document import plan_report

    shown = (plan.chosen or plan.smallest).train
    with _without_speed_figures(report, optimize):
        # the memory plan's alternatives generate as the user's config does: vLLM's model loads only when asked for
        ranking = rank_configs(context, plan, reward, try_vllm=optimize == "speed")
        report.optimize = optimize
        chosen = ranking.memory_choice
        if optimize == "speed" and ranking.fastest is not None:
            chosen = ranking.fastest
            fastest = chosen.verdict
            changes = describe_changes(context, train, fastest.train, fastest.train, join_costs=False)
            report = plan_report(Plan(plan.requested, fastest, changes, plan.smallest, plan.rank))
            report.optimize, shown = optimize, fastest.train
        _add_time(report, chosen if chosen is not None else ranking.requested, prompts)
        rows = [_alternative(r, knob_changes(train, r.train), r is chosen, prompts) for r in ranking.ranked]
        if not plan.requested.fits:  # how fast the config as asked would be, had the card room for it
            rows.append(_alternative(ranking.requested, {}, False, prompts))
        report.alternatives = rows
    return report, shown


@contextmanager
def _without_speed_figures(report: Report, optimize: str) -> Iterator[None]:
    """A card without speed figures: the report says so (its memory answer stands), unless speed was what was
    asked for."""
    from vram_planner.model.step_time import NoSpeedFigures

    try:
        yield
    except NoSpeedFigures as exc:
        if optimize == "speed":
            raise VramPlanError(f"{field_name('optimize')} speed: {exc}") from exc
        report.step_time = {"problem": str(exc)}


def _add_time(report: Report, ranked: Any, prompts: int | None) -> None:
    time = ranked.time
    report.step_seconds = round(time.step_seconds, 4)
    report.step_time = {"step_seconds": report.step_seconds,
                        "seconds": {phase: round(s, 4) for phase, s in time.seconds.items()},
                        "bounds": time.bounds,
                        "completion_tokens_per_second": round(time.completion_tokens_per_second, 1),
                        "completions_per_step": time.completions_per_step,
                        "epoch_seconds": None if prompts is None else round(time.epoch_seconds(prompts), 1),
                        "efficiency": "calibrated" if ranked.verdict.context.calibration.step_time else "priors",
                        "notes": list(time.notes)}
    for phase in report.phases:
        phase.seconds = report.step_time["seconds"].get(phase.name)


def _alternative(ranked: Any, changes: dict[str, Any], chosen: bool, prompts: int | None) -> dict[str, Any]:
    time = ranked.time
    return {"fits": ranked.verdict.fits, "chosen": chosen, "peak_bytes": round(ranked.verdict.estimate.peak_bytes),
            "step_seconds": round(time.step_seconds, 4),
            "seconds": {phase: round(s, 4) for phase, s in time.seconds.items()},
            "completion_tokens_per_second": round(time.completion_tokens_per_second, 1),
            "epoch_seconds": None if prompts is None else round(time.epoch_seconds(prompts), 1),
            "changes": {knob: list(values) for knob, values in changes.items()}}
