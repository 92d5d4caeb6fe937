"""`check`: the verdict for exactly one configuration on one GPU."""

from __future__ import annotations

from dataclasses import dataclass

from vram_planner.architecture import ModelArchitecture
from vram_planner.calibration import Calibration
from vram_planner.errors import ConfigError
from vram_planner.estimate import Estimate, estimate
from vram_planner.profiles import GpuProfile
from vram_planner.spec import TrainingConfig, with_changes
from vram_planner.trl_releases import TrlRelease

# Share of the card a plan leaves free: the analytic model's error before calibration is several percent
# (fitcheck-llm's mean 5.5% total error on T4, ../shared/design/grpo-memory.md), so "fits" keeps 5% spare.
DEFAULT_SAFETY_MARGIN = 0.05


@dataclass(frozen=True)
class Context:
    """What a verdict is judged against, besides the training config."""

    arch: ModelArchitecture
    gpu: GpuProfile
    release: TrlRelease
    calibration: Calibration
    safety_margin: float = DEFAULT_SAFETY_MARGIN
    model_id: str = ""

    @property
    def capacity_bytes(self) -> int:
        return self.gpu.capacity_bytes

    @property
    def margin_bytes(self) -> float:
        return self.safety_margin * self.capacity_bytes

    @property
    def budget_bytes(self) -> float:
        return self.capacity_bytes - self.margin_bytes


@dataclass(frozen=True)
class Verdict:
    """One configuration judged on one GPU."""

    context: Context
    train: TrainingConfig
    estimate: Estimate

    @property
    def fits(self) -> bool:
        return self.estimate.peak_bytes <= self.context.budget_bytes

    @property
    def spare_bytes(self) -> float:
        """Capacity left at the peak (negative: missing), before the safety margin."""
        return self.context.capacity_bytes - self.estimate.peak_bytes


def judge(context: Context, train: TrainingConfig) -> Verdict:
    return Verdict(context, train, estimate(context.arch, train, context.release, context.calibration,
                                            context.capacity_bytes))


def gpu_problems(train: TrainingConfig, gpu: GpuProfile) -> list[str]:
    """Settings this GPU cannot run at all, whatever the memory."""
    problems = []
    cc = f" (compute capability {gpu.compute_capability})" if gpu.compute_capability else ""
    if train.attn_implementation == "flash_attention_2" and not gpu.flash_attention_2:
        problems.append(f"--attn-implementation flash_attention_2 does not run on {gpu.label}{cc}; use sdpa")
    if not gpu.bf16 and train.mixed_precision == "bf16":
        problems.append(f"{gpu.label}{cc} has no bf16: use --mixed-precision fp16")
    if not gpu.bf16 and (train.dtype == "bfloat16" or train.load_in_4bit and train.mixed_precision == "bf16"):
        problems.append(f"{gpu.label}{cc} has no bf16: load float16 (with LoRA) or float32")
    return problems


def adapt_to_gpu(train: TrainingConfig, gpu: GpuProfile, explicit: set[str]) -> TrainingConfig:
    """Defaults the user did not set that this GPU cannot honour (bf16 autocast on a pre-Ampere card)."""
    if not gpu.bf16 and train.mixed_precision == "bf16" and "mixed_precision" not in explicit:
        train = with_changes(train, mixed_precision="fp16")
    return train


def check_gpu(train: TrainingConfig, gpu: GpuProfile) -> None:
    problems = gpu_problems(train, gpu)
    if problems:
        raise ConfigError(problems)
