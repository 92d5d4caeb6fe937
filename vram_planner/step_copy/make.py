"""Making a step's copy: seven traces of a shallow copy of the model at short lengths (the torch side; imports
torch, transformers, TRL and PEFT through the trace).

The model keeps 2p + 3 layers (p the period of its layer types, plus the rest of its depth modulo p, so that copies of
a period reach it), its widths, its batch and its knobs. Six traces on the principal lattice (prompts 16 tokens
apart, completions 32: lengths.lengths_to_trace places it) give each request outside the KV cache's growth as a
polynomial of degree two in the two lengths, solved exactly; a seventh, its decoding steps grouped two tokens at a
time (as a deeper model's trace groups them past MAX_CACHE_UPDATES), what the last decoding step's requests grow by
per token it adds past one. The completions traced are scored in as many of the fused LM head's token tiles as the
completion asked (a tile's size stops growing at one, and where a tile makes requests of its own, float32 weights
cast under autocast, each tile more makes more), and the lengths fill each sliding window as the config's do, so the
copy answers for the lengths of that many tiles on those sides of the windows.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from fractions import Fraction
from typing import Any

from vram_planner.model.spec import TrainingConfig
from vram_planner.model.trl_releases import TrlRelease
from vram_planner.step_copy.document import StepCopy
from vram_planner.step_copy.layers import copied_unit
from vram_planner.step_copy.lengths import GROWTH, lengths_to_trace, monomials
from vram_planner.step_copy.streams import numbered, request_for_request, with_free_runs_sorted
from vram_planner.tracing import cache_growth
from vram_planner.tracing.cache_growth import CacheLayer, additions, growth, growth_requests


def text_config(config: dict) -> dict:
    """The part of a config.json that holds the decoder's sizes (a multimodal config's text_config)."""
    return config.get("text_config", config)


def with_layers(config: dict, layers: int) -> dict:
    out = json.loads(json.dumps(config))
    text_config(out)["num_hidden_layers"] = layers
    return out


def _text_config_object(config: dict) -> Any:
    from transformers import CONFIG_MAPPING

    built = CONFIG_MAPPING[config["model_type"]](**{k: v for k, v in config.items() if k != "model_type"})
    return built.get_text_config(decoder=True)


def layer_period(config: dict) -> int:
    """The period of the decoder's layers' sliding windows (`windows`): 1 where all are alike."""
    kinds = windows(with_layers(config, 24))
    return next(p for p in range(1, 25) if all(kinds[i] == kinds[i + p] for i in range(24 - p)))


def windows(config: dict) -> list[int | None]:
    """Each decoder layer's sliding window (None: full) as the installed transformers' DynamicCache lays out its
    layers: by the config's layer types, else every layer sliding where the config names a window (Phi-3's 2,047)."""
    text = _text_config_object(config)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # transformers before 5.24 inferred the same from the config's own fields
        types = getattr(text, "layer_types", None) or [
            "sliding_attention" if getattr(text, "sliding_window", None) is not None else "full_attention"
        ] * text.num_hidden_layers
        return [text.sliding_window if kind == "sliding_attention" else None for kind in types]
    return [kwargs.get("sliding_window") for kwargs in get_layer_types_and_kwargs(text)[1]]


def shallow_depth(config: dict) -> int:
    """The layers a copy of this model is traced with: 2p + 3, and its depth's rest modulo p, so that whole periods
    reach the depth (the model's own where it is no deeper)."""
    depth, every = text_config(config)["num_hidden_layers"], layer_period(config)
    shallow = copied_unit(every).stop + 2
    return depth if depth <= shallow else shallow + (depth - shallow) % every


def traced_events(config: dict, train: TrainingConfig, release: TrlRelease | None) -> list[tuple]:
    """The traced step's events, step 2 after step 1, as `check --exact` replays them: (kind, block, bytes, phase,
    moment, layer)."""
    from vram_planner.tracing.step import trace_step

    return numbered([tuple(e) for e in trace_step(config, train, release).steady_stream().events])


@contextlib.contextmanager
def grouped_steps(updates: int) -> Iterator[None]:
    """Traces inside group the decoding steps as past `updates` cache updates (cache_growth.MAX_CACHE_UPDATES)."""
    saved = cache_growth.MAX_CACHE_UPDATES
    cache_growth.MAX_CACHE_UPDATES = updates
    try:
        yield
    finally:
        cache_growth.MAX_CACHE_UPDATES = saved


def growth_spans(events: list[tuple], layers: int, completion: int) -> list[tuple[int, int]]:
    """[start, end) of each run of recorded cache growth: the first steps of every run of the decoding steps' events
    (the last step runs as itself), each step two requests for each of the layers' keys and values."""
    recorded = (len(additions(completion - 2, layers)) - 1) * 4 * layers if completion >= 2 else 0
    spans, i = [], 0
    while i < len(events):
        if events[i][4] == GROWTH and (i == 0 or events[i - 1][4] != GROWTH):
            if any(e[4] != GROWTH or e[5] < 0 for e in events[i:i + recorded]):
                raise ValueError("a decoding step's cache growth makes other requests than the cache layers'")
            spans.append((i, i + recorded))
            i += recorded
        i += 1
    return spans


def without_growth(events: list[tuple], spans: list[tuple[int, int]]) -> list[tuple]:
    keep = [True] * len(events)
    for start, end in spans:
        keep[start:end] = [False] * (end - start)
    return [e for e, kept in zip(events, keep) if kept]


def solved(points: list[tuple[int, int]], values: list[int]) -> list[Fraction]:
    """The coefficients of the polynomial of degree two in (p, c) through the six points (Gaussian elimination)."""
    rows = [[Fraction(m) for m in monomials(p, c)] + [Fraction(v)] for (p, c), v in zip(points, values)]
    for col in range(6):
        pivot = next(r for r in range(col, 6) if rows[r][col] != 0)
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(6):
            if r != col and rows[r][col] != 0:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col])]
    return [rows[r][6] / rows[r][r] for r in range(6)]


class _Traces:
    """The traces a copy is made from, counted, of one shallow model under one training config."""

    def __init__(self, config: dict, train: TrainingConfig, release: TrlRelease | None,
                 progress: Callable[[str], None] | None) -> None:
        self.config, self.train, self.release = config, train, release
        self.say = progress or (lambda what: None)
        self.count = 0

    def __call__(self, prompt: int, completion: int) -> list[tuple]:
        self.count += 1
        self.say(f"tracing the copy's step {self.count} of 7 ({prompt} + {completion} tokens)")
        lengths = replace(self.train, max_prompt_length=prompt, max_completion_length=completion)
        return traced_events(self.config, lengths, self.release)


def copy_from_traces(config: dict, train: TrainingConfig, release: TrlRelease | None,
                     lengths: tuple[tuple[int, int], ...], completion_range: tuple[int, int] | None = None,
                     progress: Callable[[str], None] | None = None) -> tuple[StepCopy, list[tuple]]:
    """(the copy of `config`'s step as traced, its depth the copy's, at `lengths` (a principal lattice, the base
    first), the base trace's events). ValueError where another length makes other requests outside the cache
    growth, or a size is no whole number of bytes per token where the copy needs one."""
    layer_windows = windows(config)
    layers = len(layer_windows)
    traced = _Traces(config, train, release, progress)
    # every step of these traces adds one token (the polynomials' base), however long their completions
    with grouped_steps(max(cache_growth.MAX_CACHE_UPDATES, layers * max(c for _, c in lengths))):
        traces = [traced(p, c) for p, c in lengths]
    (prompt, completion), base = lengths[0], traces[0]
    spans = growth_spans(base, layers, completion)
    rests = [with_free_runs_sorted(numbered(without_growth(t, growth_spans(t, layers, c))))
             for t, (_, c) in zip(traces, lengths)]
    if not all(request_for_request(r, rests[0])[0] for r in rests):
        raise ValueError("another length makes other requests outside the cache growth")
    sizes = [[e[2] for e in r if e[0] == "alloc"] for r in rests]
    coefficients = [solved(list(lengths), list(request)) for request in zip(*sizes)]
    per_added_token = _per_added_token(traced, rests[0], layers, prompt, completion)
    rest = without_growth(base, spans)
    names = sorted({e[3] for e in rest} | {e[4] for e in rest})
    denominator = math.lcm(*(k.denominator for row in coefficients for k in row))
    removed = 0
    growth_at = []
    for start, end in spans:
        growth_at.append(start - removed)
        removed += end - start
    every = layer_period(config)
    unit = copied_unit(every)
    copy = StepCopy(
        windows=layer_windows, unit=(unit.start, unit.stop) if unit.stop + 2 <= layers else (0, every),
        lattice=list(lengths), completion_range=completion_range, names=names,
        events=[(e[0] == "alloc", e[1], names.index(e[3]), names.index(e[4]), e[5]) for e in rest],
        next_block=1 + max(e[1] for e in base), growth_at=growth_at,
        regions=[_region(base, start, end, layer_windows, prompt) for start, end in spans],
        denominator=denominator, coefficients=[tuple(int(k * denominator) for k in row) for row in coefficients],
        per_added_token=per_added_token)
    return copy, base


def _per_added_token(traced: _Traces, base: list[tuple], layers: int, prompt: int, completion: int) -> list[int]:
    """Per request outside the growth, the bytes it grows by for each token the last decoding step adds beyond one:
    traced with the steps grouped two tokens at a time (the new tokens' states, a sliding-window layer's
    concatenation)."""
    with grouped_steps((completion - 2) // 2 * layers):
        last = additions(completion - 2, layers)[-1]  # 2, or 3 where the tokens are odd
        grouped = traced(prompt, completion)
        rest = with_free_runs_sorted(numbered(without_growth(grouped, growth_spans(grouped, layers, completion))))
    if not request_for_request(rest, base)[0]:
        raise ValueError("a last decoding step adding several tokens makes other requests")
    deltas = [(b[2] - a[2], a[4]) for a, b in zip(base, rest) if a[0] == "alloc"]
    if any(delta and moment != GROWTH or delta % (last - 1) for delta, moment in deltas):
        raise ValueError("decoding steps of several tokens change requests outside the decoding steps, or not by a "
                         "whole number of bytes a token")
    return [delta // (last - 1) for delta, _ in deltas]


def _region(base: list[tuple], start: int, end: int, layer_windows: list[int | None],
            prompt: int) -> tuple[list[int], list[int], list[int]]:
    """(the blocks the prefill's cache storages hold, their bytes per token, the blocks the base's last step makes)
    of one run of cache growth, keys then values, layer by layer (cache_growth's order)."""
    layers = len(layer_windows)
    made = {e[1]: e[2] for e in base if e[0] == "alloc"}
    region = base[start:end]
    unit = 4 * layers
    before = [-1] * (2 * layers)
    last = [-1] * (2 * layers)
    # one step's requests: which cache tensor each of a step's events allocates or frees
    requests = list(growth_requests(growth([CacheLayer(k, 1, 1, 0, w) for k, w in enumerate(layer_windows)], [1])))
    for (allocated, j, _), event in zip(requests, region[:unit]):
        if not allocated:
            before[j] = event[1]
    for (allocated, j, _), event in zip(requests, region[-unit:] if region else []):
        if allocated:
            last[j] = event[1]
    if any(made[b] % prompt for b in before if b >= 0):
        raise ValueError("a prefill's cache storage holds no whole number of bytes per prompt token")
    return before, [made[b] // prompt if b >= 0 else 0 for b in before], last


def make_copy(config: dict, train: TrainingConfig, release: TrlRelease | None,
              progress: Callable[[str], None] | None = None) -> StepCopy:
    """The copy of `train`'s step on the model of `config` (its widths, batch and knobs; any depth of whole periods
    above the shallow one, the completions of as many fused-head tiles): seven traces of a shallow copy of the model.
    ValueError where the step cannot be copied (a multi-GPU step: one GPU's only; lengths or a structure the copy
    cannot make)."""
    if train.num_gpus > 1:
        raise ValueError("the copy makes one GPU's step; this one runs on several")
    shallow = with_layers(config, shallow_depth(config))
    lengths, completion_range = lengths_to_trace(train, release, {w for w in windows(shallow) if w})
    return copy_from_traces(shallow, train, release, lengths, completion_range, progress)[0]
