"""The HTTP API's query, `?gpu=...&model=...&max_completion_length=1024`, read by the CLI's own options into the
document `check --json` or `plan --json` prints, and bad input into the CLI's one-line message."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import click

from vram_planner.cli.options import NOT_KNOBS, resolve
from vram_planner.cli.plan import check, exact_judgement, judge_report, plan
from vram_planner.cli.report import Report
from vram_planner.cli.speed import with_step_times
from vram_planner.errors import UnknownNameError, VramPlanError, one_line

COMMANDS: dict[str, click.Command] = {"check": check, "plan": plan}
# Besides the knobs: what names the model, the card and the release, and exact=true (the traced step's need decides,
# as with --exact). The files of the command line (--config, --calibration, --plot) are not read or written over HTTP.
CONTEXT_PARAMETERS = ("gpu", "model", "trl_version", "safety_margin", "exact")
HINT = "(query parameters are spelled as GRPOConfig fields, e.g. max_completion_length=1024, plus gpu and model)"


def knob_parameters(command: click.Command = check) -> list[click.Option]:
    """The command's knobs, as the CLI declares them (the page shows one field for each)."""
    return [p for p in command.params if isinstance(p, click.Option) and p.name not in NOT_KNOBS]


def query_parameters(command: click.Command) -> dict[str, click.Option]:
    """What a query may set: the model, the card, the release, the safety margin and every knob, by field name."""
    context = [p for p in command.params if isinstance(p, click.Option) and p.name in CONTEXT_PARAMETERS]
    return {p.name: p for p in context + knob_parameters(command)}


def options_from_query(command: str, query: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """The options `vram-plan <command>` gets from the flags these parameters spell; click parses and checks them,
    so a bad value is refused in the CLI's words."""
    cli_command = COMMANDS[command]
    known = query_parameters(cli_command)
    args: list[str] = []
    for key, value in query:
        param = known.get(key.replace("-", "_"))
        if param is None:
            raise UnknownNameError("query parameter", key, sorted(known), hint=HINT)
        args += _flag(param, value)
    return cli_command.make_context(command, args).params


def _flag(param: click.Option, value: str) -> list[str]:
    """`--name=value`, so that a value starting with a dash stays a value; on/off switches from a boolean."""
    if param.secondary_opts:
        return [param.opts[0] if click.BOOL.convert(value, param, None) else param.secondary_opts[0]]
    if param.is_flag:
        return [param.opts[0]] if click.BOOL.convert(value, param, None) else []
    return [f"{param.opts[0]}={value}"]


def query_report(command: str, query: Iterable[tuple[str, str]]) -> Report:
    """Exactly the document `vram-plan <command> --json` prints for the flags these parameters spell."""
    options = options_from_query(command, query)
    if options.get("exact"):
        return exact_judgement(command, options)[0]
    context, train = resolve(command, options)
    report, shown = judge_report(command, context, train)
    return with_step_times(command, report, shown, context, train, options)[0]


def error_line(exc: VramPlanError | click.ClickException) -> str:
    """What the CLI prints after `error: ` for this bad input."""
    return one_line(exc.format_message() if isinstance(exc, click.ClickException) else str(exc))
