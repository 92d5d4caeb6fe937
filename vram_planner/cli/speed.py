"""Step times in `plan` and `check`: the predicted seconds per optimizer step of the config shown, and for `plan` every
config that fits ranked by them (`--optimize speed` recommends the fastest). GiB and seconds in what people read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from vram_planner.errors import VramPlanError

if TYPE_CHECKING:
    from vram_planner.cli.report import Report

REWARD = click.option("--reward-seconds", type=click.FloatRange(min=0, max=3600), default=0.0, show_default=True,
                      help="Seconds your reward functions take per completion (a model judge: tenths of a second).")
PROMPTS = click.option("--dataset-prompts", type=click.IntRange(min=1, max=2**40),
                       help="Prompts in your dataset: the predicted time of one epoch.")
CHECK_SPEED = [REWARD, PROMPTS]
PLAN_SPEED = [click.option("--optimize", type=click.Choice(["memory", "speed"]), default="memory", show_default=True,
                           help="memory: the config that keeps most of yours (the first saver that fits); speed: the "
                                "config that fits with the least predicted time per optimizer step."),
              *CHECK_SPEED]
SPEED_OPTIONS = ("optimize", "reward_seconds", "dataset_prompts")
SHOWN_ALTERNATIVES = 5


def refuse_speed_with(options: dict[str, Any]) -> None:
    """`--optimize speed` ranks the plan's configs: --maximize and --exact answer other questions."""
    if options.get("optimize") == "speed":
        for other in ("maximize", "exact"):
            if options.get(other):
                raise VramPlanError(f"--optimize speed ranks the plan's configs by step time; --{other} answers "
                                    "another question: run them one at a time")


def with_step_times(command: str, report: Report, shown: Any, context: Any, train: Any,
                    options: dict[str, Any]) -> tuple[Report, Any]:
    """The report with the predicted step time of its config, for `plan` the ranked alternatives, and with
    `--optimize speed` the fastest config's report in place of the memory plan's; and the config it shows."""
    from vram_planner.model.step_time import NoSpeedFigures

    optimize = options.get("optimize") or "memory"
    reward, prompts = options.get("reward_seconds") or 0.0, options.get("dataset_prompts")
    try:
        if command == "plan":
            report, shown = _ranked(report, shown, context, train, optimize, reward, prompts)
        else:
            from vram_planner.model.ranking import timed
            from vram_planner.model.verdict import judge

            _add_time(report, timed(judge(context, train), reward), prompts)
    except NoSpeedFigures as exc:
        if optimize == "speed":
            raise VramPlanError(f"--optimize speed: {exc}") from exc
        report.step_time = {"problem": str(exc)}
    return report, shown


def _ranked(report: Report, shown: Any, context: Any, train: Any, optimize: str, reward: float,
            prompts: int | None) -> tuple[Report, Any]:
    from vram_planner.cli.report import plan_report
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


def render_speed(report: Report, console: Any) -> None:
    """The predicted step time of the config shown, and (plan) the fastest configs that fit."""
    from rich.table import Table

    from vram_planner.model.spec import command_line_flags
    from vram_planner.units import GiB

    if report.step_time is None:
        return
    time = report.step_time
    if "problem" in time:
        console.print(f"No step time: {time['problem']}", style="dim")
        return
    phases = ", ".join(f"{phase} {s:.2f} s" for phase, s in time["seconds"].items())
    epoch = "" if time["epoch_seconds"] is None else f"; one epoch {_duration(time['epoch_seconds'])}"
    console.print(f"Predicted step time: {time['step_seconds']:.2f} s per optimizer step ({phases}); "
                  f"{time['completion_tokens_per_second']:.0f} completion tokens/s{epoch} "
                  f"(efficiency {time['efficiency']}; full-length completions)")
    if not report.alternatives:
        return
    vllm = "" if report.optimize == "speed" else "; --optimize speed also weighs vLLM generation"
    table = Table(title=f"Configs that fit, fastest first (→ the one shown{vllm})")
    for column in ("", "s/step", "tokens/s", "peak GiB", "changes from yours"):
        table.add_column(column, justify="left" if column.startswith("changes") else "right")
    fitting = [r for r in report.alternatives if r["fits"]]
    shown = fitting[:SHOWN_ALTERNATIVES] + [r for r in fitting[SHOWN_ALTERNATIVES:] if r["chosen"]]
    for row in shown:
        changes = command_line_flags({k: a for k, (_, a) in row["changes"].items()}) or "none"
        table.add_row("→" if row["chosen"] else "", f"{row['step_seconds']:.2f}",
                      f"{row['completion_tokens_per_second']:.0f}", f"{row['peak_bytes'] / GiB:.2f}", changes)
    console.print(table)


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"
