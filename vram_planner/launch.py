"""`vram-plan run`: start the TRL GRPO run the plan recommends, with the same objects `plan` prints.

Everything a run depends on is checked before the output folder is created (dataset columns, rewards on a sample
batch, a model folder's weights), so bad input leaves nothing behind. Heavy imports happen only here.
"""

from __future__ import annotations

import itertools
import json
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vram_planner.errors import VramPlanError
from vram_planner.grpo_config import call_args, grpo_config_kwargs, lora_config_kwargs, quantization_config_kwargs
from vram_planner.rewards import check_reward, load_reward
from vram_planner.search import Plan, micro_batch_variants, rungs
from vram_planner.spec import TrainingConfig
from vram_planner.units import GiB
from vram_planner.verdict import Verdict, judge

LOG_NAME = "vram-plan-log.jsonl"
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


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
    notes: list[str] = field(default_factory=list)

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

    def grpo_kwargs(self) -> dict[str, Any]:
        kwargs = grpo_config_kwargs(self.train)
        kwargs.update(output_dir=str(self.output_dir), max_steps=self.max_steps, save_steps=self.save_steps,
                      logging_steps=1, report_to=[])
        if self.on_cpu:  # tests and smoke runs: no autocast on the CPU
            kwargs.update(use_cpu=True, bf16=False, fp16=False)
        return kwargs

    def describe(self) -> str:
        """The exact configuration, for --dry-run and the run's first lines."""
        lines = [f"model: {self.model_id}", f"dataset: {self.dataset}", f"rewards: {', '.join(self.rewards)}",
                 f"predicted peak: {self.predicted_peak_bytes / GiB:.2f} GiB "
                 f"(on {self.verdict.context.gpu.label})",
                 f"GRPOConfig({call_args(self.grpo_kwargs())})"]
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


def prepared_dataset(setup: RunSetup) -> Any:
    """The dataset with its columns checked against the rewards, each reward tried on a sample batch."""
    from vram_planner.train_data import load_prompts, require_columns

    dataset = load_prompts(setup.dataset)
    require_columns(dataset, {"prompt"}, "GRPOTrainer reads the prompts from it")
    if "correctness" in setup.rewards:
        require_columns(dataset, {"answer"}, "the correctness reward compares with it")
    row = dataset[0]
    sample = {"prompts": [row["prompt"]] * 2,
              "completions": ["<reasoning>\n1 + 1 = 2\n</reasoning>\n<answer>\n2\n</answer>\n", "2"],
              **{column: [row[column]] * 2 for column in dataset.column_names if column != "prompt"}}
    for name in setup.rewards:
        check_reward(load_reward(name), sample, name)
    return dataset


class JsonlLog:
    """A TrainerCallback writing each logged step (with measured and predicted peak memory) as one JSON line."""

    def __init__(self, path: Path, predicted_peak_bytes: float) -> None:
        self.path, self.predicted = path, predicted_peak_bytes
        self.started = time.perf_counter()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
        import torch

        record = {"step": state.global_step, "seconds": round(time.perf_counter() - self.started, 3),
                  **(logs or {}), "predicted_peak_bytes": round(self.predicted)}
        if torch.cuda.is_available():
            record["measured_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            record["measured_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        with self.path.open("a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")


def prepare(setup: RunSetup) -> Any:
    """Everything a run depends on, checked before anything is written: the model folder, the dataset, the
    rewards. Returns the dataset."""
    check_model_folder(setup.model_id)
    return prepared_dataset(setup)


class RunOutOfMemory(VramPlanError):
    """Training ran out of GPU memory; what was trained is saved in `checkpoint`."""

    def __init__(self, setup: RunSetup, error: BaseException, checkpoint: Path | None) -> None:
        estimate = setup.verdict.estimate
        peak = estimate.peak_phase
        parts = sorted(peak.components.items(), key=lambda kv: -kv[1])[:3]
        biggest = ", ".join(f"{name.replace('_', ' ')} {size / GiB:.2f} GiB" for name, size in parts)
        saved = f"; training so far is saved in {checkpoint}" if checkpoint else ""
        super().__init__(f"out of GPU memory ({str(error).splitlines()[0][:160]}); the plan put the peak at "
                         f"{estimate.peak_bytes / GiB:.2f} GiB in {peak.name} ({biggest}){saved}")
        self.setup, self.checkpoint = setup, checkpoint


# Extra TrainerCallbacks for every run (tests add a fake allocator cap here).
EXTRA_CALLBACKS: list[Any] = []


class RichProgress:
    """The run's progress on stderr: step, reward, step time, and measured peak memory against the plan's."""

    def __init__(self, predicted_peak_bytes: float) -> None:
        self.predicted = predicted_peak_bytes
        self.progress: Any = None
        self.task: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("GRPO"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.description}"), console=Console(stderr=True))
        self.progress.start()
        self.task = self.progress.add_task("", total=state.max_steps or None, completed=state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
        import torch

        if self.progress is None or not logs or "reward" not in logs:
            return
        measured = (f"{torch.cuda.max_memory_reserved() / GiB:.2f}" if torch.cuda.is_available() else "-")
        self.progress.update(self.task, completed=state.global_step, description=(
            f"reward {float(logs['reward']):.3f}  step {float(logs.get('step_time', 0)):.1f} s  "
            f"peak {measured} / predicted {self.predicted / GiB:.2f} GiB"))

    def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.progress is not None:
            self.progress.stop()


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
        start_run(smoke, longest_first(dataset, rows), smoke=True)


def start_run(setup: RunSetup, dataset: Any, resume_from: Path | None = None, smoke: bool = False) -> Path:
    """Train on a prepared dataset (from a checkpoint when given); returns the output folder."""
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    kwargs = {**setup.grpo_kwargs(), "disable_tqdm": True}  # the rich progress line replaces TRL's bar
    if smoke:
        kwargs.update(save_strategy="no", generation_kwargs={"min_new_tokens": setup.train.max_completion_length})
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
    setup.output_dir.mkdir(parents=True, exist_ok=True)
    log = JsonlLog(setup.output_dir / LOG_NAME, setup.predicted_peak_bytes)
    progress = RichProgress(setup.predicted_peak_bytes)

    def on_log(*args: Any, **kwargs: Any) -> None:
        log.on_log(*args, **kwargs)
        progress.on_log(*args, **kwargs)

    callback = type("VramPlanLog", (TrainerCallback,), {"on_log": staticmethod(on_log),
                                                        "on_train_begin": staticmethod(progress.on_train_begin),
                                                        "on_train_end": staticmethod(progress.on_train_end)})()
    try:
        trainer = GRPOTrainer(model=setup.model_id, reward_funcs=[load_reward(r) for r in setup.rewards],
                              args=args, train_dataset=dataset, peft_config=peft_config,
                              callbacks=[callback, *EXTRA_CALLBACKS])
    except Exception as exc:
        if created:  # nothing trained yet: leave no half-made folder behind
            shutil.rmtree(setup.output_dir, ignore_errors=True)
        raise VramPlanError(f"GRPOTrainer could not start: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # with TRL's bar off it prints every log dict; the line shows them
    try:
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    except torch.cuda.OutOfMemoryError as exc:
        raise RunOutOfMemory(setup, exc, None if smoke else _rescue(trainer)) from exc
    if not smoke:
        trainer.save_model(str(setup.output_dir / "final"))
    return setup.output_dir


def _rescue(trainer: Any) -> Path | None:
    """Save a checkpoint of the steps done so far (an OOM leaves the weights and optimizer states intact)."""
    import torch

    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    try:
        trainer._save_checkpoint(trainer.model, trial=None)
    except Exception:  # the OOM may recur while saving: the last scheduled checkpoint is then what there is
        pass
    checkpoints = sorted(Path(trainer.args.output_dir).glob("checkpoint-*"),
                         key=lambda p: int(p.name.rpartition("-")[2]))
    return checkpoints[-1] if checkpoints else None


# accelerate configs TRL ships (trl/accelerate_configs), by the plan's distribution strategy
ACCELERATE_TEMPLATES = {"ddp": "multi_gpu", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "fsdp": "fsdp2"}
CONFIG_NAME = "accelerate_config.yaml"


def needs_launcher(train: TrainingConfig) -> bool:
    """Several GPUs, and this process is not one that `accelerate launch` started."""
    import os

    return train.num_gpus > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1


def accelerate_config_yaml(train: TrainingConfig) -> str:
    """TRL's accelerate config for the plan's strategy, with the plan's GPU count and mixed precision."""
    import yaml

    import trl

    template = Path(trl.__file__).parent / "accelerate_configs" / f"{ACCELERATE_TEMPLATES[train.distributed]}.yaml"
    config = yaml.safe_load(template.read_text())
    config.update(num_processes=train.num_gpus, mixed_precision=train.mixed_precision)
    return yaml.safe_dump(config, sort_keys=True)


def launch_command(setup: RunSetup, argv: list[str]) -> list[str]:
    """`accelerate launch` of this same `vram-plan run` (each process then trains its share)."""
    return ["accelerate", "launch", "--config_file", str(setup.output_dir / CONFIG_NAME), "-m", "vram_planner",
            *(arg for arg in argv if arg != "--dry-run")]


def launch(setup: RunSetup, argv: list[str]) -> int:
    """Write the accelerate config beside the run's output and start one process per GPU."""
    import subprocess

    from vram_planner.files import write_atomically

    write_atomically(setup.output_dir / CONFIG_NAME, accelerate_config_yaml(setup.train))
    return subprocess.call(launch_command(setup, argv))
