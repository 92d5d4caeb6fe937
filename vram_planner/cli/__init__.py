"""The command line: parse, call the library, render. Exit 0 fits, 1 does not fit, 2 bad input or error, 141 the
output's reader went away (a broken pipe, as a shell reports a process SIGPIPE ended).

One module per command that has grown (plan.py for plan/check/trace, run.py, advise.py); the catalogs and probe
are a few lines each and stay here. Each command imports its engine only when it runs.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import click

from vram_planner.cli.console import OutputClosed, encode_anywhere, outputs_closed, terminal
from vram_planner.cli.options import EXIT_ERROR, EXIT_FITS, KNOBS, MAXIMIZE, MODEL_CONTEXT, PATH
from vram_planner.cli.trl_arguments import TrlArgumentsCommand
from vram_planner.errors import UnknownNameError, VramPlanError, first_line, flag, one_line, short_repr

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what `yes | head` exits with, and never a verdict

# The commands with modules of their own, loaded when they run (or when --help lists them): each declares dozens
# of options, and `plan` should not pay for building those of `run`, `advise` and `replay` (click's documented
# pattern for lazily loaded subcommands).
LAZY_COMMANDS = {"plan": "vram_planner.cli.plan:plan", "check": "vram_planner.cli.plan:check",
                 "trace": "vram_planner.cli.plan:trace", "run": "vram_planner.cli.run:run",
                 "advise": "vram_planner.cli.advise:advise_command", "replay": "vram_planner.cli.replay:replay"}


class LazyGroup(click.Group):
    """A group whose LAZY_COMMANDS are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *LAZY_COMMANDS])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY_COMMANDS:
            module, name = LAZY_COMMANDS[cmd_name].split(":")
            return getattr(importlib.import_module(module), name)
        return super().get_command(ctx, cmd_name)

    # click answers a broken pipe with exit 1, our "does not fit": carried past it as OutputClosed instead, from
    # parsing (which prints --help and --version) and from the command.
    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except BrokenPipeError as exc:
            raise OutputClosed from exc

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError as exc:
            raise OutputClosed from exc

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple:
        """click suggests only among the commands already loaded; an unknown name is compared with all of them."""
        name = args[0] if args else ""
        if name and not name.startswith("-") and not ctx.resilient_parsing and self.get_command(ctx, name) is None:
            raise UnknownNameError("command", name, self.list_commands(ctx), hint="(vram-plan --help lists them)")
        return super().resolve_command(ctx, args)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="vram-plan")
def app() -> None:
    """Plan the GPU memory of TRL GRPO fine-tuning: will it fit, where does the memory go, what fits best.

    `vram-plan --gpu G --model M` is short for `vram-plan plan --gpu G --model M`.
    """


def _gpus_options(command):
    """`gpus`' own --json, and what judges a config on every card: the model's context, the knobs, --maximize."""
    for option in reversed([click.option("--json", "json_output", is_flag=True, help="Print JSON."),
                            *MODEL_CONTEXT, *MAXIMIZE, *KNOBS]):
        command = option(command)
    return command


@app.command("gpus", cls=TrlArgumentsCommand)
@_gpus_options
def list_gpus(**options) -> None:
    """The GPU catalog: capacity as CUDA reports it, bf16 and FlashAttention-2 support. With --model (and knobs):
    every card's verdict for that config, the smallest fitting card first; with --maximize FIELD, each card's
    largest value of that knob."""
    from vram_planner.cli.listing import gpus_for_model, gpus_json, print_gpus

    if any(value not in (None, False) for name, value in options.items() if name not in ("json_output",
                                                                                          "safety_margin")):
        raise click.exceptions.Exit(gpus_for_model(options))
    if options["json_output"]:
        click.echo(gpus_json())
    else:
        print_gpus()


@app.command("models")
@click.option("--json", "json_output", is_flag=True, help="Print the catalog as JSON.")
def list_models(json_output: bool) -> None:
    """The model catalog: parameters and architecture facts."""
    from vram_planner.cli.listing import models_json, print_models

    if json_output:
        click.echo(models_json())
    else:
        print_models()


@app.command("app")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every one).")
@click.option("--port", type=click.IntRange(1, 65535), default=7860, show_default=True, help="Port to listen on.")
@click.option("--allow-local-files/--no-allow-local-files", default=None,
              help="Read config.json paths given as the model (default: only when --host is 127.0.0.1).")
def web_app(host: str, port: int, allow_local_files: bool | None) -> None:
    """A local web page for plan and check, with an HTTP API beside it: GET /api/check and /api/plan take the
    knobs as query parameters and return the --json documents, /api/gpus and /api/models the catalogs,
    /api/openapi.json describes them (needs the app extra: Gradio)."""
    import signal
    import subprocess

    # A process of its own: the command line and the web app are two skins that never import each other
    command = [sys.executable, "-m", "vram_planner.app", "--host", host, "--port", str(port)]
    if allow_local_files is not None:
        command.append("--allow-local-files" if allow_local_files else "--no-allow-local-files")
    with subprocess.Popen(command) as server:
        # SIGTERM (systemd, docker stop, kill) reaches this process only: passed on, or the server outlives it
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: server.terminate())
        try:
            code = server.wait()
        except KeyboardInterrupt:  # the server has the same Ctrl+C and stops on it
            code = server.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
    code = 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + its number
    raise click.exceptions.Exit(0 if code == 130 else code)


@app.command("probe")
@click.option("--gpu", help="Catalog name of the card (default: the local one); required with --simulate.")
@click.option("--simulate", is_flag=True, help="Measure with the trace engine instead of a CUDA device.")
@click.option("--out", type=PATH, help="Also write the calibration to this file.")
@click.option("--quick", is_flag=True, help="A short grid with a small model (minutes on the CPU).")
@click.option("--validate", is_flag=True, help="Then run configs around the boundary of emulated smaller cards.")
@click.option("--json", "json_output", is_flag=True, help="Print one JSON document.")
def probe(gpu: str | None, simulate: bool, out: Path | None, quick: bool, validate: bool, json_output: bool) -> None:
    """Measure GRPO steps on this GPU, fit the calibration plan/check use for it, and check the verdicts."""
    from vram_planner.probe.command import run_probe

    raise click.exceptions.Exit(run_probe(gpu, simulate, out, quick, validate, json_output, terminal()))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `vram-plan` script; returns the exit code."""
    # pydantic's plugin discovery scans every installed distribution's entry points (~20 ms); a planner run has
    # no use for observability plugins.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    args = list(sys.argv[1:] if argv is None else argv) or ["--help"]
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    if args and args[0].startswith("-") and args[0] not in ("--help", "-h", "--version"):
        args.insert(0, "plan")
    encode_anywhere(sys.stdout, sys.stderr)
    try:
        return _answer(args, debug)
    except (OutputClosed, BrokenPipeError):  # `vram-plan ... | head` (2>&1 too): the reader has what it wanted
        outputs_closed()
        return EXIT_BROKEN_PIPE


def _answer(args: list[str], debug: bool) -> int:
    """Run the command; its exit code, and any error as the one line the contract promises."""
    try:
        exit_code = app.main(args, prog_name="vram-plan", standalone_mode=False, obj={"argv": args})
        sys.stdout.flush()  # a closed pipe shows here, while it can still be answered
    except click.exceptions.Exit as done:
        return done.exit_code
    except (OutputClosed, BrokenPipeError):  # main's to answer, even when the error line meets the closed pipe
        raise
    except SystemExit as done:  # user code (a reward) ending the process: neither a verdict nor silence
        if debug:
            raise
        click.echo(f"error: code vram-plan ran for you (a reward, a callback) called "
                   f"sys.exit({short_repr(done.code)}); run with --debug for where", err=True)
        return EXIT_ERROR
    except (VramPlanError, click.ClickException) as exc:
        if debug:
            raise
        message = exc.format_message() if isinstance(exc, click.ClickException) else exc.worded(flag)
        click.echo(f"error: {one_line(message)}", err=True)
        return EXIT_ERROR
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        return EXIT_ERROR
    except Exception as exc:
        if debug:
            raise
        if isinstance(exc, OSError) and exc.filename:
            # A file that changed under the work after it was checked (replaced, made read-only, its disk full):
            # the system's word for it, not a bug's
            click.echo(f"error: cannot use {exc.filename}: {exc.strerror or first_line(exc)}", err=True)
            return EXIT_ERROR
        # A bug, not bad input: what it says, without the class name (the traceback is what --debug is for).
        reason = first_line(exc, default="")
        click.echo(f"error: internal error{': ' + reason if reason else ''}; run with --debug for the traceback",
                   err=True)
        return EXIT_ERROR
    return exit_code if isinstance(exit_code, int) else EXIT_FITS

