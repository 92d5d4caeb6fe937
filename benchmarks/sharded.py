"""One rank of FSDP2: the sharded trace beside the analytic per-rank model, phase by phase and component by component.

    python benchmarks/sharded.py [--quick | --zero]

The trace runs PyTorch's own `fully_shard` (as accelerate prepares a model for TRL's fsdp2 config) on torch's fake
process group over fake tensors, rank 0 of N (vram_planner/tracing/sharded.py); the analytic model is what `check
--num-gpus N --fsdp` adds up (vram_planner/model/components.py, phases.py). Per config and phase: the tensor peak of
each and the error (analytic - trace) / trace, then each component at the phase's peak. The grid: models (a fixture with
untied embeddings and biases, Qwen2.5-0.5B and Llama-3.2-1B with tied ones, Qwen2.5-7B untied) x N in (2, 4, 8) x
full fine-tuning, LoRA, gradient accumulation (no_sync), a reference model (beta), float32 weights; bf16 autocast,
short sequences (the sharded terms are the point; the activations are the one-GPU model's, held to the one-GPU trace
elsewhere), and TRL's default batch and lengths on Llama-3.2-1B and Qwen2.5-7B. Results:
benchmarks/results/sharded.json and sharded.txt.
`--quick` runs the fixture only.
`--zero` (an interpreter with DeepSpeed: the `deepspeed` extra) runs DeepSpeed's own engine instead, one rank of N
(vram_planner/tracing/zero.py; each phase on the rank the planner counts there, whose ZeRO-1/2 partition holds the
most: vram_planner/model/zero.py heaviest_rank), for Qwen2.5-0.5B and Llama-3.2-1B x N in (2, 8) x ZeRO-1/2/3 with short sequences,
and Llama-3.2-1B with LoRA, with gradient accumulation and with a reference model (beta) under ZeRO-1/2/3 on 8, both
models generating layer by layer
under ZeRO-3 (ds3_gather_for_generation=False) on 2 and 8, and sets DeepSpeed's estimator of the model states beside
the optimizer step's, with why they differ: benchmarks/results/sharded.zero.json and sharded.zero.txt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vram_planner import engine  # noqa: E402
from vram_planner.model import zero  # noqa: E402
from vram_planner.model.phases import TENSOR_COMPONENTS, estimate  # noqa: E402
from vram_planner.tracing.step import trace_phases_on_their_ranks  # noqa: E402
from vram_planner.units import GiB  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "sharded.json"
TABLE = ROOT / "benchmarks" / "results" / "sharded.txt"
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-llama-bias.json"
MODELS = ROOT / "profiles" / "models"
SHORT = {"per_device_train_batch_size": 2, "num_generations": 2, "max_prompt_length": 32,
         "max_completion_length": 32, "dtype": "bfloat16", "fsdp": True}
# TRL 1.16's batch and completion length, and the planner's default prompt
DEFAULT_LENGTHS = {"per_device_train_batch_size": 8, "num_generations": 8, "max_prompt_length": 256,
                   "max_completion_length": 512}
GRID = [
    (str(FIXTURE), {}),
    (str(FIXTURE), {"lora_r": 8}),
    (str(FIXTURE), {"dtype": "float32"}),
    (str(FIXTURE), {"gradient_accumulation_steps": 2}),
    (str(MODELS / "Qwen2.5-0.5B.json"), {}),
    (str(MODELS / "Llama-3.2-1B.json"), {}),
    (str(MODELS / "Llama-3.2-1B.json"), {"lora_r": 16}),
    (str(MODELS / "Llama-3.2-1B.json"), {"gradient_accumulation_steps": 2}),
    (str(MODELS / "Llama-3.2-1B.json"), {"beta": 0.04}),
    (str(MODELS / "Llama-3.2-1B.json"), {"dtype": "float32", "max_completion_length": 256}),
    (str(MODELS / "Qwen2.5-7B.json"), {}),
    (str(MODELS / "Llama-3.2-1B.json"), DEFAULT_LENGTHS),
    (str(MODELS / "Qwen2.5-7B.json"), DEFAULT_LENGTHS),
]
GPUS = (2, 4, 8)
# What the analytic model may fall short of the trace by and still count as never under it: a few one-block tensors
# it leaves out (a decoding step's cache position and sampler flags, an LM head's label ids)
UNDER_BYTES = 16 * 512
# --zero: DeepSpeed's engine, one rank of N (vram_planner/tracing/zero.py), per stage; DeepSpeed's own estimator of the
# model states beside (vram_planner/model/zero.py deepspeed_estimate_bytes, held to DeepSpeed's functions in
# tests/model/test_zero.py)
ZERO_GRID = [(str(MODELS / "Qwen2.5-0.5B.json"), {}), (str(MODELS / "Llama-3.2-1B.json"), {})]
ZERO_GPUS = (2, 8)
ZERO_STAGES = (1, 2, 3)
# LoRA (its adapters are the optimizer's only parameters), gradient accumulation (ZeRO's non-boundary backward) and a
# full fine-tune's reference model (TRL's prepare_deepspeed: ZeRO-3 partitioned, else whole on every rank)
ZERO_MORE = [(str(MODELS / "Llama-3.2-1B.json"), knobs) for knobs in (
    {"lora_r": 16}, {"gradient_accumulation_steps": 2}, {"lora_r": 16, "gradient_accumulation_steps": 2},
    {"beta": 0.04})]
ZERO_MORE_GPUS, ZERO_MORE_STAGES = (8,), (1, 2, 3)
# ZeRO-3 generating layer by layer (`--no-ds3-gather-for-generation`): the coordinator's prefetch and the round in
# use twice (vram_planner/model/zero.py), stage 3 only
ZERO_LAYERED = [(m, {"ds3_gather_for_generation": False}) for m, _ in ZERO_GRID]
# Why the optimizer step's model states differ from DeepSpeed's estimate, by the moment of the traced peak
# (vram_planner/model/zero.py has the source lines)
WHY = {
    (2, "optimizer step: the gradient norm"):
        "the 16-bit gradients the partition touches, kept whole, beside the norm's fp64 copy of the largest slice "
        "(8 B an element); the estimate counts 2 + 4 B per parameter of the partition",
    (2, "optimizer step: the fp32 gradient partition"):
        "the 16-bit gradients the partition touches, kept whole, their flat copy and its fp32 copy (2 + 2 + 4 B) "
        "with Adam's moments alive; the estimate counts 2 + 4 B",
    (3, "optimizer step: the fp32 gradient partition"):
        "a sub-group's flat and fp32 copies (2 + 4 B) beside the 16-bit gradient partition (2 B) and the 1 GB bucket "
        "the estimate leaves out; every gathered layer released, the estimate's 4 x largest layer not held",
    (3, "optimizer step: persistent parameters gathered"):
        "the persistent parameters (each under 1e5 elements) gathered again after the update, beside the gradient "
        "partition and the 1 GB bucket; every other gathered layer released",
}
ZERO_RESULTS = ROOT / "benchmarks" / "results" / "sharded.zero.json"
ZERO_TABLE = ROOT / "benchmarks" / "results" / "sharded.zero.txt"


def at_depth(config: dict, layers: int) -> dict:
    """The config cut to `layers` decoder layers, its per-layer attention types with them."""
    config = json.loads(json.dumps(config))
    text = config.get("text_config", config)
    text["num_hidden_layers"] = layers
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][:layers]
    return config


def measure(model: str, knobs: dict, gpus: int, stage: int | None = None, layers: int | None = None) -> dict:
    """One config's phases, each traced on its rank beside the analytic model; `layers`: the model cut to that depth
    (benchmarks/shallow_ranks.py)."""
    config = json.loads(Path(model).read_text())
    if layers is not None:
        config = at_depth(config, layers)
    context = engine.make_context(model if layers is None else config, "h100-80gb")
    strategy = {"fsdp": False, "zero_stage": stage} if stage is not None else {}
    train = engine.make_training(context, {**SHORT, **knobs, "num_gpus": gpus, **strategy})
    analytic = {p.name: p for p in estimate(context.arch, train, context.release, context.calibration,
                                             context.capacity_bytes).phases}
    start = time.perf_counter()
    # each phase traced on the rank the planner counts there (ZeRO-1/2's partitions differ from rank to rank)
    traced = trace_phases_on_their_ranks(config, train, context.release)
    seconds = time.perf_counter() - start
    phases = []
    for rank, phase in traced:
        other = analytic[phase.name]
        phases.append({"phase": phase.name, "rank": rank, "trace_bytes": phase.peak_bytes,
                       "analytic_bytes": round(other.tensor_bytes),
                       "trace_moment": phase.moment, "analytic_moment": other.moment,
                       "components": {c: [phase.components.get(c, 0), round(other.components.get(c, 0.0))]
                                      for c in TENSOR_COMPONENTS}})
    row = {"model": Path(model).stem, "knobs": knobs, "num_gpus": gpus, "seconds": round(seconds, 1),
           "phases": phases}
    if stage is not None:
        arch = context.arch
        row["zero_stage"] = stage
        # DeepSpeed's estimators know full fine-tuning only
        row["deepspeed_estimate_bytes"] = None if train.uses_lora else zero.deepspeed_estimate_bytes(
            arch.params, gpus, 3 if stage == 3 else 2, zero.largest_layer_params(arch))
    return row


def zero_table(rows: list[dict], seconds: float) -> str:
    """Per model x N x stage and phase: the traced peak, the analytic one, the error; for the optimizer step its model
    states (weights, gradients, optimizer states) traced, analytic and as DeepSpeed's estimator counts them (ZeRO-1
    estimated as ZeRO-2, as DeepSpeed has no ZeRO-1 estimator; none for LoRA), and why the trace and the estimate
    differ."""
    names = [f"{row['model']}{''.join(f' {k}={v}' for k, v in row['knobs'].items())}" for row in rows]
    width = max(44, *map(len, names))
    lines = [f"{'config':<{width}} {'N':>2} {'stage':>5} {'phase':<10} {'rank':>4} {'trace GiB':>10} {'analytic':>10} "
             f"{'error':>8}  step's model states trace / analytic / DeepSpeed's estimate (GiB): why they differ"]
    worst: dict[str, float] = {}
    for name, row in zip(names, rows, strict=True):
        for p in row["phases"]:
            error = (p["analytic_bytes"] - p["trace_bytes"]) / p["trace_bytes"]
            worst[p["phase"]] = max(worst.get(p["phase"], 0.0), abs(error))
            states = ""
            if p["phase"] == "optimizer":
                t, a = (sum(p["components"][c][i] for c in ("weights", "gradients", "optimizer_states"))
                        for i in (0, 1))
                estimate = row["deepspeed_estimate_bytes"]
                why = WHY.get((3 if row["zero_stage"] == 3 else 2, p["trace_moment"]), p["trace_moment"])
                states = (f"{t / GiB:.3f} / {a / GiB:.3f} / "
                          f"{'n/a' if estimate is None else f'{estimate / GiB:.3f}'}: {why}")
            lines.append(f"{name:<{width}} {row['num_gpus']:>2} {row['zero_stage']:>5} {p['phase']:<10} "
                         f"{p.get('rank', 0):>4} {p['trace_bytes'] / GiB:>10.4f} {p['analytic_bytes'] / GiB:>10.4f} "
                         f"{error:>+8.2%}  {states}")
    lines.append(f"worst |error| over {len(rows)} configs, per phase: "
                 + ", ".join(f"{phase} {value:.2%}" for phase, value in worst.items()))
    lines.append(f"run time: {seconds / 60:.1f} min (one process, this machine's CPU)")
    return "\n".join(lines)


def fixture(row: dict) -> bool:
    return row["model"] == FIXTURE.stem


def table(rows: list[dict], seconds: float) -> str:
    lines = [f"{'config':<44} {'N':>2} {'phase':<10} {'trace GiB':>10} {'analytic':>10} {'error':>8}  components "
             "(trace/analytic MiB, where they differ by 1% or more)"]
    worst = worst_fixture = 0.0
    under = []
    for row in rows:
        knobs = ("TRL defaults" if row["knobs"] == DEFAULT_LENGTHS
                 else "".join(f" {k}={v}" for k, v in row["knobs"].items()))
        name = f"{row['model']} {knobs}".strip()
        for p in row["phases"]:
            error = (p["analytic_bytes"] - p["trace_bytes"]) / p["trace_bytes"]
            if p["trace_bytes"] - p["analytic_bytes"] > UNDER_BYTES:
                under.append(f"{name} N={row['num_gpus']} {p['phase']} ({error:+.4%})")
            if fixture(row):
                worst_fixture = max(worst_fixture, abs(error))
            else:
                worst = max(worst, abs(error))
            differ = ", ".join(f"{c} {t / 2**20:.2f}/{a / 2**20:.2f}" for c, (t, a) in p["components"].items()
                               if max(t, a) and abs(a - t) > 0.01 * max(t, a))
            lines.append(f"{name:<44} {row['num_gpus']:>2} {p['phase']:<10} {p['trace_bytes'] / GiB:>10.4f} "
                         f"{p['analytic_bytes'] / GiB:>10.4f} {error:>+8.2%}  {differ}")
    lines.append(f"worst |error| over the catalog models' {sum(not fixture(r) for r in rows)} configs: {worst:.2%}; "
                 f"over the fixture's {sum(map(fixture, rows))} (kilobyte shards, where every storage's 512-byte "
                 f"rounding shows): {worst_fixture:.2%}")
    lines.append(f"under the trace by more than {UNDER_BYTES} bytes: "
                 + (", ".join(under) if under else "none"))
    lines.append(f"run time: {seconds / 60:.1f} min (one process, this machine's CPU)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the fixture model only")
    parser.add_argument("--zero", action="store_true", help="DeepSpeed ZeRO-1/2/3 instead of FSDP2 (needs deepspeed)")
    args = parser.parse_args()
    if args.zero:
        start = time.perf_counter()
        rows = [measure(m, k, n, stage) for m, k in ZERO_GRID for n in ZERO_GPUS for stage in ZERO_STAGES]
        rows += [measure(m, k, n, stage) for m, k in ZERO_MORE for n in ZERO_MORE_GPUS for stage in ZERO_MORE_STAGES]
        rows += [measure(m, k, n, 3) for m, k in ZERO_LAYERED for n in ZERO_GPUS]
        text = zero_table(rows, time.perf_counter() - start)
        print(text)
        ZERO_RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
        ZERO_TABLE.write_text(text + "\n")
        return
    grid = [(m, k) for m, k in GRID if not args.quick or m == str(FIXTURE)]
    start = time.perf_counter()
    rows = []
    for model, knobs in grid:
        for gpus in GPUS:
            rows.append(measure(model, knobs, gpus))
            print(f"{Path(model).stem} {knobs} N={gpus}: {rows[-1]['seconds']} s", file=sys.stderr)
    text = table(rows, time.perf_counter() - start)
    print(text)
    if not args.quick:
        RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
        TABLE.write_text(text + "\n")


if __name__ == "__main__":
    main()
