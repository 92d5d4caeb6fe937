"""`run --auto-fallback`: the config to resume with after an out-of-memory error, chosen from what the snapshot of the
failed allocation shows (else the next rung down the plan's ladder, as before there was a snapshot)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from vram_planner.errors import VramPlanError


def fallback_setup(setup: Any, snapshot: Path | None) -> tuple[Any, str]:
    """The setup to resume with (None when the ladder has nothing smaller) and why it was chosen. Fragmentation that
    decided the crash is answered by expandable segments alone; otherwise the first config down the ladder whose
    predicted peak is lower by at least the bytes the card lacked (the request less what CUDA and the largest
    cached block still had); without a readable snapshot, the next rung."""
    from vram_planner.model.search import micro_batch_variants, rungs, with_expandable_segments
    from vram_planner.model.spec import with_changes
    from vram_planner.model.verdict import judge

    moment = _moment(snapshot)
    if moment is None or moment.requested_bytes is None:
        return setup.one_rung_down(), "the next rung down the plan's ladder (no snapshot of the failed allocation)"
    train, context = setup.train, setup.verdict.context
    if moment.fragmentation_decided and not train.expandable_segments:
        expandable = with_changes(train, allocator_conf=with_expandable_segments(train.allocator_conf or ""))
        return replace(setup, verdict=judge(context, expandable)), (
            f"the snapshot shows fragmentation decided it ({moment.reserved_unallocated_bytes / 2**30:.2f} GiB "
            f"cached, no block of {moment.requested_bytes / 2**30:.2f} GiB): expandable segments, the same config")
    lacked = moment.requested_bytes - (moment.device_free_bytes or 0) - moment.largest_free_block_bytes
    smaller = [v for v in micro_batch_variants(train)
               if v.per_device_train_batch_size < train.per_device_train_batch_size]
    ladder = smaller + list(rungs(train, context.gpu.bf16, context.arch))[1:]
    for candidate in ladder:
        verdict = judge(context, candidate)
        if setup.predicted_peak_bytes - verdict.estimate.peak_bytes >= lacked:
            return replace(setup, verdict=verdict), (
                f"the snapshot shows {lacked / 2**30:.2f} GiB lacking at the failed allocation: the first config "
                "down the ladder predicted to need that much less")
    return None, f"nothing down the ladder saves the {lacked / 2**30:.2f} GiB the snapshot shows lacking"


def _moment(snapshot: Path | None) -> Any:
    from vram_planner.allocator.snapshot import load_snapshot
    from vram_planner.allocator.snapshot_moment import moment_of
    from vram_planner.allocator.snapshot_replay import pick_device

    if snapshot is None or not snapshot.is_file():
        return None
    try:
        loaded = load_snapshot(snapshot)
        return moment_of(loaded, pick_device(loaded, None))
    except VramPlanError:
        return None
