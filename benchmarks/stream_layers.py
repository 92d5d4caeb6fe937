"""A traced step's layers as a loop: the step of a deeper model made from the trace of a shallow one, held to a fresh
trace of the deeper model, request for request.

    python benchmarks/stream_layers.py         # every fixture architecture: LoRA bf16 with and without checkpointing
                                               # and checkpointed reentrantly, full fp32 + beta
    python benchmarks/stream_layers.py --fixtures tiny-qwen3

benchmarks/stream_template.py made a step's requests at other sizes from a few traces, with the loops whose counts
change with the config left out. The layers are the first of those loops. The trace marks each event with the decoder
layer it belongs to (`Event.layer`: a layer's forward hooks in the forward, the autograd nodes its forward made in the
backward, the layer a cache update grows), so the events of one layer are known wherever they run: the prefill, the
decoding steps' cache growth, the last decoding step, the scoring passes, the loss forward, a checkpointed layer's
recomputation and the backward; the weights' allocations at loading and the optimizer step's in the layers of the
parameters they belong to.

Each fixture is traced with 2p + 3 layers, p the period of its layer types, and a period of them copied twice in
every run of its events (vram_planner.step_copy.layers says how). The result is compared with a fresh trace with 2p
more layers, the whole stream that `check --exact` replays (loading, step 1, zero_grad, step 2): the same requests in
the same order, of the same size, in the same layer ("exact"). Writes benchmarks/results/stream_layers.txt.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from stream_shape import BASE, KNOBS, fixture_main, traced_events

from vram_planner.step_copy.layers import copied_unit, expanded
from vram_planner.step_copy.make import layer_period, with_layers
from vram_planner.step_copy.streams import renumbered, request_for_request

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "stream_layers.txt"
COPIES = 2
# stream_shape's knobs, a run without gradient checkpointing (no layer runs again in the backward) and one that
# checkpoints reentrantly (a layer's forward inside one autograd node, its backward a backward of its own)
LAYER_KNOBS = {**KNOBS, "lora-bf16-nogc": {**KNOBS["lora-bf16"], "gradient_checkpointing": False},
               "lora-reentrant": {**KNOBS["lora-bf16"], "use_reentrant": True}}


def table(fixtures: list[Path]) -> list[str]:
    exact = 0
    lines = [f"{'fixture':24} {'knobs':16} {'period':>6} {'layers':>7} {'events':>7} {'made':>7} {'aligned':>8} "
             f"{'other':>6} {'seconds':>8}"]
    for path in fixtures:
        config = json.loads(path.read_text())
        every = layer_period(config)
        unit = copied_unit(every)
        shallow, deep = unit.stop + 2, unit.stop + 2 + COPIES * every
        for knobs_name, knobs in LAYER_KNOBS.items():
            start = time.perf_counter()
            settings = {**BASE, **knobs}
            fresh = renumbered(traced_events(with_layers(config, deep), settings))
            try:
                made = renumbered(expanded(traced_events(with_layers(config, shallow), settings), unit, COPIES))
            except ValueError as exc:
                lines.append(f"{path.stem:24} {knobs_name:16} no loop: {exc}")
                continue
            aligned, other = request_for_request(made, fresh)
            exact += aligned and not other
            lines.append(f"{path.stem:24} {knobs_name:16} {every:6d} {f'{shallow}->{deep}':>7} {len(fresh):7d} "
                         f"{len(made):7d} {'yes' if aligned else 'NO':>8} {other:6d} "
                         f"{time.perf_counter() - start:8.0f}")
            print(lines[-1], file=sys.stderr)
    return [*lines, f"{exact} of {len(lines) - 1} steps made exactly from a trace with fewer layers"]


if __name__ == "__main__":
    sys.exit(fixture_main(__doc__.splitlines()[0], table, RESULTS))
