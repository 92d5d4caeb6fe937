"""vram_planner.step_copy.make: a tiny model's step copied from seven traces of a shallow copy of it, held to fresh
traces at other lengths and depths, request for request, and replayed to the same need (the copy `check` replays)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from helpers import FIXTURES
from vram_planner import engine
from vram_planner.allocator import parse_allocator_conf
from vram_planner.step_copy.lengths import stream_at
from vram_planner.step_copy.make import grouped_steps, make_copy, traced_events, with_layers
from vram_planner.step_copy.replay import copied_need, copied_stream, runs_on
from vram_planner.step_copy.streams import renumbered
from vram_planner.tracing.cache_growth import additions
from vram_planner.tracing.events import Event, repeated_stream, with_workspaces

pytestmark = pytest.mark.slow
SETTINGS = {"per_device_train_batch_size": 8, "num_generations": 8, "max_prompt_length": 32,
            "max_completion_length": 64, "beta": 0.04}
DEPTH = 7  # two layers more than the five the copy traces (tiny-qwen3's layer types have a period of 1)
WORKSPACE = 4 << 20


def training(config: dict | None = None, **lengths):
    context = engine.make_context(config or CONFIG, "h100-80gb")
    return engine.make_training(context, {**SETTINGS, **lengths}), context.release


CONFIG = with_layers(json.loads((FIXTURES / "tiny-qwen3.json").read_text()), DEPTH)


@pytest.fixture(scope="module")
def copy():
    pytest.importorskip("trl")
    return make_copy(CONFIG, *training())


def fresh(config: dict, prompt: int, completion: int) -> list[tuple]:
    return traced_events(config, *training(config, max_prompt_length=prompt, max_completion_length=completion))


def test_the_step_at_other_lengths_is_a_fresh_traces_with_its_own_number_of_decoding_steps(copy):
    assert copy.layers == 5 and copy.unit == (2, 3)
    shallow = with_layers(CONFIG, copy.layers)
    made = renumbered(stream_at(copy, 24, 152))
    assert made == renumbered(fresh(shallow, 24, 152))
    def growth(events: list[tuple]) -> int:
        return sum(e[4] == "decoding steps" and e[5] >= 0 for e in events)

    # 88 recorded steps more in each of the two steps, four requests a layer each
    assert growth(made) == growth(stream_at(copy, 24, 64)) + 2 * 88 * 4 * copy.layers
    with pytest.raises(ValueError, match="no whole number"):
        stream_at(copy, 24, 152, factors=[Fraction(1, 3)] * len(copy.coefficients))


def test_decoding_steps_grouped_several_tokens_at_a_time_are_made_as_a_deeper_models_trace_groups_them(copy):
    shallow = with_layers(CONFIG, copy.layers)
    # 40 recorded steps for 150 tokens: the last adds 4, three more than the traces the copy was made from
    with grouped_steps(40 * copy.layers):
        assert additions(150, copy.layers)[-1] == 4
        assert renumbered(stream_at(copy, 24, 152)) == renumbered(fresh(shallow, 24, 152))
    assert any(copy.per_added_token)


def test_the_deeper_models_step_is_made_and_needs_what_its_trace_needs(copy):
    prompt, completion = 40, 80
    made = copied_stream(copy, prompt, completion, DEPTH, WORKSPACE)
    traced = with_workspaces(repeated_stream([Event(*e) for e in fresh(CONFIG, prompt, completion)]), WORKSPACE)
    assert renumbered([tuple(e) for e in made.events]) == renumbered([tuple(e) for e in traced.events])
    conf = parse_allocator_conf("")
    need = copied_need(made, conf, 1 << 30)
    assert need.fits_card and runs_on(made, conf, need.capacity_bytes)
    assert not runs_on(made, conf, need.capacity_bytes - (2 << 20))
    with pytest.raises(ValueError, match="multiple of 1"):
        copied_stream(copy, prompt, completion, 3, WORKSPACE)


def test_a_step_whose_decoding_fills_the_sliding_window_is_made_from_traces_that_fill_it_too():
    pytest.importorskip("trl")
    config = {**json.loads((FIXTURES / "tiny-gemma2.json").read_text()), "sliding_window": 128}
    copy = make_copy(config, *training(config, max_prompt_length=40, max_completion_length=120))
    assert copy.lattice[0] == (93, 64) and 128 in copy.windows  # prompts short of it, sequences past it
    for prompt, completion in ((40, 120), (56, 150)):
        assert renumbered(stream_at(copy, prompt, completion)) == renumbered(fresh(config, prompt, completion))
    with pytest.raises(ValueError, match="sliding window"):  # the prompt alone fills it: another prefill
        stream_at(copy, 140, 64)
