"""`vram-plan run`: start the TRL GRPO run the plan recommends, with the same objects `plan` prints: the smoke step,
then the run, each falling back down the plan's ladder on an out-of-memory error when asked. What it depends on is
checked first (run/checks.py). Heavy imports happen only in the run's modules.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

from vram_planner.errors import VramPlanError, first_line
from vram_planner.extras import library_log_warnings_hidden
from vram_planner.model.grpo_config import lora_config_kwargs, quantization_config_kwargs
from vram_planner.model.spec import TrainingConfig, knob_names
from vram_planner.run.checks import PreparedRun, clear_previous_run, last_checkpoint, load_processor, tokenizer_only
from vram_planner.run.interrupts import (RunInterrupted, StopAtStepEnd, Terminated, signals_held,
                                         terminate_as_interrupt)
from vram_planner.run.memory_history import OOM_SNAPSHOT_NAME, memory_history
from vram_planner.run.model_card import place_model_card, users_readme
from vram_planner.run.out_of_memory import RunOutOfMemory
from vram_planner.run.progress import LOG_NAME, JsonlLog, RichProgress
from vram_planner.run.ranks import RankBytes, gathered
from vram_planner.run.record import record_outcome, run_record, write_record
from vram_planner.run.rewards import load_reward
from vram_planner.run.setup import RunSetup
from vram_planner.run.several import gloo_ranks, launched_worker
from vram_planner.run.smoke import (force_full_length, full_length_completions, generation_kwargs_field, longest_first,
                                    release_memory)
from vram_planner.run.step_memory import ReservedGrowth, StepMemory
from vram_planner.units import GiB


def is_main_process() -> bool:
    """The process that prints: the only one, or rank 0 of those `accelerate launch` started."""
    return int(os.environ.get("RANK", "0")) == 0


@contextlib.contextmanager
def library_output(verbose: bool) -> Iterator[None]:
    """Without --verbose, the run's own lines only: no deprecation warnings, library log lines or progress bars
    (loading weights, writing shards, datasets' maps) from transformers, datasets and the hub client, nor the
    warnings of libraries that log without setting logging up (bitsandbytes)."""
    if verbose:
        yield
        return
    import datasets
    import transformers
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    bars = transformers_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()  # the hub client's bars too
    datasets.disable_progress_bars()
    try:
        with warnings.catch_warnings(), library_log_warnings_hidden():
            for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
                warnings.simplefilter("ignore", category)
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars[0]:
            transformers_logging.enable_progress_bar()
        if bars[1]:
            datasets.enable_progress_bars()


@dataclass(frozen=True)
class RunSummary:
    """How a run ended: its steps, its wall time, the most memory it reserved and whether that crept up."""

    output_dir: Path
    steps: int
    seconds: float
    measured_peak_reserved_bytes: int | None  # the allocator's, over the run (no CUDA context); None off CUDA
    reserved_growth: ReservedGrowth | None = None  # None off CUDA or before a step after the allocator settled


# Extra TrainerCallbacks for every run (tests add a fake allocator cap here).
EXTRA_CALLBACKS: list[Any] = []


def smoke_step(setup: RunSetup, dataset: Any) -> None:
    """One step on the longest prompts with every completion forced to full length, in a scratch folder: an
    out-of-memory error shows up in seconds instead of hours into the run."""
    import tempfile

    train = setup.train
    rows = train.per_device_train_batch_size * train.steps_per_generation_resolved
    with tempfile.TemporaryDirectory(prefix="vram-plan-smoke-") as scratch:
        smoke = replace(setup, output_dir=Path(scratch), max_steps=1)
        try:
            start_run(smoke, longest_first(dataset, rows), smoke=True,
                      oom_snapshot=setup.output_dir / OOM_SNAPSHOT_NAME)
        except RunOutOfMemory as oom:
            oom.setup = setup  # what falls back is the run, not the scratch folder's single step
            raise
    release_memory()


def start_run(setup: RunSetup, dataset: Any, resume_from: Path | None = None, smoke: bool = False,
              oom_snapshot: Path | None = None) -> RunSummary:
    """Train on a prepared dataset (from a checkpoint when given). Ctrl+C or SIGTERM save a checkpoint of the steps
    done and raise RunInterrupted. On CUDA the allocator's history is recorded, and an out-of-memory error writes its
    snapshot to `oom_snapshot` (default: the run's folder) before anything is freed."""
    _use_allocator_conf(setup.train.allocator_conf)
    if setup.on_cpu and launched_worker():
        gloo_ranks()
    from transformers import TrainerCallback
    from trl import GRPOConfig

    kwargs = {**setup.grpo_kwargs(), "disable_tqdm": True}  # the rich progress line replaces TRL's bar
    if smoke:
        kwargs.update(save_strategy="no")
        if generation_kwargs_field():
            kwargs.update(generation_kwargs=full_length_completions(setup.train))
    args = GRPOConfig(**kwargs)
    peft = lora_config_kwargs(setup.train)
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(**peft)
    quantization = quantization_config_kwargs(setup.train)
    if quantization:
        from transformers import BitsAndBytesConfig

        args.model_init_kwargs = {**(args.model_init_kwargs or {}),
                                  "quantization_config": BitsAndBytesConfig(**quantization)}
    created = not setup.output_dir.exists()
    readme_kept = users_readme(setup.output_dir)
    setup.output_dir.mkdir(parents=True, exist_ok=True)
    resumed_at = int(resume_from.name.partition("-")[2]) if resume_from is not None else None
    memory = StepMemory.start()
    log = JsonlLog(setup.output_dir / LOG_NAME, setup.predicted_peak_bytes, resumed_at, setup.predicted_step_seconds,
                   setup.predicted_reserved_bytes, memory, setup.predicted_allocated_bytes)
    progress = RichProgress(setup.predicted_reserved_bytes, transient=smoke, memory=memory)

    def on_log(*args: Any, **kwargs: Any) -> None:
        record = log.on_log(*args, **kwargs)
        progress.on_log(*args, **kwargs, step_seconds=(record or {}).get("measured_step_seconds"))

    ranks = RankBytes()
    stop = StopAtStepEnd(save=not smoke) if launched_worker() else None
    hooks = {"on_log": on_log, "on_step_begin": memory.on_step_begin, "on_train_begin": progress.on_train_begin,
             "on_train_end": progress.on_train_end, "on_optimizer_step": ranks.on_optimizer_step,
             **({"on_step_end": stop.on_step_end} if stop else {})}
    callback = type("VramPlanLog", (TrainerCallback,), {name: staticmethod(hook) for name, hook in hooks.items()})()
    snapshot_path = oom_snapshot or setup.output_dir / OOM_SNAPSHOT_NAME
    with memory_history(snapshot_path, setup.record_frames) as history:  # from the weights' loading on
        return _train_recorded(setup, args, peft_config, dataset, callback, progress, created, readme_kept,
                               resume_from, smoke, history, ranks, memory, stop)


def _use_allocator_conf(allocator_conf: str) -> None:
    """PYTORCH_CUDA_ALLOC_CONF for the run: torch reads it when CUDA first allocates; once it has (a fallback resumed
    in the same process), it takes the settings that can change at run time, expandable segments among them."""
    if not allocator_conf:
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = allocator_conf
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(allocator_conf)


def _train_recorded(setup: RunSetup, args: Any, peft_config: Any, dataset: Any, callback: Any, progress: RichProgress,
                    created: bool, readme_kept: bool, resume_from: Path | None, smoke: bool,
                    history: Any, ranks: RankBytes, memory: StepMemory,
                    stop_at_step_end: StopAtStepEnd | None = None) -> RunSummary:
    import torch
    from trl import GRPOTrainer

    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    try:
        processing_class = (load_processor(setup.model_id, "GRPOTrainer tokenizes with it")
                            if tokenizer_only(setup.model_id) else None)  # None: TRL's AutoProcessor
        trainer = GRPOTrainer(model=setup.model_id, reward_funcs=[load_reward(r) for r in setup.rewards],
                              args=args, train_dataset=dataset, peft_config=peft_config,
                              processing_class=processing_class, callbacks=[callback, *EXTRA_CALLBACKS])
    except Exception as exc:
        if created and not history.written:  # nothing trained yet: leave no half-made folder behind
            shutil.rmtree(setup.output_dir, ignore_errors=True)
        raise VramPlanError(f"GRPOTrainer could not start: {first_line(exc)}") from exc
    # Trainer sets a rank other than the first to log warnings (TrainingArguments.log_level_replica): the run's own
    # setting stands (quiet without --verbose)
    transformers_logging.set_verbosity(verbosity)
    if smoke and not generation_kwargs_field():
        force_full_length(trainer, setup.train)
    main = is_main_process()  # of several ranks, rank 0 alone writes the record and places the card
    if not smoke and main:
        place_model_card(trainer, setup.output_dir, setup.model_id, aside=readme_kept)
        write_record(setup.output_dir, run_record(setup, setup.command))
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # with TRL's bar off it prints every log dict; the line shows them
    started = time.perf_counter()
    try:
        with stop_at_step_end.handling() if stop_at_step_end else terminate_as_interrupt():
            trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    except torch.cuda.OutOfMemoryError as exc:
        snapshot = history.written[-1] if history.written else None
        oom = RunOutOfMemory(setup, exc, None if smoke else _rescue(trainer), snapshot)
        if not smoke and main:
            record_outcome(setup.output_dir, {"status": "out_of_memory", "step": trainer.state.global_step,
                                              "checkpoint": oom.checkpoint, "error": first_line(exc, limit=400),
                                              "oom_snapshot": snapshot, "oom_snapshot_failed": history.failed})
        raise oom from exc
    except KeyboardInterrupt as exc:
        progress.stop()
        terminated = isinstance(exc, Terminated)
        stop = RunInterrupted(143 if terminated else 130, "SIGTERM" if terminated else "Ctrl+C",
                              trainer.state.global_step, None if smoke else _rescue(trainer))
        _interrupted(setup, stop, record=not smoke and main)
    if stop_at_step_end is not None and stop_at_step_end.stopped_at is not None:  # the ranks saved it together
        progress.stop()
        _interrupted(setup, RunInterrupted(stop_at_step_end.exit_code, stop_at_step_end.signal_name or "SIGTERM",
                                           trainer.state.global_step,
                                           None if smoke else last_checkpoint(setup.output_dir)),
                     record=not smoke and main)
    if not smoke:
        trainer.save_model(str(setup.output_dir / "final"))
    peaks, growth = memory.run_peaks(), memory.reserved_growth()
    summary = RunSummary(setup.output_dir, trainer.state.global_step, time.perf_counter() - started,
                         None if peaks is None else peaks[1], growth)
    per_rank = gathered(ranks.measured) if setup.train.num_gpus > 1 else None  # every rank takes part
    # each rank's bytes, and the plan's CUDA context and NCCL buffers beside what CUDA ranks held outside the allocator
    several = ({"ranks": per_rank, "predicted_outside_allocator_bytes": setup.predicted_outside_allocator_bytes}
               if per_rank else {})
    if not smoke and main:
        record_outcome(setup.output_dir, {"status": "finished", "steps": summary.steps,
                                          "seconds": round(summary.seconds, 1),
                                          "measured_peak_allocated_bytes": None if peaks is None else peaks[0],
                                          "measured_peak_reserved_bytes": summary.measured_peak_reserved_bytes,
                                          "predicted_peak_bytes": round(setup.predicted_peak_bytes),
                                          "predicted_peak_reserved_bytes": round(setup.predicted_reserved_bytes),
                                          "predicted_peak_allocated_bytes": round(setup.predicted_allocated_bytes),
                                          "measured_reserved_growth": growth.to_dict() if growth else None,
                                          **several})
    return summary


def _interrupted(setup: RunSetup, stop: RunInterrupted, record: bool) -> NoReturn:
    if record:
        record_outcome(setup.output_dir, {"status": "interrupted", "signal": stop.signal_name, "step": stop.step,
                                          "checkpoint": stop.checkpoint})
    raise stop from None


def _rescue(trainer: Any) -> Path | None:
    """Save a checkpoint of the steps done so far (an OOM leaves the weights and optimizer states intact); before
    the first step there is nothing to save."""
    import torch

    if trainer.state.global_step == 0:
        return last_checkpoint(Path(trainer.args.output_dir))

    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    try:
        with signals_held():
            trainer._save_checkpoint(trainer.model, trial=None)
    except Exception:  # the OOM may recur while saving: the last scheduled checkpoint is then what there is
        pass
    return last_checkpoint(Path(trainer.args.output_dir))


def train(setup: RunSetup, prepared: PreparedRun, auto_fallback: bool, say: Callable[[str], None]) -> None:
    """The smoke step, then the run (from the checkpoint to resume from); on out-of-memory with `auto_fallback`,
    in either, again with the config the snapshot points to down the plan's ladder: the smoke step from the start,
    the run from the checkpoint it saved."""
    setup, snapshots = _smoke_passed(setup, prepared.dataset, auto_fallback, say)
    clear_previous_run(setup, keep=snapshots)  # only now: a smoke step that fails leaves the earlier run as it was
    resume = prepared.resume_from
    while True:
        try:
            summary = start_run(setup, prepared.dataset, resume)
            say(closing_line(setup, summary))
            return
        except RunOutOfMemory as oom:
            smaller = _fallen_back(oom, auto_fallback, say, f"resuming from {oom.checkpoint}"
                                   if oom.checkpoint else "starting again (no checkpoint was saved)")
            if smaller is None:
                raise
            resume = oom.checkpoint
        release_memory()  # out of the handler: the failed trainer is no longer held by the error's frames
        setup = smaller


def _smoke_passed(setup: RunSetup, dataset: Any, auto_fallback: bool,
                  say: Callable[[str], None]) -> tuple[RunSetup, list[Path]]:
    """The setup whose smoke step passed (with `auto_fallback`, down the ladder from each out-of-memory error) and
    the snapshots the failed ones wrote."""
    snapshots: list[Path] = []
    while True:
        say("smoke step: the longest prompts, full-length completions")
        try:
            smoke_step(setup, dataset)
            return setup, snapshots
        except RunOutOfMemory as oom:
            smaller = _fallen_back(oom, auto_fallback, say, "the smoke step again (nothing was trained to keep)")
            if smaller is None:
                raise
            snapshots += [oom.snapshot] if oom.snapshot else []
        release_memory()
        setup = smaller


def _fallen_back(oom: RunOutOfMemory, auto_fallback: bool, say: Callable[[str], None], then: str) -> RunSetup | None:
    """The config to go on with after `oom` (chosen from its snapshot), said with what changed; None: stop."""
    if not auto_fallback:
        return None
    from vram_planner.run.fallback import fallback_setup

    smaller, why = fallback_setup(oom.setup, oom.snapshot)
    if smaller is None:
        say(f"no fallback: {why}")
    else:
        say(f"{oom}\nfalling back: {changed(oom.setup.train, smaller.train)}, predicted peak "
            f"{smaller.predicted_peak_bytes / GiB:.2f} GiB ({why}); {then}")
    return smaller


def closing_line(setup: RunSetup, summary: RunSummary) -> str:
    """Steps, time, the peak reserved against the plan's like for like, whether reserved crept, and where things
    are."""
    if summary.measured_peak_reserved_bytes is None:
        measured = f"predicted peak {setup.predicted_peak_bytes / GiB:.2f} GiB (not measured without CUDA)"
    else:
        context = setup.predicted_peak_bytes - setup.predicted_reserved_bytes
        measured = (f"peak reserved {summary.measured_peak_reserved_bytes / GiB:.2f} GiB, predicted "
                    f"{setup.predicted_reserved_bytes / GiB:.2f} GiB (the plan's {setup.predicted_peak_bytes / GiB:.2f}"
                    f" GiB less {context / GiB:.2f} GiB of {setup.outside_allocator_words})")
        if summary.reserved_growth is not None:
            measured += f"; {summary.reserved_growth.describe()}"
    steps = "1 step" if summary.steps == 1 else f"{summary.steps} steps"
    return (f"done: {steps} in {_duration(summary.seconds)}; {measured}; the model is in "
            f"{setup.output_dir / 'final'}, the log in {setup.output_dir / LOG_NAME}")


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {seconds:02d}s" if hours else f"{minutes}m {seconds:02d}s"


def changed(before: TrainingConfig, after: TrainingConfig) -> str:
    """The fields two configs differ in, as 'name before -> after'."""
    fields = knob_names()
    return ", ".join(f"{k} {getattr(before, k)} -> {getattr(after, k)}" for k in fields
                     if getattr(before, k) != getattr(after, k))
