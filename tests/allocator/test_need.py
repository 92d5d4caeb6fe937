"""The need of a traced step: the least capacity on which the allocator model replays it without running out, bisected
over event streams whose need is known by construction, and over a traced step of a tiny model."""

from __future__ import annotations

import json

import pytest

from helpers import FIXTURES
from vram_planner.allocator import parse_allocator_conf, replay_events
from vram_planner.allocator.conf import AllocatorConf
from vram_planner.allocator.need import NEAR_TRIES, granule_bytes, least_capacity
from vram_planner.units import MiB

DEFAULT, EXPANDABLE = AllocatorConf(), parse_allocator_conf("expandable_segments:True", "--allocator-conf")


def growing_cache(sizes_mib: list[int]) -> list[tuple[str, int, int]]:
    """A KV cache grown by concatenation: each larger copy is made while the previous one is alive, then the
    previous one is freed. No freed block can hold the next, larger copy."""
    events = []
    for block, size in enumerate(sizes_mib):
        events.append(("alloc", block, size * MiB))
        if block:
            events.append(("free", block - 1, sizes_mib[block - 1] * MiB))
    return events


def runs_on(events, capacity, conf=DEFAULT) -> bool:
    return replay_events(events, conf, capacity).out_of_memory is None


def test_one_large_tensor_needs_its_rounded_segment():
    need = least_capacity([("alloc", 0, 100 * MiB + 1)], DEFAULT)
    assert need.capacity_bytes == need.held_bytes == 102 * MiB  # large requests round up to 2 MiB
    assert need.tensor_peak_bytes == 100 * MiB + 512 and need.fits_card is None


def test_small_tensors_need_one_small_segment():
    need = least_capacity([("alloc", block, 1000) for block in range(100)], DEFAULT)
    assert need.capacity_bytes == 2 * MiB and need.tensor_peak_bytes == 100 * 1024


def test_a_growing_cache_needs_its_last_two_copies_but_fills_a_roomy_card():
    sizes = list(range(40, 80, 2))  # MiB: each copy 2 MiB larger than the one before
    events = growing_cache(sizes)
    need = least_capacity(events, DEFAULT)
    # With room the allocator keeps every freed copy; short of room it frees them and retries.
    assert need.held_bytes == sum(sizes) * MiB
    assert need.capacity_bytes == (sizes[-1] + sizes[-2]) * MiB == need.tensor_peak_bytes
    assert runs_on(events, need.capacity_bytes) and not runs_on(events, need.capacity_bytes - 1)


def test_on_a_card_it_holds_what_fits_there_and_the_need_stays_the_same():
    sizes = list(range(40, 80, 2))
    events = growing_cache(sizes)
    card = 500 * MiB
    need = least_capacity(events, DEFAULT, card)
    assert need.fits_card and need.capacity_bytes == (sizes[-1] + sizes[-2]) * MiB
    assert need.capacity_bytes < need.held_bytes <= card
    assert need.held_bytes == replay_events(events, DEFAULT, card).max_reserved_bytes


def test_a_card_too_small_runs_out_and_the_need_is_above_it():
    events = growing_cache(list(range(40, 80, 2)))
    card = 100 * MiB
    need = least_capacity(events, DEFAULT, card)
    assert need.fits_card is False and need.capacity_bytes > card
    assert need.held_bytes == replay_events(events, DEFAULT).max_reserved_bytes  # on a card with room


def test_a_card_between_two_granules_runs_as_the_granule_below_it():
    events = growing_cache(list(range(40, 80, 2)))
    exact = least_capacity(events, DEFAULT).capacity_bytes
    assert least_capacity(events, DEFAULT, exact + MiB).fits_card
    assert least_capacity(events, DEFAULT, exact - 1).fits_card is False


def test_the_bisection_takes_a_logarithmic_number_of_replays():
    # 200 copies of 2 to 400 MiB: a roomy card holds 40 GiB, the step needs 798 MiB
    events = growing_cache(list(range(2, 402, 2)))
    need = least_capacity(events, DEFAULT)
    assert need.capacity_bytes == 798 * MiB and need.held_bytes > 39_000 * MiB
    # the bisection, then the capacities above it tried: NEAR_TRIES of them near it, then at doubling distances
    assert need.replays <= 2 + 2 * (need.held_bytes // granule_bytes(DEFAULT)).bit_length() + NEAR_TRIES


# Found by replaying random streams: capacities from 604 MiB run, some between them and 656 MiB run out.
ISLAND = [("alloc", 0, 105906176), ("free", 0, 0), ("alloc", 1, 154140672), ("free", 1, 0), ("alloc", 2, 84934656),
          ("free", 2, 0), ("alloc", 3, 30770474), ("alloc", 4, 72351744), ("free", 4, 0), ("free", 3, 0),
          ("alloc", 5, 22497351), ("alloc", 6, 3707766), ("alloc", 7, 4900219), ("free", 5, 0),
          ("alloc", 8, 191889408), ("alloc", 9, 6783517), ("free", 7, 0), ("alloc", 10, 114294784), ("free", 6, 0),
          ("free", 9, 0), ("alloc", 11, 2097152), ("alloc", 12, 27638377), ("free", 8, 0), ("free", 12, 0),
          ("alloc", 13, 26970158), ("free", 10, 0), ("alloc", 14, 9870221), ("free", 11, 0),
          ("alloc", 15, 110100480), ("alloc", 16, 47185920), ("alloc", 17, 54525952), ("free", 15, 0),
          ("free", 13, 0), ("free", 16, 0), ("free", 14, 0), ("alloc", 18, 14435707), ("free", 18, 0),
          ("alloc", 19, 168820736), ("free", 17, 0), ("alloc", 20, 189792256), ("alloc", 21, 26600384),
          ("alloc", 22, 196083712), ("alloc", 23, 24952857), ("alloc", 24, 7373452), ("free", 20, 0),
          ("free", 19, 0), ("alloc", 25, 188743680), ("alloc", 26, 90177536), ("free", 21, 0), ("free", 23, 0),
          ("free", 25, 0), ("alloc", 27, 27530718), ("free", 26, 0), ("alloc", 28, 1783916), ("free", 22, 0),
          ("free", 27, 0)]


def test_the_need_is_where_every_larger_capacity_runs_not_an_island_below_one_that_runs_out():
    need = least_capacity(ISLAND, DEFAULT)
    granule = granule_bytes(DEFAULT)
    assert all(runs_on(ISLAND, capacity) for capacity in range(need.capacity_bytes, need.held_bytes + 1, granule))
    below = range(need.capacity_bytes - 60 * MiB, need.capacity_bytes, granule)
    assert any(runs_on(ISLAND, capacity) for capacity in below)  # where a bisection alone can stop
    assert not runs_on(ISLAND, need.capacity_bytes - granule)


def test_expandable_segments_need_what_their_pages_map():
    # One growing segment: freed pages are unmapped when cudaMalloc (cuMemCreate) fails, so the need is again
    # the last two copies, in 20 MiB pages.
    sizes = list(range(40, 80, 2))
    events = growing_cache(sizes)
    need = least_capacity(events, EXPANDABLE)
    assert runs_on(events, need.capacity_bytes, EXPANDABLE)
    assert not runs_on(events, need.capacity_bytes - granule_bytes(EXPANDABLE), EXPANDABLE)
    assert (sizes[-1] + sizes[-2]) * MiB <= need.capacity_bytes <= need.held_bytes


def test_the_granule_follows_the_large_segment_size():
    assert granule_bytes(DEFAULT) == 2 * MiB
    assert granule_bytes(parse_allocator_conf("large_segment_size_mb:21", "--allocator-conf")) == MiB


def test_an_empty_stream_needs_nothing():
    need = least_capacity([], DEFAULT, 10 * MiB)
    assert need.capacity_bytes == need.tensor_peak_bytes == need.held_bytes == 0 and need.fits_card


@pytest.fixture(scope="module")
def traced_stream():
    pytest.importorskip("trl")
    from vram_planner.model.spec import TrainingConfig
    from vram_planner.tracing.events import with_workspaces
    from vram_planner.tracing.step import trace_step

    # 8 x 1024-token completions: the KV cache grows by one concatenation per layer per token
    config = json.loads((FIXTURES / "tiny-llama-headdim.json").read_text())
    result = trace_step(config, TrainingConfig(per_device_train_batch_size=8, num_generations=8,
                                               max_prompt_length=16, max_completion_length=1024))
    stream = with_workspaces(result.steady_stream(), 4 * MiB)
    return [(e.kind, e.block, e.size_bytes) for e in stream.events]


@pytest.mark.parametrize("conf", [DEFAULT, EXPANDABLE], ids=["default", "expandable_segments"])
def test_a_traced_step_runs_at_its_need_and_runs_out_one_granule_below(traced_stream, conf):
    need = least_capacity(traced_stream, conf, 24 * 1024 * MiB)
    granule = granule_bytes(conf)
    assert need.fits_card and need.capacity_bytes % granule == 0
    assert need.tensor_peak_bytes <= need.capacity_bytes <= need.held_bytes
    assert runs_on(traced_stream, need.capacity_bytes, conf)
    assert not runs_on(traced_stream, need.capacity_bytes - granule, conf)


def test_a_traced_growing_kv_cache_makes_a_roomy_card_hold_more_than_the_step_needs(traced_stream):
    need = least_capacity(traced_stream, DEFAULT, 24 * 1024 * MiB)
    assert need.held_bytes > 1.1 * need.capacity_bytes


@pytest.mark.parametrize("conf", [DEFAULT, EXPANDABLE], ids=["default", "expandable_segments"])
@pytest.mark.parametrize("card_mib", [24 * 1024, 200])  # a card it runs on, and one too small
def test_shared_replays_give_the_same_need_and_reserved_figures_replaying_each_kept_capacity_once(
        traced_stream, conf, card_mib, monkeypatch):
    from vram_planner.allocator import replay as replay_module
    from vram_planner.allocator.replay import Replays
    from vram_planner.tracing.events import Event, SteadyStream
    from vram_planner.tracing.reserve import reserved_memory

    card = card_mib * MiB
    stream = SteadyStream([Event(kind, block, size, "training", "") for kind, block, size in traced_stream],
                          {"training": (0, len(traced_stream))}, len(traced_stream))
    alone = least_capacity(traced_stream, conf, card), reserved_memory(stream, conf, card)
    capacities = []
    original = replay_module._replay

    def counted(events, conf, capacity, *args):
        capacities.append(capacity)
        return original(events, conf, capacity, *args)

    monkeypatch.setattr(replay_module, "_replay", counted)
    replays = Replays(traced_stream, conf, kept=(card, None))
    shared = reserved_memory(stream, conf, card, replays)
    need = least_capacity(traced_stream, conf, card, replays)
    assert (need.capacity_bytes, need.held_bytes, need.fits_card, need.replays) == (
        alone[0].capacity_bytes, alone[0].held_bytes, alone[0].fits_card, alone[0].replays)
    assert (shared.by_phase, shared.peak_bytes, shared.out_of_memory) == (
        alone[1].by_phase, alone[1].peak_bytes, alone[1].out_of_memory)
    # reserved_memory's replays (the card's, and the unlimited one where the card runs out) are the bisection's own
    assert shared.out_of_memory == (card_mib == 200)
    assert capacities.count(card) == 1 and capacities.count(None) == int(shared.out_of_memory)
    assert len(capacities) == need.replays


@pytest.mark.parametrize("conf", [DEFAULT, EXPANDABLE], ids=["default", "expandable_segments"])
def test_replays_resumed_from_checkpoints_bisect_the_same_need(traced_stream, conf, monkeypatch):
    from vram_planner.allocator import replay as replay_module
    from vram_planner.allocator.replay import Replays

    card = 200 * MiB
    # none taken: every replay from the first event
    monkeypatch.setattr(replay_module, "MIN_CHECKPOINT_EVENTS", len(traced_stream))
    fresh = least_capacity(traced_stream, conf, card)
    monkeypatch.setattr(replay_module, "MIN_CHECKPOINT_EVENTS", 500)
    replays = Replays(traced_stream, conf, kept=(card, None))
    resumed = least_capacity(traced_stream, conf, card, replays)
    assert (resumed.capacity_bytes, resumed.held_bytes, resumed.fits_card, resumed.replays) == (
        fresh.capacity_bytes, fresh.held_bytes, fresh.fits_card, fresh.replays)
    # expandable segments map pages against the capacity as well: their replays start from the first event
    assert (replays.resumed_events > 0) == (conf is DEFAULT)
