"""`plan`, `check` and `trace`: one config judged, printed as a table or JSON, drawn when asked."""

from __future__ import annotations

from typing import Any

import click

from vram_planner.cli.options import (CONTEXT, EXACT, EXIT_DOES_NOT_FIT, EXIT_FITS, KNOBS, MAXIMIZE, REPORT, resolve,
                                      settings_from)
from vram_planner.cli.speed import CHECK_SPEED, PLAN_SPEED, refuse_speed_with, render_speed, with_step_times
from vram_planner.errors import VramPlanError


def training_command(command: str, doc: str, extra: tuple = ()) -> click.Command:
    """A command that judges one config: the context options, the report options, every knob and `extra`."""
    def run(**options: Any) -> None:
        _execute(command, options)

    run.__doc__ = doc
    for option in reversed(CONTEXT + REPORT + KNOBS + list(extra)):
        run = option(run)
    return click.command(command)(run)


plan = training_command("plan", "The best config that fits, the changes that lead to it, and where the memory goes; "
                                "with --maximize FIELD, the largest value of that knob that fits; with --exact, the "
                                "choice and the config ranked above it traced and judged by their needs.",
                        (*MAXIMIZE, EXACT, *PLAN_SPEED))
check = training_command("check", "The verdict for exactly this config (with --exact: by the traced step's need).",
                         (EXACT, *CHECK_SPEED))
trace = training_command("trace", "Count this config's GRPO step tensor by tensor on the CPU, next to the analytic "
                                  "model, and what PyTorch's caching allocator reserves for it; judged by the least "
                                  "card the step runs on (needs the train extras; without --gpu: the local card, "
                                  "else rtx3080-mobile).")


def _execute(command: str, options: dict[str, Any]) -> None:
    refuse_speed_with(options)
    if options["plot"]:  # before any work: a plot that cannot be written is refused now, not after the plan
        from vram_planner.cli.plot import check_plot_target

        check_plot_target(options["plot"])
    if command == "trace":
        _trace(options)
    if options.get("exact"):
        _exact(command, options)
    if options.get("maximize") is not None or options.get("allow_savers"):
        _maximize(options)
    context, train = resolve(command, options)
    report, shown = judge_report(command, context, train)
    report, shown = with_step_times(command, report, shown, context, train, options)

    def human() -> None:
        from vram_planner.cli.render import render, terminal

        render(report, context.gpu, shown, context.arch.hub_id or context.model_id)
        render_speed(report, terminal())

    _emit(report, options, human)


def _emit(report: Any, options: dict[str, Any], human: Any) -> None:
    """The plot when asked, then the JSON document or the human view; the exit code says whether it fits."""
    if options["plot"]:
        from vram_planner.cli.plot import plot_phases

        plot_phases(report, options["plot"])
    if options["json_output"]:
        from vram_planner.validation import to_json

        click.echo(to_json(report, indent=2))
    else:
        human()
    raise click.exceptions.Exit(EXIT_FITS if report.fits else EXIT_DOES_NOT_FIT)


def _maximize(options: dict[str, Any]) -> None:
    """`plan --maximize FIELD`: the answer, then the plan at it; the impossible case in one line (exit 1)."""
    from vram_planner.cli.maximized_report import maximized_report
    from vram_planner.model.maximize import maximizable_field, maximize

    if options["maximize"] is None:
        raise VramPlanError("--allow-savers goes with --maximize FIELD (plan without --maximize already uses the "
                            "savers)")
    field = maximizable_field(options["maximize"])
    context, train = resolve("plan", options)
    result = maximize(context, train, field, options["allow_savers"])
    report = maximized_report(result)

    def human() -> None:
        from vram_planner.cli.render import render, render_maximized

        if render_maximized(report, context.gpu):
            render(report, context.gpu, result.plan.chosen.train, context.arch.hub_id or context.model_id)

    _emit(report, options, human)


def _trace(options: dict[str, Any]) -> None:
    from rich.console import Console

    from vram_planner import api
    from vram_planner.cli.report import trace_report

    model, gpu, trl_version, knobs = settings_from("trace", options, gpu_required=False)
    # The spinner names the phase being traced (up to a minute for a 70B model); stderr keeps --json clean.
    with Console(stderr=True).status("resolving the model and the config") as status:
        outcome = api.trace(model, gpu, knobs, progress=status.update, trl_version=trl_version,
                            calibration=options["calibration"], safety_margin=options["safety_margin"])
    report = trace_report(outcome)

    def human() -> None:
        from vram_planner.cli.render import render_trace

        render_trace(report, outcome.traced.context.gpu)

    _emit(report, options, human)


def _exact(command: str, options: dict[str, Any]) -> None:
    """`check --exact` and `plan --exact`: the analytic answer's document, judged by the traced step's need."""
    from rich.console import Console

    with Console(stderr=True).status("resolving the model and the config") as status:
        report, shown, context = exact_judgement(command, options, status.update)

    def human() -> None:
        from vram_planner.cli.render import render

        render(report, context.gpu, shown, context.arch.hub_id or context.model_id)

    _emit(report, options, human)


def exact_judgement(command: str, options: dict[str, Any], progress: Any = None):
    """The report `command --exact` prints, the training config it shows and its context (the web app's HTTP API
    serves the same report for exact=true)."""
    from vram_planner import api
    from vram_planner.cli import report as reports

    if options.get("maximize") is not None or options.get("allow_savers"):
        raise VramPlanError("--exact judges one config (check) or the plan's choice (plan), not --maximize: run "
                            "`vram-plan check --exact` with the value --maximize finds")
    model, gpu, trl_version, knobs = settings_from(command, options)
    context_options = {"trl_version": trl_version, "calibration": options["calibration"],
                       "safety_margin": options["safety_margin"]}
    if command == "check":
        outcome = api.check(model, gpu, knobs, exact=True, progress=progress, **context_options)
        return reports.exact_check_report(outcome), outcome.traced.train, outcome.traced.context
    exact = api.plan(model, gpu, knobs, exact=True, progress=progress, **context_options)
    return (reports.exact_plan_report(exact), (exact.plan.chosen or exact.plan.smallest).train,
            exact.plan.requested.context)


def judge_report(command: str, context, train):
    """The report `command` (check or plan) prints and the training config it describes (the web app's HTTP API
    serves the same)."""
    from vram_planner.cli import report as reports

    if command == "plan":
        from vram_planner.model.search import best_plan

        result = best_plan(context, train)
        return reports.plan_report(result), (result.chosen or result.smallest).train
    from vram_planner.model.verdict import judge

    return reports.verdict_report(judge(context, train)), train
