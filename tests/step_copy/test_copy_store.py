"""vram_planner.step_copy.store: copies kept by key, one file per copy of the same thing, never read by other code."""

from __future__ import annotations

import gzip

from vram_planner import engine
from vram_planner.step_copy import store
from vram_planner.step_copy.document import StepCopy
from vram_planner.step_copy.lengths import lattice


def a_copy() -> StepCopy:
    return StepCopy(windows=[None], unit=(0, 1), lattice=list(lattice(32, 64)), completion_range=None,
                    names=["generation", "prefill"], events=[(True, 0, 0, 1, 0), (False, 0, 0, 1, 0)], next_block=1,
                    growth_at=[], regions=[], denominator=1, coefficients=[(1, 2, 3, 0, 0, 0)], per_added_token=[0])


def key(**settings):
    context = engine.make_context("Qwen3-0.6B", "rtx4090")
    return store.copy_key(context.arch, engine.make_training(context, settings), context.release)


def test_a_copy_is_read_back_under_its_key_only():
    kept_key = key(lora_r=8, max_completion_length=256)
    path = store.keep(a_copy(), kept_key)
    copy, made = store.kept(kept_key)
    assert copy == a_copy() and made.endswith("+00:00")
    # other lengths in the same tile and on the same sides of the windows: the same copy
    assert store.kept(key(lora_r=8, max_completion_length=300, max_prompt_length=100))[0] == a_copy()
    assert store.kept(key(lora_r=16, max_completion_length=256)) is None  # other knobs
    # the same thing by other code: the same file, not read; keeping it again replaces it
    newer = (kept_key[0], kept_key[1] + " and a change")
    assert store.copy_path(newer) == path and store.kept(newer) is None
    store.keep(a_copy(), newer)
    assert store.kept(kept_key) is None and store.kept(newer) is not None


def test_a_damaged_copy_is_passed_by():
    damaged = key(lora_r=4)
    path = store.keep(a_copy(), damaged)
    path.write_bytes(path.read_bytes()[:40])
    assert store.kept(damaged) is None
    path.write_bytes(gzip.compress(b'{"key": 1}'))
    assert store.kept(damaged) is None
    path.write_bytes(b"not gzip")
    assert store.kept(damaged) is None
