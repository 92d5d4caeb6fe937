"""A copied step at any prompt and completion length: the stream outside the KV cache's growth with each request's
size a polynomial in the lengths, the growth made by vram_planner.tracing.cache_growth for the lengths and the depth.

Every request outside the growth is made in the same order at any length (benchmarks/stream_shape.py), its size a
polynomial of degree two in the prompt and the completion (the prompt's square in the prefill's masks and eager
scores, the sequence's in the loss forward's), fixed by six traces on the principal lattice; the last decoding step's
requests grow by what a seventh trace, its steps grouped, showed per token added past one (a deeper model's trace
groups its steps past MAX_CACHE_UPDATES). The growth between the prefill and the last decoding step is the trace's
own code run at the lengths asked (benchmarks/stream_lengths.py holds it to fresh traces of every fixture). Pure
Python.
"""

from __future__ import annotations

from fractions import Fraction
from itertools import count

from vram_planner.model.spec import TrainingConfig
from vram_planner.model.trl_releases import TrlRelease
from vram_planner.step_copy.document import StepCopy
from vram_planner.tracing.cache_growth import CacheLayer, additions, growth, growth_requests, prefill_tokens

GROWTH = "decoding steps"  # the moment of the cache growth's events
# The shortest lengths the copy answers for: a shorter completion leaves the decoding no step to record before its last
SHORTEST_PROMPT, SHORTEST_COMPLETION = 1, 4
BASE_PROMPT, BASE_COMPLETION = 32, 64  # the lattice's first lengths, where the tiles and windows allow
PROMPT_SPAN, COMPLETION_SPAN = 32, 64  # how far the lattice's lengths reach past its first
REGIME_MARGIN = 2  # tokens kept clear of a sliding window's edges (window_regime)


def lattice(prompt: int, completion: int) -> tuple[tuple[int, int], ...]:
    """Six (prompt, completion) lengths on which a polynomial of degree two in both is one (the principal lattice),
    the base first: prompts 16 tokens apart, completions 32."""
    p, c, dp, dc = prompt, completion, PROMPT_SPAN // 2, COMPLETION_SPAN // 2
    return (p, c), (p + dp, c), (p + 2 * dp, c), (p, c + dc), (p, c + 2 * dc), (p + dp, c + dc)


def lengths_to_trace(train: TrainingConfig, release: TrlRelease | None, windows: set[int] | frozenset[int] = frozenset()
                     ) -> tuple[tuple[tuple[int, int], ...], tuple[int, int] | None]:
    """(the lattice to trace, the completions the copy then answers for: None for any): scored in as many of the
    fused LM head's token tiles as `train`'s completions (TRL 1.15 on: a micro-batch's completion tokens
    lm_head_token_chunk at a time), and filling each of the sliding `windows` as its lengths do (window_regime).
    ValueError where no lattice does both."""
    from vram_planner.model.lm_head import uses_fused_head

    prompt, completion = train.max_prompt_length, train.max_completion_length
    shortest, low, high = BASE_COMPLETION, 1, None
    regimes = {window: window_regime(prompt, completion, window) for window in windows}
    if None in regimes.values():
        raise ValueError(f"{prompt} + {completion} tokens lie within {REGIME_MARGIN} tokens of filling the sliding "
                         "window")
    # prompts past each window the prompt fills; where only the sequence fills one, prompts just short of it, so
    # that the shortest completions fill it too
    base_prompt = max([BASE_PROMPT] + [window + REGIME_MARGIN + 1 for window, (full, _) in regimes.items() if full])
    if any(not full and filled for full, filled in regimes.values()):
        base_prompt = max(base_prompt, min(window - REGIME_MARGIN - 1 - PROMPT_SPAN
                                           for window, (full, _) in regimes.items() if not full))
    for window, (_, filled) in regimes.items():
        if filled:
            shortest = max(shortest, window + REGIME_MARGIN + 1 - base_prompt)
    if release is not None and uses_fused_head(train, release):
        tile, sequences = release.lm_head_token_chunk, train.per_device_train_batch_size
        tiles = -(-sequences * completion // tile)
        low, high = (tiles - 1) * tile // sequences + 1, tiles * tile // sequences
        shortest = max(shortest, low)
        if shortest + COMPLETION_SPAN > high:
            raise ValueError(f"no three completion lengths 32 tokens apart are scored in as many of the fused LM "
                             f"head's {tile}-token tiles as {completion}-token completions ({tiles})"
                             + (" and fill the sliding window as they do" if windows else ""))
    traced = lattice(base_prompt, shortest)
    if any(window_regime(p, c, window) != regime for p, c in traced for window, regime in regimes.items()):
        raise ValueError(f"no prompts 16 tokens apart and completions 32 apart fill the sliding window as "
                         f"{prompt} + {completion} tokens do")
    return traced, None if high is None else (low, high)


def monomials(prompt: int, completion: int) -> tuple[int, ...]:
    """The terms of a polynomial of degree two in the two lengths, as the copy's coefficients order them."""
    p, c = prompt, completion
    return 1, p, c, p * p, p * c, c * c


def refusal(copy: StepCopy, prompt: int, completion: int) -> str | None:
    """Why the copy cannot make the step at these lengths (None: it can): a length too short to decode, another
    number of the fused LM head's token tiles than the traced completions' (a tile makes requests of its own under
    autocast), or a sliding window the traced lengths and these fill otherwise (a window filled while decoding makes
    other requests in the last step)."""
    if prompt < SHORTEST_PROMPT or completion < SHORTEST_COMPLETION:
        return f"the copy makes prompts of {SHORTEST_PROMPT} token and completions of {SHORTEST_COMPLETION} or more"
    if copy.completion_range is not None:
        low, high = copy.completion_range
        if not low <= completion <= high:
            return (f"the fused LM head scores {completion}-token completions in another number of token tiles than "
                    f"the copy traced ({low} to {high} tokens)")
    for window in sorted({w for w in copy.windows if w}):
        regime = window_regime(prompt, completion, window)
        if regime is None or {window_regime(p, c, window) for p, c in copy.lattice} != {regime}:
            return (f"{prompt} + {completion} tokens fill the {window}-token sliding window otherwise than the "
                    "lengths the copy traced")
    return None


def window_regime(prompt: int, completion: int, window: int) -> tuple[bool, bool] | None:
    """(whether the prompt fills the sliding window, whether the prompt and the completion do): a step makes other
    requests on either side of each (the prefill's cache is cut to the window, the decoding's concatenation drops a
    token). None within REGIME_MARGIN tokens of an edge, where an off-by-one in what the cache keeps would decide."""
    if abs(prompt - window) <= REGIME_MARGIN or abs(prompt + completion - window) <= REGIME_MARGIN:
        return None
    return prompt > window, prompt + completion > window


def stream_at(copy: StepCopy, prompt: int, completion: int, depth: int | None = None,
              factors: list[Fraction] | None = None) -> list[tuple]:
    """The shallow model's stream at these lengths: (kind, block, bytes, phase, moment, layer), as a trace's steady
    stream gives it. A stream whose layers will be copied to `depth` layers (layers.expanded) groups its decoding
    steps as that model's trace groups them. With `factors`, each request outside the growth (in order) that many
    times its size, the cache's bytes per token as the prefill's cache storage they come from. ValueError where the
    copy cannot make these lengths (`refusal`) or a size is no whole number of bytes."""
    problem = refusal(copy, prompt, completion)
    if problem:
        raise ValueError(problem)
    factors = factors or [Fraction(1)] * len(copy.coefficients)
    depth = depth or copy.layers
    extra_tokens = additions(completion - 2, depth)[-1] - 1
    ordinal = {block: k for k, block in enumerate(block for allocates, block, *_ in copy.events if allocates)}
    fresh = count(copy.next_block)
    renamed: dict[int, int] = {}
    sizes: dict[int, int] = {}
    out: list[tuple] = []
    names, at_lengths = copy.names, monomials(prompt, completion)
    regions = dict(zip(copy.growth_at, copy.regions))
    request = 0
    for i, (allocates, block, phase, moment, layer) in enumerate([*copy.events, (False, -1, 0, 0, -1)]):
        if i in regions:
            before, per_token, last = regions[i]
            scaled = [_whole(n * factors[ordinal[b]]) if b >= 0 else 0 for n, b in zip(per_token, before)]
            grown = _growth(copy, (before, scaled, last), prompt, completion, depth, fresh, renamed)
            sizes.update((e[1], e[2]) for e in grown if e[0] == "alloc")
            out += grown
        if i == len(copy.events):
            break
        block = renamed.get(block, block)
        if allocates:
            size = sum(k * m for k, m in zip(copy.coefficients[request], at_lengths))
            size += extra_tokens * copy.per_added_token[request] * copy.denominator
            sizes[block] = _whole(factors[request] * Fraction(size, copy.denominator))
            request += 1
        out.append(("alloc" if allocates else "free", block, sizes[block], names[phase], names[moment], layer))
    return out


def _growth(copy: StepCopy, region: tuple[list[int], list[int], list[int]], prompt: int, completion: int,
            depth: int, fresh: count, renamed: dict[int, int]) -> list[tuple]:
    """One run of cache growth: each decoding step's storages its own blocks, freeing those they replace; the
    prefill's storages freed by the first step, the last step's renamed for the frees of the stream that follows."""
    before, per_token, last = region
    cache = [CacheLayer(k, per_token[2 * k], per_token[2 * k + 1], prefill_tokens(prompt, window), window)
             for k, window in enumerate(copy.windows)]
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


def _whole(value: Fraction) -> int:
    if value.denominator != 1:
        raise ValueError(f"a request of {value} bytes: the copy's sizes are no whole number there")
    return int(value)
