"""A torch-free copy of a traced step: the sizes, the lengths and the layers at once, from traces of a shallow tiny
model, held to a fresh trace of a deeper, wider model at other lengths and batch, request for request.

    python benchmarks/stream_copy.py                      # every fixture architecture, LoRA bf16 and full fp32 + beta
    python benchmarks/stream_copy.py --fixtures tiny-qwen3

The three loops and sizes of the exact engine's stream, each held to fresh traces alone (benchmarks/stream_template.py:
the widths, the batch and the prompt; stream_layers.py: the layers; stream_lengths.py: the prompt and completion
lengths, with the decoding steps' cache growth), put together as the copy in `check` would put them. From a model of 2p
+ 3 layers (p the period of its layer types): six traces at the lengths of stream_lengths.py give each request's size
as a polynomial of degree two in the prompt and completion lengths (a seventh, its decoding steps grouped, what a
step adding several tokens adds), and one trace with each width changed (the hidden
width, the MLP's, the heads with their key-value heads, the head width, the vocabulary) and one with the batch changed,
at the base lengths, the whole power of that ratio each request grew by. The stream is then made at every size changed
at once (the batch x2, the hidden width x2, the MLP x3, the heads x2, the head width x2, the vocabulary x2, the prompt
40 and the completion 80 tokens), its cache growth run by vram_planner.tracing.cache_growth at the bytes per token of
the widened prefill's cache, and its layers copied by a period twice (stream_layers.expanded), and compared with a
fresh trace of that model with 2p more layers: the whole stream `check --exact` replays, the same requests in the
same order, of the same size and layer ("exact"). Writes benchmarks/results/stream_copy.txt.
"""

from __future__ import annotations

import json
import sys
import time
from fractions import Fraction
from pathlib import Path

from stream_lengths import LengthTemplate
from stream_shape import BASE, KNOBS, fixture_main, traced_events
from stream_template import BATCH_TRIED, at_tried_sizes, batch_settings, dimension_powers

from vram_planner.step_copy.layers import copied_unit, expanded
from vram_planner.step_copy.make import growth_spans, layer_period, with_layers, without_growth
from vram_planner.step_copy.streams import numbered, renumbered, request_for_request, with_free_runs_sorted

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "stream_copy.txt"
COPIES = 2
TRIED_LENGTHS = (40, 80)


class StepTemplate:
    """One architecture's step under one set of knobs, at any widths, batch, lengths and depth."""

    def __init__(self, config: dict, settings: dict) -> None:
        self.config, self.settings = config, settings
        self.unit = copied_unit(layer_period(config))
        self.shallow = with_layers(config, self.unit.stop + 2)
        self.lengths = LengthTemplate(self.shallow, settings)
        self.traces = self.lengths.traces
        base = self._rest(self.lengths.base)
        powers, self.widths = dimension_powers(self.shallow, base, self._traced)
        # per request, as the length template orders them
        self.powers = {name: [power for power, event in zip(each, base) if event[0] == "alloc"]
                       for name, each in powers.items()}

    def _rest(self, events: list[tuple]) -> list[tuple]:
        """The stream outside the cache growth at the base lengths, as the length template orders its requests."""
        completion = self.settings["max_completion_length"]
        return with_free_runs_sorted(numbered(without_growth(events, growth_spans(events, self.lengths.layers,
                                                                                  completion))))

    def _traced(self, config: dict, changes: dict) -> list[tuple]:
        self.traces += 1
        return self._rest(traced_events(config, {**self.settings, **changes}))

    def instantiate(self, widths: dict[str, int], batch_ratio: Fraction, prompt: int, completion: int,
                    copies: int) -> list[tuple]:
        """The stream at these widths (the fixture's where not given), the batch times `batch_ratio`, these lengths
        and `copies` more periods of layers."""
        factors = []
        for k in range(len(self.lengths.coefficients)):
            factor = batch_ratio ** self.powers["batch"][k]
            for name, width in widths.items():
                factor *= Fraction(width, self.widths[name]) ** self.powers[name][k]
            factors.append(factor)
        depth = self.lengths.layers + copies * len(self.unit)
        return expanded(self.lengths.instantiate(prompt, completion, factors, depth), self.unit, copies)


def tried(template: StepTemplate) -> tuple[int, bool, int]:
    """(requests, aligned, requests of another size) against a fresh trace of the deeper model at every size
    changed."""
    deep = with_layers(template.config, template.unit.stop + 2 + COPIES * len(template.unit))
    widths, config = at_tried_sizes(deep, template.widths)
    prompt, completion = TRIED_LENGTHS
    fresh = renumbered(traced_events(config, {**template.settings, **batch_settings(BATCH_TRIED),
                                              "max_prompt_length": prompt, "max_completion_length": completion}))
    made = renumbered(template.instantiate(widths, BATCH_TRIED, prompt, completion, COPIES))
    return len(fresh), *request_for_request(made, fresh)


def table(fixtures: list[Path]) -> list[str]:
    exact = 0
    lines = [f"{'fixture':24} {'knobs':16} {'layers':>7} {'traces':>6} {'requests':>9} {'aligned':>8} "
             f"{'other size':>10} {'seconds':>8}"]
    for path in fixtures:
        config = json.loads(path.read_text())
        for knobs_name, knobs in KNOBS.items():
            start = time.perf_counter()
            try:
                template = StepTemplate(config, {**BASE, **knobs})
                requests, aligned, wrong = tried(template)
            except ValueError as exc:
                lines.append(f"{path.stem:24} {knobs_name:16} no copy: {exc}")
                continue
            exact += aligned and not wrong
            layers = f"{template.unit.stop + 2}->{template.unit.stop + 2 + COPIES * len(template.unit)}"
            lines.append(f"{path.stem:24} {knobs_name:16} {layers:>7} {template.traces + 1:6d} {requests:9d} "
                         f"{'yes' if aligned else 'NO':>8} {wrong:10d} {time.perf_counter() - start:8.0f}")
            print(lines[-1], file=sys.stderr)
    return [*lines, f"{exact} of {len(lines) - 1} steps made exactly at every size changed at once"]


if __name__ == "__main__":
    sys.exit(fixture_main(__doc__.splitlines()[0], table, RESULTS))
