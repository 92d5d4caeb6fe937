"""The step-time model against every step time committed so far and against a cited public throughput figure.

    python benchmarks/step_time.py     # prints the tables, writes benchmarks/results/step_time.txt

Inputs, all measured before the step-time model existed (none of its constants was set from them):
1. benchmarks/results/gpu/h100-trl-steps.json: real TRL GRPO runs of two optimizer steps on an H100
   (benchmarks/gpu_steps.py). Their `seconds` is the wall time of the whole run: loading the model, building the
   trainer and TRL's start-up included, and for the first six allocator-history recording too. The prediction is
   two steps, so the difference is start-up; the ranking is what they can check. Runs since issue 30 also time each
   optimizer step (`step_seconds`), and their last step is compared with one predicted step.
2. benchmarks/results/gpu/h100-probe-record.json: probe points on the same H100, two steps each of the probe's
   phases (generation there is the prefill and one decoding step; vram_planner/tracing/phases.py), model building
   included; the first point also warmed the process up (Triton's kernels compiled).
3. benchmarks/results/gpu/h200-step-times.json: TRL GRPO runs of three optimizer steps on an H200 (gpu_steps.py
   --timing, one process, every completion at full length), the last, warm step of each; those of calls 4 and 5
   kept each phase's seconds (generation, training, optimizer). Compared with the priors, then with the factors
   probe/step_fit.py fits to the other configs' times (leave-one-out: a config's own times never set the factors it
   is judged with). The factors fitted to the phases of calls 4 and 5, each run alone on the GPU as a probe measures,
   are the H200's calibration (profiles/calibrations/h200.json); call 1's whole steps, taken in the wake of other
   runs, check it, and so do two 32-step `vram-plan run`s on the same H200 (results/gpu/h200-runs/*/vram-plan-log.jsonl,
   their median step).
4. A public decoding throughput: gpt-fast's README (github.com/pytorch-labs/gpt-fast, "Benchmarks"): Llama-3.1-8B
   in bf16, batch 1, on an A100-80GB power-limited to 330 W, 93.89 tokens/s, against the model's decoding in a
   CUDA-graph engine (its vLLM path; the priors' decode bandwidth efficiency cites gpt-fast's blog, so this row checks
   the bytes per token and the per-step overhead, not that factor).
5. Published GRPO runs that give seconds per optimizer step (benchmarks/data/public_measurements.toml rows with
   `measured_step_seconds`: jsboige/CoursIA's QLoRA probe on laptop and desktop cards, whose figure is the wall time
   of building the trainer and three steps, divided by three), planned on their cards with the priors.
Targets (issue 30): Spearman >= 0.9 over a measured set, median |error| < 15% before calibration, < 10% after.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
from public_measurements import DATA as PUBLIC_DATA
from public_measurements import load_rows, planned

from vram_planner import engine
from vram_planner.files import write_atomically
from vram_planner.model.ranking import timed
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.step_time import Card, Efficiency, efficiency_from, generation_round_seconds, step_time
from vram_planner.probe.step_fit import TimedPhase, fit_step_time, predicted_seconds
from vram_planner.profiles import GpuProfile

ROOT = Path(__file__).resolve().parent
GPU_RESULTS = ROOT / "results" / "gpu"
OUT = ROOT / "results" / "step_time.txt"
CALIBRATIONS = ROOT.parent / "profiles" / "calibrations"
CARD = "h100-80gb"
H200 = "h200"
H200_PHASES = ("generation", "training", "optimizer")
STEPS_PER_RUN = 2  # gpu_steps.py trains max_steps=2; the probe runs each point's step twice
GPT_FAST = {"model": "Llama-3.1-8B", "gpu": "a100-80gb", "tokens_per_second": 93.89,
            "source": "github.com/pytorch-labs/gpt-fast README, Benchmarks: Llama-3.1-8B Base, 8xA100-80GB at 330 W, "
                      "batch 1, 5-token prompts"}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's of the average ranks."""
    return float(pd.Series(a).rank().corr(pd.Series(b).rank()))


def trl_rows() -> list[dict]:
    runs = json.loads((GPU_RESULTS / "h100-trl-steps.json").read_text())["configs"]
    rows = []
    for run in runs:
        if run.get("ran") is False:  # stopped by the memory limit it was given: no step time
            continue
        verdict = engine.check(run["model"], CARD, {k: v for k, v in run["train"].items() if k != "trl_version"})
        if run.get("step_seconds"):  # runs since issue 30 time each step: the last, warm one is compared
            rows.append({"name": f"{run['name']} (step {len(run['step_seconds'])})",
                         "measured": run["step_seconds"][-1], "predicted": timed(verdict).step_seconds})
        else:
            rows.append({"name": run["name"], "measured": run["seconds"],
                         "predicted": STEPS_PER_RUN * timed(verdict).step_seconds})
    return rows


def probe_rows() -> list[dict]:
    record = json.loads((GPU_RESULTS / "h100-probe-record.json").read_text())
    gpu = GpuProfile.from_name(CARD)
    rows = []
    for point in record["points"]:
        train = TrainingConfig(**point["settings"])
        arch = engine.make_context(point["model"], gpu).arch
        work = sum(predicted_seconds(TimedPhase(arch, train, phase, 1.0), gpu, Efficiency())
                   for phase in ("training", "optimizer"))
        # the probe's generation phase: the prefill and one decoding step (the cache between is grown, not decoded)
        generation, _ = generation_round_seconds(arch, train, Card.of(gpu, train), new_tokens=2)
        rows.append({"name": point["label"], "measured": point["seconds"],
                     "predicted": STEPS_PER_RUN * (work + generation)})
    return rows


def h200_runs() -> list[dict]:
    """Each timed run on the H200 with its config as the planner reads it: the settings it ran, at the longest prompt
    of the data (the runs without their own record took the same prompts as their model's other runs)."""
    runs = [r for r in json.loads((GPU_RESULTS / "h200-step-times.json").read_text())["configs"]
            if r.get("step_seconds")]
    prompts = {r["model"]: r["train"]["max_prompt_length"] for r in runs if "train" in r}
    for run in runs:
        verdict = engine.check(run["model"], H200, {**run["settings"], "max_prompt_length": prompts[run["model"]]})
        run["arch"], run["config"] = verdict.context.arch, verdict.train
        run["last_phases"] = {p["phase"]: p["seconds"] for p in run.get("phases", ())
                              if p["step"] == len(run["step_seconds"])}
    return runs


def h200_samples(run: dict) -> list[TimedPhase]:
    """What a probe-style fit reads from a run: its last step's phases where it kept them, else the whole step."""
    phases = run["last_phases"]
    if not phases:
        return [TimedPhase(run["arch"], run["config"], "step", run["step_seconds"][-1])]
    return [replace(sample, seconds=phases[name]) for name, sample in zip(H200_PHASES, phase_samples(run))
            if name in phases]


def phase_samples(run: dict) -> list[TimedPhase]:
    """The run's phases as a probe times them, in the order of H200_PHASES, at one second each: the generation phase
    is the whole round, the prefill and every completion token."""
    arch, train = run["arch"], run["config"]
    return [TimedPhase(arch, train, "decoding", 1.0, train.max_completion_length),
            TimedPhase(arch, train, "training", 1.0), TimedPhase(arch, train, "optimizer", 1.0)]


def h200_predictions(runs: list[dict]) -> dict[str, list[dict]]:
    """Each run's step and phases predicted with the priors, with the factors fitted to the other configs (a repeated
    config left out whole), and with those fitted to every run."""
    gpu = GpuProfile.from_name(H200)
    fitted_all = fit_step_time([s for r in runs for s in h200_samples(r)], gpu)
    predicted: dict[str, list[dict]] = {"priors": [], "leave-one-out": [], "all": []}
    for run in runs:
        others = [s for r in runs if r["name"] != run["name"] for s in h200_samples(r)]
        for key, factors in (("priors", {}), ("leave-one-out", fit_step_time(others, gpu)), ("all", fitted_all)):
            eff = efficiency_from(factors)
            time = step_time(run["arch"], run["config"], gpu, eff)
            # each phase as the probe's fit predicts what was timed (the optimizer phase is optimizer.step() alone:
            # the clip and zero_grad ran outside it)
            phases = {name: predicted_seconds(sample, gpu, eff) for name, sample in zip(
                H200_PHASES, phase_samples(run))}
            predicted[key].append({"step": time.step_seconds, **phases, "factors": factors})
    return predicted


def summary(runs: list[dict], predicted: list[dict]) -> str:
    measured = [r["step_seconds"][-1] for r in runs]
    errors = [abs(p["step"] - m) / m for p, m in zip(predicted, measured)]
    return (f"median |error| {statistics.median(errors):.1%}, Spearman "
            f"{spearman(measured, [p['step'] for p in predicted]):.3f} over {len(runs)}")


def h200_calibration(factors: dict[str, float]) -> str:
    """The H200's calibration: the defaults' memory coefficients (no probe has fitted them on an H200) with the
    step-time factors fitted to the phases of calls 4 and 5, as JSON."""
    cal = json.loads((CALIBRATIONS / "default.json").read_text())
    device = json.loads((GPU_RESULTS / "h200-step-times.json").read_text())["device"]
    cal.update(name="h200-step-times", gpu=H200, measured={k: str(v) for k, v in device.items()}, step_time=factors,
               source="The defaults' memory coefficients; the step-time factors that vram_planner/probe/step_fit.py "
                      "fits to the phases of TRL GRPO steps timed on an H200 (benchmarks/step_time.py, "
                      "benchmarks/results/gpu/h200-step-times.json, calls 4 and 5)")
    return json.dumps(cal, indent=2) + "\n"


def h200_tables(calibration: Path | None = None) -> list[str]:
    """The H200's tables; writes its calibration to `calibration` when given."""
    runs = h200_runs()
    predicted = h200_predictions(runs)
    lines = []
    for key, title in (("priors", "before calibration (the priors)"),
                       ("leave-one-out", "after a probe-style fit to the other configs (leave-one-out)")):
        rows = [{"name": f"{r['name']} (call {r['call']})", "measured": r["step_seconds"][-1], "predicted": p["step"]}
                for r, p in zip(runs, predicted[key])]
        lines += table(f"TRL GRPO optimizer steps on an H200, the last of three, {title}", rows, " s")
        phased = [{"name": f"{r['name']}: {phase}", "measured": r["last_phases"][phase], "predicted": p[phase]}
                  for r, p in zip(runs, predicted[key]) for phase in H200_PHASES if phase in r["last_phases"]]
        lines += table(f"Their phases where kept, {title}", phased, " s")
    # call 1 ran in the wake of the memory-only runs: its steps jump within a run (3.6 to 4.7 s, 4.1 to 8.0 s) and
    # its Qwen2.5-0.5B full took 3.11 s where call 4's took 2.57 s
    kept = [r for r in runs if r["last_phases"]]
    alone = h200_predictions(kept)
    lines += [f"The {len(kept)} runs of calls 4 and 5 alone (phases kept, steady steps): before calibration "
              f"{summary(kept, alone['priors'])}; after, leave-one-out among them {summary(kept, alone['leave-one-out'])}"]
    prompts = {r["model"]: r["config"].max_prompt_length for r in runs}
    lines.append("")
    for label, rows in h200_run_rows(prompts).items():
        lines += table(f"32-step vram-plan runs on the same H200 (median step after the first), {label}", rows, " s")
    factors = predicted["all"][0]["factors"]
    if calibration is not None:
        write_atomically(calibration, h200_calibration(alone["all"][0]["factors"]))
    lines.append("Factors fitted to every H200 run: " + ", ".join(f"{k}={v:g}" for k, v in factors.items())
                 + "; to the phases of calls 4 and 5 (profiles/calibrations/h200.json): "
                 + ", ".join(f"{k}={v:g}" for k, v in alone["all"][0]["factors"].items()) + "; priors: "
                 + ", ".join(f"{k}={getattr(Efficiency(), k):g}" for k in factors))
    return [*lines, ""]


# The GRPOConfig keywords of a run's record that are the planner's knobs under the same names
RUN_KNOBS = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
             "max_completion_length", "beta", "optim", "gradient_checkpointing")


def h200_run_rows(prompts: dict[str, int]) -> dict[str, list[dict]]:
    """The 32-step `vram-plan run`s: the median of their steps after the first (warm-up) against one step predicted
    with the priors and with the H200's calibration, at the longest prompt of the data."""
    gpu, rows = GpuProfile.from_name(H200), {"priors": [], "calibrated": []}
    for folder in sorted((GPU_RESULTS / "h200-runs").glob("*/vram-plan-log.jsonl")):
        logged = [json.loads(line) for line in folder.read_text().splitlines()]
        steps = [r["step_time"] for r in logged[1:] if r.get("step_time")]
        run = json.loads((folder.parent / "vram-plan-run.json").read_text())
        model, grpo = Path(run["model"]).name, run["grpo_config"]
        settings = {**{k: grpo[k] for k in RUN_KNOBS}, "dtype": grpo["model_init_kwargs"]["dtype"],
                    "max_prompt_length": prompts[model],
                    **({"lora_r": run["lora_config"]["r"]} if run.get("lora_config") else {})}
        verdict = engine.check(model, H200, settings)
        for label, eff in (("priors", Efficiency()), ("calibrated", efficiency_from(verdict.context.calibration
                                                                                    .step_time))):
            rows[label].append({"name": f"{folder.parent.name}, {len(steps)} steps",
                         "measured": statistics.median(steps),
                         "predicted": step_time(verdict.context.arch, verdict.train, gpu, eff).step_seconds})
    return rows


def public_rows() -> list[dict]:
    gpu = GpuProfile.from_name(GPT_FAST["gpu"])
    train = TrainingConfig(per_device_train_batch_size=1, num_generations=1, max_prompt_length=5,
                           max_completion_length=2, dtype="bfloat16", mixed_precision="no", use_vllm=True)
    arch = engine.make_context(GPT_FAST["model"], gpu).arch
    card = Card.of(gpu, train)
    one, _ = generation_round_seconds(arch, train, card, vllm_sequences=1, new_tokens=1)
    two, _ = generation_round_seconds(arch, train, card, vllm_sequences=1, new_tokens=2)
    return [{"name": f"{GPT_FAST['model']} decode tok/s, {gpu.label}", "measured": GPT_FAST["tokens_per_second"],
             "predicted": 1 / (two - one)}]


def public_step_rows() -> list[dict]:
    """The published runs that give seconds per optimizer step (benchmarks/data/public_measurements.toml
    `measured_step_seconds`), each planned as the memory table plans it (public_measurements.planned: the tested
    set's transformers where the source names none), with the priors."""
    rows = []
    for row in load_rows(PUBLIC_DATA):
        if "measured_step_seconds" not in row:
            continue
        rows.append({"name": row["id"], "measured": row["measured_step_seconds"],
                     "predicted": timed(planned(row)).step_seconds})
    return rows


def table(title: str, rows: list[dict], unit: str) -> list[str]:
    lines = [title, f"{'config':<62} {'measured':>9} {'predicted':>9} {'error':>8}"]
    for row in rows:
        row["error"] = (row["predicted"] - row["measured"]) / row["measured"]
        lines.append(f"{row['name'][:62]:<62} {row['measured']:>8.2f}{unit} {row['predicted']:>8.2f}{unit} "
                     f"{row['error']:>+8.1%}")
    errors = [abs(r["error"]) for r in rows]
    summary = f"median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} over {len(rows)}"
    if len(rows) > 2:
        measured, predicted = [r["measured"] for r in rows], [r["predicted"] for r in rows]
        summary += f"; Spearman {spearman(measured, predicted):.3f}"
        # a diagnostic, not a fit of any constant: what is fixed per run (start-up) and how the rest scales
        slope, intercept = np.polyfit(predicted, measured, 1)
        summary += f"\nleast-squares line: measured = {intercept:.1f} s + {slope:.2f} x predicted"
    return [*lines, summary, ""]


def main(out: Path = OUT, calibration: Path = CALIBRATIONS / f"{H200}.json") -> int:
    text = [*table("Real TRL runs of two GRPO steps on an H100 (measured: the whole run, start-up included; "
                   "predicted: two steps)", trl_rows(), " s"),
            *table("Probe points on the same H100 (two steps of the probe's phases; measured includes building "
                   "the model)", probe_rows(), " s"),
            *h200_tables(calibration),
            *table(f"Public decoding throughput ({GPT_FAST['source']})", public_rows(), "  "),
            *table("Published GRPO runs' seconds per optimizer step (benchmarks/data/public_measurements.toml; "
                   "measured: the run's wall time, trainer start-up included, over its steps), priors",
                   public_step_rows(), " s"),
            "Efficiency factors of the H100 and public tables: the priors (the H100's probe record kept no phase "
            "times to fit)."]
    output = "\n".join(text) + "\n"
    print(output, end="")
    out.write_text(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
