"""A traced step's lengths as a loop: the step at other prompt and completion lengths made from seven traces, its
decoding steps' cache growth made torch-free, held to a fresh trace request for request.

    python benchmarks/stream_lengths.py                   # every fixture architecture, LoRA bf16 and full fp32 + beta
    python benchmarks/stream_lengths.py --fixtures tiny-qwen3

benchmarks/stream_template.py made a step's requests at other sizes with the completion length kept, and
benchmarks/stream_layers.py made the layers a loop. The completion length changes how many decoding steps grow the KV
cache, the second loop. The trace grows the cache between the prefill and the last decoding step with our own code
(vram_planner.tracing.cache_growth: the concatenations transformers' cache layers make, one a layer and step), so a
torch-free copy of the stream can run the same code for any length: from the cache layers the prefill leaves (each
one's bytes per token, read off the prefill's cache storage, and its sliding window, from the config as the installed
transformers lays out its layer types) and the tokens the steps add.

Everything else in the stream makes the same requests in the same order at any length (benchmarks/stream_shape.py),
each of a size that is a polynomial of degree two in the prompt and the completion lengths (the prompt's square in the
prefill's masks and eager scores, the sequence's in the loss forward's): six traces on the principal lattice (the
prompt at 32, 48, 64 tokens, the completion at 64, 96, 128) fix each one. A seventh trace, at the base lengths with
the decoding steps grouped two tokens at a time (as the trace of a deeper model groups them past MAX_CACHE_UPDATES),
gives what each request of the last decoding step grows by for every token it adds beyond one (the new tokens'
states, a sliding-window layer's concatenation). The stream is then made at lengths no trace
was made at, prompts and completions longer and shorter, each with another number of decoding steps, the cache growth
in its place (each step's storages its own blocks, freeing the step's before; the prefill's storages freed by the
first step, the last step's by the requests that freed the base's), and compared with a fresh trace there: the whole
stream that `check --exact` replays (loading, step 1, zero_grad, step 2), the same requests in the same order, each of
the same size and layer ("exact"). What it leaves out: lengths past a chunk (the fused head's tiles at min(tokens,
chunk)) or past a sliding window (the fixtures' windows of 16 tokens are full after every prefill here; a window
filled while decoding makes other requests in the last step). Writes benchmarks/results/stream_lengths.txt.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator
from fractions import Fraction
from itertools import count
from pathlib import Path

from stream_shape import (BASE, KNOBS, fixture_main, numbered, request_for_request, traced_events,
                          with_free_runs_sorted)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vram_planner.tracing import cache_growth  # noqa: E402
from vram_planner.tracing.cache_growth import (CacheLayer, additions, growth, growth_requests,  # noqa: E402
                                               prefill_tokens)

RESULTS = ROOT / "benchmarks" / "results" / "stream_lengths.txt"
GROWTH = "decoding steps"


def lattice(prompt: int, completion: int) -> tuple[tuple[int, int], ...]:
    """Six (prompt, completion) lengths on which a polynomial of degree two in both is one (the principal lattice),
    the base first: prompts 16 tokens apart, completions 32."""
    p, c = prompt, completion
    return (p, c), (p + 16, c), (p + 32, c), (p, c + 32), (p, c + 64), (p + 16, c + 32)


LENGTHS = lattice(32, 64)
TRIED = ((40, 80), (24, 152))


@contextlib.contextmanager
def grouped_steps(updates: int) -> Iterator[None]:
    """Traces inside group the decoding steps as past `updates` cache updates (cache_growth.MAX_CACHE_UPDATES)."""
    saved = cache_growth.MAX_CACHE_UPDATES
    cache_growth.MAX_CACHE_UPDATES = updates
    try:
        yield
    finally:
        cache_growth.MAX_CACHE_UPDATES = saved


def windows(config: dict) -> list[int | None]:
    """Each decoder layer's sliding window as the installed transformers lays out the layer types (None: full)."""
    from transformers import CONFIG_MAPPING

    built = CONFIG_MAPPING[config["model_type"]](**{k: v for k, v in config.items() if k != "model_type"})
    text = built.get_text_config()
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    return [text.sliding_window if kind == "sliding_attention" else None for kind in types]


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
    rows = [[Fraction(m) for m in _monomials(p, c)] + [Fraction(v)] for (p, c), v in zip(points, values)]
    for col in range(6):
        pivot = next(r for r in range(col, 6) if rows[r][col] != 0)
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(6):
            if r != col and rows[r][col] != 0:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col])]
    return [rows[r][6] / rows[r][r] for r in range(6)]


def _monomials(p: int, c: int) -> tuple[int, ...]:
    return 1, p, c, p * p, p * c, c * c


def _whole(value: Fraction) -> int:
    if value.denominator != 1:
        raise ValueError(f"a request of {value} bytes: the template's sizes are no whole number there")
    return int(value)


class LengthTemplate:
    """A step's requests at any prompt and completion length: the stream outside the cache growth with each size a
    polynomial in the lengths, the growth made by vram_planner.tracing.cache_growth."""

    def __init__(self, config: dict, settings: dict, lengths: tuple[tuple[int, int], ...] = LENGTHS) -> None:
        self.config, self.settings = config, settings
        self.windows = windows(config)
        self.layers = len(self.windows)
        # every step of these traces adds one token (the polynomials' base), however long their completions
        with grouped_steps(max(cache_growth.MAX_CACHE_UPDATES, self.layers * max(c for _, c in lengths))):
            traces = [traced_events(config, {**settings, "max_prompt_length": p, "max_completion_length": c})
                      for p, c in lengths]
            (self.prompt, completion), self.base = lengths[0], traces[0]
            self.spans = growth_spans(self.base, self.layers, completion)
            rests = [with_free_runs_sorted(numbered(without_growth(t, growth_spans(t, self.layers, c))))
                     for t, (_, c) in zip(traces, lengths)]
        self.traces = len(traces)
        if not all(request_for_request(r, rests[0])[0] for r in rests):
            raise ValueError("another length makes other requests outside the cache growth")
        sizes = [[e[2] for e in r if e[0] == "alloc"] for r in rests]
        self.coefficients = [solved(list(lengths), list(request)) for request in zip(*sizes)]
        self.per_added_token = self._per_added_token(rests[0], completion)
        # each request outside the growth by the block the base makes with it, in order (the rests' order)
        self.ordinal = {e[1]: k for k, e in enumerate(e for e in without_growth(self.base, self.spans)
                                                       if e[0] == "alloc")}
        self.regions = [self._region(start, end) for start, end in self.spans]

    def document(self) -> dict:
        """What a copy needs to make the stream, as JSON would carry it (what committing the template costs): the
        base's events outside the growth, each request's polynomial (numerators over one denominator) and growth per
        added token, and the growth's regions."""
        rest = without_growth(self.base, self.spans)
        names = sorted({e[3] for e in rest} | {e[4] for e in rest})
        denominator = math.lcm(*(k.denominator for row in self.coefficients for k in row))
        return {"names": names, "windows": self.windows, "prompt": self.prompt, "spans": self.spans,
                "regions": self.regions, "per_added_token": self.per_added_token, "denominator": denominator,
                "events": [[e[0] == "alloc", e[1], names.index(e[3]), names.index(e[4]), e[5]] for e in rest],
                "coefficients": [[int(k * denominator) for k in row] for row in self.coefficients]}

    def _per_added_token(self, base: list[tuple], completion: int) -> list[int]:
        """Per request outside the growth, the bytes it grows by for each token the last decoding step adds beyond
        one: traced with the steps grouped two tokens at a time, as a deeper model's trace groups them past
        MAX_CACHE_UPDATES (the new tokens' states, a sliding-window layer's concatenation)."""
        steps = (completion - 2) // 2
        with grouped_steps(steps * self.layers):
            last = additions(completion - 2, self.layers)[-1]  # 2, or 3 where the tokens are odd
            grouped = traced_events(self.config, {**self.settings, "max_prompt_length": self.prompt,
                                                  "max_completion_length": completion})
            rest = with_free_runs_sorted(numbered(without_growth(grouped, growth_spans(grouped, self.layers,
                                                                                       completion))))
        self.traces += 1
        if not request_for_request(rest, base)[0]:
            raise ValueError("a last decoding step adding several tokens makes other requests")
        deltas = [(b[2] - a[2], a[4]) for a, b in zip(base, rest) if a[0] == "alloc"]
        if any(delta and moment != GROWTH or delta % (last - 1) for delta, moment in deltas):
            raise ValueError("decoding steps of several tokens change requests outside the decoding steps, or not "
                             "by a whole number of bytes a token")
        return [delta // (last - 1) for delta, _ in deltas]

    def _region(self, start: int, end: int) -> tuple[list[int], list[int], list[int]]:
        """(the blocks the prefill's cache storages hold, their bytes per token, the blocks the base's last step
        makes) of one run of cache growth, keys then values, layer by layer (cache_growth's order)."""
        made = {e[1]: e[2] for e in self.base if e[0] == "alloc"}
        region = self.base[start:end]
        unit = 4 * self.layers
        before = [-1] * (2 * self.layers)
        last = [-1] * (2 * self.layers)
        # one step's requests: which cache tensor each of a step's events allocates or frees
        requests = list(growth_requests(growth([CacheLayer(k, 1, 1, 0, w) for k, w in enumerate(self.windows)], [1])))
        for (allocated, j, _), event in zip(requests, region[:unit]):
            if not allocated:
                before[j] = event[1]
        for (allocated, j, _), event in zip(requests, region[-unit:] if region else []):
            if allocated:
                last[j] = event[1]
        if any(made[b] % self.prompt for b in before if b >= 0):
            raise ValueError("a prefill's cache storage holds no whole number of bytes per prompt token")
        per_token = [made[b] // self.prompt if b >= 0 else 0 for b in before]
        return before, per_token, last

    def instantiate(self, prompt: int, completion: int, factors: list[Fraction] | None = None,
                    depth: int | None = None) -> list[tuple]:
        """The stream at these lengths: (kind, block, bytes, phase, moment, layer), as traced_events gives it; with
        `factors`, each request outside the growth (in order) that many times its size at the traced widths, the
        cache's bytes per token as the prefill's cache storage they come from. A stream whose layers will be copied
        to `depth` layers (stream_layers.expanded) groups its decoding steps as that model's trace groups them."""
        factors = factors or [Fraction(1)] * len(self.coefficients)
        extra_tokens = additions(completion - 2, depth or self.layers)[-1] - 1 if completion >= 2 else 0
        fresh = count(1 + max(e[1] for e in self.base))
        renamed: dict[int, int] = {}
        sizes: dict[int, int] = {}
        out: list[tuple] = []
        requests = iter(zip(self.coefficients, self.per_added_token, factors, strict=True))
        i, spans = 0, dict(self.spans)
        regions = dict(zip((s for s, _ in self.spans), self.regions))
        while i < len(self.base):
            if i in spans:
                before, per_token, last = regions[i]
                scaled = [_whole(n * factors[self.ordinal[b]]) if b >= 0 else 0 for n, b in zip(per_token, before)]
                grown = self._growth((before, scaled, last), prompt, completion, depth or self.layers, fresh, renamed)
                sizes.update((e[1], e[2]) for e in grown if e[0] == "alloc")
                out += grown
                i = spans[i]
                continue
            event = self.base[i]
            block = renamed.get(event[1], event[1])
            if event[0] == "alloc":
                coefficients, per_added_token, factor = next(requests)
                at_lengths = sum(k * m for k, m in zip(coefficients, _monomials(prompt, completion)))
                sizes[block] = _whole(factor * (at_lengths + extra_tokens * per_added_token))
            out.append((event[0], block, sizes.get(block, event[2]), *event[3:]))
            i += 1
        return out

    def _growth(self, region: tuple[list[int], list[int], list[int]], prompt: int, completion: int, depth: int,
                fresh: count, renamed: dict[int, int]) -> list[tuple]:
        before, per_token, last = region
        cache = [CacheLayer(k, per_token[2 * k], per_token[2 * k + 1], prefill_tokens(prompt, window), window)
                 for k, window in enumerate(self.windows)]
        steps = growth(cache, additions(completion - 2, depth)[:-1])
        current = [(block, per_token[j] * prompt) for j, block in enumerate(before)]
        made = list(current)
        out = []
        for allocated, j, size in growth_requests(steps):
            layer = j // 2
            if allocated:
                made[j] = (next(fresh), size)
                out.append(("alloc", made[j][0], size, "generation", GROWTH, layer))
            else:
                out.append(("free", *current[j], "generation", GROWTH, layer))
                current[j] = made[j]
        renamed.update({base: new for base, (new, _) in zip(last, current) if base >= 0})
        return out


def table(fixtures: list[Path]) -> list[str]:
    exact = 0
    lines = [f"{'fixture':24} {'knobs':16} {'lengths':>9} {'traces':>6} {'events':>7} {'made':>7} {'aligned':>8} "
             f"{'other':>6} {'seconds':>8}"]
    for path in fixtures:
        config = json.loads(path.read_text())
        for knobs_name, knobs in KNOBS.items():
            start = time.perf_counter()
            settings = {**BASE, **knobs}
            try:
                template = LengthTemplate(config, settings)
            except ValueError as exc:
                lines.append(f"{path.stem:24} {knobs_name:16} no template: {exc}")
                continue
            for prompt, completion in TRIED:
                fresh = with_free_runs_sorted(numbered(traced_events(
                    config, {**settings, "max_prompt_length": prompt, "max_completion_length": completion})))
                made = with_free_runs_sorted(numbered(template.instantiate(prompt, completion)))
                aligned, other = request_for_request(made, fresh)
                exact += aligned and not other
                lines.append(f"{path.stem:24} {knobs_name:16} {f'{prompt}+{completion}':>9} {template.traces + 1:6d} "
                             f"{len(fresh):7d} {len(made):7d} {'yes' if aligned else 'NO':>8} {other:6d} "
                             f"{time.perf_counter() - start:8.0f}")
                print(lines[-1], file=sys.stderr)
    return [*lines, f"{exact} of {len(lines) - 1} steps made exactly at lengths no trace was made at"]


if __name__ == "__main__":
    sys.exit(fixture_main(__doc__.splitlines()[0], table, RESULTS))
