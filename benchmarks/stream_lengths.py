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

import json
import sys
import time
from fractions import Fraction
from pathlib import Path

from stream_shape import BASE, KNOBS, fixture_main, traced_events

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vram_planner.step_copy.lengths import lattice, stream_at  # noqa: E402
from vram_planner.step_copy.make import copy_from_traces  # noqa: E402
from vram_planner.step_copy.streams import numbered, request_for_request, with_free_runs_sorted  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "stream_lengths.txt"
LENGTHS = lattice(32, 64)
TRIED = ((40, 80), (24, 152))


class LengthTemplate:
    """A step's requests at any prompt and completion length (vram_planner.step_copy: its document and stream_at),
    made from the traces of `config` under `settings` at `lengths`."""

    def __init__(self, config: dict, settings: dict, lengths: tuple[tuple[int, int], ...] = LENGTHS) -> None:
        from vram_planner import engine

        self.config, self.settings = config, settings
        context = engine.make_context(config, "h100-80gb")
        self.copy, self.base = copy_from_traces(config, engine.make_training(context, settings), context.release,
                                                lengths)
        self.layers, self.traces, self.coefficients = self.copy.layers, len(lengths) + 1, self.copy.coefficients

    def document(self) -> dict:
        """What a copy needs to make the stream, as JSON carries it (what keeping the copy costs)."""
        return self.copy.model_dump(mode="json")

    def instantiate(self, prompt: int, completion: int, factors: list[Fraction] | None = None,
                    depth: int | None = None) -> list[tuple]:
        return stream_at(self.copy, prompt, completion, depth, factors)


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
