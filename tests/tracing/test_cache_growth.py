"""vram_planner.tracing.cache_growth: the decoding steps' cache growth as pure Python, which the trace records and a
torch-free copy of its stream makes again at other lengths."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vram_planner.tracing.cache_growth import (MAX_CACHE_UPDATES, CacheLayer, additions, growth, growth_requests,
                                               prefill_tokens)


@given(st.integers(1, 10**6), st.integers(1, 80))
def test_the_steps_add_every_token_in_at_most_the_recorded_updates(tokens, layers):
    added = additions(tokens, layers)
    assert sum(added) == tokens and min(added) >= 1
    assert len(added) == min(tokens, max(1, MAX_CACHE_UPDATES // layers))
    assert max(added) - min(added) <= 1  # the tokens spread evenly over the steps
    if tokens < 5000:  # a real device runs every step
        assert additions(tokens, layers, recorded=False) == [1] * tokens


def test_a_full_layer_replaces_keys_then_values_and_a_sliding_one_both_at_once_keeping_its_window():
    full, sliding = CacheLayer(0, 10, 20, 5, None), CacheLayer(1, 1, 1, prefill_tokens(40, 8), 8)
    assert sliding.tokens == 7  # window - 1 of the prompt's 40
    steps = growth([full, sliding], [1, 1])
    assert steps == [[(60,), (120,), (8, 8)], [(70,), (140,), (8, 8)]]
    assert prefill_tokens(5, 8) == 5 and prefill_tokens(5, None) == 5


def test_each_group_is_allocated_before_the_storages_it_replaces_are_freed():
    requests = list(growth_requests([[(60,), (120,), (8, 8)]]))
    assert requests == [(True, 0, 60), (False, 0, 60), (True, 1, 120), (False, 1, 120),
                        (True, 2, 8), (True, 3, 8), (False, 2, 8), (False, 3, 8)]
