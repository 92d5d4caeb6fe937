"""`vram-plan run --num-gpus N`: the planned run on N GPUs, one process each, through accelerate's own launcher.

The accelerate config `plan` prints is written beside the run and `accelerate launch` starts this same `vram-plan run`
in every process; what `--num-gpus auto` chose is spelled out so no rank searches again. On a machine without CUDA
(tests) the ranks train on the CPU over gloo with accelerate's own FSDP2 or DeepSpeed set-up (`gloo_ranks`).
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

from vram_planner.errors import VramPlanError
from vram_planner.files import write_atomically
from vram_planner.model.accelerate_config import CONFIG_FILE, DEEPSPEED_FILE, deepspeed_config_json
from vram_planner.model.spec import TrainingConfig

# `setup` below is run/launch.py's RunSetup, which imports this module: typed Any, so the two make no import circle
CONFIG_NAME = CONFIG_FILE  # TRL's accelerate config for the plan's strategy, beside the run's output
DEEPSPEED_NAME = DEEPSPEED_FILE  # the DeepSpeed config it names, where the plan's buckets need one


def launched_worker() -> bool:
    """This process is one of several that `accelerate launch` (or torchrun) started."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def missing_launcher(train: TrainingConfig) -> str | None:
    """What several GPUs need that is not installed: accelerate's launcher, and DeepSpeed under --zero-stage."""
    import importlib.util

    if train.num_gpus < 2:
        return None
    what = f"--num-gpus {train.num_gpus}"
    if importlib.util.find_spec("accelerate") is None:
        return (f"{what} starts one process per GPU with accelerate's launcher, which is not installed: "
                "pip install accelerate")
    if train.zero_stage is not None and importlib.util.find_spec("deepspeed") is None:
        return (f"{what} --zero-stage {train.zero_stage} runs DeepSpeed's ZeRO, which is not installed: "
                "pip install deepspeed")
    return None


def needs_launcher(train: TrainingConfig) -> bool:
    """Several GPUs, and this process is not one that `accelerate launch` started."""
    return train.num_gpus > 1 and not launched_worker()


def accelerate_config_yaml(setup: Any, planned: bool = False) -> str:
    """TRL's accelerate config for the plan's strategy, with the plan's GPU count and mixed precision: the file `plan`
    prints (vram_planner/model/accelerate_config.py). On a machine without CUDA (tests) the ranks train in float32,
    as the CPU_NOTE says of the GRPOConfig: mixed precision "no", unless `planned` asks for the GPU run's file (what
    a dry run shows)."""
    import yaml

    from vram_planner.model.accelerate_config import accelerate_config, accelerate_config_yaml as config_text

    deepspeed_file = str(setup.output_dir / DEEPSPEED_NAME)
    text = config_text(setup.train, deepspeed_file) or ""
    if planned or not setup.on_cpu or not text:
        return text
    origin = text.splitlines(keepends=True)[0]
    config = accelerate_config(setup.train, deepspeed_file) or {}
    if "mixed_precision" in config:  # none beside a DeepSpeed config file, whose "auto" follows the GRPOConfig
        config["mixed_precision"] = "no"
    return (origin.rstrip("\n") + "; no CUDA here: ranks on the CPU with gloo, in float32\n"
            + yaml.safe_dump(config, sort_keys=True))


def launch_command(setup: Any, argv: list[str]) -> list[str]:
    """`accelerate launch` of this same `vram-plan run` (each process then trains its share), with the count and
    strategy `--num-gpus auto` chose spelled out, so every rank starts the planned run without searching again."""
    return ["accelerate", "launch", "--config_file", str(setup.output_dir / CONFIG_NAME), "-m", "vram_planner",
            *(arg for arg in _strategy_spelled_out(setup.train, argv) if arg != "--dry-run")]


def _strategy_spelled_out(train: TrainingConfig, argv: list[str]) -> list[str]:
    """`argv` with `--num-gpus auto` replaced by the count, and the strategy's flags the search chose added."""
    args, auto = [], False
    for arg in argv:
        if arg.lower() == "--num-gpus=auto":
            args.append(f"--num-gpus={train.num_gpus}")
            auto = True
        elif arg == "auto" and args and args[-1] == "--num-gpus":
            args.append(str(train.num_gpus))
            auto = True
        else:
            args.append(arg)
    if not auto:
        return argv
    strategy = (["--fsdp"] if train.fsdp else
                ["--zero-stage", str(train.zero_stage)] if train.zero_stage is not None else [])
    given = {arg.split("=")[0] for arg in argv if arg.startswith("--")}
    if given & {"--fsdp", "--zero-stage"}:
        strategy = []
    offload = [item for flag, device in (("--offload-optimizer", train.offload_optimizer),
                                         ("--offload-param", train.offload_param))
               if device != "none" and flag not in given for item in (flag, device)]
    return args + strategy + offload


# What the ranks of a run on a machine without CUDA need: accelerate's device, and DeepSpeed's CPU accelerator (gloo)
CPU_RANKS_ENV = {"ACCELERATE_TORCH_DEVICE": "cpu", "DS_ACCELERATOR": "cpu"}


# torch's launcher gives the ranks this long to finish after it passes on Ctrl+C or SIGTERM before it kills them
# (its default, 30 s, can cut a large model's checkpoint short; torch reads it since pytorch#172596, March 2026;
# older releases keep 30 s)
LAUNCHER_ENV = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "600"}


# The exit codes of a rank that said why it stopped, in its own line above: refused (2), Ctrl+C (130), SIGTERM (143)
RANK_SAID_WHY = (2, 130, 143)
# The launcher's own exit once Ctrl+C (130) or SIGTERM (143) reached it and it passed the signal to the ranks
SIGNALLED_LAUNCHER = (130, 143)


def launch(setup: Any, argv: list[str], verbose: bool = False) -> int:
    """Write the accelerate config beside the run's output (what an earlier run left is cleared first, by
    launch.clear_previous_run) and start one process per GPU with accelerate's own launcher, in this process (so this
    Python runs the ranks). Returns the exit code: 0, or a failed rank's, which said why in its own line; a rank that
    stopped without a word (killed) is named in one line. Without --verbose, torch's launcher logs nothing (its
    warnings and the failure report with its traceback): the ranks' lines say it."""
    import logging

    import torch.distributed.run  # noqa: F401  (the launcher's loggers exist before their levels are set below)
    from accelerate.commands.launch import launch_command as accelerate_launch
    from accelerate.commands.launch import launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    write_atomically(setup.output_dir / CONFIG_NAME, accelerate_config_yaml(setup))
    deepspeed = deepspeed_config_json(setup.train)
    if deepspeed is not None:
        write_atomically(setup.output_dir / DEEPSPEED_NAME, deepspeed)
    args = launch_command_parser().parse_args(launch_command(setup, argv)[2:])
    # torch's elastic modules each set their logger's own level, so the parent's alone does not quiet them
    loggers = [logging.getLogger(name) for name in ["torch.distributed", *logging.root.manager.loggerDict]
               if name.startswith("torch.distributed")]
    levels = {logger: logger.level for logger in loggers}
    if not verbose:
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
    environment = {**(CPU_RANKS_ENV if setup.on_cpu else {}), **LAUNCHER_ENV}
    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update({name: value for name, value in environment.items() if name in CPU_RANKS_ENV
                       or os.environ.get(name) is None})  # a user's own shutdown timeout stands
    try:
        accelerate_launch(args)
    except SignalException as stop:  # Ctrl+C or SIGTERM reached the launcher, which passed it to every rank
        return 128 + stop.sigval  # the ranks saved their checkpoint and rank 0 said where, and how to resume
    except SystemExit as stop:  # accelerate 1.16 on ends the launch itself: 128 + the signal's number, as above
        if stop.code in SIGNALLED_LAUNCHER:  # (commands/launch.py _run_torchrun: SignalException, KeyboardInterrupt)
            return stop.code
        raise VramPlanError(f"accelerate's launcher stopped with exit code {stop.code!r}; --verbose shows its "
                            "report") from None
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        if failure.exitcode in RANK_SAID_WHY:
            return failure.exitcode
        how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
               else f"exited with code {failure.exitcode}")
        raise VramPlanError(f"rank {rank} of {setup.train.num_gpus} {how} (out of host memory, or killed); "
                            "--verbose shows the launcher's report") from None
    finally:
        for logger, level in levels.items():
            logger.setLevel(level)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0


def end_ranks() -> None:
    """A launched rank leaves its process group before its process exits: left to the interpreter's exit, the
    group's threads can be destroyed while joinable, and the rank dies with "terminate called without an active
    exception" after a run that finished (seen on CPU ranks over gloo under load)."""
    if not launched_worker():
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_rank(exit_code: int) -> NoReturn:
    """Leave a launched rank's process without the interpreter's teardown, once the run has ended either way.

    Python's exit makes a thread that asks for the GIL during finalization leave through pthread_exit; in a thread
    inside torch's C++ (a store or a collective waiting with the GIL released, returning as the peer rank exits) that
    unwinds through a noexcept frame and the rank aborts with "terminate called without an active exception", a
    SIGABRT the launcher reports as a failed run after the run finished (seen on CPU ranks over gloo under load, after
    end_ranks' destroy_process_group). What Python's exit does before finalizing is done here, in its order: the
    non-daemon threads joined, the atexit functions run (logging's flush among them), the streams flushed; the rest,
    freeing memory and closing files, the OS does at os._exit."""
    import atexit
    import threading

    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed by the reader (a pipe) or by an exit function
            pass
    os._exit(exit_code)


def gloo_ranks() -> None:
    """Let accelerate set up FSDP or DeepSpeed across processes on a machine without CUDA (tests), over gloo.

    accelerate picks the process group from the device: without CUDA and without its cpu flag it finds none and
    trains each rank alone; with the cpu flag it takes gloo but as MULTI_CPU, plain data parallelism, turning FSDP and
    DeepSpeed off (accelerate/state.py, PartialState._prepare_backend and AcceleratorState.__init__). So the ranks run
    without the cpu flag (RunSetup.grpo_kwargs), ACCELERATE_TORCH_DEVICE names the CPU, and the backend is gloo as a
    GPU's is nccl: what follows is accelerate's own FSDP2 or DeepSpeed set-up. Plain data parallelism (neither) takes
    accelerate's own CPU path, MULTI_CPU: DDP given a GPU's device ids refuses a module on the CPU."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    found = PartialState._prepare_backend
    if getattr(found, "gloo_ranks", False):
        return

    def prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False,
                        backend: str | None = None) -> tuple[str | None, Any]:
        if not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            sharded = any(os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() == "true"
                          for name in ("FSDP", "DEEPSPEED"))  # what accelerate's launcher sets from the config
            return "gloo", DistributedType.MULTI_GPU if sharded else DistributedType.MULTI_CPU
        return found(self, cpu, sagemaker_dp, backend)

    prepare_backend.gloo_ranks = True  # type: ignore[attr-defined]
    PartialState._prepare_backend = prepare_backend
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        _no_shared_memory_all_reduce()


def _no_shared_memory_all_reduce() -> None:
    """DeepSpeed's CPU backend would compile its shared-memory all-reduce as it starts, for tensor-parallel
    inference alone (vram_planner/tracing/zero.py `shared_memory_all_reduce_off`): marked off for this rank's
    process, whose whole life is the run. A GPU run is as it was."""
    from vram_planner.tracing.zero import shared_memory_all_reduce_off

    shared_memory_all_reduce_off()
