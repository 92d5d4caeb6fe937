"""The optimizer phase's peak once an optimizer has stepped, shared by the single-GPU trace and DeepSpeed's (whose
engine steps the torch optimizer it wraps)."""

from __future__ import annotations

from typing import Any

import torch

from vram_planner.tracing.counter import ACTS, STATES, STEP, PhasePeak
from vram_planner.tracing.session import Session


def host_step_scalars(optimizer: Any) -> list[Any]:
    """The `step` scalars a CUDA run keeps on the host: those of every group that is neither fused nor capturable
    (torch/optim/adam.py _init_group). A parameter no group holds any more (ZeRO-3 takes its partitions out of the
    groups after a step) follows the optimizer's defaults. On the CPU, where the trace and the test ranks run, they
    are made beside the parameters."""
    def on_device(options: Any) -> bool:
        return bool(options.get("fused") or options.get("capturable"))

    grouped = {id(p): on_device(group) for group in optimizer.param_groups for p in group["params"]}
    ungrouped = on_device(optimizer.defaults)
    return [state["step"] for p, state in optimizer.state.items()
            if "step" in state and getattr(state["step"], "dim", lambda: 1)() == 0
            and not grouped.get(id(p), ungrouped)]


def step_peak(session: Session, optimizer: Any) -> PhasePeak:
    """The optimizer phase's peak once `optimizer` has stepped under the STEP tag: its states counted as such (their
    bytes to `session.state_bytes`), whether this step made them or an earlier one, the rest the step allocated as
    temporaries."""
    tracker = session.tracker
    host = host_step_scalars(optimizer)
    if host:
        # torch hosts a per-parameter `step` on the CPU unless the optimizer is fused or capturable
        # (torch/optim/adam.py _init_group); made as the step starts, they were in its peak
        on_host = tracker.forget(host)
        tracker.peak -= on_host
        tracker.peak_split[STEP] = tracker.peak_split.get(STEP, 0) - on_host
    state_tensors = [t for state in optimizer.state.values() for t in state.values()
                     if isinstance(t, torch.Tensor) and not any(t is h for h in host)]
    made_here = tracker.bytes_of(state_tensors, STEP)  # none where an earlier step made them (tracing.zero)
    for t in state_tensors:
        tracker.track(t, STATES)
    session.state_bytes = tracker.bytes_of(state_tensors)
    # At the step's peak the states exist already (created before the update); the rest it allocated are
    # temporaries (foreach intermediates), which vram_planner.model.phases counts as activations.
    split = dict(tracker.peak_split)
    in_step = split.pop(STEP, 0)
    split[STATES] = split.get(STATES, 0) + min(made_here, in_step)
    split[ACTS] = split.get(ACTS, 0) + max(in_step - made_here, 0)
    return PhasePeak("optimizer", tracker.peak, split, tracker.peak_moment)
