"""Replays that resume from an earlier replay's checkpoint: a clone of the allocator goes on exactly as the allocator
it copies, and a replay started from a checkpoint its capacity reaches is the replay from the first event."""

from __future__ import annotations

import random
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_allocator_invariants import SIZES, check
from vram_planner.allocator import CachingAllocator, OutOfMemory, parse_allocator_conf, replay_events
from vram_planner.allocator import replay as replay_module
from vram_planner.allocator.replay import ALLOC, EMPTY_CACHE, FREE, Replays

MiB = 1024**2
CONFS = ("", "max_split_size_mb:40,roundup_power2_divisions:4")


def random_events(seed: int, n: int = 3000) -> list[tuple[str, int, int]]:
    """Allocations and frees of the sizes that exercise both pools, splitting and oversize blocks."""
    rng = random.Random(seed)
    live: list[int] = []
    events = []
    for tensor in range(n):
        roll = rng.random()
        if roll < 0.003:
            events.append((EMPTY_CACHE, 0, 0))
        elif live and roll < 0.45:
            events.append((FREE, live.pop(rng.randrange(len(live))), 0))
        else:
            events.append((ALLOC, tensor, rng.choice(SIZES) + rng.randrange(0, 4096)))
            live.append(tensor)
    return events


def outcome(allocator: CachingAllocator, call) -> tuple:
    try:
        return ("ok", call(allocator))
    except OutOfMemory as error:
        return ("out of memory", error.requested_bytes, error.reserved_bytes)


@pytest.mark.parametrize("conf", CONFS)
@pytest.mark.parametrize("capacity", [None, 300 * MiB])
def test_a_clone_goes_on_exactly_as_the_allocator_it_copies(conf, capacity):
    rng = random.Random(f"{conf}{capacity}")
    original = CachingAllocator(parse_allocator_conf(conf), capacity)
    clone = None
    live: list[int] = []
    for step in range(3000):
        if step % 700 == 350:
            clone = original.clone(capacity)  # from here both see the same calls
            check(clone)
        size = rng.choice(SIZES) + rng.randrange(0, 4096)
        if live and rng.random() < 0.45:
            address = live.pop(rng.randrange(len(live)))
            call = lambda a, address=address: a.free(address)  # noqa: E731
        else:
            call = lambda a, size=size: a.malloc(size, stream=0)  # noqa: E731
        results = [outcome(a, call) for a in (original, clone) if a is not None]
        assert len(set(results)) == 1, f"step {step}: {results}"
        if results[0][0] == "ok" and results[0][1] is not None:
            live.append(results[0][1])
        if clone is not None:
            assert (clone.reserved_bytes, clone.allocated_bytes, clone.max_reserved_bytes, clone.segment_log,
                    clone.granted_bytes, clone.refused_bytes) == (
                original.reserved_bytes, original.allocated_bytes, original.max_reserved_bytes,
                original.segment_log, original.granted_bytes, original.refused_bytes)
    check(original)
    check(clone)


@pytest.mark.parametrize("conf", ["expandable_segments:True", "per_process_memory_fraction:0.8"])
def test_only_an_allocator_the_capacity_alone_decides_is_cloned(conf):
    allocator = CachingAllocator(parse_allocator_conf(conf), 500 * MiB)
    assert not allocator.resumable()
    with pytest.raises(ValueError):
        allocator.clone(500 * MiB)


def test_what_the_capacity_decided_says_which_capacities_reach_the_same_state():
    allocator = CachingAllocator(parse_allocator_conf(""), 100 * MiB)
    allocator.malloc(60 * MiB)  # a 60 MiB segment: granted up to 60
    with pytest.raises(OutOfMemory):
        allocator.malloc(50 * MiB)  # 110 MiB refused
    assert (allocator.granted_bytes, allocator.refused_bytes) == (60 * MiB, 110 * MiB)
    assert [allocator.same_replay_until_now(c * MiB) for c in (59, 60, 109, 110)] == [False, True, True, False]
    assert not allocator.same_replay_until_now(None)


def comparable(result) -> tuple:
    oom = result.out_of_memory
    return (result.out_of_memory_event, oom and (oom.requested_bytes, oom.reserved_bytes), result.max_reserved_bytes,
            result.max_allocated_bytes, result.segment_sizes, result.segment_log)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), conf=st.sampled_from(CONFS), every=st.sampled_from([16, 64, 257]),
       capacities=st.lists(st.integers(20, 400), min_size=2, max_size=12))
def test_replays_resumed_from_checkpoints_are_the_replays_from_the_first_event(seed, conf, every, capacities):
    events = random_events(seed, 1500)
    allocator_conf = parse_allocator_conf(conf)
    # `every` events apart, three times that after a refusal (hypothesis runs examples in one test: no fixture each)
    with patch.multiple(replay_module, MIN_CHECKPOINT_EVENTS=every, CHECKPOINTS_BEFORE_REFUSAL=len(events),
                        SPARSER_AFTER_REFUSAL=3):
        replays = Replays(events, allocator_conf, kept=(None,))
        replays(None)
        for capacity in [c * MiB for c in capacities]:
            assert comparable(replays(capacity, series=False)) == comparable(
                replay_events(events, allocator_conf, capacity, series=False))


def test_a_bisection_resumes_its_replays_where_their_capacities_decided_alike(monkeypatch):
    monkeypatch.setattr(replay_module, "MIN_CHECKPOINT_EVENTS", 16)  # these replays run out within 100 events
    monkeypatch.setattr(replay_module, "CHECKPOINTS_BEFORE_REFUSAL", 4000)
    events = random_events(7, 4000)
    conf = parse_allocator_conf("")
    replays = Replays(events, conf)
    fresh = {}
    low, high = 20 * MiB, 400 * MiB
    while high - low > 2 * MiB:  # the capacities close in on one another, as least_capacity's do
        capacity = (low + high) // 2 // (2 * MiB) * (2 * MiB)
        result = replays(capacity, series=False)
        fresh[capacity] = replay_events(events, conf, capacity, series=False)
        assert comparable(result) == comparable(fresh[capacity])
        low, high = (capacity, high) if result.out_of_memory else (low, capacity)
    assert replays.resumed_events > 0


def test_checkpoints_are_dense_until_cudamalloc_first_refuses_and_sparse_after():
    """A checkpoint taken before the first refusal serves every larger capacity; one taken after it only those
    between what was granted and what was refused, so a replay takes them further apart from there on."""
    from vram_planner.allocator.replay import _replay

    def churn(first: int, n: int) -> list[tuple[str, int, int]]:  # a 4 MiB tensor made and freed, n times
        return [event for t in range(first, first + n) for event in ((ALLOC, t, 4 * MiB), (FREE, t, 0))]

    # a 40 MiB segment cached, then a 50 MiB request that 64 MiB hold only once it is given back
    events = churn(0, 300) + [(ALLOC, -1, 40 * MiB), (FREE, -1, 0), (ALLOC, -2, 50 * MiB), (FREE, -2, 0)]
    events += churn(300, 600)
    conf, capacity = parse_allocator_conf(""), 64 * MiB
    checkpoints = []
    result = _replay(events, conf, capacity, 0, False, None, 50, checkpoints.append, 200)
    assert result.out_of_memory is None
    gaps = [(b.event - a.event, a.allocator.refused_bytes is None) for a, b in zip(checkpoints, checkpoints[1:])]
    assert {gap for gap, before in gaps if before} == {50}
    assert {gap for gap, before in gaps if not before} == {200}
    # those before serve a larger card; those after do not (it would have kept the 40 MiB segment)
    larger = [c.allocator.same_replay_until_now(2 * capacity) for c in checkpoints]
    assert larger == [c.allocator.refused_bytes is None for c in checkpoints]
