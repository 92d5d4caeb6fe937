"""`vram-plan advise SNAPSHOT`: what was on the card at a memory snapshot's failed allocation (its trace's last oom
event), or at its worst moment (the most bytes allocated) where nothing failed, and the fixes ranked against the plan.

The moment's figures are the snapshot's own (vram_planner/allocator/snapshot_moment.py); the roles are the plan's
tensors found among its live blocks (roles.py); the fixes are ranked as for a log (diagnosis.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from vram_planner.advise.diagnosis import Attribution, Fix
from vram_planner.advise.roles import ROLES, Tagged, planned_tensors, tag_blocks
from vram_planner.allocator.snapshot import Snapshot
from vram_planner.units import GiB

# Frames that say which phase a block was made in: (a part of "file:line in function", phase), the first found in
# any frame deciding (TRL's loss takes its log-probabilities with the function scoring uses, so the loss comes first)
FRAME_PHASES = (("/optim/", "optimizer"), ("in backward", "training"), ("compute_loss", "training"),
                ("in generate", "generation"), ("in _get_per_token_logps", "scoring"))


class SnapshotAdvice(BaseModel):
    """A snapshot explained at one moment; figures in bytes."""

    device: int
    moment: Literal["out_of_memory", "worst"]  # the failed allocation, or the most bytes allocated
    event_index: int  # the moment: just before this event of the device's trace
    events: int
    allocated_bytes: int  # the live blocks as the allocator made them (what torch.cuda.memory_allocated counts)
    reserved_bytes: int
    by_role: dict[str, int]  # sums to allocated_bytes
    requested_bytes_by_role: dict[str, int]  # the tensors' own bytes, before the allocator rounds them
    roles_from: Literal["plan", "frames", "plan and frames", "none"]
    phase: str | None
    requested_bytes: int | None = None  # the failed request
    device_free_bytes: int | None = None  # what CUDA still had free when it failed
    reserved_unallocated_bytes: int
    largest_free_block_bytes: int
    free_blocks: int
    fragmentation: float  # 1 - largest free block / reserved-but-unallocated: 0 is one block, near 1 is scattered
    fragmentation_decided: bool  # the request fit the cached bytes in all but no cached block
    # the trace is not the run's whole history (torch keeps the last max_entries events, or recording began
    # mid-run): the live blocks made before it, and their bytes by role (within by_role)
    history_truncated: bool = False
    before_history_blocks: int = 0
    before_history_by_role: dict[str, int] = {}
    diagnosis: list[str] = []
    culprit: str | None = None
    attribution: Attribution | None = None  # the failed request's tensor in the plan, and what makes it exact
    fixes: list[Fix] = []
    fitting_config: dict[str, Any] | None = None


def explain_snapshot(snapshot: Snapshot, device: int, context: Any = None, train: Any = None) -> SnapshotAdvice:
    """The snapshot at its failed allocation (or worst moment), by role against the plan where `context` and
    `train` are given (by frames alone otherwise), with the fixes ranked against the plan."""
    from vram_planner.allocator.snapshot_moment import moment_of

    events = snapshot.device_traces[device]
    moment = moment_of(snapshot, device)
    stop = moment.index
    frames = {index: stack for (d, index), stack in snapshot.frames.items() if d == device}
    planned = planned_tensors(context.arch, train, context.release) if context is not None else None
    tagged = tag_blocks(events, stop, planned, frames, moment.before_history)
    by_role, requested, before = dict.fromkeys(ROLES, 0), dict.fromkeys(ROLES, 0), dict.fromkeys(ROLES, 0)
    for address, n_bytes in moment.block_sizes.items():
        size, role = tagged.live.get(address, (n_bytes, "other"))
        by_role[role] += n_bytes
        requested[role] += size
        if address in moment.before_history:
            before[role] += n_bytes
    roles_from = ("plan and frames" if planned and tagged.by_frames else "plan" if planned
                  else "frames" if tagged.by_frames else "none")
    advice = SnapshotAdvice(
        device=device, moment=moment.kind, event_index=stop, events=len(events), allocated_bytes=moment.allocated_bytes,
        reserved_bytes=moment.reserved_bytes, by_role=by_role, requested_bytes_by_role=requested,
        roles_from=roles_from,
        phase=_phase(tagged, frames.get(stop) or frames.get(_last_alloc(events, stop)), planned,
                     moment.requested_bytes),
        requested_bytes=moment.requested_bytes, device_free_bytes=moment.device_free_bytes,
        reserved_unallocated_bytes=moment.reserved_unallocated_bytes,
        largest_free_block_bytes=moment.largest_free_block_bytes, free_blocks=len(moment.free_block_sizes),
        fragmentation=moment.fragmentation, fragmentation_decided=moment.fragmentation_decided,
        history_truncated=moment.history_truncated, before_history_blocks=len(moment.before_history),
        before_history_by_role=before)
    _rank_fixes(advice, moment.conf.expandable_segments, context, train)
    return advice


def _last_alloc(events: list, stop: int) -> int:
    return next((i for i in range(min(stop, len(events)) - 1, -1, -1) if events[i][0] == "alloc"), -1)


def _phase(tagged: Tagged, frames: tuple[str, ...] | None, planned: Any, request: int | None) -> str | None:
    """The phase of the step at the moment: from the frames that made its last block, else from what was live."""
    for part, phase in FRAME_PHASES:
        if any(part in frame for frame in frames or ()):
            return phase
    if planned is None:
        return None
    if not tagged.stepping:
        return "loading"
    live = [role for _, role in tagged.live.values()]
    grads, states = live.count("gradients"), live.count("optimizer_states")
    all_grads = grads == sum(planned.gradients.values()) > 0
    if 0 < states < sum(planned.optimizer_states.values()) or (
            all_grads and tagged.last_role in ("activations", "other") and request in planned.gradients):
        return "optimizer"
    if "kv_cache" in live:
        return "generation"
    if grads:
        return "training"
    return "scoring or training forward" if "logits" in live else "training"


def _rank_fixes(advice: SnapshotAdvice, expandable: bool, context: Any, train: Any) -> None:
    """The diagnosis in words, and the fixes: the plan's (through the log advice's ranking) where it is known."""
    from vram_planner.advise.diagnosis import advise as advise_error
    from vram_planner.advise.oom_log import OomError

    a = advice
    parts = ", ".join(f"{role.replace('_', ' ')} {_gib(n)}" for role, n in
                      sorted(a.by_role.items(), key=lambda kv: -kv[1]) if n)
    at = ("when the allocation of " + _gib(a.requested_bytes or 0) + " failed" if a.moment == "out_of_memory"
          else "at its most")
    a.diagnosis.append(f"{_gib(a.allocated_bytes)} allocated {at}{f' ({a.phase})' if a.phase else ''}: {parts}; "
                       f"{_gib(a.reserved_bytes)} reserved")
    if a.history_truncated:
        a.diagnosis.append(_truncation_note(a))
    if a.roles_from == "none":
        a.diagnosis.append("give the run's --model, --gpu and knobs to tell its tensors apart by size")
    if a.reserved_unallocated_bytes:
        a.diagnosis.append(f"{_gib(a.reserved_unallocated_bytes)} reserved but unallocated in {a.free_blocks} cached "
                           f"block(s), the largest {_gib(a.largest_free_block_bytes)} "
                           f"(fragmentation {a.fragmentation:.0%})")
    if a.fragmentation_decided:
        a.diagnosis.append("fragmentation decided this crash: the cached bytes would have held the request, no "
                           "cached block would")
    error = OomError(kind="cuda_oom", message=f"a memory snapshot's {a.moment.replace('_', ' ')} moment",
                     gpu_index=a.device, tried_to_allocate=a.requested_bytes, tried_to_allocate_exact=True,
                     free=a.device_free_bytes,
                     allocated_by_pytorch=a.allocated_bytes, reserved_unallocated=a.reserved_unallocated_bytes,
                     reserved_total=a.reserved_bytes, expandable_segments=expandable)
    found = advise_error(error, context, train,
                         "flag" if train is not None and train.transformers_version is not None else "assumed")
    fixes = list(found.fixes)
    if a.fragmentation_decided and not expandable:
        fixes = [f for f in fixes if not f.change.startswith("PYTORCH_CUDA_ALLOC_CONF")]
        fixes.insert(0, Fix(change="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                            saves_bytes=a.reserved_unallocated_bytes, cost="none",
                            why="the request fit the cached bytes but no cached block; segments that grow in place "
                                "leave no such holes"))
    a.fixes, a.fitting_config, a.culprit, a.attribution = fixes, found.fitting_config, found.culprit, found.attribution
    a.diagnosis.extend(note for note in found.diagnosis if not note.startswith("fragmentation:"))


def _truncation_note(a: SnapshotAdvice) -> str:
    """The history's start is missing: what the live blocks made before it were, by the plan's sizes."""
    made = sum(a.before_history_by_role.values())
    note = (f"the recorded history is truncated: it holds the last {a.events:,} events (torch keeps a ring of "
            "max_entries, or recording began mid-run)")
    if not a.before_history_blocks:
        return note + "; every block alive at this moment was made within it"
    parts = ", ".join(f"{role.replace('_', ' ')} {_gib(n)}" for role, n in
                      sorted(a.before_history_by_role.items(), key=lambda kv: -kv[1]) if n)
    how = "by the plan's sizes" if a.roles_from in ("plan", "plan and frames") else "unknown without the plan"
    return (f"{note}; {a.before_history_blocks} live block(s), {_gib(made)}, were made before it ({how}): "
            f"{parts}")


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"
