"""`vram-plan run`: start the GRPO run the plan recommends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from vram_planner.cli.options import CONTEXT, EXIT_ERROR, EXIT_FITS, KNOBS, resolve
from vram_planner.cli.trl_arguments import TrlArgumentsCommand
from vram_planner.errors import VramPlanError


def _output_dir(ctx: click.Context, param: click.Parameter, value: str | None) -> Path | None:
    """An empty --output-dir would mean the current folder: refused, as '.' says that plainly."""
    if value is None:
        return None
    if not value.strip():
        raise click.BadParameter("is empty: name the folder the run should write to ('.' for this one)")
    return click.Path(path_type=Path, file_okay=False).convert(value, param, ctx)


def _run_options(function: Any) -> Any:
    for option in reversed(CONTEXT + KNOBS + [
        click.option("--dataset", required=True, help="gsm8k, math-sample, a .jsonl/.parquet file or a folder."),
        click.option("--reward", "rewards", multiple=True,
                     help="format, correctness, or module:function (repeat for several; default: both built-ins)."),
        click.option("--output-dir", callback=_output_dir, help="Where checkpoints go."),
        click.option("--resume", is_flag=True, help="Continue the run in --output-dir from its last checkpoint."),
        click.option("--overwrite", is_flag=True, help="Remove the run already in --output-dir and start afresh."),
        click.option("--max-steps", type=int, default=-1, show_default=True, help="-1: one epoch."),
        click.option("--save-steps", type=int, default=100, show_default=True),
        click.option("--dry-run", is_flag=True, help="Print the config, command and predicted memory; start nothing."),
        click.option("--auto-fallback", is_flag=True,
                     help="On out-of-memory, resume from the last checkpoint with the next config down the ladder."),
        click.option("--verbose", is_flag=True, help="Show the libraries' warnings, log lines and progress bars."),
        click.option("--record-frames", is_flag=True,
                     help="On CUDA, keep each allocation's Python frames in the allocator's history (for advise "
                          "SNAPSHOT; slower, and a larger oom-snapshot.pickle.gz)."),
    ]):
        function = option(function)
    return function


def _run_arguments_of_trl(trl_arguments: dict[str, Any]) -> dict[str, Any]:
    """TRL's own spelling of the run's flags (`--output_dir`, `--max_steps`, `--save_steps` on the command line),
    where the flag itself is not given: the run's settings they make."""
    from click.core import ParameterSource

    context = click.get_current_context()
    taken = {}
    for key in ("output_dir", "max_steps", "save_steps"):
        if key in trl_arguments and context.get_parameter_source(key) in (None, ParameterSource.DEFAULT):
            value = trl_arguments[key]
            if key != "output_dir" and (isinstance(value, bool) or not isinstance(value, int)):
                raise VramPlanError(f"--{key} takes a whole number of steps (got {value!r})")
            taken[key] = Path(str(value)) if key == "output_dir" else value
    return taken


@click.command("run", cls=TrlArgumentsCommand)
@_run_options
def run(**options: Any) -> None:
    """Start the GRPO run the plan recommends (TRL's GRPOTrainer), logging memory per step."""
    from vram_planner.extras import require_train_extra
    from vram_planner.model.grpo_config import output_dir_name

    require_train_extra("vram-plan run")
    from vram_planner.engine import planned
    from vram_planner.run.checks import clear_previous_run, prepare
    from vram_planner.run.interrupts import RunInterrupted, interrupted_message
    from vram_planner.run.launch import is_main_process, library_output, train
    from vram_planner.run.out_of_memory import RunOutOfMemory
    from vram_planner.run.setup import RunSetup
    from vram_planner.model.accelerate_config import deepspeed_config_json
    from vram_planner.run.several import (CONFIG_NAME, DEEPSPEED_NAME, accelerate_config_yaml, end_ranks, launch,
                                          launch_command, needs_launcher)

    run_keys = ("dataset", "rewards", "output_dir", "max_steps", "save_steps", "resume", "overwrite",
                "record_frames")
    settings = {k: options.pop(k) for k in run_keys}
    settings.update(_run_arguments_of_trl(options.get("trl_arguments") or {}))
    dry_run, auto_fallback, verbose = (options.pop(k) for k in ("dry_run", "auto_fallback", "verbose"))
    context, knobs = resolve("run", options)
    _check_installed_trl(context.release)
    model_id = context.arch.hub_id or context.model_id
    on_cpu = not _cuda_available()
    settings["rewards"] = list(settings["rewards"]) or ["format", "correctness"]
    settings["output_dir"] = settings["output_dir"] or Path(output_dir_name(model_id))
    argv = click.get_current_context().find_root().obj["argv"]  # the command line, as the user gave it
    recipe_note = None
    if options.get("recipe") is not None:  # a TRL recipe as --config: how it trains comes along
        settings["recipe_arguments"], recipe_note = RunSetup.recipe_arguments_of(options["recipe"])
    setup = RunSetup.from_plan(planned(context, knobs), model_id=model_id, on_cpu=on_cpu, command=argv,
                               dry_run=dry_run, **settings)
    if recipe_note:
        setup.notes.append(recipe_note)
    if on_cpu:
        setup.notes.append(CPU_RANKS_NOTE if setup.train.num_gpus > 1 else CPU_NOTE)
    echo = click.echo if is_main_process() else (lambda *args, **kwargs: None)
    with library_output(verbose):
        prepared = prepare(setup)
        echo(setup.describe())
        if needs_launcher(setup.train):
            deepspeed = deepspeed_config_json(setup.train)
            echo(f"{setup.output_dir / CONFIG_NAME}:\n{accelerate_config_yaml(setup, planned=dry_run)}"
                 + ("" if deepspeed is None else f"{setup.output_dir / DEEPSPEED_NAME}:\n{deepspeed}")
                 + f"command: {' '.join(launch_command(setup, argv))}")
            if dry_run:
                raise click.exceptions.Exit(EXIT_FITS)
            clear_previous_run(setup)
            raise click.exceptions.Exit(launch(setup, argv, verbose))
        if not dry_run:
            try:
                train(setup, prepared, auto_fallback, say=lambda text: echo(text, err=True))
            except RunInterrupted as stop:  # Ctrl+C or SIGTERM: where the training is, and how to go on
                echo(interrupted_message(stop, argv), err=True)
                raise click.exceptions.Exit(stop.exit_code) from None
            except RunOutOfMemory as oom:  # its lines as they are (the advise command is pasted); every rank's
                click.echo(f"error: {oom}", err=True)
                raise click.exceptions.Exit(EXIT_ERROR) from None
            finally:
                end_ranks()
    raise click.exceptions.Exit(EXIT_FITS)


# The config printed is the GPU run's; started here, the run changes only what a machine without CUDA refuses.
CPU_NOTE = ("no CUDA device: started on this machine the run uses the CPU (for smoke tests only), with "
            "use_cpu=True, bf16=False, fp16=False over the GPU run's GRPOConfig above")


# Several ranks on the CPU: accelerate's FSDP2 or DeepSpeed over gloo, which its cpu flag would turn off
CPU_RANKS_NOTE = ("no CUDA device: started on this machine each rank trains on the CPU over gloo (for tests only), "
                  "with bf16=False, fp16=False over the GPU run's GRPOConfig above, and mixed_precision 'no' in the "
                  "accelerate config it writes")


def _check_installed_trl(release: Any) -> None:
    """The run starts the installed TRL's GRPOTrainer with the keywords of the release planned for: another
    --trl-version's GRPOConfig would not take them (TRL 0.14's max_prompt_length is gone from 1.x, say)."""
    from vram_planner.model.trl_releases import installed_trl_version, parse_version

    installed = installed_trl_version()
    parsed = parse_version(installed) if installed else None
    if parsed is None or release.note or parsed[1] == release.version:  # a release beyond the table is read as one
        return
    raise VramPlanError(f"run starts the installed TRL {installed}, not --trl-version {release.version}: install it "
                        f"(pip install 'trl=={release.version}') or leave --trl-version out")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
