"""Step times in `plan` and `check`: the predicted seconds per optimizer step of the config shown, and for `plan` every
config that fits ranked by them (`--optimize speed` recommends the fastest). GiB and seconds in what people read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from vram_planner.report.document import Report

REWARD = click.option("--reward-seconds", type=click.FloatRange(min=0, max=3600), default=0.0, show_default=True,
                      help="Seconds your reward functions take per completion (a model judge: tenths of a second).")
PROMPTS = click.option("--dataset-prompts", type=click.IntRange(min=1, max=2**40),
                       help="Prompts in your dataset: the predicted time of one epoch.")
CHECK_SPEED = [REWARD, PROMPTS]
PLAN_SPEED = [click.option("--optimize", type=click.Choice(["memory", "speed"]), default="memory", show_default=True,
                           help="memory: the config that keeps most of yours (the first saver that fits); speed: the "
                                "config that fits with the least predicted time per optimizer step."),
              *CHECK_SPEED]
SHOWN_ALTERNATIVES = 5


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
