"""Does the boundary fit generalize? boundary.py's comparison on random configs the reserve was never fitted on.

    python benchmarks/boundary_heldout.py --held-out 32 --seed 0    # a trace and a bisection each: ~10 minutes
    python benchmarks/boundary_heldout.py --held-out 32 --seed 0 --largest-gib 24   # where most users train
    python benchmarks/boundary_heldout.py --held-out 16 --seed 1 --largest-gib 24 --qlora   # LoRA over 4-bit weights
    python benchmarks/boundary_heldout.py --recheck "SmolLM2-135M fp32 full" "phi-2 lora c256 B128"
    python benchmarks/boundary_heldout.py --from-results   # every committed sweep's points, the analytic side only

The analytic reserve (benchmarks/reserve_fit.py) was fitted on the 112 points of boundary.py's grid and is judged
there; a user's config is rarely one of them. Here N configs are drawn with a seeded generator over the knobs users
set (catalog models up to ~3B parameters and at most MAX_LARGE Mistral-7B points; dtype, LoRA rank or full fine-tuning,
the batch, num_generations dividing the generation batch as TRL requires, accumulation, steps_per_generation, prompt and
completion lengths, beta, the optimizer, gradient checkpointing, attention and the allocator's expandable segments),
none equal to a grid point. A draw is skipped (and another drawn) when TRL would refuse it, when prompt and completion
are longer than the model's positions, when no catalog card holds its analytic peak (nobody runs it), or when its
trace would take more than MAX_TRACE_SECONDS (estimated from its layers and the passes the trace runs). Each is judged
as boundary.py judges its grid: the need bisected with `check --exact`, beside the analytic peak and the capacity from
which `check` says "fits". Nothing is refitted to these points. `--largest-gib G` keeps only the draws whose analytic
peak is at most G GiB: the consumer cards most users have (16 GB laptops, 24 GB desktops), which the whole catalog's
draws, up to the H200's 141 GB, rarely reach.

Needs are cached in benchmarks/results/boundary-heldout-needs.json (keyed by boundary.py's need key, each point by its
model and knobs); the table and the summary go to boundary-heldout.txt and .json (another seed's to
boundary-heldout-seedS.txt and .json; with --largest-gib G, boundary-heldout-Ggib-seedS).

--recheck re-bisects points of boundary.py's grid with the current code and sets each need beside the committed one in
boundary-needs.json, whose key may name older tracing and allocator code (boundary.py --from-needs uses it as it is);
writes boundary-recheck.txt.

--from-results traces nothing: it judges the points of every committed sweep (boundary-heldout*.json; those over
4-bit weights against their own needs file, with a summary of their own) against their committed needs with the
current analytic model, as boundary.py --from-needs judges the grid, so that a change to the
analytic model is judged on the held-out points in seconds (a new draw of the same seed may name other points: the
skips depend on the analytic peaks). It writes each sweep's table again, and boundary-heldout-rejudged.txt: each
sweep's summary, all of them together, and the points more than 1% under their needs.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import sys
from pathlib import Path

from accuracy import load_cache, save_atomically
from boundary import (MODELS, RESULTS, exact, heaviest_prompt, need_key, points, row, shorter_need, summary, table,
                      traced_release)

from vram_planner.model.spec import training_config
from vram_planner.units import GiB, MiB

# Catalog models up to ~3B parameters, one per architecture and size (an -Instruct variant has its base's shapes)
SMALL = ("SmolLM2-135M", "SmolLM2-360M", "SmolLM2-1.7B", "Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-3B", "Qwen3-0.6B",
         "Qwen3-1.7B", "Llama-3.2-1B", "Llama-3.2-3B", "DeepSeek-R1-Distill-Qwen-1.5B", "gemma-2-2b",
         "gemma-3-1b-it", "phi-2")
LARGE = "Mistral-7B-v0.3"
MAX_LARGE = 2  # its traces take the longest (up to 36 s on the grid's machine)
LARGE_SHARE = 0.1  # of the draws
# The slowest grid point per decoder layer and traced pass (Mistral-7B's accumulating, reference-scored step: 36.3 s
# over 32 layers x 3 passes), doubled for a machine shared with other work
SECONDS_PER_LAYER_PASS = 0.8
MAX_TRACE_SECONDS = 180.0
BATCHES = (1, 2, 4, 8, 16, 32, 64)
ACCUMULATION = (1, 1, 2, 4)
PROMPTS = (64, 128, 256, 512, 1024)
COMPLETIONS = (128, 8192)  # drawn log-uniform between, in multiples of 64
BETAS = (0.01, 0.04, 0.1)
LORA_RANKS = (8, 16, 32, 64)
MAX_DRAWS = 1000  # per point: a generator that cannot find a valid config is a bug, not a long wait


def draw(rng: random.Random, large_allowed: bool, qlora: bool = False) -> tuple[str, dict]:
    """One (model, settings) with every knob set; TRL's divisibility rule holds by construction. `qlora`: LoRA over
    4-bit weights, every other knob drawn as before."""
    model = LARGE if large_allowed and rng.random() < LARGE_SHARE else rng.choice(SMALL)
    batch, accumulation = rng.choice(BATCHES), rng.choice(ACCUMULATION)
    spg = rng.choice((None, 2 * accumulation))  # None: one generation per optimizer step, TRL's default
    generation_batch = batch * (spg or accumulation)
    # Groups of 4 to 16 where the generation batch allows (GRPO compares completions within a group), else 2
    generations = rng.choice([g for g in range(4, 17) if generation_batch % g == 0] or [2])
    completion = 64 * round(2 ** rng.uniform(*(n.bit_length() - 1 for n in COMPLETIONS)) / 64)
    settings = {"dtype": rng.choice(("float32", "bfloat16")),
                "lora_r": rng.choice((None, *LORA_RANKS)),
                "per_device_train_batch_size": batch, "num_generations": generations,
                "gradient_accumulation_steps": accumulation, "steps_per_generation": spg,
                "max_prompt_length": rng.choice(PROMPTS), "max_completion_length": completion,
                "beta": rng.choice((0.0, rng.choice(BETAS))),
                "optim": rng.choice(("adamw_torch_fused", "adamw_8bit")),
                "gradient_checkpointing": rng.random() < 0.5,
                "attn_implementation": rng.choice(("sdpa", "eager")),
                "allocator_conf": rng.choice(("", "expandable_segments:True"))}
    if qlora:
        settings.update(lora_r=rng.choice(LORA_RANKS), load_in_4bit=True)
    return model, settings


def knobs(settings: dict) -> str:
    """The settings in a few words, the point's name in the table and the cache."""
    s = settings
    words = ["fp32" if s["dtype"] == "float32" else "bf16", f"lora{s['lora_r']}" if s["lora_r"] else "full",
             *(["4bit"] if s.get("load_in_4bit") else []),
             f"B{s['per_device_train_batch_size']}", f"G{s['num_generations']}",
             f"A{s['gradient_accumulation_steps']}"]
    words += [f"S{s['steps_per_generation']}"] if s["steps_per_generation"] else []
    words += [f"p{s['max_prompt_length']}", f"c{s['max_completion_length']}"]
    words += [f"beta{s['beta']:g}"] if s["beta"] else []
    words += ["8bit"] if s["optim"] == "adamw_8bit" else []
    words += [] if s["gradient_checkpointing"] else ["nogc"]
    words += ["eager"] if s["attn_implementation"] == "eager" else []
    words += ["expandable"] if s["allocator_conf"] else []
    return " ".join(words)


def point_label(model: str, settings: dict) -> str:
    """A drawn point's name in the needs cache: the model and its knobs."""
    return f"{model} {knobs(settings)}"


def trace_seconds(model: str, settings: dict) -> float:
    """A bound on the trace and bisection's time: the decoder layers times the passes the trace runs (one micro-batch,
    two when gradients accumulate, and the reference model's scoring)."""
    from vram_planner.profiles import model_config

    config = model_config(model)[0]
    layers = config.get("num_hidden_layers") or config.get("text_config", {}).get("num_hidden_layers", 32)
    passes = (2 if settings["gradient_accumulation_steps"] > 1 else 1) + (1 if settings["beta"] else 0)
    return SECONDS_PER_LAYER_PASS * layers * passes


@functools.cache
def positions(model: str) -> int:
    """The model's positions (max_position_embeddings): the trace refuses longer sequences, as the model would."""
    from vram_planner.model.architecture import ModelArchitecture
    from vram_planner.profiles import model_config

    return ModelArchitecture.from_config(model_config(model)[0]).max_position_embeddings or sys.maxsize


def grid_configs() -> set[tuple[str, str]]:
    """boundary.py's grid as (model, validated config): what a held-out point must not be."""
    return {(model, _comparable(training_config(settings))) for _, model, settings in points(list(MODELS), False)}


def _comparable(config) -> str:
    return repr(config)  # every field, defaults included; a TrainingConfig is not hashable (its lists)


def held_out(n: int, seed: int, largest_card_bytes: int | None = None,
             qlora: bool = False) -> list[tuple[str, str, dict]]:
    """(label, model, settings) for n configs drawn with `seed` (`qlora`: over 4-bit weights): valid for TRL, off the
    grid, and (with `largest_card_bytes`) on some card by the analytic peak, none whose trace would exceed
    MAX_TRACE_SECONDS."""
    from vram_planner.errors import ConfigError

    rng, grid, out, large = random.Random(seed), grid_configs(), [], 0
    for _ in range(n):
        for _ in range(MAX_DRAWS):
            model, settings = draw(rng, large < MAX_LARGE, qlora)
            label = point_label(model, settings)
            try:  # TRL's rules, then the model's (gemma-2 has no SDPA attention in transformers 5)
                config = training_config(settings)
                peak = _analytic_peak(model, settings) if largest_card_bytes else 0
            except ConfigError:
                continue
            if ((model, _comparable(config)) in grid or label in {o[0] for o in out}
                    or config.sequence_length > positions(model)
                    or trace_seconds(model, settings) > MAX_TRACE_SECONDS or peak > (largest_card_bytes or 0)):
                continue
            large += model == LARGE
            out.append((label, model, settings))
            break
        else:
            raise RuntimeError(f"no valid config in {MAX_DRAWS} draws")
    return out


def _analytic_peak(model: str, settings: dict) -> int:
    from boundary import CARD

    from vram_planner import engine
    from vram_planner.model.calibration import default_calibration

    return engine.check(model, CARD, settings, calibration=default_calibration()).estimate.peak_bytes


def largest_card() -> int:
    from vram_planner.profiles import gpu_catalog

    return max(gpu.capacity_bytes for gpu in gpu_catalog().values())


def needs_path(qlora: bool = False) -> Path:
    """The held-out sweeps' needs: the 4-bit sweeps' apart, as their tables are (their reserve is not fitted)."""
    return RESULTS / ("boundary-heldout-qlora-needs.json" if qlora else "boundary-heldout-needs.json")


def sweep(n: int, seed: int, largest_gib: float | None = None, qlora: bool = False) -> list[str]:
    path = needs_path(qlora)
    key = need_key()
    cache = load_cache(path, key)
    rows, chosen = [], held_out(n, seed, round(largest_gib * GiB) if largest_gib else largest_card(), qlora)
    for i, (label, model, settings) in enumerate(chosen, 1):
        known = set(cache)
        try:
            rows.append(judged(f"h{i:02d} {model}", model, settings, cache, trace=True))
        except Exception as exc:  # a point the engines cannot run is reported, not fatal to the sweep
            print(f"[{i}/{n}] {label}: {exc}", file=sys.stderr, flush=True)
            continue
        for name in sorted(set(cache) - known):
            print(f"[{i}/{n}] {name}: need bisected in {cache[name]['seconds']:.1f} s", file=sys.stderr, flush=True)
        if set(cache) != known:
            save_atomically(path, json.dumps({"key": key, "points": cache}, indent=1))
    return save_sweep(rows, n, seed, largest_gib, key, qlora)


def judged(point: str, model: str, settings: dict, cache: dict, trace: bool, release: dict | None = None) -> dict:
    """A drawn point's row: the run's need (a shorter prompt's where that needs more, as on the grid) beside the
    analytic peak, with its knobs; its needs bisected into `cache` where it lacks them and `trace`, else read there;
    the analytic side planned for `release` (boundary.traced_release: the release the needs were traced under)."""
    label = point_label(model, settings)
    traced = exact(model, settings, cache, label) if trace else cache[label]
    planned = {**settings, **(release or {})}
    shorter = shorter_need(label, model, settings, cache, heaviest_prompt(model, planned), trace=trace)
    return {**row(point, model, planned, traced, shorter), "knobs": knobs(settings), "model": model,
            "settings": settings, "binding_phase": traced["binding_phase"]}


def save_sweep(rows: list[dict], n: int, seed: int, largest_gib: float | None, key: str,
               qlora: bool = False) -> list[str]:
    """Write a sweep's table and rows (table_stem names them); returns the table's lines."""
    lines = table(rows)
    lines = [lines[0] + "   knobs", lines[1]] + [f"{line:108}  {r['knobs']}" for line, r in zip(lines[2:], rows)]
    drawn = f"held-out: {n} configs{' over 4-bit weights' if qlora else ''} drawn with seed {seed}"
    drawn += f", analytic peaks up to {largest_gib:g} GiB" if largest_gib else ""
    lines += summary(rows) + [drawn, f"needs from {key}"]
    save_atomically(RESULTS / f"{table_stem(seed, largest_gib, qlora)}.txt", "\n".join(lines) + "\n")
    save_atomically(RESULTS / f"{table_stem(seed, largest_gib, qlora)}.json", json.dumps(rows, indent=1))
    return lines


def table_stem(seed: int, largest_gib: float | None = None, qlora: bool = False) -> str:
    """Seed 0's table keeps its name (the sweep whose points the patterns of 2026-11-28 were read off); another seed's
    sits beside it, a hold-out nothing was read from, and a sweep bounded to consumer cards names its bound; a sweep
    over 4-bit weights says so first."""
    if qlora:
        return f"boundary-heldout-qlora{f'-{largest_gib:g}gib' if largest_gib else ''}-seed{seed}"
    if largest_gib:
        return f"boundary-heldout-{largest_gib:g}gib-seed{seed}"
    return "boundary-heldout" if seed == 0 else f"boundary-heldout-seed{seed}"


def add_draw_arguments(parser: argparse.ArgumentParser) -> None:
    """--held-out N, --seed S and --largest-gib G: for the benchmarks that ask a sweep's first draws (copy_at_boundary,
    kept_copy)."""
    parser.add_argument("--held-out", type=int, metavar="N", help="instead, the first N draws of a held-out sweep")
    parser.add_argument("--seed", type=int, default=0, help="the held-out sweep's seed")
    parser.add_argument("--largest-gib", type=float, metavar="G", help="the held-out sweep's largest analytic peak")


def write_draws_table(benchmark: str, args: argparse.Namespace, text: str) -> None:
    """A table of a sweep's first draws beside the sweep's: <benchmark>-heldout-...-firstN.txt."""
    stem = table_stem(args.seed, args.largest_gib).removeprefix("boundary-")
    (RESULTS / f"{benchmark}-{stem}-first{args.held_out}.txt").write_text(text + "\n")


def recheck(labels: list[str]) -> list[str]:
    """Each grid point's need with the current code beside the committed one."""
    committed = json.loads((RESULTS / "boundary-needs.json").read_text())
    settings_of = {label: (model, settings) for label, model, settings in points(list(MODELS), quick=False)}
    lines = [f"committed needs from {committed['key']}", f"current code: {need_key()}",
             f"{'point':50} {'committed':>10} {'now':>10} {'diff MiB':>9}  binding phase (committed / now)"]
    for label in labels:
        model, settings = settings_of[label]
        now, before = exact(model, settings, {}, label), committed["points"][label]
        need_now, need_before = now["allocator_need_bytes"], before["allocator_need_bytes"]
        lines.append(f"{label:50} {need_before / GiB:10.3f} {need_now / GiB:10.3f} "
                     f"{(need_now - need_before) / MiB:+9.0f}  {before.get('binding_phase')} / {now['binding_phase']}")
    return lines


def committed_sweeps(qlora: bool = False) -> dict[tuple[int, float | None], list[dict]]:
    """The committed sweeps' rows by (seed, largest GiB), as table_stem names their files: the 16-bit sweeps', or
    with `qlora` those over 4-bit weights."""
    sweeps = {}
    for path in sorted(RESULTS.glob("boundary-heldout*.json")):
        found = re.fullmatch(r"boundary-heldout(-qlora)?(?:-([0-9.]+)gib)?(?:-seed(\d+))?", path.stem)
        if found and bool(found.group(1)) == qlora:
            _, largest, seed = found.groups()
            sweeps[(int(seed or 0), float(largest) if largest else None)] = json.loads(path.read_text())
    return sweeps


def rejudged_sweeps(qlora: bool = False) -> tuple[dict[tuple[int, float | None], list[dict]], str]:
    """Every committed sweep's rows (`qlora`: those over 4-bit weights) judged with the current analytic model against
    their committed needs, by (seed, largest GiB); and the key of the code the needs came from."""
    data = json.loads(needs_path(qlora).read_text())
    cache, sweeps, release = data["points"], {}, traced_release(data["key"])
    for found, committed in committed_sweeps(qlora).items():
        sweeps[found] = [judged(before["point"], before["model"], before["settings"], cache, trace=False,
                                release=release) for before in committed]
    return sweeps, data["key"]


def rejudged() -> list[str]:
    """rejudged_sweeps, each sweep's table written again with its rows, the 16-bit sweeps' and then those over
    4-bit weights (whose reserve was not fitted: a summary of their own); returns the summary's lines."""
    lines = []
    for qlora, title in ((False, "all committed sweeps"), (True, "all committed sweeps over 4-bit weights")):
        sweeps, key = rejudged_sweeps(qlora)
        every = []
        for (seed, largest_gib), rows in sweeps.items():
            stem = table_stem(seed, largest_gib, qlora)
            save_sweep(rows, len(rows), seed, largest_gib, key, qlora)
            every += [{**r, "point": f"{stem} {r['point']}"} for r in rows]
            lines += [stem] + summary(rows)[1:] + [""]
        under = [r for r in every if r["error"] < -0.01 or r["window"]]
        lines += ([title] + summary(every)[1:] + ["", "more than 1% under, or a window:"] + table(under)
                  + [f"needs from {key}", ""])
    return lines[:-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held-out", type=int, default=16, metavar="N")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--largest-gib", type=float, metavar="G",
                        help="draw only configs whose analytic peak is at most G GiB (default: the largest card's)")
    parser.add_argument("--recheck", nargs="+", metavar="POINT", help="grid points to re-bisect instead")
    parser.add_argument("--from-results", action="store_true",
                        help="judge the committed sweeps' points against their committed needs, tracing nothing")
    parser.add_argument("--qlora", action="store_true", help="draw LoRA over 4-bit weights (a table of their own)")
    args = parser.parse_args()
    if args.from_results:
        lines = rejudged()
        save_atomically(RESULTS / "boundary-heldout-rejudged.txt", "\n".join(lines) + "\n")
    elif args.recheck:
        lines = recheck(args.recheck)
        save_atomically(RESULTS / "boundary-recheck.txt", "\n".join(lines) + "\n")
    else:
        lines = sweep(args.held_out, args.seed, args.largest_gib, args.qlora)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
