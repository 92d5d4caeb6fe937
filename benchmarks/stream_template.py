"""A traced step as a template: its requests' sizes as functions of the batch, the prompt and the widths, made from
traces of a tiny model and held to a fresh trace at other sizes, request for request.

    python benchmarks/stream_template.py                   # every fixture architecture, LoRA bf16 and full fp32 + beta
    python benchmarks/stream_template.py --fixtures tiny-qwen3

benchmarks/stream_shape.py found that a traced step makes the same requests in the same order whatever its sizes (for
one structure: MQA, GQA and MHA attention are three), each width and the batch a factor of every request it changes.
This builds on it. From one fixture and one set of knobs, up to nine traces: the base (8 sequences of 32 + 64 tokens),
one with each dimension changed (the batch, the hidden width, the MLP's width, the heads with their key-value heads,
the head width where the config names it, the vocabulary) and two more prompt lengths. Each request's size is then its
base size at the prompt (a polynomial of degree two through the three lengths: masks and eager scores grow with its
square) times each dimension's ratio to the power its variant showed (a whole number, negative where a derived head
width shrinks as the heads grow). The template is instantiated for sizes no trace was made at (every dimension changed
at once: the batch x2, the prompt 40, the hidden width x2, the MLP x3, the heads x2, the head width x2, the vocabulary
x2) and compared with a fresh trace there: the same requests in the same order, each of the same size ("exact"); the
table counts that tenth trace among its traces.

What it leaves out, for the engine that would replay such templates in `check`: the loops whose counts change with the
config (the layers, which benchmarks/stream_layers.py makes from the trace's layer marks, the decoding steps, the fused
head's and TRL's chunks, the micro-batches and scoring chunks), so the completion length and the layers stay the
fixture's here, and the sizes past a chunk (the fused head's tiles at min(tokens, chunk)). Writes
benchmarks/results/stream_template.txt.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

from stream_shape import BASE, KNOBS, fixture_main, text_config, traced_events, varied, with_free_runs_sorted

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "stream_template.txt"
# (dimension, the config keys it scales, the ratio of its variant, the ratio of the sizes the template is tried at)
DIMENSIONS = (
    ("hidden", ("hidden_size",), 1.5, 2),
    ("mlp", ("intermediate_size",), 1.5, 3),
    ("heads", ("num_attention_heads", "num_key_value_heads"), 2, 2),
    ("head width", ("head_dim",), 2, 2),
    ("vocabulary", ("vocab_size",), 1.5, 2),
)
PROMPTS = (32, 48, 64)  # the base's first
BATCH_VARIANT, BATCH_TRIED = Fraction(3, 2), Fraction(2)
PROMPT_TRIED = 40


def events(config: dict, settings: dict) -> list[tuple]:
    return with_free_runs_sorted(traced_events(config, settings))


def scaled(config: dict, keys: tuple[str, ...], ratio: float) -> dict | None:
    """The config with each of `keys` it names times `ratio` (None where it names the first of them not at all); a
    single key-value head stays single (multi-query attention views it where grouped attention copies it: another
    structure, another template)."""
    text = text_config(config)
    if text.get(keys[0]) is None:
        return None
    return varied(config, {key: ratio for key in keys
                           if text.get(key) is not None and not (key == "num_key_value_heads" and text[key] == 1)})


def exponents(base: list[tuple], other: list[tuple], ratio: float) -> list[int]:
    """Per event, the power of `ratio` its size grew by (0 for frees); ValueError where the streams differ in shape
    or a size grew by no whole power."""
    if len(base) != len(other) or any(a[0] != b[0] or a[1] != b[1] or a[3:] != b[3:] for a, b in zip(base, other)):
        raise ValueError("the variant makes other requests")
    powers = []
    for a, b in zip(base, other):
        if a[0] != "alloc" or a[2] == b[2]:
            powers.append(0)
            continue
        power = math.log(b[2] / a[2], ratio)
        if abs(power - round(power)) > 1e-9:
            raise ValueError(f"a request grew from {a[2]} to {b[2]} bytes, no whole power of {ratio}")
        powers.append(round(power))
    return powers


class Template:
    """One step's requests, each size a function of the batch, the prompt and the dimensions."""

    def __init__(self, config: dict, settings: dict) -> None:
        self.config, self.settings = config, settings
        self.base = events(config, settings)
        self.traces = 1
        self.powers, self.widths = dimension_powers(config, self.base, self._traced)
        by_prompt = [self.base] + [self._traced(config, {"max_prompt_length": p}) for p in PROMPTS[1:]]
        if any(len(s) != len(self.base) for s in by_prompt):
            raise ValueError("another prompt length makes other requests")
        self.sizes_by_prompt = [[stream[i][2] for stream in by_prompt] for i in range(len(self.base))]

    def _traced(self, config: dict, changes: dict) -> list[tuple]:
        self.traces += 1
        return events(config, {**self.settings, **changes})

    def instantiate(self, widths: dict[str, int], batch: Fraction, prompt: int) -> list[tuple]:
        """The requests at these dimensions (the fixture's where not given), the batch times `batch`, and `prompt`."""
        out = []
        for index, event in enumerate(self.base):
            if event[0] != "alloc":
                out.append(event)
                continue
            size = _through(PROMPTS, self.sizes_by_prompt[index], prompt) * batch ** self.powers["batch"][index]
            for name, width in widths.items():
                size *= Fraction(width, self.widths[name]) ** self.powers[name][index]
            out.append((event[0], event[1], size, *event[3:]))
        return out


def _through(xs: tuple[int, ...], ys: list[int], x: int) -> Fraction:
    """The polynomial of degree len(xs) - 1 through (xs, ys) at x, exactly (Lagrange)."""
    total = Fraction(0)
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        term = Fraction(yi)
        for j, xj in enumerate(xs):
            if j != i:
                term *= Fraction(x - xj, xi - xj)
        total += term
    return total


def batch_settings(ratio: Fraction) -> dict:
    """The base's batch (sequences and generations) times `ratio`."""
    return {key: int(BASE[key] * ratio) for key in ("per_device_train_batch_size", "num_generations")}


def dimension_powers(config: dict, base: list[tuple],
                     traced: Callable[[dict, dict], list[tuple]]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """(per dimension, each width the config names and the batch, the power of its variant's ratio each event of
    `base` grew by in `traced(config changed, settings changed)`; each width as the config names it)."""
    powers: dict[str, list[int]] = {}
    widths: dict[str, int] = {}
    for name, keys, ratio, _ in DIMENSIONS:
        other = scaled(config, keys, ratio)
        if other is not None:
            powers[name] = exponents(base, traced(other, {}), ratio)
            widths[name] = text_config(config)[keys[0]]
    powers["batch"] = exponents(base, traced(config, batch_settings(BATCH_VARIANT)), float(BATCH_VARIANT))
    return powers, widths


def at_tried_sizes(config: dict, widths: dict[str, int]) -> tuple[dict[str, int], dict]:
    """(the widths a template is tried at, the config with them): each width the fixture names times its tried
    ratio."""
    tried_widths = {}
    for name, keys, _, times in DIMENSIONS:
        if name in widths:
            tried_widths[name] = widths[name] * times
            config = scaled(config, keys, times)
    return tried_widths, config


def tried(template: Template) -> tuple[int, int, int]:
    """(allocations, aligned 0/1, allocations of another size) against a fresh trace at sizes no trace was made at."""
    widths, config = at_tried_sizes(template.config, template.widths)
    fresh = events(config, {**template.settings, **batch_settings(BATCH_TRIED), "max_prompt_length": PROMPT_TRIED})
    made = template.instantiate(widths, BATCH_TRIED, PROMPT_TRIED)
    allocations = sum(e[0] == "alloc" for e in fresh)
    if len(made) != len(fresh) or any(a[0] != b[0] or a[1] != b[1] or a[3:] != b[3:] for a, b in zip(made, fresh)):
        return allocations, 0, allocations
    return allocations, 1, sum(a[2] != b[2] for a, b in zip(made, fresh) if a[0] == "alloc")


def table(fixtures: list[Path]) -> list[str]:
    exact = 0
    lines = [f"{'fixture':24} {'knobs':16} {'traces':>6} {'requests':>9} {'aligned':>8} {'other size':>10} "
             f"{'seconds':>8}"]
    for path in fixtures:
        for knobs_name, knobs in KNOBS.items():
            start = time.perf_counter()
            config = json.loads(path.read_text())
            try:
                template = Template(config, {**BASE, **knobs})
            except ValueError as exc:
                lines.append(f"{path.stem:24} {knobs_name:16} no template: {exc}")
                continue
            allocations, aligned, wrong = tried(template)
            exact += bool(aligned) and not wrong
            lines.append(f"{path.stem:24} {knobs_name:16} {template.traces + 1:6d} {allocations:9d} "
                         f"{'yes' if aligned else 'NO':>8} {wrong:10d} {time.perf_counter() - start:8.0f}")
            print(lines[-1], file=sys.stderr)
    return [*lines, f"{exact} of {len(lines) - 1} templates exact at sizes no trace was made at"]


if __name__ == "__main__":
    sys.exit(fixture_main(__doc__.splitlines()[0], table, RESULTS))
