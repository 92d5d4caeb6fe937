"""Does a traced step keep its shape as its sizes change? The question behind a fast copy of the exact engine.

    python benchmarks/stream_shape.py                 # every fixture architecture, LoRA in bfloat16 and full fp32
    python benchmarks/stream_shape.py --fixtures tiny-qwen3 tiny-phi

The exact engine (`check --exact`) traces the step on the CPU and replays its allocations through the allocator model:
seconds to a minute, and torch. The analytic answer weighs allocation patterns read off such replays, one mechanism at
a time (vram_planner/model/fragmentation.py); the held-out sweeps keep finding steps whose allocations strand memory in
ways no pattern counts (a later phase's tensors cut from the segments an earlier one left: benchmarks/results/
boundary-heldout-rejudged.txt). A copy of the engine that needs no torch would replay the step's own requests: a
template of the traced stream per architecture and knobs, its sizes as functions of the batch, the lengths and the
widths. That holds only if a step makes the same requests in the same order whatever those sizes are.

Each fixture is traced at a base size (8 sequences of 32 + 64 tokens) and at variants that change one size each: the
prompt, the completion, the batch (sequences and generations), the hidden width, the MLP's width, the heads (query and
key-value, head width kept) and the head width. For each variant the two streams are compared event for event: the
same kinds (allocation or free), of the same blocks, in the same phases and moments ("aligned"), and where they are,
how many allocations changed size and how many of those grew by a whole power of the variant's ratio (a product of
sizes, such as tokens x width x bytes; the rest are sums, such as a fused projection's query and key-value widths, or
are cut into chunks). A completion of another length takes another number of decoding steps: its variant is compared
outside the decoding (the phases before it and after it, event for event). Writes benchmarks/results/stream_shape.txt.

2026-12-02 (torch 2.13, transformers 5.24, TRL 1.16, PEFT 0.21): 136 of the 144 variants aligned; in every width's
and the batch's variant each resized allocation grew by a whole power of the ratio (tokens x width x bytes and the
like), and the lengths' grew as sums do (prompt + completion). The 8 that did not are the heads' variants of the
fixtures with one key-value head (gemma, gemma-3, llama's head-width fixture), where attention takes a view of the
single head instead of copying it: another structure, not another size. In the traced Qwen3-0.6B step of the grid's
"lora p1024 c384 B8 8bit" the requests of 10 MiB or more make 89% of what the allocator strands at the need (310 of
350 MiB; 330 with those of 1 MiB or more).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vram_planner.step_copy.make import text_config  # noqa: E402
from vram_planner.step_copy.streams import numbered, with_free_runs_sorted  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
RESULTS = ROOT / "benchmarks" / "results" / "stream_shape.txt"
BASE = {"per_device_train_batch_size": 8, "num_generations": 8, "max_prompt_length": 32, "max_completion_length": 64}
KNOBS = {"lora-bf16": {"lora_r": 8, "dtype": "bfloat16"}, "full-fp32-beta": {"beta": 0.04}}
# (name, settings changed, config changed, the ratio of the size it changes)
VARIANTS = (
    ("prompt x1.5", {"max_prompt_length": 48}, {}, 1.5),
    ("completion x1.5", {"max_completion_length": 96}, {}, 1.5),
    ("batch x1.5", {"per_device_train_batch_size": 12, "num_generations": 12}, {}, 1.5),
    ("hidden x1.5", {}, {"hidden_size": 1.5}, 1.5),
    ("mlp x1.5", {}, {"intermediate_size": 1.5}, 1.5),
    ("heads x2", {}, {"num_attention_heads": 2, "num_key_value_heads": 2}, 2.0),
    ("head width x2", {}, {"head_dim": 2}, 2.0),
)
DECODING = ("decoding steps", "last decoding step")




def varied(config: dict, changes: dict) -> dict | None:
    """The config with each size multiplied; None where it has no such size (phi-2 names no head width)."""
    out = json.loads(json.dumps(config))
    text = text_config(out)
    for key, factor in changes.items():
        if key == "head_dim" and text.get(key) is None:
            return None
        if key == "num_key_value_heads" and text.get(key) is None:
            continue
        value = text.get(key)
        if value is None:
            return None
        text[key] = int(value * factor)
    return out


def traced_events(config: dict, settings: dict) -> list[tuple]:
    """The traced step's events, step 2 after step 1, as `check --exact` replays them: (kind, block, bytes, phase,
    moment, layer). The step at the longest prompt, without the need's bisection (`check --exact` also traces a
    shorter prompt where the analytic model says it may need more, and answers with the step that needs more)."""
    from vram_planner import engine
    from vram_planner.step_copy import make

    context = engine.make_context(config, "h100-80gb")
    return make.traced_events(config, engine.make_training(context, settings), context.release)




def outside_decoding(events: list[tuple]) -> list[tuple]:
    """The events of the phases around the decoding, their blocks numbered again."""
    return numbered([e for e in events
                     if e[4] not in DECODING and not e[4].startswith(tuple(f"{d}:" for d in DECODING))])






def compared(base: list[tuple], other: list[tuple], ratio: float) -> tuple[bool, int, int]:
    """(aligned, allocations resized, of those a whole power of `ratio` larger)."""
    base, other = with_free_runs_sorted(base), with_free_runs_sorted(other)
    if len(base) != len(other) or any(a[0] != b[0] or a[1] != b[1] or a[3:] != b[3:] for a, b in zip(base, other)):
        return False, 0, 0
    resized = powers = 0
    for a, b in zip(base, other):
        if a[0] != "alloc" or a[2] == b[2]:
            continue
        resized += 1
        if a[2] and b[2]:
            power = math.log(b[2] / a[2], ratio)
            powers += abs(power - round(power)) < 1e-9 and round(power) >= 1
    return True, resized, powers


def table(fixtures: list[Path]) -> list[str]:
    lines = [f"{'fixture':24} {'knobs':16} {'variant':16} {'events':>7} {'aligned':>8} {'resized':>8} {'products':>9}"]
    for path in fixtures:
        config = json.loads(path.read_text())
        for knobs_name, knobs in KNOBS.items():
            settings = {**BASE, **knobs}
            start = time.perf_counter()
            base = traced_events(config, settings)
            for name, setting_changes, config_changes, ratio in VARIANTS:
                changed = varied(config, config_changes)
                if changed is None:
                    continue
                other = traced_events(changed, {**settings, **setting_changes})
                a, b = (outside_decoding(base), outside_decoding(other)) if "completion" in name else (base, other)
                aligned, resized, powers = compared(a, b, ratio)
                lines.append(f"{path.stem:24} {knobs_name:16} {name:16} {len(a):7d} {'yes' if aligned else 'NO':>8} "
                             f"{resized if aligned else '':>8} {powers if aligned else '':>9}")
            print(f"{path.stem} {knobs_name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    aligned = sum(" yes " in line for line in lines[1:])
    return [*lines, f"{aligned} of {len(lines) - 1} variants aligned event for event"]


def fixture_main(description: str, table: Callable[[list[Path]], list[str]], results: Path) -> int:
    """A fixture benchmark's command line: `table` over the fixtures named (default: every tiny-*.json), printed,
    and written to `results` when it covered them all."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--fixtures", nargs="*", help="fixture names (default: every tiny-*.json)")
    args = parser.parse_args()
    fixtures = sorted(FIXTURES.glob("tiny-*.json"))
    if args.fixtures:
        fixtures = [p for p in fixtures if p.stem in args.fixtures]
    text = "\n".join(table(fixtures))
    print(text)
    if not args.fixtures:
        results.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(fixture_main(__doc__.splitlines()[0], table, RESULTS))
