"""The optimizer phase's peak once an optimizer has stepped, shared by the single-GPU trace and DeepSpeed's (whose
engine steps the torch optimizer it wraps)."""

from __future__ import annotations

from typing import Any

import torch

from vram_planner.tracing.counter import ACTS, STATES, STEP, PhasePeak
from vram_planner.tracing.session import Session


def _host_step_scalars(optimizer: Any) -> list[Any]:
    """The `step` scalars a CUDA run keeps on the host: every group that is neither fused nor capturable (the trace
    runs on the CPU, where they are made beside the parameters)."""
    return [state["step"] for group in optimizer.param_groups
            if not group.get("fused") and not group.get("capturable")
            for p in group["params"] for state in [optimizer.state.get(p, {})]
            if "step" in state and getattr(state["step"], "dim", lambda: 1)() == 0]


def step_peak(session: Session, optimizer: Any) -> PhasePeak:
    """The optimizer phase's peak once `optimizer` has stepped under the STEP tag: its states counted as such (their
    bytes to `session.state_bytes`), the rest the step allocated as temporaries."""
    tracker = session.tracker
    host = _host_step_scalars(optimizer)
    if host:
        # torch hosts a per-parameter `step` on the CPU unless the optimizer is fused or capturable
        # (torch/optim/adam.py _init_group); made as the step starts, they were in its peak
        on_host = tracker.forget(host)
        tracker.peak -= on_host
        tracker.peak_split[STEP] = tracker.peak_split.get(STEP, 0) - on_host
    state_tensors = [t for state in optimizer.state.values() for t in state.values()
                     if isinstance(t, torch.Tensor) and not any(t is h for h in host)]
    for t in state_tensors:
        tracker.track(t, STATES)
    session.state_bytes = states = tracker.bytes_of(state_tensors)
    # At the step's peak the states exist already (created before the update); the rest it allocated are
    # temporaries (foreach intermediates), which vram_planner.model.phases counts as activations.
    split = dict(tracker.peak_split)
    in_step = split.pop(STEP, 0)
    split[STATES] = split.get(STATES, 0) + min(states, in_step)
    split[ACTS] = split.get(ACTS, 0) + max(in_step - states, 0)
    return PhasePeak("optimizer", tracker.peak, split, tracker.peak_moment)
