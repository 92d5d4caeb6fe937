"""The command line: parse, call the library, render. Exit 0 fits, 1 does not fit, 2 bad input or error."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

from vram_planner.errors import VramPlanError, first_line

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_ERROR = 0, 1, 2
_PATH = click.Path(path_type=Path, dir_okay=False)

# Knobs are spelled like GRPOConfig fields; unset ones take the TRL release's defaults (None = not given).
_KNOBS = [
    click.option("--per-device-train-batch-size", type=int),
    click.option("--gradient-accumulation-steps", type=int),
    click.option("--steps-per-generation", type=int),
    click.option("--num-generations", type=int),
    click.option("--max-prompt-length", type=int, help="Longest prompt of your dataset, in tokens (default 256)."),
    click.option("--max-completion-length", type=int),
    click.option("--beta", type=float),
    click.option("--num-iterations", type=int),
    click.option("--optim", help="transformers optimizer name, e.g. adamw_torch_fused, adamw_8bit."),
    click.option("--gradient-checkpointing/--no-gradient-checkpointing", default=None),
    click.option("--dtype", help="Weights' dtype: float32 (TRL's default), bfloat16, float16."),
    click.option("--mixed-precision", help="bf16 (default), fp16 or no."),
    click.option("--attn-implementation", help="sdpa (default), eager or flash_attention_2."),
    click.option("--use-liger-kernel/--no-use-liger-kernel", default=None),
    click.option("--use-vllm/--no-use-vllm", default=None),
    click.option("--vllm-mode", help="colocate (default) or server."),
    click.option("--vllm-gpu-memory-utilization", type=float),
    click.option("--vllm-enable-sleep-mode/--no-vllm-enable-sleep-mode", default=None),
    click.option("--lora-r", type=int),
    click.option("--lora-alpha", type=int),
    click.option("--lora-dropout", type=float),
    click.option("--lora-target-modules", help="Comma-separated module names, or all-linear."),
    click.option("--load-in-4bit/--no-load-in-4bit", default=None),
    click.option("--bnb-4bit-quant-type", help="nf4 or fp4."),
    click.option("--bnb-4bit-use-double-quant/--no-bnb-4bit-use-double-quant", default=None),
    click.option("--num-gpus", type=int),
    click.option("--zero-stage", type=int),
    click.option("--fsdp/--no-fsdp", default=None),
]
_CONTEXT = [
    click.option("--gpu", help="Catalog name, 'auto', or a size like 24GiB."),
    click.option("--model", help="Catalog name, config.json, model folder or hub id."),
    click.option("--config", "config_file", type=_PATH, help="YAML/JSON file with the same keys as the flags."),
    click.option("--trl-version", help="Plan for this TRL release (default: the installed one)."),
    click.option("--calibration", type=_PATH, help="Calibration profile to use."),
    click.option("--safety-margin", type=click.FloatRange(0, 0.5), default=0.05, show_default=True,
                 help="Share of the card kept free."),
]
# What plan/check/trace report besides the exit code; a run's output is its folder and log instead.
_REPORT = [
    click.option("--json", "json_output", is_flag=True, help="Print one JSON document."),
    click.option("--plot", type=_PATH, help="Write stacked bars per phase to this PNG."),
]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="vram-plan")
def app() -> None:
    """Plan the GPU memory of TRL GRPO fine-tuning: will it fit, where does the memory go, what fits best.

    `vram-plan --gpu G --model M` is short for `vram-plan plan --gpu G --model M`.
    """


def _training_command(command: str, doc: str) -> None:
    def run(**options: Any) -> None:
        _execute(command, options)

    run.__doc__ = doc
    for option in reversed(_CONTEXT + _REPORT + _KNOBS):
        run = option(run)
    app.command(command)(run)


_training_command("plan", "The best config that fits, the changes that lead to it, and where the memory goes.")
_training_command("check", "The verdict for exactly this config.")
_training_command("trace", "Count this config's GRPO step tensor by tensor on the CPU, next to the analytic model "
                           "(needs the train extras; without --gpu: the local card, else rtx3080-mobile).")

_NOT_KNOBS = ("gpu", "model", "config_file", "json_output", "plot", "trl_version", "calibration", "safety_margin")


def _execute(command: str, options: dict[str, Any]) -> None:
    if options["plot"]:  # before any work: a plot that cannot be written is refused now, not after the plan
        from vram_planner.cli.plot import check_plot_target

        check_plot_target(options["plot"])
    if command == "trace":
        _trace(options)
    context, train = _resolve(command, options)
    report, shown = _judge(command, context, train)

    def human() -> None:
        from vram_planner.cli.render import render

        render(report, context.gpu, shown, context.arch.hub_id or context.model_id)

    _emit(report, options, human)


def _emit(report: Any, options: dict[str, Any], human: Any) -> None:
    """The plot when asked, then the JSON document or the human view; the exit code says whether it fits."""
    if options["plot"]:
        from vram_planner.cli.plot import plot_phases

        plot_phases(report, options["plot"])
    if options["json_output"]:
        click.echo(report.model_dump_json(indent=2))
    else:
        human()
    raise click.exceptions.Exit(EXIT_FITS if report.fits else EXIT_DOES_NOT_FIT)


def _trace(options: dict[str, Any]) -> None:
    from rich.console import Console

    from vram_planner import api
    from vram_planner.cli.report import trace_report

    model, gpu, knobs = _settings("trace", options, gpu_required=False)
    # The spinner names the phase being traced (up to a minute for a 70B model); stderr keeps --json clean.
    with Console(stderr=True).status("resolving the model and the config") as status:
        outcome = api.trace(model, gpu, knobs, progress=status.update, trl_version=options["trl_version"],
                            calibration=options["calibration"], safety_margin=options["safety_margin"])
    report = trace_report(outcome)

    def human() -> None:
        from vram_planner.cli.render import render_trace

        render_trace(report, outcome.traced.context.gpu)

    _emit(report, options, human)


def _settings(command: str, options: dict[str, Any], gpu_required: bool = True) -> tuple[str, str | None, dict]:
    """The model, the GPU and the knobs from the flags, over the --config file's values."""
    from vram_planner.cli.settings_file import read_settings_file

    settings = read_settings_file(options["config_file"]) if options["config_file"] else {}
    for name in ("gpu", "model"):  # an empty value is a mistake, not "not given"
        if (options[name] is not None and not options[name].strip()) or settings.get(name) == "":
            raise VramPlanError(f"--{name} is empty; give a catalog name (vram-plan {name}s) or "
                                + ("a size such as 24GiB" if name == "gpu" else "a config.json, folder or hub id"))
    gpu = options["gpu"] or settings.get("gpu")
    model = options["model"] or settings.get("model")
    missing = [f"--{name}" for name, value in (("gpu", gpu or not gpu_required), ("model", model)) if not value]
    if missing:
        raise VramPlanError(f"{command} needs {' and '.join(missing)} (e.g. vram-plan {command} --gpu rtx3080-mobile "
                            "--model Llama-3.2-1B)")
    knobs = {k: v for k, v in settings.items() if k not in ("gpu", "model")}
    knobs.update({k: v for k, v in options.items() if k not in _NOT_KNOBS and v is not None})
    return model, gpu, knobs


def _resolve(command: str, options: dict[str, Any]):
    """The context and training config from the flags, over the --config file's values."""
    from vram_planner import api

    model, gpu, knobs = _settings(command, options)
    context = api.make_context(model, gpu, trl_version=options["trl_version"], calibration=options["calibration"],
                               safety_margin=options["safety_margin"])
    return context, api.make_training(context, knobs)


def _judge(command: str, context, train):
    """The report to print and the training config it describes."""
    from vram_planner.cli import report as reports

    if command == "plan":
        from vram_planner.model.search import best_plan

        result = best_plan(context, train)
        return reports.plan_report(result), (result.chosen or result.smallest).train
    from vram_planner.model.verdict import judge

    return reports.verdict_report(judge(context, train)), train


@app.command("gpus")
@click.option("--json", "json_output", is_flag=True, help="Print the catalog as JSON.")
def list_gpus(json_output: bool) -> None:
    """The GPU catalog: capacity as CUDA reports it, bf16 and FlashAttention-2 support."""
    from vram_planner.cli.listing import gpus_json, print_gpus

    if json_output:
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


def _run_options(function: Any) -> Any:
    for option in reversed(_CONTEXT + _KNOBS + [
        click.option("--dataset", required=True, help="gsm8k, math-sample, a .jsonl/.parquet file or a folder."),
        click.option("--reward", "rewards", multiple=True,
                     help="format, correctness, or module:function (repeat for several; default: both built-ins)."),
        click.option("--output-dir", type=click.Path(path_type=Path, file_okay=False), help="Where checkpoints go."),
        click.option("--resume", is_flag=True, help="Continue the run in --output-dir from its last checkpoint."),
        click.option("--overwrite", is_flag=True, help="Remove the run already in --output-dir and start afresh."),
        click.option("--max-steps", type=int, default=-1, show_default=True, help="-1: one epoch."),
        click.option("--save-steps", type=int, default=100, show_default=True),
        click.option("--dry-run", is_flag=True, help="Print the config, command and predicted memory; start nothing."),
        click.option("--auto-fallback", is_flag=True,
                     help="On out-of-memory, resume from the last checkpoint with the next config down the ladder."),
        click.option("--verbose", is_flag=True, help="Show the libraries' warnings, log lines and progress bars."),
    ]):
        function = option(function)
    return function


@app.command("run")
@_run_options
def run(**options: Any) -> None:
    """Start the GRPO run the plan recommends (TRL's GRPOTrainer), logging memory per step."""
    from vram_planner.extras import require_train_extra
    from vram_planner.model.grpo_config import output_dir_name

    require_train_extra("vram-plan run")
    from vram_planner.model.search import best_plan
    from vram_planner.run.launch import (CONFIG_NAME, RunSetup, accelerate_config_yaml, is_main_process, launch,
                                         launch_command, library_output, needs_launcher, prepare, train)

    run_keys = ("dataset", "rewards", "output_dir", "max_steps", "save_steps", "resume", "overwrite")
    settings = {k: options.pop(k) for k in run_keys}
    dry_run, auto_fallback, verbose = (options.pop(k) for k in ("dry_run", "auto_fallback", "verbose"))
    context, knobs = _resolve("run", options)
    model_id = context.arch.hub_id or context.model_id
    on_cpu = not _cuda_available()
    settings["rewards"] = list(settings["rewards"]) or ["format", "correctness"]
    settings["output_dir"] = settings["output_dir"] or Path(output_dir_name(model_id))
    setup = RunSetup.from_plan(best_plan(context, knobs), model_id=model_id, on_cpu=on_cpu, **settings,
                               notes=["no CUDA device: the run uses the CPU (for smoke tests only)"] if on_cpu else [])
    echo = click.echo if is_main_process() else (lambda *args, **kwargs: None)
    with library_output(verbose):
        prepared = prepare(setup)
        echo(setup.describe())
        if needs_launcher(setup.train):
            argv = click.get_current_context().find_root().obj["argv"]
            echo(f"{setup.output_dir / CONFIG_NAME}:\n{accelerate_config_yaml(setup.train)}"
                 f"command: {' '.join(launch_command(setup, argv))}")
            raise click.exceptions.Exit(EXIT_FITS if dry_run else launch(setup, argv))
        if not dry_run:
            train(setup, prepared, auto_fallback, say=lambda text: echo(text, err=True))
    raise click.exceptions.Exit(EXIT_FITS)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@app.command("advise")
@click.argument("log", required=False, default="-")
@click.option("--gpu", help="The card the run used (catalog name or size), to attribute the allocation.")
@click.option("--model", help="The model the run trained.")
@click.option("--config", "config_file", type=_PATH, help="YAML/JSON file with the run's settings.")
@click.option("--trl-version", help="The TRL release the run used (default: the installed one).")
@click.option("--json", "json_output", is_flag=True, help="Print one JSON document (figures in bytes).")
def advise_command(log: str, gpu: str | None, model: str | None, config_file: Path | None, trl_version: str | None,
                   json_output: bool, **knobs: Any) -> None:
    """Explain an out-of-memory error from a log (a file, or - for stdin) and rank the fixes."""
    from vram_planner.advise.diagnosis import advise
    from vram_planner.advise.oom_log import read_log

    error = read_log(_bounded_lines(log))
    context = train = None
    # The run's model and card attribute the allocation; given one without the other (or a --config without
    # either), say what is missing rather than advise without them.
    if gpu is not None or model is not None or config_file is not None:
        options = {"gpu": gpu, "model": model, "config_file": config_file, "trl_version": trl_version,
                   "calibration": None, "safety_margin": 0.05, **knobs}
        context, train = _resolve("advise", options)
    advice = advise(error, context, train)
    if json_output:
        click.echo(advice.model_dump_json(indent=2))
    else:
        from vram_planner.cli.render import render_advice

        render_advice(advice)


for _knob in reversed(_KNOBS):
    advise_command = _knob(advise_command)


def _bounded_lines(log: str):  # -> Iterator[str]
    """The log's lines, each read 64 KiB at most at a time, undecodable bytes replaced."""
    import io

    if log == "-":
        stream = io.TextIOWrapper(sys.stdin.buffer, errors="replace")
    else:
        try:
            stream = open(log, errors="replace")  # noqa: SIM115 (closed below, after the generator is drained)
        except OSError as exc:
            raise VramPlanError(f"cannot read {log}: {exc.strerror}") from exc
    with stream:
        yield from iter(lambda: stream.readline(65536), "")


@app.command("probe")
@click.option("--gpu", help="Catalog name of the card (default: the local one); required with --simulate.")
@click.option("--simulate", is_flag=True, help="Measure with the trace engine instead of a CUDA device.")
@click.option("--out", type=_PATH, help="Also write the calibration to this file.")
@click.option("--quick", is_flag=True, help="A short grid with a small model (minutes on the CPU).")
@click.option("--validate", is_flag=True, help="Then run configs around the boundary of emulated smaller cards.")
@click.option("--json", "json_output", is_flag=True, help="Print one JSON document.")
def probe(gpu: str | None, simulate: bool, out: Path | None, quick: bool, validate: bool, json_output: bool) -> None:
    """Measure GRPO steps on this GPU, fit the calibration plan/check use for it, and check the verdicts."""
    from vram_planner.probe.command import run_probe

    raise click.exceptions.Exit(run_probe(gpu, simulate, out, quick, validate, json_output))


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
    try:
        exit_code = app.main(args, prog_name="vram-plan", standalone_mode=False, obj={"argv": args})
    except click.exceptions.Exit as done:
        return done.exit_code
    except (VramPlanError, click.ClickException) as exc:
        if debug:
            raise
        message = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
        click.echo(f"error: {_one_line(message)}", err=True)
        return EXIT_ERROR
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        return EXIT_ERROR
    except Exception as exc:
        if debug:
            raise
        # A bug, not bad input: what it says, without the class name (the traceback is what --debug is for).
        reason = first_line(exc, default="")
        click.echo(f"error: internal error{': ' + reason if reason else ''}; run with --debug for the traceback",
                   err=True)
        return EXIT_ERROR
    return exit_code if isinstance(exit_code, int) else EXIT_FITS


def _one_line(message: str) -> str:
    """A message as the one line the contract promises, whatever it quotes (a path or a value with a newline)."""
    return " ".join(line.strip() for line in message.strip().splitlines() if line.strip())

