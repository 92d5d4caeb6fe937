"""The caching allocator's peak bytes of each optimizer step of a run, its maximum over the run, and whether what it
reserves creeps up from step to step.

torch's peak statistics are a running maximum since the process began (or since the last reset): read as they are,
a step's own peak is hidden under every earlier one, the smoke step's included. They are reset as each step begins,
so a step's record is its own, and the run's maximum is kept here. PyTorch's figures never include the CUDA
context, so they are set beside the plan's peak less the CUDA context it counts (`predicted_reserved_bytes`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vram_planner.model.phases import OUTSIDE_ALLOCATOR
from vram_planner.units import GiB

# The steps before the allocator settles: the first creates the optimizer's states and the second caches blocks of
# the step's final shapes (the H200 runs of issue 29: reserved flat after step 2 over 32 steps)
SETTLING_STEPS = 2


def predicted_reserved_bytes(estimate: Any) -> float:
    """What the plan expects the caching allocator to reserve at the peak: its peak less the CUDA context and NCCL's
    buffers, which the allocator never sees."""
    return estimate.peak_bytes - sum(estimate.peak_phase.components.get(c, 0.0) for c in OUTSIDE_ALLOCATOR)


@dataclass(frozen=True)
class ReservedGrowth:
    """How much more the allocator reserved at its last step than at the step it had settled by."""

    from_step: int
    to_step: int
    growth_bytes: int

    def to_dict(self) -> dict[str, int]:
        return {"from_step": self.from_step, "to_step": self.to_step, "growth_bytes": self.growth_bytes}

    def describe(self) -> str:
        span = f"from step {self.from_step} to {self.to_step}"
        if self.growth_bytes == 0:
            return f"reserved flat {span}"
        change = "grew" if self.growth_bytes > 0 else "fell"
        return f"reserved {change} {abs(self.growth_bytes) / GiB:.2f} GiB {span}"


@dataclass
class StepMemory:
    """A TrainerCallback's part: peaks reset at each step's start, read at its log line. Off CUDA every reading is
    None."""

    cuda: bool = False
    run_peak_allocated_bytes: int = 0
    run_peak_reserved_bytes: int = 0
    reserved_by_step: dict[int, int] = field(default_factory=dict)  # each logged step's own peak reserved

    @classmethod
    def start(cls) -> StepMemory:
        """From here on: the peaks of whatever ran before in this process (the smoke step, a run that fell back)
        are not this run's."""
        import torch

        memory = cls(cuda=torch.cuda.is_available())
        if memory.cuda:
            torch.cuda.reset_peak_memory_stats()
        return memory

    def on_step_begin(self, *_: Any, **__: Any) -> None:
        if not self.cuda:
            return
        import torch

        self._fold()
        torch.cuda.reset_peak_memory_stats()

    def step_peaks(self, step: int | None = None) -> tuple[int, int] | None:
        """(allocated, reserved) peak bytes since the current step began; `step` notes the reserved one as that
        step's."""
        if not self.cuda:
            return None
        import torch

        peaks = int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved())
        if step is not None:
            self.reserved_by_step[step] = peaks[1]
        return peaks

    def run_peaks(self) -> tuple[int, int] | None:
        """(allocated, reserved) peak bytes over the whole run so far."""
        if not self.cuda:
            return None
        self._fold()
        return self.run_peak_allocated_bytes, self.run_peak_reserved_bytes

    def reserved_growth(self) -> ReservedGrowth | None:
        """From the step the allocator settled by to the last step logged; None before there is a step after it."""
        steps = sorted(self.reserved_by_step)
        if len(steps) <= SETTLING_STEPS:
            return None
        settled, last = steps[SETTLING_STEPS - 1], steps[-1]
        return ReservedGrowth(settled, last, self.reserved_by_step[last] - self.reserved_by_step[settled])

    def _fold(self) -> None:
        import torch

        self.run_peak_allocated_bytes = max(self.run_peak_allocated_bytes, int(torch.cuda.max_memory_allocated()))
        self.run_peak_reserved_bytes = max(self.run_peak_reserved_bytes, int(torch.cuda.max_memory_reserved()))
