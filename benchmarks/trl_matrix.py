"""The trace under every (TRL, transformers) pair people run, beside the analytic model of the same pair.

    python benchmarks/trl_matrix.py [--venvs DIR] [--build] [--pair 0.14.0/4.52.4 ...]   # all pairs: the table
    python benchmarks/trl_matrix.py --build-only --pair 0.14.0/4.52.4 ...                 # only the environments
    python benchmarks/trl_matrix.py --measure                                             # the installed pair only
    python benchmarks/trl_matrix.py --analytic                                            # re-judge the committed traces

Each pair runs in a virtual environment of its own (DIR/trl-X-transformers-Y, DIR .release-venvs of this checkout by
default; `--build` makes the missing ones with
pip: the pinned CPU torch, the pair, the accelerate and PEFT releases of its time, this checkout with --no-deps). In
each, `--measure` traces the grid (fixture configs, and the seeds' Llama-3.2-1B-Instruct step) under the installed
libraries and computes the analytic model under the same --trl-version and --transformers-version; this script
gathers the answers into benchmarks/results/trl_matrix.json and prints the table: per phase the traced and analytic
tensor peaks and the error ((analytic - trace) / trace), and the largest single allocation of the step (the request
an out-of-memory error names). A pair that does not install or does not trace is a row with its error. CI runs the
installed pair through the test suite; this runs the rest.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's model, wherever another one is installed (a pair's venv has this one)
RESULTS = ROOT / "benchmarks" / "results" / "trl_matrix.json"
TABLE = ROOT / "benchmarks" / "results" / "trl_matrix.txt"
FIXTURES = ROOT / "tests" / "fixtures"
DEFAULT_VENVS = ROOT / ".release-venvs"  # the README's test set-up builds the two pairs the suite traces here
TORCH = "torch==2.13.0"  # the CPU wheel the project pins (constraints.txt)
# (TRL, transformers, accelerate, PEFT): each TRL row of profiles/trl.toml with the transformers of its time (the
# newest before the TRL wheel, benchmarks/results/trl_releases.json), and TRL 0.14 with the transformers that
# stopped honouring its num_logits_to_keep (4.52). accelerate and PEFT: releases of the same months. The releases
# between them that the trace accepts (0.18.2, 0.20.0, 0.22.2, 0.25.1, 0.27.1, 0.28.0, 1.5.1, 1.13.0, 1.15.0) run with
# the transformers, accelerate and PEFT of the pair next to them.
# Then pairs across the generations, which the trace refuses up front (vram_planner/tracing/support.py): TRL 0.14's
# GRPOTrainer does not import under transformers 5, and TRL 1.16 under 4.57 would be traced with 5.x's row.
PAIRS = (
    ("0.14.0", "4.48.2", "1.3.0", "0.14.0"),
    ("0.14.0", "4.52.4", "1.3.0", "0.14.0"),
    ("0.14.0", "4.57.3", "1.3.0", "0.17.1"),
    ("0.15.2", "4.49.0", "1.4.0", "0.14.0"),
    ("0.16.1", "4.50.3", "1.6.0", "0.15.2"),
    ("0.17.0", "4.51.3", "1.6.0", "0.15.2"),
    ("0.18.2", "4.52.4", "1.3.0", "0.14.0"),
    ("0.19.1", "4.53.1", "1.8.1", "0.15.2"),
    ("0.20.0", "4.55.0", "1.10.0", "0.17.0"),
    ("0.21.0", "4.55.0", "1.10.0", "0.17.0"),
    ("0.22.2", "4.56.2", "1.10.1", "0.17.1"),
    ("0.23.1", "4.56.2", "1.10.1", "0.17.1"),
    ("0.25.1", "4.57.3", "1.12.0", "0.18.0"),
    ("0.26.2", "4.57.3", "1.12.0", "0.18.0"),
    ("0.27.1", "4.57.3", "1.12.0", "0.18.0"),
    ("0.28.0", "5.3.0", "1.13.0", "0.18.1"),
    ("0.29.1", "5.3.0", "1.13.0", "0.18.1"),
    ("1.0.0", "5.4.0", "1.13.0", "0.18.1"),
    ("1.5.1", "5.4.0", "1.13.0", "0.18.1"),
    ("1.12.0", "5.16.1", "1.15.0", "0.21.2"),
    ("1.13.0", "5.16.1", "1.15.0", "0.21.2"),
    ("1.14.2", "5.19.0", "1.15.0", "0.21.2"),
    ("1.15.0", "5.19.0", "1.15.0", "0.21.2"),
    ("1.16.0", "5.24.0", "1.15.0", "0.21.2"),
    ("0.14.0", "5.4.0", "1.13.0", "0.18.1"),
    ("1.16.0", "4.57.3", "1.15.0", "0.18.1"),
)
SHORT = {"per_device_train_batch_size": 2, "num_generations": 2, "max_prompt_length": 16,
         "max_completion_length": 24}
# Small configs that run every phase (beta > 0 scores a reference), full and LoRA, then the seeds' crash: Llama-3.2-1B
# Instruct, bf16 weights and autocast, 1 prompt x 4 generations per micro-batch (TRL 0.14 counts prompts; from 0.15
# the same 4 completions), 4 accumulation steps, 208-token prompts (the 994 positions of its 1.90 GiB request) and
# 786-token completions, no checkpointing. FlashAttention-2 has no CPU kernel: SDPA stands in (the logits do not care).
GRID = (
    ("tiny-llama/full-fp32", str(FIXTURES / "tiny-llama-headdim.json"), {**SHORT, "beta": 0.04}),
    ("tiny-qwen2/lora-bf16", str(FIXTURES / "tiny-qwen2.json"),
     {**SHORT, "lora_r": 8, "dtype": "bfloat16", "mixed_precision": "bf16", "gradient_accumulation_steps": 2}),
    ("Llama-3.2-1B-Instruct/seeds", "Llama-3.2-1B-Instruct",
     {"num_generations": 4, "gradient_accumulation_steps": 4, "max_prompt_length": 208, "max_completion_length": 786,
      "gradient_checkpointing": False, "dtype": "bfloat16", "mixed_precision": "bf16", "attn_implementation": "sdpa"}),
    # LoRA with a reference (the adapter disabled) and two chunks per scoring pass from TRL 0.17 on
    ("Llama-3.2-1B/lora-beta", "Llama-3.2-1B",
     {"num_generations": 4, "gradient_accumulation_steps": 2, "max_completion_length": 512, "lora_r": 16,
      "beta": 0.04, "dtype": "bfloat16", "mixed_precision": "bf16"}),
)


def seeds_batch(trl: str) -> dict:
    """A micro-batch of 4 completions: B=1 prompt under TRL 0.14 (B counts prompts), B=4 from 0.15."""
    return {"per_device_train_batch_size": 1 if trl.startswith("0.14.") else 4}


def point_settings(name: str, settings: dict, trl: str) -> dict:
    """A grid point's knobs under a TRL release (the seeds' micro-batch depends on it)."""
    return {**settings, **seeds_batch(trl)} if name.startswith("Llama-") else settings


def analytic_phases(model: str, settings: dict, trl: str, transformers: str) -> dict:
    """The analytic model's phases under the pair's releases (pure Python: runs in any environment)."""
    from vram_planner import engine
    from vram_planner.model.phases import micro_batch_moments

    context = engine.make_context(model, "rtx3080-mobile", trl_version=trl)
    train = engine.make_training(context, {**settings, "transformers_version": transformers})
    phases = {p.name: p for p in engine.judge(context, train).estimate.phases}
    if "training" in phases:
        # the moment of the most tensors, as the trace's peak is: the estimate's is the one that needs the most,
        # which may be another where the allocator strands a block at it (the LM head's backward of TRL 0.15-1.14)
        moments = micro_batch_moments(context.arch, train, context.release, context.calibration, first=False)
        phases["training"] = max(moments, key=lambda moment: moment.tensor_bytes)
    return phases


def phase_figures(trace_bytes: int, moment: str, components: dict, analytic) -> dict:
    """One phase's row of the results: the trace's figures beside the analytic model's (None: no such phase)."""
    from vram_planner.model.phases import TENSOR_COMPONENTS

    return {"trace": trace_bytes, "moment": moment,
            "analytic": round(analytic.tensor_bytes) if analytic is not None else None,
            "components": {c: [components.get(c, 0),
                               round(analytic.components.get(c, 0)) if analytic is not None else None]
                           for c in TENSOR_COMPONENTS}}


def measure_installed() -> dict:
    """Trace the grid under the installed pair; the analytic model under the same releases."""
    from vram_planner import engine
    from vram_planner.errors import VramPlanError
    from vram_planner.profiles import model_config
    from vram_planner.tracing.step import engine_versions, trace_step

    versions = engine_versions()
    points = {}
    for name, model, settings in GRID:
        settings = point_settings(name, settings, versions["trl"])
        print(f"  tracing {name}", file=sys.stderr, flush=True)
        try:
            context = engine.make_context(model, "rtx3080-mobile", trl_version=versions["trl"])
            train = engine.make_training(context, {**settings, "transformers_version": versions["transformers"]})
            config, _, _ = model_config(model)
            start = time.perf_counter()
            traced = trace_step(config, train, context.release)
            seconds = time.perf_counter() - start
            analytic = analytic_phases(model, settings, versions["trl"], versions["transformers"])
        except VramPlanError as error:
            points[name] = {"error": str(error)}
            continue
        largest = max((e for e in traced.events if e.kind == "alloc"), key=lambda e: e.size_bytes)
        points[name] = {
            "seconds": round(seconds, 1),
            "largest_request": {"bytes": largest.size_bytes, "phase": largest.phase, "moment": largest.moment},
            "phases": {p.name: phase_figures(p.peak_bytes, p.moment, p.components, analytic.get(p.name))
                       for p in traced.phases}}
    return {"versions": versions, "points": points}


def reanalyse(results: dict) -> dict:
    """The committed traces with the analytic column recomputed by this checkout's model under each pair's
    releases."""
    grid = {name: (model, settings) for name, model, settings in GRID}
    for key, result in results.items():
        trl, transformers = key.split("/")
        for name, point in result.get("points", {}).items():
            if "error" in point:
                continue
            model, settings = grid[name]
            analytic = analytic_phases(model, point_settings(name, settings, trl), trl, transformers)
            point["phases"] = {
                phase: phase_figures(f["trace"], f["moment"], {c: v[0] for c, v in f["components"].items()},
                                     analytic.get(phase))
                for phase, f in point["phases"].items()}
    return results


# What a TRL release imports without requiring it, installed in its environment so that the trace runs (without it
# the trace refuses the release in one line, as a real run fails), and why; the table says so in the pair's rows
IMPORTED_UNREQUIRED = {
    "1.15.0": {"triton": "its fused LM head imports triton unconditionally (its import needs no GPU)"},
    "0.28.0": {"weave": "it asks transformers whether weave is installed, and from transformers 5.3 the answer is a "
                        "tuple, true without weave, so its callbacks import it (a run without weave fails the same "
                        "way: vram_planner/tracing/step.py UNREQUIRED_IMPORTS)"},
}


def venv_of(venvs: Path, trl: str, transformers: str) -> Path:
    return venvs / f"trl-{trl}-transformers-{transformers}"


def build(venv: Path, trl: str, transformers: str, accelerate: str, peft: str) -> None:
    """A virtual environment with the pair (pip, as a user installs it) and this checkout."""
    pip = [str(venv / "bin" / "pip"), "install", "-q"]
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([*pip, TORCH], check=True)
    # requests: TRL 1.0 imports it without requiring it
    subprocess.run([*pip, f"trl=={trl}", f"transformers=={transformers}", f"accelerate=={accelerate}",
                    f"peft=={peft}", "requests", "pydantic", "rich", "click", "pyyaml", "packaging",
                    *IMPORTED_UNREQUIRED.get(trl, {})], check=True)
    subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True)


def run_pair(venvs: Path, pair: tuple[str, str, str, str], make: bool) -> dict:
    trl, transformers = pair[:2]
    venv = venv_of(venvs, trl, transformers)
    python = venv / "bin" / "python"
    try:
        if not python.exists():
            if not make:
                return {"error": f"no virtual environment at {venv} (--build makes it)"}
            build(venv, *pair)
        done = subprocess.run([str(python), str(Path(__file__).resolve()), "--measure"], capture_output=True,
                              text=True, cwd=ROOT, timeout=1800)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return {**json.loads(done.stdout), **({"installed_unrequired": IMPORTED_UNREQUIRED[trl]}
                                          if trl in IMPORTED_UNREQUIRED else {})}


def table(results: dict) -> str:
    """One line per pair, config and phase: trace, analytic (MiB: the fixtures are a few), error; the step's
    largest request."""
    mib = 2 ** 20
    lines = [f"{'TRL':8} {'transformers':12} {'config':28} {'phase':10} {'trace':>9} {'analytic':>9} {'error':>8}  "
             "largest request (MiB, where)"]
    for key, result in results.items():
        trl, transformers = key.split("/")
        if "error" in result:
            lines.append(f"{trl:8} {transformers:12} error: {result['error']}")
            continue
        for package, why in result.get("installed_unrequired", {}).items():
            lines.append(f"{trl:8} {transformers:12} {package} installed, which TRL {trl} does not require: {why}")
        for name, point in result["points"].items():
            if "error" in point:
                lines.append(f"{trl:8} {transformers:12} {name:28} error: {point['error']}")
                continue
            request = point["largest_request"]
            where = f"{request['bytes'] / mib:.1f} ({request['phase']}: {request['moment']})"
            for i, (phase, figures) in enumerate(point["phases"].items()):
                analytic = figures["analytic"]
                error = f"{(analytic - figures['trace']) / figures['trace']:+.1%}" if analytic else "n/a"
                lines.append(f"{trl:8} {transformers:12} {name:28} {phase:10} {figures['trace'] / mib:9.1f} "
                             f"{(analytic or 0) / mib:9.1f} {error:>8}  {where if i == 0 else ''}".rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="trace the grid under the installed pair (JSON)")
    parser.add_argument("--venvs", type=Path, default=DEFAULT_VENVS, help="where the per-pair environments live")
    parser.add_argument("--build", action="store_true", help="make the missing environments with pip")
    parser.add_argument("--build-only", action="store_true",
                        help="make the missing environments of the chosen pairs and stop (no tracing, no results)")
    parser.add_argument("--pair", action="append", default=[], metavar="TRL/TRANSFORMERS",
                        help="only these pairs (repeatable); the results file keeps the others")
    parser.add_argument("--table", action="store_true", help="print the committed results' table (no tracing)")
    parser.add_argument("--analytic", action="store_true",
                        help="recompute the analytic column of the committed traces here (no tracing, no venvs)")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(RESULTS.read_text())["pairs"]))
        return 0
    if args.measure:
        print(json.dumps(measure_installed()))
        return 0
    chosen = [p for p in PAIRS if not args.pair or f"{p[0]}/{p[1]}" in args.pair]
    unknown = sorted(set(args.pair) - {f"{p[0]}/{p[1]}" for p in PAIRS})
    if unknown:
        parser.error(f"no pair {', '.join(unknown)} in the matrix (TRL/transformers, as --table lists them)")
    if args.build_only:
        for pair in chosen:
            venv = venv_of(args.venvs, *pair[:2])
            if not (venv / "bin" / "python").exists():
                print(f"building TRL {pair[0]} with transformers {pair[1]} in {args.venvs}", file=sys.stderr, flush=True)
                build(venv, *pair)
        return 0
    results = json.loads(RESULTS.read_text())["pairs"] if RESULTS.exists() else {}
    if args.analytic:
        results = reanalyse(results)
    for pair in chosen if not args.analytic else ():
        print(f"TRL {pair[0]} with transformers {pair[1]}", file=sys.stderr, flush=True)
        results[f"{pair[0]}/{pair[1]}"] = run_pair(args.venvs, pair, args.build)
    ordered = {f"{p[0]}/{p[1]}": results[f"{p[0]}/{p[1]}"] for p in PAIRS if f"{p[0]}/{p[1]}" in results}
    RESULTS.write_text(json.dumps({"grid": [[n, m if "/" not in m else Path(m).name, s] for n, m, s in GRID],
                                   "pairs": ordered}, indent=1) + "\n")
    text = table(ordered)
    TABLE.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
