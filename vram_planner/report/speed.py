"""Predicted step times in the report: the seconds per optimizer step of the config shown, and for a plan every config
that fits ranked by them (optimize="speed" recommends the fastest; vram_planner.model.ranking ranks them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vram_planner.errors import VramPlanError, field_name

if TYPE_CHECKING:
    from vram_planner.report.document import Report

__all__ = ["with_step_times", "OPTIMIZE_CHOICES"]

OPTIMIZE_CHOICES = ("memory", "speed")


def with_step_times(command: str, report: Report, shown: Any, context: Any, train: Any, optimize: str = "memory",
                    reward: float = 0.0, prompts: int | None = None) -> tuple[Report, Any]:
    """The report with the predicted step time of its config, for `plan` the ranked alternatives, and with
    optimize="speed" the fastest config's report in place of the memory plan's; and the config it shows.

    `reward`: seconds the reward functions take per completion; `prompts`: the dataset's, for the time of an epoch.
    """
    from vram_planner.model.step_time import NoSpeedFigures

    try:
        if command == "plan":
            report, shown = _ranked(report, shown, context, train, optimize, reward, prompts)
        else:
            from vram_planner.model.ranking import timed
            from vram_planner.model.verdict import judge

            _add_time(report, timed(judge(context, train), reward), prompts)
    except NoSpeedFigures as exc:
        if optimize == "speed":
            raise VramPlanError(f"{field_name('optimize')} speed: {exc}") from exc
        report.step_time = {"problem": str(exc)}
    return report, shown


def _ranked(report: Report, shown: Any, context: Any, train: Any, optimize: str, reward: float,
            prompts: int | None) -> tuple[Report, Any]:
    from vram_planner.report.document import plan_report
    from vram_planner.model.ranking import knob_changes, rank_configs
    from vram_planner.model.search import Plan, best_plan, describe_changes

    plan = best_plan(context, train)
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
