"""The torch-free copy of the exact engine at the boundary grid's hardest points: each point's whole stream made from
traces of the same model with a few layers at short lengths, held to the point's own trace, request for request.

    python benchmarks/copy_at_boundary.py          # the grid's window and points > 1% under, the held-out windows
    python benchmarks/copy_at_boundary.py --points "Qwen3-0.6B lora p1024 c384 B8 8bit"
    python benchmarks/copy_at_boundary.py --held-out 8 --seed 7 --largest-gib 24   # a held-out sweep's first draws

benchmarks/stream_copy.py holds the copy (the widths, the batch, the lengths and the layers at once) to fresh traces
of tiny fixtures. The points where `check`'s analytic answer is furthest under the need (benchmarks/results/
boundary.txt: the window and the points more than 1% under), with the held-out sweeps' three windows, are catalog
models at real widths, up to 1,408 tokens and 512 sequences generated at once, 8-bit AdamW, eager attention, 64
micro-batches a generation. Here each is made
from seven traces of its own model with 2p + 3 (+ the rest of the depth modulo p) layers, at its widths, batch and
knobs, at the six lengths of benchmarks/stream_lengths.py (32 to 64 prompt tokens, 64 to 128 completion tokens) and
once with the decoding steps grouped two tokens at a time (as a deeper trace groups them past MAX_CACHE_UPDATES): its
requests' sizes as polynomials in the lengths, its cache growth run by vram_planner.tracing.cache_growth for the
point's lengths and depth, its layers copied by their period up to the point's depth. Compared with the point's own
trace at its longest prompt (the stream `check --exact` replays there): "exact" where every request agrees, in order, in
size and in layer; an exact stream replays to the point's need through the allocator model by construction, so
`check` replaying it would have no window there. The seconds are the seven traces' and the copy's (the trace of the
point itself aside). What the copy would cost `check`, without torch: the template's size as gzipped JSON
(LengthTemplate.document), the seconds to make the stream from it, and those of one replay through the allocator model
on the point's committed need (cuBLAS workspaces included, as `check --exact` replays), where it must run, and one 2
MiB granule below it, where it must run out unless the need is a shorter prompt's (`check --exact` also traces a
batch of shorter prompts where the analytic model says it may need more). Writes
benchmarks/results/copy_at_boundary.txt.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boundary import CARD, MODELS, points
from boundary_heldout import add_draw_arguments, write_draws_table
from stream_shape import text_config, traced_events

from vram_planner.step_copy.make import make_copy
from vram_planner.step_copy.replay import copied_stream, runs_on
from vram_planner.step_copy.streams import renumbered, request_for_request
from vram_planner.tracing.events import Event, SteadyStream, repeated_stream, with_workspaces

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "copy_at_boundary.txt"
# boundary.txt's window and its points more than 1% under their need (2026-12-02)
HARDEST = ("Qwen3-0.6B lora p1024 c384 B8 8bit", "Qwen3-0.6B lora p256 c128 B8 S64 eager",
           "Llama-3.2-1B lora p1024 c384 B8 8bit", "SmolLM2-135M lora c1024 B16 nogc",
           "Qwen2.5-0.5B lora p1024 c384 B8 8bit", "Llama-3.2-1B fp32 full adamw_8bit",
           "SmolLM2-135M lora p512 c128 B8 S64")
# the held-out sweeps' windows (benchmarks/results/boundary-heldout-rejudged.txt): (sweep, point)
HELD_OUT_WINDOWS = (("boundary-heldout-seed3", "h17 Qwen3-1.7B"), ("boundary-heldout-24gib-seed2", "h31 SmolLM2-1.7B"),
                    ("boundary-heldout-24gib-seed7", "h12 SmolLM2-135M"))


def config_of(model: str) -> dict:
    from vram_planner.profiles import model_config

    return model_config(model)[0]


@dataclass
class Copy:
    """A point's stream made from a shallow model's traces, and what making it took."""

    stream: SteadyStream  # with the cuBLAS workspaces, as `check --exact` replays a trace
    shallow_layers: int
    traces: int
    template_bytes: int  # the copy's document as gzipped JSON
    make_seconds: float  # making the stream from the document, torch-free


def training(config: dict, settings: dict) -> tuple[Any, Any]:
    """(the point's TrainingConfig, its TRL release) as `check` makes them."""
    from vram_planner import engine

    context = engine.make_context(config, CARD)
    return engine.make_training(context, settings), context.release


def copied(config: dict, settings: dict) -> Copy:
    train, release = training(config, settings)
    copy = make_copy(config, train, release)
    size = len(gzip.compress(copy.model_dump_json().encode()))
    start = time.perf_counter()
    stream = copied_stream(copy, train.max_prompt_length, train.max_completion_length,
                           text_config(config)["num_hidden_layers"], workspace())
    return Copy(stream, copy.layers, len(copy.lattice) + 1, size, time.perf_counter() - start)


def workspace() -> int:
    from vram_planner.model.cublas import workspace_bytes
    from vram_planner.profiles import gpu_catalog

    return workspace_bytes(gpu_catalog()[CARD].compute_capability)


def verdicts(stream: SteadyStream, settings: dict, need_bytes: int) -> tuple[bool, bool, float]:
    """(whether the allocator model replays the stream on the point's need, whether it runs out one granule below,
    the seconds of one replay): `check`'s verdict from a copy, CUDA context aside, with the cuBLAS workspaces."""
    from vram_planner.allocator import parse_allocator_conf
    from vram_planner.allocator.need import granule_bytes

    conf = parse_allocator_conf(settings.get("allocator_conf"))
    start = time.perf_counter()
    at_need = runs_on(stream, conf, need_bytes)
    seconds = time.perf_counter() - start
    return at_need, not runs_on(stream, conf, need_bytes - granule_bytes(conf)), seconds


def cases(labels: list[str] | None) -> list[tuple[str, str, dict, int]]:
    """(label, model, settings, the committed need) of the grid points named (default: the hardest and the held-out
    windows)."""
    grid = {label: (model, settings) for label, model, settings in points(list(MODELS), quick=False)}
    unknown = [label for label in labels or () if label not in grid]
    if unknown:
        raise ValueError(f"not a grid point: {', '.join(unknown)}")
    needs = json.loads((RESULTS.parent / "boundary-needs.json").read_text())["points"]
    out = [(label, *grid[label], needs[label]["allocator_need_bytes"]) for label in labels or HARDEST]
    held_out = json.loads((RESULTS.parent / "boundary-heldout-needs.json").read_text())["points"]
    for sweep, name in () if labels else HELD_OUT_WINDOWS:
        point = next(p for p in json.loads((RESULTS.parent / f"{sweep}.json").read_text()) if p["point"] == name)
        out.append((f"{sweep.removeprefix('boundary-heldout-')} {name}", point["model"], point["settings"],
                    held_out[f"{point['model']} {point['knobs']}"]["allocator_need_bytes"]))
    return out


def drawn(n: int, seed: int, largest_gib: float | None) -> list[tuple[str, str, dict, int | None]]:
    """(label, model, settings, the committed need where a committed sweep has it) of the held-out sweep's first n
    draws (benchmarks/boundary_heldout.py: the same seed draws the same configs in the same order)."""
    import boundary_heldout as sweep

    from vram_planner.units import GiB

    needs = json.loads((RESULTS.parent / "boundary-heldout-needs.json").read_text())["points"]
    largest = round(largest_gib * GiB) if largest_gib else sweep.largest_card()
    return [(label, model, settings, needs.get(f"{model} {sweep.knobs(settings)}", {}).get("allocator_need_bytes"))
            for label, model, settings in sweep.held_out(n, seed, largest)]


def table(points_to_copy: list[tuple[str, str, dict, int | None]]) -> list[str]:
    lines = [f"{'point':40} {'layers':>6} {'traces':>6} {'requests':>9} {'aligned':>7} {'other':>6} {'seconds':>7} "
             f"{'KiB':>5} {'make s':>6} {'replay s':>8}  on the need"]
    exact = 0
    for label, model, settings, need_bytes in points_to_copy:
        config = config_of(model)
        start = time.perf_counter()
        try:
            copy = copied(config, settings)
        except ValueError as exc:
            lines.append(f"{label:40} no copy: {exc}")
            print(lines[-1], file=sys.stderr)
            continue
        seconds = time.perf_counter() - start
        fresh = with_workspaces(repeated_stream([Event(*e) for e in traced_events(config, settings)]), workspace())
        aligned, other = request_for_request(renumbered([tuple(e) for e in copy.stream.events]),
                                             renumbered([tuple(e) for e in fresh.events]))
        exact += aligned and not other
        if need_bytes is None:
            replay_seconds, need = float("nan"), "no committed need"
        else:
            at_need, below, replay_seconds = verdicts(copy.stream, settings, need_bytes)
            need = ("runs" if at_need else "OUT") + (", out a granule below" if below else ", runs a granule below")
        depth = text_config(config)["num_hidden_layers"]
        lines.append(f"{label:40} {f'{copy.shallow_layers}->{depth}':>6} {copy.traces:6d} {len(fresh.events):9d} "
                     f"{'yes' if aligned else 'NO':>7} {other:6d} {seconds:7.0f} {copy.template_bytes / 1024:5.0f} "
                     f"{copy.make_seconds:6.2f} {replay_seconds:8.2f}  {need}")
        print(lines[-1], file=sys.stderr)
    return [*lines, f"{exact} of {len(points_to_copy)} points' streams made exactly from shallow traces at short "
                    "lengths"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="*",
                        help="grid labels (default: the grid's window, its points > 1%% under, the held-out windows)")
    add_draw_arguments(parser)
    args = parser.parse_args()
    try:
        chosen = drawn(args.held_out, args.seed, args.largest_gib) if args.held_out else cases(args.points)
    except ValueError as exc:
        parser.error(str(exc))
    text = "\n".join(table(chosen))
    print(text)
    if args.held_out:
        write_draws_table("copy_at_boundary", args, text)
    elif not args.points:
        RESULTS.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
