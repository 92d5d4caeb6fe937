"""`plan`, `check` and `trace`: one config judged, printed as a table or JSON, drawn when asked."""

from __future__ import annotations

from typing import Any

import click

from vram_planner.cli.options import (CONTEXT, EXACT, EXIT_DOES_NOT_FIT, EXIT_FITS, KEEP_COPY, KNOBS, MAXIMIZE,
                                      REPORT, request_from)
from vram_planner.cli.speed import CHECK_SPEED, PLAN_SPEED
from vram_planner.cli.trl_arguments import TrlArgumentsCommand
from vram_planner.errors import VramPlanError


def training_command(command: str, doc: str, extra: tuple = ()) -> click.Command:
    """A command that judges one config: the context options, the report options, every knob and `extra`."""
    def run(**options: Any) -> None:
        _execute(command, options)

    run.__doc__ = doc
    for option in reversed(CONTEXT + REPORT + KNOBS + list(extra)):
        run = option(run)
    return click.command(command, cls=TrlArgumentsCommand)(run)


plan = training_command("plan", "The best config that fits, the changes that lead to it, and where the memory goes; "
                                "with --maximize FIELD, the largest value of that knob that fits; with --exact, the "
                                "choice and the config ranked above it traced and judged by their needs.",
                        (*MAXIMIZE, EXACT, *PLAN_SPEED))
check = training_command("check", "The verdict for exactly this config (with --exact: by the traced step's need).",
                         (EXACT, KEEP_COPY, *CHECK_SPEED))
trace = training_command("trace", "Count this config's GRPO step tensor by tensor on the CPU, next to the analytic "
                                  "model, and what PyTorch's caching allocator reserves for it; judged by the least "
                                  "card the step runs on (needs the train extras; without --gpu: the local card, "
                                  "else rtx3080-mobile).")


def _execute(command: str, options: dict[str, Any]) -> None:
    from vram_planner.report.speed import check_optimize

    check_optimize(options.get("optimize") or "memory", exact=bool(options.get("exact")),
                   maximize=options.get("maximize") is not None)
    if options["plot"]:  # before any work: a plot that cannot be written is refused now, not after the plan
        from vram_planner.report.plot import check_plot_target

        check_plot_target(options["plot"])
    if command == "trace":
        _trace(options)
    if options.get("exact"):
        _exact(command, options)
    if options.get("maximize") is not None or options.get("allow_savers"):
        _maximize(options)
    from vram_planner import api

    speed = {"reward_seconds": options["reward_seconds"], "dataset_prompts": options["dataset_prompts"]}
    if command == "plan":
        report = api.plan(request_from(command, options), optimize=options["optimize"], **speed)
    else:
        report = api.check(request_from(command, options), keep_copy=bool(options.get("keep_copy")), **speed)

    if command == "plan" and options.get("recipe") is not None:
        report.recipe_edits = api.recipe_edits(options["recipe"], report)

    def human() -> None:
        _render(report)
        if report.recipe_edits:
            _print_recipe_edits(report.recipe_edits, options["config_file"], bool(options.get("trl_arguments")))

    _emit(report, options, human)


def _print_recipe_edits(edits: dict[str, Any], path: Any, command_line: bool) -> None:
    """What to set in the recipe for the plan's choice, never wrapped: YAML lines to paste into the file, or where
    TRL's arguments came on the command line (which win over the file's), the arguments to add to that command."""
    import json

    if command_line:
        from vram_planner.trl_arguments import trl_command_line

        click.echo("\nAdd to the TRL command's arguments (they win over those before them and the --config file's):")
        click.echo(trl_command_line(edits))
        return
    click.echo(f"\nIn {path}, set (the rest as it is):")
    for key, value in edits.items():
        click.echo(f"{key}: {json.dumps(value)}")


def _render(report: Any) -> None:
    from vram_planner.cli.console import terminal
    from vram_planner.cli.render import render
    from vram_planner.cli.speed import render_speed

    context = report.judged.context
    render(report, context.gpu, report.judged.train, context.arch.hub_id or context.model_id)
    render_speed(report, terminal())


def _emit(report: Any, options: dict[str, Any], human: Any) -> None:
    """The plot when asked, then the JSON document or the human view; the exit code says whether it fits."""
    if options.get("recipe") is not None:
        report.notes.append(options["recipe"].summary())
    if options["plot"]:
        from vram_planner.report.plot import plot_phases

        plot_phases(report, options["plot"])
    if options["json_output"]:
        click.echo(report.to_json(indent=2))
    else:
        human()
    raise click.exceptions.Exit(EXIT_FITS if report.fits else EXIT_DOES_NOT_FIT)


def _maximize(options: dict[str, Any]) -> None:
    """`plan --maximize FIELD`: the answer, then the plan at it; the impossible case in one line (exit 1)."""
    from vram_planner import api
    from vram_planner.model.maximize import maximizable_field

    if options["maximize"] is None:
        raise VramPlanError("--allow-savers goes with --maximize FIELD (plan without --maximize already uses the "
                            "savers)")
    field = maximizable_field(options["maximize"])
    report = api.maximize(request_from("plan", options), field=field, allow_savers=options["allow_savers"])

    def human() -> None:
        from vram_planner.cli.render import render_maximized

        if render_maximized(report, report.judged.context.gpu):
            _render(report)

    _emit(report, options, human)


def _trace(options: dict[str, Any]) -> None:
    from rich.console import Console

    from vram_planner import api

    request = request_from("trace", options, gpu_required=False)
    # The spinner names the phase being traced (up to a minute for a 70B model); stderr keeps --json clean.
    with Console(stderr=True).status("resolving the model and the config") as status:
        report = api.trace(request, progress=status.update)

    def human() -> None:
        from vram_planner.cli.render import render_trace

        render_trace(report, report.judged.context.gpu)

    _emit(report, options, human)


def _exact(command: str, options: dict[str, Any]) -> None:
    """`check --exact` and `plan --exact`: the analytic answer's document, judged by the traced step's need."""
    from rich.console import Console

    from vram_planner import api

    if options.get("maximize") is not None or options.get("allow_savers"):
        raise VramPlanError("--exact judges one config (check) or the plan's choice (plan), not --maximize: run "
                            "`vram-plan check --exact` with the value --maximize finds")
    request = request_from(command, options)
    with Console(stderr=True).status("resolving the model and the config") as status:
        if command == "plan":
            report = api.plan(request, exact=True, progress=status.update)
        else:
            report = api.check(request, exact=True, progress=status.update, keep_copy=bool(options.get("keep_copy")))
    _emit(report, options, lambda: _render(report))
