"""`run --auto-fallback` reads the snapshot of the failed allocation: fragmentation is answered with expandable
segments, a shortfall with the first config down the ladder predicted to save at least the bytes the card lacked, and a
card that let PyTorch hold less than the plan counted on is judged as it was."""

from __future__ import annotations

import pickle

import pytest
from snapshot_builder import Recorder, fragmented_until_oom

from vram_planner.allocator.caching import OutOfMemory
from vram_planner.model.search import ladder_below
from vram_planner.model.verdict import judge
from vram_planner.profiles import GpuProfile
from vram_planner.run.fallback import fallback_setup
from vram_planner.run.out_of_memory import advise_command

MiB = 2**20


def snapshot_file(tmp_path, recorder: Recorder, device_free: int | None = None):
    """The recorder's snapshot; `device_free` replaces what CUDA had free at the failed request."""
    snapshot = recorder.snapshot()
    if device_free is not None:
        snapshot["device_traces"][0][-1]["device_free"] = device_free
    path = tmp_path / "oom-snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    return path


def card(setup, share: float, top: int) -> Recorder:
    """A card that lets PyTorch hold `share` of what the plan counted on, all of it but `top` bytes (whole 20 MiB
    segments) taken by one block, so the step's last requests play out in the top."""
    held = int(share * setup.verdict.context.allocatable_bytes(setup.train)) // (20 * MiB) * 20 * MiB
    recorder = Recorder(capacity_bytes=held)
    recorder.malloc(held - top)
    return recorder


def lacking(tmp_path, setup, lacked: int):
    """The planned card with 10 MiB still free and nothing cached, failing a request `lacked` beyond that."""
    recorder = card(setup, 1.0, 20 * MiB)
    recorder.malloc(10 * MiB)
    with pytest.raises(OutOfMemory):
        recorder.malloc(lacked + 10 * MiB)
    return snapshot_file(tmp_path, recorder)


def fragmented(tmp_path, setup, share: float, device_free: int | None = None):
    """A card holding `share` of the plan whose top 200 MiB are 4 MiB blocks, every other one freed, failing an 8
    MiB request (no new segment fits, no cached one is empty); `device_free` as in snapshot_file."""
    recorder = card(setup, share, 10 * 20 * MiB)
    with pytest.raises(OutOfMemory):
        fragmented_until_oom(recorder, 4 * MiB, 50, 8 * MiB)
    return snapshot_file(tmp_path, recorder, device_free), recorder.allocator.reserved_bytes


def test_the_rung_saves_at_least_what_the_card_lacked_skipping_smaller_ones(setup, tmp_path):
    train, context = setup.train, setup.verdict.context
    ladder = list(ladder_below(train, context.gpu.bf16, context.arch))
    savings = [setup.predicted_peak_bytes - judge(context, c).estimate.peak_bytes for c in ladder]
    lacked = (round(max(savings[:2])) // (2 * MiB) + 1) * 2 * MiB  # more than either of the next two rungs saves
    chosen, why = fallback_setup(setup, lacking(tmp_path, setup, lacked))
    assert chosen is not None and "lacking at the failed allocation" in why
    assert setup.predicted_peak_bytes - chosen.predicted_peak_bytes >= lacked
    assert chosen.train != setup.one_rung_down().train  # not simply the next rung
    first = next(c for c, saved in zip(ladder, savings) if saved >= lacked)
    assert chosen.train == first


def test_fragmentation_gets_expandable_segments_and_the_same_config(setup, tmp_path):
    chosen, why = fallback_setup(setup, fragmented(tmp_path, setup, 1.0)[0])
    assert chosen.train.expandable_segments and "fragmentation decided it" in why
    assert chosen.train.per_device_train_batch_size == setup.train.per_device_train_batch_size


def test_without_a_snapshot_the_next_rung_down(setup, tmp_path):
    chosen, why = fallback_setup(setup, tmp_path / "missing.pickle")
    assert chosen.train == setup.one_rung_down().train and "no snapshot" in why


def test_a_lack_nothing_down_the_ladder_covers_is_said(setup, tmp_path):
    chosen, why = fallback_setup(setup, lacking(tmp_path, setup, 2**40))
    assert chosen is None and "nothing down the ladder fits and saves" in why


@pytest.mark.parametrize("capped", [False, True], ids=["another-process", "capped"])
def test_a_card_that_held_less_than_planned_is_judged_as_it_was(setup, tmp_path, capped):
    """On the H200, with the allocator capped at 5.5 GiB under an 8 GiB plan, the fallback chose expandable segments
    for the same config, predicted at 7.03 GiB, and would have run out again. Another process's memory does the same
    to a laptop's card (CUDA has less free than the request), a cap of torch's leaves CUDA's memory free."""
    snapshot, reserved = fragmented(tmp_path, setup, 0.15, device_free=64 * 2**30 if capped else None)
    chosen, why = fallback_setup(setup, snapshot)
    context = setup.verdict.context
    outside = context.capacity_bytes - context.allocatable_bytes(setup.train)
    assert f"let PyTorch hold {reserved / 2**30:.2f} GiB" in why and "judged on what it had" in why
    assert chosen is not None and chosen.verdict.fits and "fragmentation" not in why
    assert chosen.verdict.context.capacity_bytes == pytest.approx(reserved + outside, abs=1)
    assert chosen.predicted_peak_bytes <= chosen.verdict.context.budget_bytes
    assert setup.predicted_peak_bytes > chosen.verdict.context.budget_bytes  # the planned config would not have
    # what the run says and prints after the fallback names the card as it was, as --gpu takes it
    size = chosen.verdict.context.gpu.name
    assert size.endswith("GiB") and context.gpu.label not in chosen.describe()
    assert f"(on {size};" in chosen.describe()
    named = GpuProfile.from_name(size)
    assert chosen.verdict.context.capacity_bytes - 0.01 * 2**30 <= named.capacity_bytes
    assert named.capacity_bytes <= chosen.verdict.context.capacity_bytes
    advise = advise_command(chosen, snapshot)
    assert advise[advise.index("--gpu") + 1] == size


def test_a_card_that_held_what_was_planned_is_judged_as_planned(setup, tmp_path):
    chosen, why = fallback_setup(setup, fragmented(tmp_path, setup, 0.99)[0])
    assert "let PyTorch hold" not in why and chosen.verdict.context == setup.verdict.context
    assert chosen.train.expandable_segments and "fragmentation decided it" in why
