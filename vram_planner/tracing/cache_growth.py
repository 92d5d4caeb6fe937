"""The KV cache's growth over the decoding steps, as transformers' cache layers grow it by concatenation.

Pure Python, no torch: the trace (vram_planner.tracing.phases, LiveBytes.record_growth) makes its requests with it,
and a torch-free copy of the traced stream (benchmarks/stream_lengths.py) makes the same requests at other lengths.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

# The most cache updates (layers x decoding steps) whose allocations the trace records between the prefill and the
# last decoding step: up to four events each, in every replayed step.
MAX_CACHE_UPDATES = 4096


class CacheLayer(NamedTuple):
    """One decoder layer's cache as the prefill leaves it."""

    layer: int
    key_bytes_per_token: int
    value_bytes_per_token: int
    tokens: int  # the tokens its keys hold
    sliding_window: int | None  # a sliding-window layer's window (it keeps window - 1 tokens), None for a full one


def prefill_tokens(prompt_tokens: int, sliding_window: int | None) -> int:
    """The tokens a cache layer keeps after a prefill of `prompt_tokens` (transformers 5's DynamicSlidingWindowLayer
    keeps the last window - 1 of them, as a view of the prefill's states)."""
    return min(prompt_tokens, sliding_window - 1) if sliding_window else prompt_tokens


def additions(tokens: int, cache_layers: int, recorded: bool = True) -> list[int]:
    """The tokens each decoding step adds to the cache, `tokens` in all: one a step, or where the counter records the
    steps (`recorded`) and they would pass MAX_CACHE_UPDATES, fewer steps of several tokens each."""
    steps = max(1, min(tokens, MAX_CACHE_UPDATES // max(cache_layers, 1))) if recorded else tokens
    return [tokens * step // steps - tokens * (step - 1) // steps for step in range(1, steps + 1)]


def growth(layers: list[CacheLayer], added: list[int]) -> list[list[tuple[int, ...]]]:
    """Per step, the bytes of each layer's next keys and values storage (keys, then values, layer by layer), grouped
    as the concatenations of `added` tokens make them: a DynamicLayer replaces its keys, then its values; a
    sliding-window layer makes both before it replaces them, and keeps window - 1 tokens."""
    kept = [layer.tokens for layer in layers]
    steps = []
    for count in added:
        step: list[tuple[int, ...]] = []
        for i, layer in enumerate(layers):
            tokens = kept[i] + count
            sizes = (layer.key_bytes_per_token * tokens, layer.value_bytes_per_token * tokens)
            window = layer.sliding_window
            step += [sizes] if window else [sizes[:1], sizes[1:]]
            kept[i] = min(tokens, window - 1) if window else tokens
        steps.append(step)
    return steps


def growth_requests(steps: list[list[tuple[int, ...]]]) -> Iterator[tuple[bool, int, int]]:
    """(allocated, the cache tensor's index, bytes) in the order the steps request them: each group's new storages,
    then the frees of those they replace (the bytes: the new storage's)."""
    for step in steps:
        first = 0
        for group in step:
            made = range(first, first + len(group))
            yield from ((True, i, size) for i, size in zip(made, group))
            yield from ((False, i, size) for i, size in zip(made, group))
            first += len(group)
