"""The analytic model of `plan`/`check` against the trace engine, over a grid: relative error per phase and peak.

    python benchmarks/accuracy.py                 # the whole grid, about 15 minutes on 2 cores
    python benchmarks/accuracy.py --models SmolLM2-135M --quick

Relative error is (analytic - trace) / trace on tensor bytes (no CUDA context, no allocator reserve). Traces are
cached in benchmarks/results/accuracy-traces.json, keyed by the point and the versions of torch, transformers, TRL
and the tracing code (its syntax, not its comments), so changing the analytic model re-runs in seconds. Writes accuracy.txt (the table),
accuracy.json and accuracy.png (errors per phase and point) next to the cache.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.calibration import default_calibration
from vram_planner.model.phases import TENSOR_COMPONENTS, estimate
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.trl_releases import trl_release
from vram_planner.probe.fit import ProbePoint
from vram_planner.tracing.step import engine_versions
from vram_planner.units import GiB

ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = ROOT / "profiles" / "models"
RESULTS = ROOT / "benchmarks" / "results"
# Vocabularies from 32k to 262k; GQA from 9/3 to 14/2 and 32/8, MQA (4/1); qk-norm, biases, Gemma norms, tied or not.
MODELS = ("SmolLM2-135M", "Qwen2.5-0.5B", "Qwen3-0.6B", "Llama-3.2-1B", "gemma-3-1b-it", "Mistral-7B-v0.3")
CAPACITY = 80 * GiB  # only vLLM's reservation depends on it, and the grid does not use vLLM
SHORT = {"weights": "W", "reference_weights": "R", "gradients": "G", "optimizer_states": "O", "kv_cache": "KV",
         "activations": "A", "lm_head_buffers": "H"}
PHASES = ("generation", "scoring", "training", "optimizer")


def grid(models: list[str], quick: bool) -> list[ProbePoint]:
    """Full and LoRA, checkpointing on and off, short and long completions, one or four sequences per micro-batch."""
    points = []
    completions = (128,) if quick else (128, 512)
    for model, lora, checkpointing, completion, batch in itertools.product(
            models, (None, 16), (True, False), completions, (1, 4)):
        # B=1 takes two micro-batches per generation round for a group of two completions (gradients accumulate).
        train = TrainingConfig(per_device_train_batch_size=batch, num_generations=max(batch, 2),
                               gradient_accumulation_steps=max(2 // batch, 1), max_completion_length=completion,
                               gradient_checkpointing=checkpointing, lora_r=lora)
        points.append(ProbePoint(model, train))
    return points


def extras(models: list[str]) -> list[ProbePoint]:
    """Scoring passes (reference model, old log-probs with S=2), bfloat16 weights, eager attention, long prompts."""
    base = {"per_device_train_batch_size": 4, "num_generations": 4}
    variants = [{"beta": 0.04}, {"beta": 0.04, "lora_r": 16}, {"steps_per_generation": 2},
                {"dtype": "bfloat16"}, {"dtype": "bfloat16", "lora_r": 16},
                {"attn_implementation": "eager", "max_completion_length": 128},
                {"max_prompt_length": 1024, "max_completion_length": 128}]
    return [ProbePoint(model, TrainingConfig(**base, **v)) for model in models for v in variants]


def trace_key() -> str:
    """Versions and tracing code a cached trace depends on."""

    digest = hashlib.sha256()
    for path in sorted((ROOT / "vram_planner" / "tracing").glob("*.py")):
        digest.update(_code_only(path.read_text()).encode())
    versions = "/".join(f"{package} {version}" for package, version in engine_versions().items())
    return f"{versions} / tracing {digest.hexdigest()[:12]}"


def _code_only(source: str) -> str:
    """The module's syntax tree without docstrings (comments are not in it): what a trace depends on."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def load_cache(path: Path, key: str) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data.get("points", {}) if data.get("key") == key else {}


def save_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        tmp.write(text)
    os.chmod(tmp.name, 0o644)
    os.replace(tmp.name, path)


def traced(point: ProbePoint, cache: dict) -> dict:
    if point.label not in cache:
        from vram_planner.tracing.step import trace_step

        config = json.loads((MODELS_DIR / f"{point.model}.json").read_text())
        result = trace_step(config, point.train, trl_release())
        cache[point.label] = {"seconds": result.seconds, "peak_bytes": result.peak_bytes,
                              "phases": {p.name: {"bytes": p.peak_bytes, "moment": p.moment,
                                                  "components": p.components} for p in result.phases}}
    return cache[point.label]


def compare(point: ProbePoint, trace: dict) -> dict:
    config = json.loads((MODELS_DIR / f"{point.model}.json").read_text())
    arch = ModelArchitecture.from_config(config, name=point.model)
    cal = default_calibration()
    analytic = estimate(arch, point.train, trl_release(), cal, CAPACITY)
    phases = {}
    for p in analytic.phases:
        if p.name not in trace["phases"]:
            continue
        t = trace["phases"][p.name]
        phases[p.name] = {"trace": t["bytes"], "analytic": p.tensor_bytes,
                          "error": (p.tensor_bytes - t["bytes"]) / t["bytes"],
                          "moments": [t["moment"], p.moment],
                          "components": {c: [t["components"].get(c, 0), p.components.get(c, 0.0)]
                                         for c in TENSOR_COMPONENTS}}
    peak_error = (analytic.tensor_peak_bytes - trace["peak_bytes"]) / trace["peak_bytes"]
    return {"point": point.label, "seconds": trace["seconds"], "trace_peak": trace["peak_bytes"],
            "analytic_peak": analytic.tensor_peak_bytes, "peak_error": peak_error, "phases": phases}


def table(rows: list[dict], components: bool) -> list[str]:
    lines = [f"{'point':<84}" + "".join(f"{p[:5]:>8}" for p in PHASES) + f"{'peak':>8}{'trace GiB':>10}"]
    for row in rows:
        cells = "".join(f"{row['phases'][p]['error']:>+8.1%}" if p in row["phases"] else f"{'':>8}" for p in PHASES)
        lines.append(f"{row['point']:<84}{cells}{row['peak_error']:>+8.1%}{row['trace_peak'] / GiB:>10.3f}")
        if components:
            for name, phase in row["phases"].items():
                parts = "  ".join(f"{SHORT[c]} {t / GiB:.3f}/{a / GiB:.3f}" for c, (t, a) in phase["components"].items()
                                  if t or a)
                lines.append(f"    {name:<11} trace/analytic GiB: {parts}   [{phase['moments'][0]} | "
                             f"{phase['moments'][1]}]")
    return lines


def summary(rows: list[dict]) -> list[str]:
    lines = ["", "|relative error| of the analytic model against the trace (tensor bytes):",
             f"  {'':<11}{'median':>8}{'mean':>8}{'worst':>9}{'within 3%':>11}{'points':>8}"]
    for phase in [*PHASES, "peak"]:
        errors = [r["peak_error"] if phase == "peak" else r["phases"][phase]["error"]
                  for r in rows if phase == "peak" or phase in r["phases"]]
        if not errors:
            continue
        absolute = [abs(e) for e in errors]
        within = sum(a <= 0.03 for a in absolute)
        lines.append(f"  {phase:<11}{statistics.median(absolute):>8.2%}{statistics.mean(absolute):>8.2%}"
                     f"{max(errors, key=abs):>+9.2%}{within:>7}/{len(errors):<3}{len(errors):>8}")
    seconds = [r["seconds"] for r in rows]
    lines.append(f"trace wall time per point: median {statistics.median(seconds):.1f} s, max {max(seconds):.1f} s "
                 "(2 cores)")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4.5))
    markers = {"generation": "o", "scoring": "s", "training": "^", "optimizer": "x"}
    for phase, marker in markers.items():
        xs = [i for i, r in enumerate(rows) if phase in r["phases"]]
        ax.scatter(xs, [100 * rows[i]["phases"][phase]["error"] for i in xs], marker=marker, label=phase, s=18)
    ax.plot(range(len(rows)), [100 * r["peak_error"] for r in rows], color="black", lw=0.8, label="peak")
    for bound in (-3, 3):
        ax.axhline(bound, color="grey", ls="--", lw=0.7)
    ax.set_xlabel("grid point (see accuracy.txt for the order)")
    ax.set_ylabel("analytic vs trace, % of traced bytes")
    ax.set_title("vram-plan analytic model against the trace engine")
    ax.legend(ncol=5, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--quick", action="store_true", help="short completions only, no extras")
    parser.add_argument("--components", action="store_true", help="print the per-component split too")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the results (default: %(default)s)")
    args = parser.parse_args()
    points = grid(args.models, args.quick) + ([] if args.quick else extras(args.models[:2]))
    cache_path = args.out / "accuracy-traces.json"
    key = trace_key()
    cache = load_cache(cache_path, key)
    rows = []
    for n, point in enumerate(points, 1):
        fresh = point.label not in cache
        rows.append(compare(point, traced(point, cache)))
        if fresh:
            print(f"[{n}/{len(points)}] traced {point.label} in {cache[point.label]['seconds']:.1f} s",
                  file=sys.stderr, flush=True)
            save_atomically(cache_path, json.dumps({"key": key, "points": cache}, indent=1))
    lines = table(rows, args.components) + summary(rows) + [f"traced with {key}"]
    print("\n".join(lines))
    if not args.quick and args.models == list(MODELS):
        save_atomically(args.out / "accuracy.txt", "\n".join(table(rows, False) + summary(rows)
                                                             + [f"traced with {key}"]) + "\n")
        save_atomically(args.out / "accuracy.json", json.dumps(rows, indent=1))
        plot(rows, args.out / "accuracy.png")


if __name__ == "__main__":
    main()
