"""`vram-plan advise`: explain an out-of-memory error from a log, or a memory snapshot, and rank the fixes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from vram_planner.cli.options import KNOBS, PATH, resolve
from vram_planner.files import bounded_lines


@click.command("advise")
@click.argument("log", required=False, default="-")
@click.option("--gpu", help="The card the run used (catalog name or size), to attribute the allocation.")
@click.option("--model", help="The model the run trained.")
@click.option("--config", "config_file", type=PATH, help="YAML/JSON file with the run's settings.")
@click.option("--trl-version", help="The TRL release the run used (default: the one the log names, else the installed "
              "one).")
@click.option("--device", type=int, help="A snapshot's device to explain (default: the only one with events).")
@click.option("--json", "json_output", is_flag=True, help="Print one JSON document (figures in bytes).")
def advise_command(log: str, gpu: str | None, model: str | None, config_file: Path | None, trl_version: str | None,
                   device: int | None, json_output: bool, **knobs: Any) -> None:
    """Explain an out-of-memory error from a log (a file, or - for stdin), or a memory snapshot (the
    oom-snapshot.pickle.gz `run` writes, or any torch.cuda.memory._dump_snapshot() file), and rank the fixes."""
    from vram_planner.advise.diagnosis import advise

    if _is_snapshot(log):
        _advise_snapshot(Path(log), device, json_output, {"gpu": gpu, "model": model, "config_file": config_file,
                                                          "trl_version": trl_version, **knobs})
        return
    from vram_planner.advise.oom_log import read_log

    error = read_log(bounded_lines(log))
    context = train = None
    source = "flag" if knobs.get("transformers_version") is not None else "assumed"
    trl_from = "flag" if trl_version is not None else "installed"
    # The run's model and card attribute the allocation; given one without the other (or a --config without
    # either), say what is missing rather than advise without them.
    if gpu is not None or model is not None or config_file is not None:
        if trl_version is None and _known_trl(error.trl_version):  # the release the run used, as its log says
            trl_version, trl_from = error.trl_version, "log"
        if source == "assumed" and _known_transformers(error.transformers_version):
            knobs, source = {**knobs, "transformers_version": error.transformers_version}, "log"
        options = {"gpu": gpu, "model": model, "config_file": config_file, "trl_version": trl_version,
                   "calibration": None, "safety_margin": 0.05, **knobs}
        context, train = resolve("advise", options)
        if source == "assumed" and train.transformers_version is not None:  # a --config file named it
            source = "flag"
        elif source == "assumed" and train.transformers.version == _installed_transformers():
            source = "installed"
    advice = advise(error, context, train, source, trl_from)
    if json_output:
        click.echo(advice.model_dump_json(indent=2))
    else:
        from vram_planner.cli.render import render_advice

        render_advice(advice)


for _knob in reversed(KNOBS):
    advise_command = _knob(advise_command)


def _is_snapshot(log: str) -> bool:
    """A pickle (protocol 2 on) or gzip file: a memory snapshot, not a log's text."""
    if log == "-":
        return False
    try:
        with open(log, "rb") as stream:
            head = stream.read(2)
    except OSError:
        return False
    return head[:1] == b"\x80" or head == b"\x1f\x8b"


def _advise_snapshot(path: Path, device: int | None, json_output: bool, options: dict[str, Any]) -> None:
    """The snapshot at its failed allocation or worst moment, against the run's plan where its flags are given."""
    from vram_planner.advise.snapshot import explain_snapshot
    from vram_planner.allocator.snapshot import load_snapshot
    from vram_planner.allocator.snapshot_replay import pick_device

    context = train = None
    if any(options[k] is not None for k in ("gpu", "model", "config_file")):
        context, train = resolve("advise", {**options, "calibration": None, "safety_margin": 0.05})
    snapshot = load_snapshot(path)
    advice = explain_snapshot(snapshot, pick_device(snapshot, device), context, train)
    if json_output:
        click.echo(advice.model_dump_json(indent=2))
        return
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from vram_planner.cli.render import fixes_lines, terminal

    # the heading as a line of its own: a table's title wraps at the table's width, two narrow columns here
    heading = Text(f"{path.name}, device {advice.device}: {advice.moment.replace('_', ' ')} moment "
                   f"(event {advice.event_index} of {advice.events})", style="italic")
    table = Table(show_edge=False)
    table.add_column("role")
    table.add_column("GiB", justify="right")
    for role, n_bytes in advice.by_role.items():
        table.add_row(role.replace("_", " "), f"{n_bytes / 2**30:.2f}")
    table.add_row("allocated", f"{advice.allocated_bytes / 2**30:.2f}", style="bold")
    parts = [heading, table, *(Text(f"• {note}") for note in advice.diagnosis)]
    if advice.culprit:
        parts.append(Text(f"Most likely {advice.culprit}.", style="bold"))
    if advice.attribution is not None and advice.attribution.assumption:
        assumption = advice.attribution.assumption
        parts.append(Text(f"  {assumption[0].upper()}{assumption[1:]}."))
    terminal().print(Group(*parts, *fixes_lines(advice.fixes, advice.fitting_config)))


def _installed_transformers() -> str | None:
    from vram_planner.model.trl_releases import installed_version, parse_version

    installed = installed_version("transformers")
    parsed = parse_version(installed) if installed else None
    return parsed[1] if parsed else None


def _known_trl(version: str | None) -> bool:
    """Whether a TRL release the log names is one the release table covers (else the log's figure is unused)."""
    from vram_planner.errors import VramPlanError
    from vram_planner.model.trl_releases import trl_release

    if version is None:
        return False
    try:
        trl_release(version)
    except (VramPlanError, ValueError):
        return False
    return True


def _known_transformers(version: str | None) -> bool:
    """Whether a release the log names is one the table knows (else the log's figure is left unused)."""
    from vram_planner.model.transformers_releases import known_transformers_version

    if version is None:
        return False
    try:
        known_transformers_version(version)
    except ValueError:
        return False
    return True
