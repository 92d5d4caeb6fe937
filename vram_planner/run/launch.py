"""`vram-plan run`: start the TRL GRPO run the plan recommends, with the same objects `plan` prints.

Everything a run depends on is checked before anything is written or the smoke step starts (optional packages, the
output folder, a model folder's weights, the dataset's prompts and columns, the chat template, rewards on a sample
batch), so bad input leaves nothing behind. Heavy imports happen only here.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shlex
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vram_planner.errors import VramPlanError, first_line
from vram_planner.extras import library_log_warnings_hidden, require_bitsandbytes, require_vllm
from vram_planner.files import MAX_LOG_BYTES, check_writable, read_text, write_atomically
from vram_planner.model.grpo_config import call_args, grpo_config_kwargs, lora_config_kwargs, quantization_config_kwargs
from vram_planner.model.search import Plan, micro_batch_variants, rungs
from vram_planner.model.spec import TrainingConfig, knob_names
from vram_planner.model.verdict import Verdict, judge
from vram_planner.run.memory_history import OOM_SNAPSHOT_NAME, memory_history
from vram_planner.run.out_of_memory import RunOutOfMemory
from vram_planner.run.ranks import RankBytes, gathered
from vram_planner.run.record import RECORD_NAME, record_outcome, run_record, write_record
from vram_planner.run.rewards import check_rewards, load_reward, sample_batch
from vram_planner.run.several import CONFIG_NAME, gloo_ranks, launched_worker, missing_launcher
from vram_planner.run.step_memory import ReservedGrowth, StepMemory, predicted_reserved_bytes
from vram_planner.units import GiB

LOG_NAME = "vram-plan-log.jsonl"
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


# What a run started on a machine without CUDA changes in the GPU run's GRPOConfig (transformers refuses bf16 there)
CPU_ADAPTATION = {"use_cpu": True, "bf16": False, "fp16": False}


@dataclass
class RunSetup:
    """What `vram-plan run` will start: the verdict of the plan's config and the run's own settings."""

    verdict: Verdict  # the config to train and its predicted memory
    model_id: str  # hub id or local folder, as GRPOTrainer(model=...) takes it
    dataset: str
    rewards: list[str]
    output_dir: Path
    max_steps: int = -1  # -1: one epoch over the dataset, as TRL does
    save_steps: int = 100
    on_cpu: bool = False
    resume: bool = False  # continue from the last checkpoint in output_dir
    overwrite: bool = False  # remove the run already in output_dir and start afresh
    notes: list[str] = field(default_factory=list)
    command: list[str] | None = None  # the command line's arguments that started it, for the run's record
    dry_run: bool = False  # checks only: what needs the hub is noted, not refused, where the hub cannot be reached
    record_frames: bool = False  # the allocator's history keeps each allocation's Python frames (slower, larger)

    def __post_init__(self) -> None:
        if self.max_steps == 0 or self.max_steps < -1:
            raise VramPlanError(f"--max-steps {self.max_steps}: give the number of optimizer steps (1 or more), or -1 "
                                "for one epoch over the dataset")
        if self.save_steps < 1:
            raise VramPlanError(f"--save-steps {self.save_steps}: a checkpoint is saved every N steps; give N of 1 or "
                                "more")

    @classmethod
    def from_plan(cls, plan: Plan, **settings: Any) -> RunSetup:
        if plan.chosen is None:
            raise VramPlanError(f"nothing vram-plan knows fits this card (the smallest config needs "
                                f"{plan.smallest.estimate.peak_bytes / GiB:.2f} GiB); `vram-plan plan` shows it")
        return cls(verdict=plan.chosen, **settings)

    @property
    def train(self) -> TrainingConfig:
        return self.verdict.train

    @property
    def predicted_peak_bytes(self) -> float:
        return self.verdict.estimate.peak_bytes

    @property
    def predicted_reserved_bytes(self) -> float:
        """The plan's peak less the CUDA context it counts: what PyTorch's allocator is expected to reserve, the
        figure set beside the measured peak reserved."""
        return predicted_reserved_bytes(self.verdict.estimate)

    @property
    def predicted_step_seconds(self) -> float | None:
        """The step-time model's seconds per optimizer step (None where the card has no speed figures)."""
        from vram_planner.model.ranking import timed
        from vram_planner.model.step_time import NoSpeedFigures

        try:
            return timed(self.verdict).step_seconds
        except NoSpeedFigures:
            return None

    def one_rung_down(self) -> RunSetup | None:
        """The same run with the next smaller config of the plan's ladder: a smaller micro-batch with the same
        generation and optimizer batches, else the next saver."""
        train = self.train
        smaller = next((v for v in micro_batch_variants(train)
                        if v.per_device_train_batch_size < train.per_device_train_batch_size), None)
        if smaller is None:
            smaller = next(itertools.islice(rungs(train, self.verdict.context.gpu.bf16), 1, None), None)
        if smaller is None:
            return None
        return replace(self, verdict=judge(self.verdict.context, smaller))

    def grpo_kwargs(self, on_this_machine: bool = True) -> dict[str, Any]:
        """GRPOConfig's keywords for the run; `on_this_machine`: adapted to a machine without CUDA, as the run
        started here uses them (else as the plan's GPU runs them)."""
        kwargs = grpo_config_kwargs(self.train)
        kwargs.update(output_dir=str(self.output_dir), max_steps=self.max_steps, save_steps=self.save_steps,
                      logging_steps=1, report_to=[])
        if self.on_cpu and on_this_machine:  # tests and smoke runs: no autocast on the CPU
            kwargs.update(CPU_ADAPTATION)
            if self.train.num_gpus > 1:  # accelerate's cpu flag turns FSDP and DeepSpeed off: see gloo_ranks
                kwargs.update(use_cpu=False, dataloader_pin_memory=False)  # nothing to pin for
        return kwargs

    def describe(self) -> str:
        """The exact configuration, for --dry-run and the run's first lines."""
        lines = [f"model: {self.model_id}", f"dataset: {self.dataset}", f"rewards: {', '.join(self.rewards)}",
                 f"predicted peak: {self.predicted_peak_bytes / GiB:.2f} GiB "
                 f"(on {self.verdict.context.gpu.label}; {self.predicted_reserved_bytes / GiB:.2f} GiB reserved by "
                 f"PyTorch, the rest the CUDA context, which the per-step lines leave out)",
                 f"GRPOConfig({call_args(self.grpo_kwargs(on_this_machine=False))})"]
        peft = lora_config_kwargs(self.train)
        if peft:
            lines.append(f"LoraConfig({call_args(peft)})")
        quantization = quantization_config_kwargs(self.train)
        if quantization:
            lines.append(f"BitsAndBytesConfig({call_args(quantization)})")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def check_model_folder(model_id: str) -> None:
    """A local model folder must hold a config and weights; hub ids are left to transformers."""
    path = Path(model_id).expanduser()
    if not path.exists():
        return
    if not path.is_dir() or not (path / "config.json").is_file():
        raise VramPlanError(f"{model_id} is not a model folder with a config.json")
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise VramPlanError(f"{model_id} has a config.json but no weights (*.safetensors or *.bin): training "
                            "needs the model's weights, not only its configuration")


def check_hub_model(setup: RunSetup) -> None:
    """A hub model needs the hub, or its files in the local cache: asked once, before anything else, instead of
    half a minute of transformers' retries after the smoke step has begun. Offline with the model cached, the run
    reads the cache only."""
    if Path(setup.model_id).expanduser().exists():
        return
    from vram_planner.hub import hub_unreachable_reason

    reason = hub_unreachable_reason()
    if reason is None:
        return
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(setup.model_id, "config.json"), str):
        constants.HF_HUB_OFFLINE = True  # what transformers asks before each download: the cache, no retries
        os.environ["HF_HUB_OFFLINE"] = "1"  # and so do the processes accelerate launches
        setup.notes.append(f"the hub cannot be reached ({reason}): {setup.model_id} is read from the local cache")
        return
    problem = (f"{setup.model_id} is a hub model, and the hub cannot be reached ({reason}) nor is the model in the "
               "local cache: check the network, or pass a local model folder")
    if not setup.dry_run:
        raise VramPlanError(problem)
    setup.notes.append(problem)


def prepared_dataset(setup: RunSetup) -> Any:
    """The dataset with its prompts and columns checked, the chat template tried on chat prompts, and each reward
    tried on a sample batch."""
    from vram_planner.run.train_data import check_prompts, load_prompts, require_columns

    dataset = load_prompts(setup.dataset)
    require_columns(dataset, {"prompt"}, "GRPOTrainer reads the prompts from it")
    if "correctness" in setup.rewards:
        require_columns(dataset, {"answer"}, "the correctness reward compares with it")
    chat = check_prompts(dataset)
    processor = check_chat_template(setup.model_id, dataset) if chat else None
    if not setup.train.release.truncates_prompts:
        try:
            processor = processor or load_processor(setup.model_id, "the dataset's prompts are counted in its tokens")
        except VramPlanError as problem:
            if not setup.dry_run:
                raise
            setup.notes.append(f"prompt lengths not checked: {problem}")
        else:
            check_prompt_lengths(setup, dataset, processor, chat)
    check_rewards({name: load_reward(name) for name in setup.rewards}, sample_batch(dataset))
    return dataset


# What a model folder's processor is saved as, beside its tokenizer (transformers' image and video processors, and
# the processor that holds them)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def tokenizer_only(model_id: str) -> bool:
    """A local model folder with a tokenizer and no processor: GRPOTrainer's AutoProcessor would ask a multimodal
    config's folder for the image processor it lacks, so the run trains its text with the tokenizer (for a text
    model the tokenizer is what AutoProcessor gives anyway)."""
    path = Path(model_id).expanduser()
    return path.is_dir() and not any((path / name).is_file() for name in PROCESSOR_FILES)


def load_processor(model_id: str, why: str) -> Any:
    """The tokenizer (or processor) as the run gives it to GRPOTrainer; offline, from the cache only, without
    retries."""
    from transformers import AutoProcessor, AutoTokenizer

    from vram_planner.hub import hub_unreachable_reason, quiet_hub_logs

    offline = None if Path(model_id).expanduser().exists() else hub_unreachable_reason()
    kind = AutoTokenizer if tokenizer_only(model_id) else AutoProcessor
    try:
        with quiet_hub_logs():  # offline: the cache only, without half a minute of retries
            return kind.from_pretrained(model_id, truncation_side="left", padding_side="left",
                                        local_files_only=offline is not None)
    except Exception as exc:
        raise VramPlanError(f"cannot load the tokenizer of {model_id} ({offline or first_line(exc, limit=200)}); "
                            f"{why}") from exc


def check_prompt_lengths(setup: RunSetup, dataset: Any, processor: Any, chat: bool) -> None:
    """The plan counts prompts of max_prompt_length tokens, and the TRL release planned for does not truncate them:
    a longer prompt in the dataset would make every phase larger than planned, so it is refused with both numbers."""
    tokenizer = getattr(processor, "tokenizer", processor)
    longest, row = 0, 0
    for index, prompt in enumerate(dataset["prompt"], start=1):
        if chat:
            tokens = len(processor.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True))
        else:
            tokens = len(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if tokens > longest:
            longest, row = tokens, index
    planned = setup.train.max_prompt_length
    if longest > planned:
        raise VramPlanError(f"the dataset's longest prompt is {longest} tokens (row {row}), longer than the {planned} "
                            f"the plan counts, and TRL {setup.train.release.version} does not truncate prompts: pass "
                            f"--max-prompt-length {longest} so the plan counts it, or shorten the prompts")


def check_chat_template(model_id: str, dataset: Any) -> Any:
    """Chat prompts are rendered with the tokenizer's chat template: load the tokenizer as GRPOTrainer does and render
    the first prompts with it. Returns the processor."""
    processor = load_processor(model_id, "the dataset's prompts are chat messages, which need its chat template")
    if not getattr(processor, "chat_template", None):
        raise VramPlanError(f"the dataset's prompts are chat messages, but the tokenizer of {model_id} has no chat "
                            "template to render them: use a model with one (an instruct or chat model) or plain-text "
                            "prompts")
    for row, prompt in enumerate(dataset.select(range(min(len(dataset), 8)))["prompt"], start=1):
        try:
            processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        except Exception as exc:
            raise VramPlanError(f"the chat template of {model_id} cannot render row {row} of the dataset: "
                                f"{first_line(exc, limit=200)}") from exc
    return processor


def check_dependencies(train: TrainingConfig, dry_run: bool = False, notes: list[str] | None = None) -> None:
    """The optional packages the plan's config needs (bitsandbytes for 8-bit optimizers and 4-bit weights,
    accelerate for several GPUs and DeepSpeed for ZeRO). A dry run notes the launcher's packages it lacks instead:
    it only prints the config and the launch line."""
    problem = missing_launcher(train)
    if problem is not None:
        if not dry_run:
            raise VramPlanError(problem)
        if notes is not None:
            notes.append(problem)
    if train.optim.needs_bitsandbytes:
        require_bitsandbytes(f"--optim {train.optim.value}")
    if train.load_in_4bit:
        require_bitsandbytes("--load-in-4bit")
    if train.use_vllm:
        require_vllm("--use-vllm")


def run_files(folder: Path) -> list[Path]:
    """What an earlier run left in `folder` (checkpoint-N/, final/, the log, the accelerate config) and nothing
    else a user keeps there."""
    if not folder.is_dir():
        return []
    checkpoints = [p for p in folder.glob("checkpoint-*") if p.is_dir() and p.name.partition("-")[2].isdigit()]
    final = [folder / "final"] if (folder / "final").is_dir() else []
    files = [folder / name for name in (LOG_NAME, CONFIG_NAME, RECORD_NAME, OOM_SNAPSHOT_NAME)
             if (folder / name).is_file()]
    return sorted(checkpoints) + final + files


def last_checkpoint(folder: Path) -> Path | None:
    """The checkpoint-N folder with the largest N, as Trainer finds it."""
    from transformers.trainer_utils import get_last_checkpoint

    found = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    return Path(found) if found else None


def check_output_dir(setup: RunSetup) -> Path | None:
    """The output folder can be written and holds no earlier run, unless --resume (returns the checkpoint to
    continue from) or --overwrite (its files are removed only when training starts)."""
    folder = setup.output_dir
    if setup.resume and setup.overwrite:
        raise VramPlanError(f"--resume continues the run in {folder} and --overwrite starts it afresh: pass one of "
                            "them")
    check_writable(folder / LOG_NAME, "--output-dir")
    leftovers = [] if launched_worker() else run_files(folder)  # a launched process finds its launcher's config
    if setup.resume:
        checkpoint = last_checkpoint(folder)
        if checkpoint is None and not restartable(leftovers):
            raise VramPlanError(f"--resume: {folder} holds no checkpoint-N folder to continue from; leave --resume "
                                "out to start a run there")
        return checkpoint  # None: a run stopped before its first checkpoint starts again from the beginning
    if leftovers and not setup.overwrite and not restartable(leftovers):
        checkpoint = last_checkpoint(folder)
        resume = f"--resume to continue it from {checkpoint.name}" if checkpoint else "--resume (with a checkpoint)"
        raise VramPlanError(f"--output-dir {folder} already holds a run ({', '.join(p.name for p in leftovers[:4])}"
                            f"{', ...' if len(leftovers) > 4 else ''}): pass {resume}, --overwrite to start afresh "
                            "(removing those files), or another --output-dir")
    return None


def restartable(leftovers: list[Path]) -> bool:
    """What a run stopped before its first checkpoint leaves (its log, its accelerate config): nothing to continue
    from and nothing worth keeping, so a new run may start there without --overwrite."""
    return bool(leftovers) and all(path.is_file() for path in leftovers)


def clear_previous_run(setup: RunSetup, keep: list[Path] | None = None) -> None:
    """With --overwrite, remove what the earlier run left (nothing else in the folder), once, in the main process;
    without it, only what a run stopped before its first checkpoint left. `keep`: what this run wrote already (the
    snapshot of a smoke step it fell back from)."""
    if launched_worker() or setup.resume and last_checkpoint(setup.output_dir) is not None:
        return
    leftovers = [path for path in run_files(setup.output_dir) if path not in (keep or [])]
    if not setup.overwrite and not restartable(leftovers):
        return
    for path in leftovers:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


class JsonlLog:
    """A TrainerCallback writing each logged step (with the step's own measured peak memory beside the predicted,
    and the measured seconds per optimizer step since the last line beside the predicted ones) as one JSON line,
    from the main process only."""

    def __init__(self, path: Path, predicted_peak_bytes: float, resumed_at_step: int | None = None,
                 predicted_step_seconds: float | None = None, predicted_reserved_bytes: float | None = None,
                 memory: StepMemory | None = None) -> None:
        self.path, self.predicted = path, predicted_peak_bytes
        self.predicted_reserved = predicted_peak_bytes if predicted_reserved_bytes is None else predicted_reserved_bytes
        self.predicted_step_seconds = predicted_step_seconds
        self.memory = memory or StepMemory.start()
        self.started = time.perf_counter()
        self.last_logged: tuple[int, float] | None = None  # (step, time) of the last line
        if resumed_at_step is not None and path.is_file():
            self._drop_steps_after(resumed_at_step)

    def _drop_steps_after(self, step: int) -> None:
        """The steps an interrupted run logged after its last checkpoint are trained again: their lines go."""
        kept = [line for line in read_text(self.path, MAX_LOG_BYTES, "the run's log").splitlines(keepends=True)
                if (logged := _logged_step(line)) is None or logged <= step]
        write_atomically(self.path, "".join(kept))

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **_: Any) -> dict[str, Any] | None:
        """Write the step's line; return it (None off the main process)."""
        if not state.is_world_process_zero:
            return None
        now = time.perf_counter()
        record = {"step": state.global_step, "seconds": round(now - self.started, 3),
                  **(logs or {}), "predicted_peak_bytes": round(self.predicted),
                  "predicted_peak_reserved_bytes": round(self.predicted_reserved)}
        if self.last_logged is not None and state.global_step > self.last_logged[0]:
            # the first line's steps include the model's loading and the trainer's start: no step time there
            steps = state.global_step - self.last_logged[0]
            record["measured_step_seconds"] = round((now - self.last_logged[1]) / steps, 3)
        if self.predicted_step_seconds is not None:
            record["predicted_step_seconds"] = round(self.predicted_step_seconds, 3)
        self.last_logged = (state.global_step, now)
        if "train_runtime" in (logs or {}):  # TRL's closing line: the run's maximum, not its last step's
            peaks, prefix = self.memory.run_peaks(), "measured_run_peak"
        else:
            peaks, prefix = self.memory.step_peaks(state.global_step), "measured_peak"
        if peaks is not None:
            record[f"{prefix}_allocated_bytes"], record[f"{prefix}_reserved_bytes"] = peaks
        with self.path.open("a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")
        return record


def _logged_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return None


@dataclass
class PreparedRun:
    """What the checks found: the dataset to train on and the checkpoint to continue from (--resume)."""

    dataset: Any
    resume_from: Path | None


def prepare(setup: RunSetup) -> PreparedRun:
    """Everything a run depends on, checked before anything is written: optional packages, the output folder, the
    model folder, the dataset, the chat template, the rewards."""
    check_dependencies(setup.train, setup.dry_run, setup.notes)
    if setup.on_cpu and setup.train.use_vllm:
        raise VramPlanError("--use-vllm needs a CUDA device: vLLM generates on the GPU (drop --use-vllm to try the "
                            "run on the CPU)")
    resume_from = check_output_dir(setup)
    check_model_folder(setup.model_id)
    note_tokenizer_only(setup)
    check_hub_model(setup)
    return PreparedRun(prepared_dataset(setup), resume_from)


def note_tokenizer_only(setup: RunSetup) -> None:
    """A multimodal model's folder with a tokenizer and no processor trains on text prompts: said, as a note."""
    if not tokenizer_only(setup.model_id):
        return
    from vram_planner.profiles import read_json

    config = read_json(Path(setup.model_id).expanduser() / "config.json")
    towers = [key for key in ("vision_config", "audio_config") if isinstance(config, dict) and key in config]
    if towers:
        setup.notes.append(f"{setup.model_id} has a tokenizer and no processor: the run trains on the text prompts "
                           f"with the tokenizer (its {' and '.join(k.partition('_')[0] for k in towers)} tower is "
                           "loaded but sees no input)")


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


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's time limit, `kill`), handled as Ctrl+C is."""


class RunInterrupted(Exception):
    """Ctrl+C or SIGTERM while training: what was trained is saved in `checkpoint` (None before the first step)."""

    def __init__(self, exit_code: int, signal_name: str, step: int, checkpoint: Path | None) -> None:
        super().__init__(f"{signal_name} at step {step}")
        self.exit_code, self.signal_name, self.step, self.checkpoint = exit_code, signal_name, step, checkpoint


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises Terminated in the main thread while training, so the run saves a checkpoint and says where."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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


class RichProgress:
    """The run's progress on stderr, one line from the main process: step, reward, step time, and the step's peak
    reserved memory against the plan's (less the CUDA context, which PyTorch does not see). A transient one (the
    smoke step's) leaves nothing behind."""

    def __init__(self, predicted_reserved_bytes: float, transient: bool = False,
                 memory: StepMemory | None = None) -> None:
        self.predicted, self.transient = predicted_reserved_bytes, transient
        self.memory = memory or StepMemory.start()
        self.progress: Any = None
        self.task: Any = None
        self.lines: Any = None  # the console that gets a line per step, off a terminal

    def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(stderr=True)
        if not state.is_world_process_zero or (self.transient and not console.is_terminal):
            return  # off a terminal, a transient display would leave only a blank line
        if not console.is_terminal:  # a file, nohup, a scheduler's log: a line per step, written as it comes
            self.lines = console
            return
        self.progress = Progress(TextColumn("GRPO"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.description}"), console=console, transient=self.transient)
        self.progress.start()
        self.task = self.progress.add_task("", total=state.max_steps or None, completed=state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               step_seconds: float | None = None, **_: Any) -> None:
        """`step_seconds`: the step's time as the log measured it, for TRL releases that log no step_time (before
        0.26); None for the first step, which includes loading the model."""
        if (self.progress is None and self.lines is None) or not logs or "reward" not in logs:
            return
        peaks = self.memory.step_peaks()
        measured = "-" if peaks is None else f"{peaks[1] / GiB:.2f}"
        seconds = logs.get("step_time", step_seconds)
        step_time = "-" if seconds is None else f"{float(seconds):.1f}"
        description = (f"reward {float(logs['reward']):.3f}  step {step_time} s  "
                       f"reserved {measured} / predicted {self.predicted / GiB:.2f} GiB")
        if self.lines is not None:
            steps = f"{state.global_step}/{state.max_steps}" if state.max_steps else str(state.global_step)
            self.lines.file.write(f"GRPO step {steps}  {description}\n")
            self.lines.file.flush()
            return
        self.progress.update(self.task, completed=state.global_step, description=description)

    def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.stop()

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def longest_first(dataset: Any, rows: int) -> Any:
    """The `rows` longest prompts (by characters, a close stand-in for tokens), longest first."""
    lengths = [len(str(prompt)) for prompt in dataset["prompt"]]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:rows]
    return dataset.select(order)


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


def release_memory() -> None:
    """Free what a finished or failed trainer left before the next one starts: its model and optimizer sit in
    reference cycles (collected here), and the caching allocator keeps their blocks reserved until told (on CUDA),
    so the next run would start on their fragments (issue 29: 4.457 GiB reserved after the smoke step, 4.225 GiB in
    a fresh process, the same config)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def full_length_completions(train: TrainingConfig) -> dict[str, int]:
    """GRPOConfig.generation_kwargs that force every completion to max_completion_length: EOS is never sampled, so
    TRL's completion mask (which cuts each completion at its first EOS before the loss passes) keeps it whole. vLLM's
    SamplingParams name it min_tokens (its start-up budget is the GRPOConfig's vllm_gpu_memory_utilization, as
    planned), transformers' GenerationConfig min_new_tokens. Its logits processor holds one more float32 [sequences,
    vocabulary] copy of the scores than sampling alone at each decoding step: the smoke step's generation can be that
    much heavier than the run's."""
    return {"min_tokens" if train.use_vllm else "min_new_tokens": train.max_completion_length}


def generation_kwargs_field() -> bool:
    """Whether the installed TRL's GRPOConfig takes generation_kwargs (0.19 on)."""
    from dataclasses import fields

    from trl import GRPOConfig

    return any(field.name == "generation_kwargs" for field in fields(GRPOConfig))


def force_full_length(trainer: Any, train: TrainingConfig) -> None:
    """What full_length_completions asks, set on the trainer of a TRL release without GRPOConfig.generation_kwargs
    (0.14-0.18 build `generation_config`, or vLLM's `sampling_params`, in their trainer)."""
    for name, value in full_length_completions(train).items():
        target = getattr(trainer, "sampling_params" if train.use_vllm else "generation_config")
        setattr(target, name, value)


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
                   setup.predicted_reserved_bytes, memory)
    progress = RichProgress(setup.predicted_reserved_bytes, transient=smoke, memory=memory)

    def on_log(*args: Any, **kwargs: Any) -> None:
        record = log.on_log(*args, **kwargs)
        progress.on_log(*args, **kwargs, step_seconds=(record or {}).get("measured_step_seconds"))

    ranks = RankBytes()
    callback = type("VramPlanLog", (TrainerCallback,), {"on_log": staticmethod(on_log),
                                                        "on_step_begin": staticmethod(memory.on_step_begin),
                                                        "on_train_begin": staticmethod(progress.on_train_begin),
                                                        "on_train_end": staticmethod(progress.on_train_end),
                                                        "on_optimizer_step": staticmethod(ranks.on_optimizer_step)})()
    snapshot_path = oom_snapshot or setup.output_dir / OOM_SNAPSHOT_NAME
    with memory_history(snapshot_path, setup.record_frames) as history:  # from the weights' loading on
        return _train_recorded(setup, args, peft_config, dataset, callback, progress, created, readme_kept,
                               resume_from, smoke, history, ranks, memory)


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
                    history: Any, ranks: RankBytes, memory: StepMemory) -> RunSummary:
    import torch
    from trl import GRPOTrainer

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
        with terminate_as_interrupt():
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
        if not smoke and main:
            record_outcome(setup.output_dir, {"status": "interrupted", "signal": stop.signal_name,
                                              "step": stop.step, "checkpoint": stop.checkpoint})
        raise stop from None
    if not smoke:
        trainer.save_model(str(setup.output_dir / "final"))
    peaks, growth = memory.run_peaks(), memory.reserved_growth()
    summary = RunSummary(setup.output_dir, trainer.state.global_step, time.perf_counter() - started,
                         None if peaks is None else peaks[1], growth)
    per_rank = gathered(ranks.measured) if setup.train.num_gpus > 1 else None  # every rank takes part
    if not smoke and main:
        record_outcome(setup.output_dir, {"status": "finished", "steps": summary.steps,
                                          "seconds": round(summary.seconds, 1),
                                          "measured_peak_allocated_bytes": None if peaks is None else peaks[0],
                                          "measured_peak_reserved_bytes": summary.measured_peak_reserved_bytes,
                                          "predicted_peak_bytes": round(setup.predicted_peak_bytes),
                                          "predicted_peak_reserved_bytes": round(setup.predicted_reserved_bytes),
                                          "measured_reserved_growth": growth.to_dict() if growth else None,
                                          **({"ranks": per_rank} if per_rank else {})})
    return summary


# The line TRL's model card templates (trl/templates/*_model_card.md) all carry: a README.md with it is TRL's own.
TRL_CARD_LINE = "It has been trained using [TRL](https://github.com/huggingface/trl)."
MODEL_CARD_ASIDE = "MODEL_CARD.md"


def users_readme(folder: Path) -> bool:
    """Whether `folder` holds a README.md that is not a model card TRL wrote (an earlier run's is TRL's)."""
    readme = folder / "README.md"
    try:
        return readme.is_file() and TRL_CARD_LINE not in readme.read_text(errors="replace")
    except OSError:
        return True  # unreadable: not ours to replace


def place_model_card(trainer: Any, folder: Path, model_id: str, aside: bool) -> None:
    """GRPOTrainer writes its model card to output_dir/README.md at every checkpoint; where the user keeps a
    README.md there (`aside`), the card is written beside it as MODEL_CARD.md instead. A local model folder has no
    hub id, which the card would call "[None]": it names the folder."""
    original = trainer.create_model_card
    target = folder / (MODEL_CARD_ASIDE if aside else "README.md")

    def create_model_card(*args: Any, **kwargs: Any) -> None:
        import tempfile

        with tempfile.TemporaryDirectory(dir=folder, prefix=".model-card-") as scratch:
            output_dir, trainer.args.output_dir = trainer.args.output_dir, scratch
            try:
                original(*args, **kwargs)
            finally:
                trainer.args.output_dir = output_dir
            card = Path(scratch) / "README.md"
            if card.is_file():
                text = card.read_text().replace("[None](https://huggingface.co/None)", f"`{model_id}`")
                write_atomically(target, text)

    trainer.create_model_card = create_model_card


def _rescue(trainer: Any) -> Path | None:
    """Save a checkpoint of the steps done so far (an OOM leaves the weights and optimizer states intact); before
    the first step there is nothing to save."""
    import torch

    if trainer.state.global_step == 0:
        return last_checkpoint(Path(trainer.args.output_dir))

    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    try:
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
                    f" GiB less {context / GiB:.2f} GiB of CUDA context)")
        if summary.reserved_growth is not None:
            measured += f"; {summary.reserved_growth.describe()}"
    steps = "1 step" if summary.steps == 1 else f"{summary.steps} steps"
    return (f"done: {steps} in {_duration(summary.seconds)}; {measured}; the model is in "
            f"{setup.output_dir / 'final'}, the log in {setup.output_dir / LOG_NAME}")


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {seconds:02d}s" if hours else f"{minutes}m {seconds:02d}s"


def interrupted_message(stop: RunInterrupted, argv: list[str]) -> str:
    """Where the interrupted run's training is, and the exact command that continues it (or starts it again)."""
    again = [arg for arg in argv if arg not in ("--resume", "--overwrite")]
    if stop.checkpoint is None:
        return (f"{stop.signal_name} at step {stop.step}: nothing was trained to keep; start it again with:\n"
                f"{shlex.join(['vram-plan', *again])}")
    return (f"{stop.signal_name} at step {stop.step}: training so far is saved in {stop.checkpoint}; continue with:\n"
            f"{shlex.join(['vram-plan', *again, '--resume'])}")


def changed(before: TrainingConfig, after: TrainingConfig) -> str:
    """The fields two configs differ in, as 'name before -> after'."""
    fields = knob_names()
    return ", ".join(f"{k} {getattr(before, k)} -> {getattr(after, k)}" for k in fields
                     if getattr(before, k) != getattr(after, k))
