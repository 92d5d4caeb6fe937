"""The trace's allocation and free events: one ordered stream that balances with the live-bytes counter, the cache
growth of the decoding steps, the steady-state stream of two steps, and its replay through the allocator model."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest

from helpers import FIXTURES
from vram_planner.allocator import parse_allocator_conf, replay_events
from vram_planner.model.spec import TrainingConfig
from vram_planner.tracing.events import ALLOC, FREE, LOADING, OPTIMIZER, ZERO_GRAD, Event, live_bytes, steady_stream
from vram_planner.tracing.reserve import reserved_memory
from vram_planner.units import MiB

TINY = json.loads((FIXTURES / "tiny-llama-headdim.json").read_text())
SHORT = {"per_device_train_batch_size": 2, "num_generations": 2, "max_prompt_length": 16, "max_completion_length": 16}
# beta > 0: a reference model is loaded and scored, so every phase runs
EVERY_PHASE = TrainingConfig(**SHORT, beta=0.04)
STEP_PHASES = ("generation", "scoring", "training", OPTIMIZER)


def traced_with_phase_ends(train: TrainingConfig, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """The trace, and after each phase: (name, events so far, the counter's live bytes, the phase's peak)."""
    pytest.importorskip("trl")
    from vram_planner.tracing import phases as tp
    from vram_planner.tracing import trainer as own
    from vram_planner.tracing.step import trace_step

    ends = []
    for module, name in ((tp, "run_generation"), (own, "run_scoring"), (own, "run_training"), (tp, "run_optimizer")):
        def run(session, *args, _original=getattr(module, name), **kwargs):
            peak = _original(session, *args, **kwargs)
            tracker = session.tracker
            ends.append((peak.name, len(tracker.events), tracker.total, peak.peak_bytes))
            return peak
        monkeypatch.setattr(module, name, run)
    return trace_step(TINY, train), ends


@pytest.fixture(scope="module")
def traced():
    with pytest.MonkeyPatch.context() as monkeypatch:
        return traced_with_phase_ends(EVERY_PHASE, monkeypatch)


def test_every_event_has_its_bytes_phase_and_moment(traced):
    result, _ = traced
    assert len(result.events) > 100
    assert {e.phase for e in result.events} == {LOADING, *STEP_PHASES}
    for e in result.events:
        assert e.kind in (ALLOC, FREE) and isinstance(e.size_bytes, int) and e.size_bytes > 0
        assert e.moment, e
    # Phases run one after the other: each phase's events are one run of the stream.
    order = [e.phase for i, e in enumerate(result.events) if i == 0 or result.events[i - 1].phase != e.phase]
    assert order == [LOADING, *STEP_PHASES]


def test_each_event_names_the_decoder_layer_it_belongs_to(traced):
    result, _ = traced

    def layers_in_turn(phase: str) -> list[int]:
        return [layer for layer, _ in itertools.groupby(e.layer for e in result.events
                                                        if e.phase == phase and e.layer != -1)]

    assert {e.layer for e in result.events} == {-1, 0, 1}
    assert layers_in_turn(LOADING) == [0, 1, 0, 1]  # the policy's weights, then the reference's, in their layers
    assert layers_in_turn(OPTIMIZER) == [0, 1]  # each state and temporary in its parameter's layer
    assert layers_in_turn("scoring") == [0, 1]
    assert layers_in_turn("training") == [0, 1, 0]  # the loss forward upwards, its backward downwards
    # each decoding step grows every layer's keys and values in turn
    growth = [e.layer for e in result.events if e.moment == "decoding steps" and e.kind == ALLOC]
    assert len(growth) > 8 and growth[:8] == [0, 0, 1, 1, 0, 0, 1, 1]
    forward = Counter(e.layer for e in result.events if e.phase == "training" and e.moment == "forward")
    backward = Counter(e.layer for e in result.events if e.moment == "backward through the decoder")
    assert forward[0] == forward[1] > 0 and backward[0] > 0 and backward[1] > 0


def test_each_free_frees_a_live_block_of_its_size(traced):
    result, _ = traced
    live: dict[int, int] = {}
    for e in result.events:
        if e.kind == ALLOC:
            assert e.block not in live
            live[e.block] = e.size_bytes
        else:
            assert live.pop(e.block) == e.size_bytes
    # What stays: the weights, the reference weights, the gradients (which zero_grad frees) and the states.
    assert result.gradient_blocks and set(result.gradient_blocks) <= set(live.items())
    assert {e.phase for e in result.events if e.kind == ALLOC and e.block in live} == {LOADING, "training", OPTIMIZER}


def test_the_stream_balances_with_the_counter_at_every_phase_end(traced):
    result, ends = traced
    live = live_bytes(result.events)
    assert [name for name, *_ in ends] == list(STEP_PHASES)
    for name, count, counter_bytes, _ in ends:
        assert live[count - 1] == counter_bytes, name


def test_the_streams_peak_in_each_phase_is_the_counters_peak(traced):
    result, ends = traced
    live = live_bytes(result.events)
    start = next(i for i, e in enumerate(result.events) if e.phase != LOADING)
    for name, end, _, peak_bytes in ends:
        assert max(live[start:end]) == peak_bytes, name
        start = end


@pytest.mark.parametrize("fixture,completion", [("tiny-llama-headdim.json", 16), ("tiny-gemma3.json", 40)])
def test_the_recorded_cache_growth_is_what_running_every_decoding_step_allocates(monkeypatch, fixture, completion):
    """The counter records the decoding steps' concatenations (LiveBytes.record_growth) where the trace runs one;
    running every step on fake tensors allocates and frees the same cache storages in the same order (Gemma 3's
    sliding-window layers make keys and values before they free the old ones, and keep 15 tokens)."""
    pytest.importorskip("trl")
    from vram_planner.tracing.counter import LiveBytes
    from vram_planner.tracing.step import trace_step

    config = json.loads((FIXTURES / fixture).read_text())
    train = TrainingConfig(**SHORT | {"max_completion_length": completion})
    recorded = trace_step(config, train)
    monkeypatch.delattr(LiveBytes, "record_growth")  # a meter without it runs every step, as a real device does
    every_step = trace_step(config, train)
    # 2 sequences x 1 KV head x head_dim 32 x 16 prompt tokens, in bf16: the smaller of the keys' (float32) and the
    # values' (bf16 or float32, as the installed transformers keeps them) storage
    prompt_cache = 2 * 1 * 32 * 2 * 16

    def cache_events(result):
        return [(e.kind, e.size_bytes) for e in result.events
                if e.moment == "decoding steps" and e.size_bytes >= prompt_cache]

    # steps x layers x (keys, values) x (alloc, free)
    assert len(cache_events(recorded)) == (completion - 2) * config["num_hidden_layers"] * 2 * 2
    assert cache_events(recorded) == cache_events(every_step)
    assert [p.peak_bytes for p in recorded.phases] == [p.peak_bytes for p in every_step.phases]


def test_a_huge_completion_records_a_bounded_number_of_cache_steps():
    pytest.importorskip("trl")
    from vram_planner.tracing.cache_growth import MAX_CACHE_UPDATES
    from vram_planner.tracing.step import trace_step

    result = trace_step(TINY, TrainingConfig(**SHORT | {"max_completion_length": 10**6}))
    growth = [e for e in result.events if e.moment == "decoding steps"]
    assert 4 * MAX_CACHE_UPDATES <= len(growth) < 4 * MAX_CACHE_UPDATES + 100


# The steady-state stream and its replay, on events made by hand.
def _event(kind: str, block: int, mib: int, phase: str, moment: str = "m") -> Event:
    return Event(kind, block, mib * MiB, phase, moment)


HAND_MADE = [
    _event(ALLOC, 1, 30, LOADING),  # weights
    _event(ALLOC, 2, 30, "generation", "prefill"), _event(FREE, 2, 30, "generation", "prefill"),
    _event(ALLOC, 3, 30, "training", "forward"),  # a gradient, alive to the optimizer step
    _event(ALLOC, 4, 40, "training", "backward"), _event(FREE, 4, 40, "training", "backward"),
    _event(ALLOC, 5, 60, OPTIMIZER, "optimizer step"),  # the optimizer states
]


def test_step_two_repeats_the_phases_before_the_optimizer_step_after_zero_grad():
    stream = steady_stream(HAND_MADE, gradients=[(3, 30 * MiB)])
    step_one, rest = stream.events[:len(HAND_MADE)], stream.events[len(HAND_MADE):]
    assert step_one == HAND_MADE
    assert rest[0] == _event(FREE, 3, 30, OPTIMIZER, ZERO_GRAD)
    repeated = rest[1:]
    assert [(e.kind, e.size_bytes, e.phase) for e in repeated] == [(e.kind, e.size_bytes, e.phase)
                                                                   for e in HAND_MADE[1:6]]
    assert not {e.block for e in repeated} & {e.block for e in HAND_MADE}  # new blocks: new tensors
    assert stream.second_step == len(HAND_MADE) + 1
    assert stream.spans == {LOADING: (0, 1), OPTIMIZER: (6, 7), "generation": (8, 10), "training": (10, 13)}
    replay_events([(e.kind, e.block, e.size_bytes) for e in stream.events])  # well formed: no ReplayError


def test_a_phase_reserves_the_most_it_holds_including_what_earlier_phases_reserved():
    """Each size here is above 10 MiB, so each request is a segment of its own size, cached once freed and reused
    by a request of the same size: step 1 reserves 30 (weights) + 30 (generation's, then the gradient's) + 40 + 60,
    and step 2 reuses the cached blocks. The optimizer step (step 1) starts with 100 and ends with 160."""
    reserved = reserved_memory(steady_stream(HAND_MADE, [(3, 30 * MiB)]), parse_allocator_conf(None))
    assert reserved.by_phase == {LOADING: 30 * MiB, "generation": 160 * MiB, "training": 160 * MiB,
                                 OPTIMIZER: 160 * MiB}
    assert reserved.peak_bytes == 160 * MiB and not reserved.out_of_memory and reserved.allocator_conf == ""


def test_an_out_of_memory_names_the_phase_and_moment_and_puts_that_phase_over_the_capacity():
    capacity = 90 * MiB  # the 40 MiB backward tensor finds no room beside the weights and the gradient, nothing cached
    stream = steady_stream(HAND_MADE, [(3, 30 * MiB)])
    reserved = reserved_memory(stream, parse_allocator_conf(None), capacity)
    assert reserved.out_of_memory
    note = next(n for n in reserved.notes if "could not find memory" in n)
    assert "in training (backward, step 1)" in note and "after freeing its cache" in note
    assert reserved.by_phase["training"] > capacity
    assert not reserved_memory(stream, parse_allocator_conf(None), 400 * MiB).out_of_memory


def test_a_sliding_window_layer_puts_its_window_on_the_device_in_its_first_update():
    # transformers 5 makes the window on the host with the cache and moves it in the layer's first update
    pytest.importorskip("trl")
    from vram_planner.tracing.step import trace_step

    gemma2 = json.loads((FIXTURES / "tiny-gemma2.json").read_text())
    result = trace_step(gemma2, TrainingConfig(**SHORT, attn_implementation="eager"))
    windows = [e.layer for e in result.events
               if e.moment == "prefill" and e.kind == ALLOC and e.size_bytes == 8 and e.layer != -1]
    assert windows == [0, 2]  # gemma-2's sliding layers, one 8-byte window each


def test_a_layer_checkpointed_reentrantly_runs_its_backward_in_its_layer():
    # its forward makes no graph but one node of its own, whose backward recomputes the layer and runs a backward
    pytest.importorskip("trl")
    from vram_planner.tracing.step import trace_step

    result = trace_step(TINY, TrainingConfig(**SHORT, lora_r=8, use_reentrant=True))
    backward = Counter(e.layer for e in result.events if e.moment == "backward through the decoder")
    assert min(backward[0], backward[1]) > 4 * backward[-1]
