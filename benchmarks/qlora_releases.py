"""4-bit QLoRA steps traced under the TRL releases that set a quantized model up differently, beside the analytic model.

    python benchmarks/qlora_releases.py                          # every built pair of PAIRS (trl_matrix's venvs)
    python benchmarks/qlora_releases.py --pair 0.23.1/4.56.2     # some of them; the results file keeps the others
    python benchmarks/qlora_releases.py --measure                # the installed pair only (JSON)
    python benchmarks/qlora_releases.py --table                  # the committed results

TRL has set a 4-bit model up for LoRA three ways (TrlRelease.qlora_setup): before 0.22 get_peft_model alone (PEFT's
float32 adapters), 0.22-0.25 PEFT's prepare_model_for_kbit_training first (every unquantized weight to float32, then
under bf16 the embedding and LM head back to bfloat16), from 0.26 the adapters cast to bfloat16. The environments are
trl_matrix.py's (`python benchmarks/trl_matrix.py --build-only --pair 0.23.1/4.56.2`, then `pip install
bitsandbytes` in it). Each point is traced under the installed pair and planned under the same releases; where the
trace fails (TRL 0.22-0.25 under bf16 stop at the first generation: the float32 final norm's output meets the
bfloat16 LM head outside autocast), the row keeps the failure beside the analytic side's refusal. Writes
benchmarks/results/qlora_releases.json and .txt.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from trl_matrix import DEFAULT_VENVS, FIXTURES, analytic_phases, phase_figures, venv_of  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "qlora_releases.json"
TABLE = ROOT / "benchmarks" / "results" / "qlora_releases.txt"
# One pair per set-up (and the tested set's): the last release before prepare_model_for_kbit_training, one that
# calls it, the first that casts the adapters itself under transformers 4, and the tested TRL
PAIRS = ("0.21.0/4.55.0", "0.23.1/4.56.2", "0.26.2/4.57.3", "1.16.0/5.24.0")
QLORA = {"lora_r": 16, "load_in_4bit": True, "dtype": "bfloat16", "per_device_train_batch_size": 8,
         "num_generations": 8, "max_prompt_length": 128, "max_completion_length": 256}
POINTS = (
    ("tiny-qwen2/qlora-bf16", str(FIXTURES / "tiny-qwen2.json"), {**QLORA, "mixed_precision": "bf16"}),
    ("tiny-qwen2/qlora-fp32", str(FIXTURES / "tiny-qwen2.json"), {**QLORA, "mixed_precision": "no"}),
    ("Qwen2.5-0.5B/qlora-bf16", "Qwen2.5-0.5B", {**QLORA, "mixed_precision": "bf16"}),
    ("Qwen2.5-0.5B/qlora-fp32", "Qwen2.5-0.5B", {**QLORA, "mixed_precision": "no"}),
)


def refusal(model: str, settings: dict, trl: str) -> str | None:
    """What `check` says of a config it refuses under this TRL release (None: it plans it)."""
    from vram_planner import engine
    from vram_planner.errors import VramPlanError

    try:
        engine.check(model, "rtx3080-mobile", settings, trl_version=trl)
    except VramPlanError as error:
        return str(error)
    return None


def measure_installed() -> dict:
    """Trace every point under the installed pair; the analytic model, and its refusals, under the same releases."""
    from vram_planner import engine
    from vram_planner.errors import ConfigError, VramPlanError
    from vram_planner.model.spec import training_config
    from vram_planner.model.trl_semantics import release_defaults
    from vram_planner.profiles import model_config
    from vram_planner.tracing.step import engine_versions, trace_step

    versions = engine_versions()
    trl, transformers = versions["trl"], versions["transformers"]
    points = {}
    for name, model, settings in POINTS:
        print(f"  tracing {name}", file=sys.stderr, flush=True)
        settings = {**settings, "transformers_version": transformers}
        context = engine.make_context(model, "rtx3080-mobile", trl_version=trl)
        point: dict = {"refused": None}
        try:
            train = engine.make_training(context, settings)
        except ConfigError as error:  # what check refuses is traced all the same: the run, as TRL runs it
            point["refused"] = str(error)
            train = training_config({**release_defaults(context.release), **settings, "trl_version": trl})
        try:
            traced = trace_step(model_config(model)[0], train, context.release)
        except VramPlanError as error:
            points[name] = {**point, "error": str(error)}
            continue
        analytic = {} if point["refused"] else analytic_phases(model, settings, trl, transformers)
        points[name] = {**point, "phases": {p.name: phase_figures(p.peak_bytes, p.moment, p.components,
                                                                   analytic.get(p.name)) for p in traced.phases}}
    return {"versions": versions, "points": points}


def run_pair(venvs: Path, pair: str) -> dict:
    """The points measured in the pair's environment (this one's where it is the installed pair)."""
    from vram_planner.tracing.step import engine_versions

    python = venv_of(venvs, *pair.split("/")) / "bin" / "python"
    installed = engine_versions()
    if not python.exists() and pair == f"{installed['trl']}/{installed['transformers']}":
        python = Path(sys.executable)
    if not python.exists():
        return {"error": f"no virtual environment at {python.parent.parent} (trl_matrix.py --build-only makes it)"}
    done = subprocess.run([str(python), str(Path(__file__).resolve()), "--measure"], capture_output=True, text=True,
                          cwd=ROOT, timeout=1800)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(done.stdout)


def table(results: dict) -> str:
    mib = 2 ** 20
    lines = [f"{'TRL':8} {'transformers':12} {'config':26} {'phase':10} {'trace':>9} {'analytic':>9} {'error':>8}"]
    for key, result in results.items():
        trl, transformers = key.split("/")
        if "error" in result:
            lines.append(f"{trl:8} {transformers:12} error: {result['error']}")
            continue
        for name, point in result["points"].items():
            if "error" in point:
                said = "refused too" if point["refused"] else "NOT refused"
                failure = point["error"].removeprefix("the trace failed while ").split("; `vram-plan check`")[0]
                lines.append(f"{trl:8} {transformers:12} {name:26} trace: {failure} ({said} by check)")
                continue
            for phase, figures in point["phases"].items():
                analytic = figures["analytic"]
                error = f"{(analytic - figures['trace']) / figures['trace']:+.1%}" if analytic else "n/a"
                lines.append(f"{trl:8} {transformers:12} {name:26} {phase:10} {figures['trace'] / mib:9.1f} "
                             f"{(analytic or 0) / mib:9.1f} {error:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="trace the points under the installed pair (JSON)")
    parser.add_argument("--venvs", type=Path, default=DEFAULT_VENVS)
    parser.add_argument("--pair", action="append", default=[], choices=PAIRS, metavar="TRL/TRANSFORMERS")
    parser.add_argument("--table", action="store_true", help="the committed results' table (no tracing)")
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure_installed()))
        return 0
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if not args.table:
        for pair in args.pair or PAIRS:
            print(f"TRL {pair}", file=sys.stderr, flush=True)
            results[pair] = run_pair(args.venvs, pair)
        results = {pair: results[pair] for pair in PAIRS if pair in results}
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    TABLE.write_text(table(results) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
