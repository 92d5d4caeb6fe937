"""`run --auto-fallback` reads the snapshot of the failed allocation: fragmentation is answered with expandable
segments, a shortfall with the first config down the ladder predicted to save at least the bytes the card lacked."""

from __future__ import annotations

import pickle

import pytest
from snapshot_builder import Recorder, fragmented_until_oom

from vram_planner.allocator.caching import OutOfMemory
from vram_planner.model.search import micro_batch_variants, rungs
from vram_planner.model.verdict import judge
from vram_planner.run.fallback import fallback_setup

MiB = 2**20


def snapshot_file(tmp_path, recorder: Recorder):
    path = tmp_path / "oom-snapshot.pickle"
    path.write_bytes(pickle.dumps(recorder.snapshot()))
    return path


def lacking(tmp_path, lacked: int):
    """A card with 100 MiB in use, 10 MiB still free and nothing cached, failing a request `lacked` beyond that."""
    recorder = Recorder(capacity_bytes=110 * MiB)
    recorder.malloc(100 * MiB)
    with pytest.raises(OutOfMemory):
        recorder.malloc(lacked + 10 * MiB)
    return snapshot_file(tmp_path, recorder)


def test_the_rung_saves_at_least_what_the_card_lacked_skipping_smaller_ones(setup, tmp_path):
    train, context = setup.train, setup.verdict.context
    ladder = [v for v in micro_batch_variants(train)
              if v.per_device_train_batch_size < train.per_device_train_batch_size]
    ladder += list(rungs(train, context.gpu.bf16, context.arch))[1:]
    savings = [setup.predicted_peak_bytes - judge(context, c).estimate.peak_bytes for c in ladder]
    lacked = (round(max(savings[:2])) // (2 * MiB) + 1) * 2 * MiB  # more than either of the next two rungs saves
    chosen, why = fallback_setup(setup, lacking(tmp_path, lacked))
    assert chosen is not None and "lacking at the failed allocation" in why
    assert setup.predicted_peak_bytes - chosen.predicted_peak_bytes >= lacked
    assert chosen.train != setup.one_rung_down().train  # not simply the next rung
    first = next(c for c, saved in zip(ladder, savings) if saved >= lacked)
    assert chosen.train == first


def test_fragmentation_gets_expandable_segments_and_the_same_config(setup, tmp_path):
    recorder = Recorder(capacity_bytes=10 * 20 * MiB + 10 * MiB)
    with pytest.raises(OutOfMemory):
        fragmented_until_oom(recorder, 4 * MiB, 50, 8 * MiB)
    chosen, why = fallback_setup(setup, snapshot_file(tmp_path, recorder))
    assert chosen.train.expandable_segments and "fragmentation decided it" in why
    assert chosen.train.per_device_train_batch_size == setup.train.per_device_train_batch_size


def test_without_a_snapshot_the_next_rung_down(setup, tmp_path):
    chosen, why = fallback_setup(setup, tmp_path / "missing.pickle")
    assert chosen.train == setup.one_rung_down().train and "no snapshot" in why


def test_a_lack_nothing_down_the_ladder_covers_is_said(setup, tmp_path):
    chosen, why = fallback_setup(setup, lacking(tmp_path, 2**40))
    assert chosen is None and "nothing down the ladder saves" in why
