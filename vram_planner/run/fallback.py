"""`run --auto-fallback`: the config to resume with after an out-of-memory error, chosen from what the snapshot of the
failed allocation shows (else the next rung down the plan's ladder, as before there was a snapshot)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from vram_planner.errors import VramPlanError


def fallback_setup(setup: Any, snapshot: Path | None) -> tuple[Any, str]:
    """The setup to resume with (None when the ladder has nothing smaller) and why it was chosen. Where the card let
    PyTorch hold less than the plan counted on (another process's memory, a smaller card than --gpu named), every
    candidate is judged on the card as it was. Fragmentation that decided the crash is answered by expandable segments
    alone where the same config then fits; otherwise the first config down the ladder that fits and whose predicted
    peak is lower by at least the bytes the card lacked (the request less what CUDA and the largest cached block
    still had); without a readable snapshot, the next rung."""
    from vram_planner.model.search import ladder_below, with_expandable_segments
    from vram_planner.model.spec import with_changes
    from vram_planner.model.verdict import judge

    moment = _moment(snapshot)
    if moment is None or moment.requested_bytes is None:
        return setup.one_rung_down(), "the next rung down the plan's ladder (no snapshot of the failed allocation)"
    train = setup.train
    context, as_it_was = card_as_it_was(setup.verdict.context, train, moment)
    if moment.fragmentation_decided and not train.expandable_segments:
        expandable = judge(context, with_changes(train, allocator_conf=with_expandable_segments(
            train.allocator_conf or "")))
        if expandable.fits:
            return replace(setup, verdict=expandable), as_it_was + (
                f"the snapshot shows fragmentation decided it ({moment.reserved_unallocated_bytes / 2**30:.2f} GiB "
                f"cached, no block of {moment.requested_bytes / 2**30:.2f} GiB): expandable segments, the same "
                "config")
    lacked = moment.requested_bytes - (moment.device_free_bytes or 0) - moment.largest_free_block_bytes
    for candidate in ladder_below(train, context.gpu.bf16, context.arch):
        verdict = judge(context, candidate)
        if verdict.fits and setup.predicted_peak_bytes - verdict.estimate.peak_bytes >= lacked:
            return replace(setup, verdict=verdict), as_it_was + (
                f"the snapshot shows {max(lacked, 0) / 2**30:.2f} GiB lacking at the failed allocation: the first "
                "config down the ladder that fits and is predicted to need that much less")
    return None, as_it_was + (f"nothing down the ladder fits and saves the {max(lacked, 0) / 2**30:.2f} GiB the "
                              "snapshot shows lacking")


# Below this share of what the plan counted on, the card is re-judged as it was: the allocator's own rounding and
# the CUDA context's spread between runs stay inside it.
CARD_AS_PLANNED_SHARE = 0.98


def card_as_it_was(context: Any, train: Any, moment: Any) -> tuple[Any, str]:
    """The plan's context, or, where the snapshot shows the card let PyTorch hold less than the plan counted on, the
    context of a card that size (and the words that say so). The allocator holds `reserved` when its request fails:
    where CUDA had less free than the request, the card ended at reserved + free; where CUDA had more, a
    per-process cap (torch.cuda.set_per_process_memory_fraction) lies between reserved and reserved + the request,
    so reserved, the side that does not overrate it."""
    from vram_planner.allocator.sizes import round_size

    free = moment.device_free_bytes
    if free is None:
        return context, ""
    request = round_size(moment.requested_bytes, moment.conf.roundup_power2_divisions)
    held = moment.reserved_bytes + (free if free < request else 0)
    planned = context.allocatable_bytes(train)
    if held >= CARD_AS_PLANNED_SHARE * planned:
        return context, ""
    outside = context.capacity_bytes - planned  # the CUDA context (and NCCL's buffers) as the plan counts them
    gib = (held + outside) / 2**30
    # named by its size, as --gpu takes one, so the lines after the fallback and the advise command they print
    # speak of the card as it was (to the hundredth of a GiB below: advise then judges no larger a card)
    card = replace(context.gpu, name=f"{math.floor(gib * 100) / 100:.2f}GiB", aliases=[], cuda_name="",
                   total_memory_gib=gib, capacity_source="measured",
                   source=f"{context.gpu.label} as the out-of-memory snapshot showed it")
    return replace(context, gpu=card), (
        f"the card let PyTorch hold {held / 2**30:.2f} GiB, not the {planned / 2**30:.2f} GiB the plan counted on "
        f"(another process holds memory, or the card is smaller than {context.gpu.label}), so the configs are "
        "judged on what it had; ")


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
