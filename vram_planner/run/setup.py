"""What `vram-plan run` will start: the plan's config and the run's own settings, as GRPOConfig keywords."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vram_planner.errors import VramPlanError
from vram_planner.model.grpo_config import call_args, grpo_config_kwargs, lora_config_kwargs, quantization_config_kwargs
from vram_planner.model.phases import OUTSIDE_ALLOCATOR, outside_allocator_names
from vram_planner.model.search import Plan, ladder_below
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.verdict import Verdict, judge
from vram_planner.run.step_memory import predicted_reserved_bytes
from vram_planner.units import GiB

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
    # how a TRL recipe given as --config trains (its learning rate, schedule, seed, ...: recipe_arguments_of)
    recipe_arguments: dict[str, Any] = field(default_factory=dict)

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
    def predicted_allocated_bytes(self) -> float:
        """The plan's allocated peak (its tensors and cuBLAS workspaces, Estimate.allocated_peak_bytes): the figure
        set beside the measured peak allocated, with no allocator reserve on either side."""
        return self.verdict.estimate.allocated_peak_bytes

    @property
    def predicted_outside_allocator_bytes(self) -> dict[str, int]:
        """The plan's CUDA context and NCCL buffers on each rank, beside which a CUDA run records what its cards held
        outside the allocator."""
        components = self.verdict.estimate.peak_phase.components
        return {c: round(components.get(c, 0.0)) for c in OUTSIDE_ALLOCATOR}

    @property
    def outside_allocator_words(self) -> str:
        """What the plan counts outside PyTorch's allocator, in words: the CUDA context, NCCL's buffers on several
        GPUs, vLLM's TP communicators."""
        return outside_allocator_names(self.verdict.estimate.peak_phase.components)

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
        context = self.verdict.context
        smaller = next(ladder_below(self.train, context.gpu.bf16, context.arch), None)
        return None if smaller is None else replace(self, verdict=judge(context, smaller))

    def grpo_kwargs(self, on_this_machine: bool = True) -> dict[str, Any]:
        """GRPOConfig's keywords for the run; `on_this_machine`: adapted to a machine without CUDA, as the run
        started here uses them (else as the plan's GPU runs them)."""
        kwargs = {**self.recipe_arguments, **grpo_config_kwargs(self.train)}
        kwargs.update(output_dir=str(self.output_dir), max_steps=self.max_steps, save_steps=self.save_steps,
                      logging_steps=1, report_to=[])
        if self.on_cpu and on_this_machine:  # tests and smoke runs: no autocast on the CPU
            kwargs.update(CPU_ADAPTATION)
            if self.train.num_gpus > 1:  # accelerate's cpu flag turns FSDP and DeepSpeed off: see gloo_ranks
                kwargs.update(use_cpu=False, dataloader_pin_memory=False)  # nothing to pin for
        return kwargs

    @staticmethod
    def recipe_arguments_of(recipe: Any) -> tuple[dict[str, Any], str]:
        """What of a recipe's training arguments the run carries: those the installed TRL's GRPOConfig has, and a
        note naming them and those it has not."""
        import dataclasses

        from trl import GRPOConfig

        fields = {f.name for f in dataclasses.fields(GRPOConfig)}
        wanted = recipe.run_arguments
        carried = as_trl_parses({key: value for key, value in wanted.items() if key in fields})
        note = f"from the recipe: {', '.join(carried) or 'nothing'} carried into the GRPOConfig"
        if missing := [key for key in wanted if key not in fields]:
            note += f"; {', '.join(missing)} left out (not a field of the installed TRL's GRPOConfig)"
        return carried, note + "; where it writes, logs and saves, and its rewards, are the run's flags'"

    def describe(self) -> str:
        """The exact configuration, for --dry-run and the run's first lines."""
        lines = [f"model: {self.model_id}", f"dataset: {self.dataset}", f"rewards: {', '.join(self.rewards)}",
                 f"predicted peak: {self.predicted_peak_bytes / GiB:.2f} GiB "
                 f"(on {self.verdict.context.gpu.label}; {self.predicted_reserved_bytes / GiB:.2f} GiB reserved by "
                 f"PyTorch, the rest {self.outside_allocator_words}, which the per-step lines leave out)",
                 f"GRPOConfig({call_args(self.grpo_kwargs(on_this_machine=False))})"]
        peft = lora_config_kwargs(self.train)
        if peft:
            lines.append(f"LoraConfig({call_args(peft)})")
        quantization = quantization_config_kwargs(self.train)
        if quantization:
            lines.append(f"BitsAndBytesConfig({call_args(quantization)})")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def as_trl_parses(values: dict[str, Any]) -> dict[str, Any]:
    """A recipe's GRPOConfig values (or TRL's flags on the command line) as `trl grpo --config recipe.yaml` reads
    them: TrlParser sets them as its argparse parser's defaults, and argparse converts a default given as text with
    the argument's type, so YAML's `learning_rate: 5e-6` (text to YAML, which wants a dot in a float) trains at 5e-06;
    text no such type reads, or a value that is no number where the argument is one, is refused in one line, as TRL
    refuses it."""
    import math

    from transformers import HfArgumentParser
    from trl import GRPOConfig

    actions = {action.dest: action for action in HfArgumentParser(GRPOConfig)._actions}
    parsed = {}
    for key, value in values.items():
        action = actions.get(key)
        reads = getattr(action, "type", None)
        if isinstance(value, str) and reads is not None:
            try:
                value = reads(value)
            except (TypeError, ValueError):
                wanted = {float: "a number", int: "a whole number"}.get(reads, "a value of its type")
                raise VramPlanError(f"{key} {value!r}: TRL's parser does not read it as {wanted}") from None
        if reads in (float, int) and value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
            raise VramPlanError(f"{key} {value!r}: GRPOConfig takes a finite number there")
        parsed[key] = value
    return parsed
