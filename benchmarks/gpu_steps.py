"""Real GRPO steps on a CUDA GPU, measured: TRL's GRPOTrainer on random weights, each phase's peak allocated and
reserved memory, the CUDA context, and a memory snapshot (torch.cuda.memory._record_memory_history) of the whole run.

    python benchmarks/gpu_steps.py --out DIR           # every config, default allocator and expandable segments
    python benchmarks/gpu_steps.py --out DIR --quick   # one small config: a smoke test of the path

Each config runs in its own process, since the allocator reads PYTORCH_CUDA_ALLOC_CONF when CUDA starts. The run is
`vram-plan run`'s own (RunSetup, start_run) with every completion forced to full length, two optimizer steps, and the
prompts set to the longest in the data, so the planner's prediction for the same config is comparable. Writes
DIR/gpu_steps.json (device, versions, per config the phases of each step) as each config finishes, and DIR/NAME.pkl.gz
snapshots in torch's format, reduced to what a replay reads (trace events: action, addr, size, stream; segments
without their blocks). benchmarks/gpu_compare.py (no GPU) puts the planner's predictions beside the measurements.
Without CUDA the same path runs on the CPU with nothing measured, to test the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import unittest.mock
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tokenizer the tests train (helpers.math_sample_tokenizer)
CARD = "h100-80gb"  # the card the verdict is judged against; the measured figures do not depend on it
EXPANDABLE = "expandable_segments:True"
# Qwen2.5-0.5B and Llama-3.2-1B, full and LoRA (the configs), four sequences of 128 completion tokens.
CONFIGS = [
    {"name": f"{model}-{kind}{'-expandable' if conf else ''}", "model": model, "allocator_conf": conf,
     "settings": {"per_device_train_batch_size": 4, "num_generations": 4, "gradient_accumulation_steps": 1,
                  "max_completion_length": 128, "gradient_checkpointing": True,
                  **({"lora_r": 16} if kind == "lora16" else {})}}
    for conf in ("", EXPANDABLE) for model in ("Qwen2.5-0.5B", "Llama-3.2-1B") for kind in ("full", "lora16")
    if not conf or (model, kind) in {("Qwen2.5-0.5B", "full"), ("Llama-3.2-1B", "lora16")}
]
# The largest micro-batch `plan --maximize per_device_train_batch_size` finds for a card, trained on the H100 limited
# to that card's capacity less its CUDA context (torch.cuda.set_per_process_memory_fraction): "fits" must run.
PLANNED = [{"name": f"{model}-{kind}-max-batch-{card}", "model": model, "allocator_conf": "", "plan_on": card,
            "snapshot": False,
            "settings": {"optim": "adamw_torch_fused", **({"lora_r": 16} if kind == "lora16" else {})}}
           for model, kind, card in (("Qwen2.5-0.5B", "full", "rtx3080-mobile-16gb"),
                                     ("Llama-3.2-1B", "lora16", "rtx3080-mobile-16gb"),
                                     ("Qwen2.5-1.5B", "lora16", "rtx4090"))]
# The same runs with the allocator limited to the planner's predicted peak less the context (no safety margin): does
# the step need more than the planner says?
PLANNED += [{**c, "name": c["name"] + "-at-prediction", "limit": "prediction"} for c in PLANNED]
QUICK = [{"name": "SmolLM2-135M-lora16", "model": "SmolLM2-135M", "allocator_conf": "",
          "settings": {"per_device_train_batch_size": 2, "num_generations": 2, "gradient_accumulation_steps": 1,
                       "max_completion_length": 32, "gradient_checkpointing": True, "lora_r": 16}}]
# an out-of-memory event also says what CUDA still had free (device_free)
TRACE_KEYS = ("action", "addr", "size", "stream", "device_free")
SEGMENT_KEYS = ("device", "address", "total_size", "stream", "segment_type", "is_expandable")
BLOCK_KEYS = ("address", "size", "requested_size", "state")


def model_folder(model: str, cache: Path) -> Path:
    """A folder with the catalog model's config, random bfloat16 weights and a small BPE tokenizer trained on the
    bundled prompts (memory does not depend on the weights; ids past the tokenizer's vocabulary decode to nothing)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from vram_planner.probe.fit import _config_json

    from helpers import math_sample_tokenizer

    folder = cache / (Path(model).stem if model.endswith(".json") else model)
    if (folder / "config.json").is_file():
        return folder
    fast = math_sample_tokenizer()
    config = _config_json(model)
    built = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16)
    partial = Path(tempfile.mkdtemp(dir=cache))
    built.save_pretrained(partial)
    fast.save_pretrained(partial)
    partial.rename(folder)
    return folder


class PhaseMeter:
    """Peak allocated and reserved bytes of each phase of each step, from the caching allocator's statistics, with
    each phase's and each optimizer step's synchronized wall time (the step-time model's measurements)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.rows, self.step, self.phase = cuda, [], 0, None
        self.step_seconds: list[float] = []
        self.phase_started = self.step_started = 0.0

    def start(self, phase: str) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.phase = phase
        self.reserved_at_start = torch.cuda.memory_reserved() if self.cuda else 0
        self.phase_started = time.perf_counter()

    def end(self, phase: str) -> None:
        import torch

        if self.phase != phase:
            return
        if self.cuda:
            torch.cuda.synchronize()
        stats = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(),
                 torch.cuda.memory_allocated()) if self.cuda else (0, 0, 0)
        self.rows.append({"step": self.step, "phase": phase, "allocated_peak_bytes": stats[0],
                          "reserved_peak_bytes": stats[1], "allocated_after_bytes": stats[2],
                          "reserved_at_start_bytes": self.reserved_at_start,
                          "seconds": round(time.perf_counter() - self.phase_started, 4)})
        self.phase = None


def instrument(meter: PhaseMeter) -> Any:
    """Wrap GRPOTrainer's phases (TRL 1.16 method names) and return the callback that times the optimizer step."""
    import torch
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    def around(name: str, before, after) -> None:
        original = getattr(GRPOTrainer, name)

        def wrapped(self, *args, **kwargs):
            before()
            out = original(self, *args, **kwargs)
            after()
            return out

        setattr(GRPOTrainer, name, wrapped)

    def step_begins() -> None:
        meter.step += 1

    around("training_step", step_begins, lambda: meter.end("training"))
    around("_generate", lambda: meter.start("generation"), lambda: meter.end("generation"))
    around("_prepare_inputs", lambda: None, lambda: meter.start("training"))
    scoring = getattr(GRPOTrainer, "_get_per_token_logps_and_entropies")

    def logps(self, *args, **kwargs):
        if torch.is_grad_enabled():  # the training forward, inside the training phase
            return scoring(self, *args, **kwargs)
        meter.start("scoring")
        out = scoring(self, *args, **kwargs)
        meter.end("scoring")
        return out

    GRPOTrainer._get_per_token_logps_and_entropies = logps

    class OptimizerPhase(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            meter.step_started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if meter.cuda:
                torch.cuda.synchronize()
            meter.step_seconds.append(round(time.perf_counter() - meter.step_started, 4))

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            meter.start("optimizer")

        def on_optimizer_step(self, args, state, control, **kwargs):
            meter.end("optimizer")

    return OptimizerPhase()


def same_prompt_rows(dataset: Any, tokenizer: Any, rows: int) -> Any:
    """`rows` copies of the prompt with the most tokens: every step's prompts are max_prompt_length long, as the
    trace's are (the longest-first order leaves the second step's prompts shorter than the first's)."""
    from vram_planner.run.train_data import longest_prompt_tokens

    longest = max(range(len(dataset)), key=lambda i: longest_prompt_tokens(dataset.select([i]), tokenizer))
    return dataset.select([longest] * rows)


def run_one(config: dict[str, Any], folder: Path, out: Path, meter: PhaseMeter | None = None) -> dict[str, Any]:
    """Train `max_steps` (default two) steps of one config in this process and measure them (the parent set the
    allocator's env). Config keys beside the model and settings: `plan_on` (the largest micro-batch a card takes) with
    `limit` ("prediction": the allocator limited to the predicted peak), `limit_bytes` (the allocator limited to that
    many bytes), `same_prompts` (every prompt the longest), `snapshot` (record the allocator's history)."""
    import torch

    from vram_planner import engine
    from vram_planner.model.spec import changed_settings
    from vram_planner.probe.cuda import _nvidia_smi
    from vram_planner.run import launch
    from vram_planner.run.checks import prepared_dataset
    from vram_planner.run.launch import start_run
    from vram_planner.run.out_of_memory import RunOutOfMemory
    from vram_planner.run.setup import RunSetup
    from vram_planner.run.smoke import longest_first
    from vram_planner.run.train_data import load_prompts, longest_prompt_tokens

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.reset_peak_memory_stats()
    used_before_mib = float(_nvidia_smi("memory.used") or 0) if cuda else 0.0
    recorded: list[dict[str, Any]] = []
    from transformers import AutoTokenizer

    settings = dict(config["settings"])
    settings["max_prompt_length"] = longest_prompt_tokens(load_prompts("math-sample"),
                                                          AutoTokenizer.from_pretrained(folder))
    if config["allocator_conf"]:
        settings["allocator_conf"] = config["allocator_conf"]
    if config.get("plan_on"):
        verdict = engine.maximize(config["model"], config["plan_on"], "per_device_train_batch_size", settings).plan.chosen
        if verdict is None:
            raise SystemExit(f"nothing fits {config['plan_on']}")
        limit = (verdict.estimate.peak_bytes if config.get("limit") == "prediction"
                 else verdict.context.capacity_bytes) - verdict.context.cuda_context.bytes
    else:
        verdict = engine.check(config["model"], CARD, settings)
        limit = int(config["limit_bytes"]) if config.get("limit_bytes") else None
    if cuda and limit is not None:
        torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.mem_get_info()[1])
    scratch = Path(tempfile.mkdtemp(prefix="gpu-steps-"))
    steps = int(config.get("max_steps", 2))
    setup = RunSetup(verdict=verdict, model_id=str(folder), dataset="math-sample", rewards=["format", "correctness"],
                     output_dir=scratch / "run", max_steps=steps, on_cpu=not cuda)
    if meter is None:
        meter = PhaseMeter(cuda)
        launch.EXTRA_CALLBACKS.append(instrument(meter))
    rows = verdict.train.per_device_train_batch_size * verdict.train.steps_per_generation_resolved * steps
    if config.get("same_prompts"):
        dataset = same_prompt_rows(prepared_dataset(setup), AutoTokenizer.from_pretrained(folder), rows)
    else:
        dataset = longest_first(prepared_dataset(setup), rows)
    start = time.perf_counter()
    oom_note = oom_snapshot = None
    try:
        with run_history(recorded) if cuda and config.get("snapshot", True) else contextlib.nullcontext():
            start_run(setup, dataset, smoke=True)  # smoke: full-length completions, nothing saved
        ran = True
    except RunOutOfMemory as exc:
        ran = False
        oom_note = str(exc)[:400]
        if exc.snapshot is not None and Path(exc.snapshot).is_file():
            oom_snapshot = save_oom_snapshot(Path(exc.snapshot), out / f"{config['name']}.oom.pkl.gz")
    seconds = time.perf_counter() - start
    result: dict[str, Any] = {**config, "ran": ran, "fits": verdict.fits, "limit_bytes": limit if cuda else None,
                              "train": changed_settings(verdict.train),
                              "predicted_peak_bytes": verdict.estimate.peak_bytes, "phases": meter.rows,
                              "seconds": round(seconds, 1), "step_seconds": meter.step_seconds}
    if oom_note:
        result["out_of_memory"] = oom_note
    if oom_snapshot:
        result["oom_snapshot"] = oom_snapshot
    if cuda:
        free, total = torch.cuda.mem_get_info()
        result.update(capacity_bytes=total, max_reserved_bytes=torch.cuda.max_memory_reserved(),
                      context_bytes=int(total - free - used_before_mib * 2**20 - torch.cuda.memory_reserved()),
                      used_before_bytes=int(used_before_mib * 2**20))
        if recorded:
            result["snapshot"] = save_snapshot(recorded[-1], out / f"{config['name']}.pkl.gz")
    return result


# A whole history: a fixture's run makes a few hundred thousand events, a catalog model's 512-token generation
# millions (vram_planner/run/memory_history.py: ~180 per layer per decoding step)
WHOLE_HISTORY_ENTRIES = 50_000_000


@contextlib.contextmanager
def run_history(recorded: list[dict[str, Any]]) -> Iterator[None]:
    """While the block runs, `vram-plan run`'s own recording of the allocator's history keeps every event and hands
    its snapshot to `recorded` just before the run stops it (stopping clears it: a snapshot taken after the run is
    empty, as the 2026-12-04 call's were)."""
    import torch

    from vram_planner.run import launch, memory_history

    recording = memory_history.memory_history

    @contextlib.contextmanager
    def kept(target: Path, frames: bool = False) -> Iterator[Any]:
        with recording(target, frames) as history:
            try:
                yield history
            finally:
                recorded.append(torch.cuda.memory._snapshot())

    with unittest.mock.patch.object(memory_history, "MAX_ENTRIES", WHOLE_HISTORY_ENTRIES), \
            unittest.mock.patch.object(launch, "memory_history", kept):
        yield


def save_snapshot(snapshot: dict[str, Any], path: Path, last_events: int | None = None,
                  blocks: bool = False) -> dict[str, Any]:
    """The snapshot in torch's format, without stack frames (a replay reads none), its segments' blocks only if
    `blocks` (what the card held at an out-of-memory), its last `last_events` events if given, gzip-compressed."""
    def segment(s: dict[str, Any]) -> dict[str, Any]:
        kept = {k: s[k] for k in SEGMENT_KEYS if k in s}
        if blocks:
            kept["blocks"] = [{k: b[k] for k in BLOCK_KEYS if k in b} for b in s.get("blocks", [])]
        return kept

    traces = [trace if last_events is None else trace[-last_events:] for trace in snapshot.get("device_traces", [])]
    small = {"device_traces": [[{k: e[k] for k in TRACE_KEYS if k in e} for e in trace] for trace in traces],
             "segments": [segment(s) for s in snapshot.get("segments", [])]}
    for key, value in snapshot.items():  # allocator settings and the like: small plain data, kept as recorded
        if key not in small and len(repr(value)) < 20_000:
            small[key] = value
    path.write_bytes(gzip.compress(pickle.dumps(small, protocol=4), compresslevel=9))
    return {"file": path.name, "keys": sorted(snapshot), "events": sum(len(t) for t in small["device_traces"]),
            "bytes": path.stat().st_size}


# The events an out-of-memory snapshot keeps: its segments' blocks show the card at the failed request, and the last
# events how it came to be (a catalog model's run makes millions, more than a GPU call brings back)
OOM_SNAPSHOT_EVENTS = 300_000


def save_oom_snapshot(path: Path, out: Path) -> dict[str, Any]:
    """The snapshot `run` wrote when memory ran out, with its segments' blocks and its last OOM_SNAPSHOT_EVENTS
    events."""
    return save_snapshot(pickle.loads(gzip.decompress(path.read_bytes())), out, OOM_SNAPSHOT_EVENTS, blocks=True)


def replay_check(path: Path, conf_text: str) -> dict[str, Any]:
    """The allocator model's replay of a recorded snapshot beside what the allocator recorded."""
    from vram_planner.allocator.conf import parse_allocator_conf
    from vram_planner.allocator.snapshot import load_snapshot
    from vram_planner.allocator.snapshot_replay import pick_device, replay_snapshot

    snapshot = load_snapshot(path)
    replay = replay_snapshot(snapshot, pick_device(snapshot, None), parse_allocator_conf(conf_text, "benchmark"))
    predicted, recorded = replay.predicted_segment_sizes, replay.recorded.segment_sizes
    return {"predicted_segment_sizes": predicted, "recorded_segment_sizes": recorded,
            "segments_match": predicted == recorded,
            "predicted_max_reserved_bytes": replay.predicted_max_reserved_bytes,
            "recorded_max_reserved_bytes": replay.recorded.max_reserved_bytes, "notes": replay.notes}


def device_info() -> dict[str, Any]:
    import torch

    from vram_planner.probe.cuda import _nvidia_smi
    from vram_planner.tracing.step import engine_versions

    info = {**engine_versions(), "cuda": str(torch.version.cuda), "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(), driver=_nvidia_smi("driver_version") or "unknown",
                    capacity_bytes=torch.cuda.mem_get_info()[1],
                    sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
    return info


# Issue 30's step-time set: what plan's ranking chooses between (checkpointing, LoRA or full, micro-batch against
# accumulation, completion length, weights' dtype, model size), three optimizer steps each, timed in one process one
# after another on an otherwise idle GPU (the first step warms the kernels up; step_time.py compares the last).
TIMED = [{"name": f"{model} {label}", "model": model, "allocator_conf": "", "snapshot": False, "max_steps": 3,
          "settings": {"per_device_train_batch_size": 4, "num_generations": 4, "gradient_accumulation_steps": 1,
                       "max_completion_length": 128, "gradient_checkpointing": True, "dtype": "bfloat16",
                       "optim": "adamw_torch_fused", **settings}}
         for model, label, settings in (
             ("Qwen2.5-0.5B", "full", {}),
             ("Qwen2.5-0.5B", "full no-checkpointing", {"gradient_checkpointing": False}),
             ("Llama-3.2-1B", "lora16", {"lora_r": 16}),
             ("Llama-3.2-1B", "lora16 no-checkpointing", {"lora_r": 16, "gradient_checkpointing": False}),
             ("Llama-3.2-1B", "lora16 B2 GA2", {"lora_r": 16, "per_device_train_batch_size": 2,
                                                "gradient_accumulation_steps": 2}),
             ("Qwen2.5-0.5B", "full B8 G8 c256", {"per_device_train_batch_size": 8, "num_generations": 8,
                                                  "max_completion_length": 256}),
             ("Qwen2.5-0.5B", "fp32 full", {"dtype": "float32"}),
             ("Qwen2.5-1.5B", "lora16 B8 G8 c256", {"lora_r": 16, "per_device_train_batch_size": 8,
                                                    "num_generations": 8, "max_completion_length": 256}),
             ("Qwen3-0.6B", "lora16 B32 G16", {"lora_r": 16, "per_device_train_batch_size": 32,
                                               "num_generations": 16}),
             ("Llama-3.2-1B", "full B8 G8", {"per_device_train_batch_size": 8, "num_generations": 8}),
             ("Qwen2.5-1.5B", "full", {}),
             ("Llama-3.2-1B", "qlora16", {"lora_r": 16, "load_in_4bit": True}),
             ("SmolLM2-135M", "lora16 B16 G16 c256", {"lora_r": 16, "per_device_train_batch_size": 16,
                                                      "num_generations": 16, "max_completion_length": 256}),
             # held out from the 4-bit linear's host crossings (step_work.BNB_4BIT_CALL_OPS): more rows decoding, a
             # wider model
             ("Llama-3.2-1B", "qlora16 B16 G16 c256", {"lora_r": 16, "load_in_4bit": True,
                                                       "per_device_train_batch_size": 16, "num_generations": 16,
                                                       "max_completion_length": 256}),
             ("Qwen2.5-1.5B", "qlora16", {"lora_r": 16, "load_in_4bit": True}),
         )]


def run_in_process(configs: list[dict[str, Any]], models: Path, out: Path, summary: dict[str, Any],
                   summary_path: Path) -> None:
    """Each config after the other in this process, timed (the allocator's figures of later configs include what
    earlier ones left cached, so only the times are comparable)."""
    import gc

    import torch

    from vram_planner.run import launch

    meter = PhaseMeter(torch.cuda.is_available())
    launch.EXTRA_CALLBACKS.append(instrument(meter))
    for config in configs:
        meter.rows, meter.step, meter.step_seconds = [], 0, []
        try:
            result = run_one(config, model_folder(config["model"], models), out, meter)
        except Exception as exc:  # report and go on: the other configs' times still count
            result = {**config, "error": repr(exc)[-3000:]}
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        summary["configs"].append(result)
        save(summary, summary_path)
        print(f"{config['name']}: " + (result["error"][-300:] if "error" in result else
                                       f"steps {result['step_seconds']} s"), flush=True)


def save(summary: dict[str, Any], path: Path) -> None:
    from vram_planner.files import write_atomically

    write_atomically(path, json.dumps(summary, indent=1))


def run_subprocess(config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": config["allocator_conf"]}
    done = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--models", str(args.models),
                           "--one", json.dumps(config)], env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        return {**config, "error": done.stderr[-3000:]}
    result = json.loads(lines[-1][len("RESULT "):])
    if "snapshot" in result and args.replay:
        try:
            result["replay"] = replay_check(args.out / result["snapshot"]["file"], config["allocator_conf"])
        except Exception as exc:  # report and go on: the other configs' measurements still count
            result["replay"] = {"error": repr(exc)}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timing", action="store_true", help="issue 30's step-time set, in one process")
    parser.add_argument("--points", type=Path, help="configs from a JSON file's 'points' (gpu_boundary.py prepare)")
    parser.add_argument("--jobs", type=int, default=1, help="configs run at once (memory only: times interfere)")
    parser.add_argument("--only", nargs="*", help="config names to run (default: all)")
    parser.add_argument("--replay", action="store_true", help="replay each snapshot through the allocator model")
    parser.add_argument("--build-model", metavar="MODEL", help="build one model's folder and stop (in parallel)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a config as JSON: run it in this process
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "vram-plan-gpu-models")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.models.mkdir(parents=True, exist_ok=True)
    if args.one:
        config = json.loads(args.one)
        print("RESULT " + json.dumps(run_one(config, model_folder(config["model"], args.models), args.out)))
        return 0
    if args.build_model:
        model_folder(args.build_model, args.models)
        return 0
    if args.points:
        configs = json.loads(args.points.read_text())["points"]
    else:
        configs = QUICK if args.quick else TIMED if args.timing else CONFIGS + PLANNED
    configs = [c for c in configs if not args.only or c["name"] in args.only]
    summary_path = args.out / ("step_times.json" if args.timing else "gpu_steps.json")
    summary = {"device": device_info(), "configs": []}
    for model in dict.fromkeys(c["model"] for c in configs):
        model_folder(model, args.models)  # built once, before any process holds CUDA memory
    if args.timing:
        run_in_process(configs, args.models, args.out, summary, summary_path)
        return 0
    from concurrent.futures import ThreadPoolExecutor, as_completed

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        # saved as each ends, not in order: a call cut by its timeout keeps every run that finished
        futures = {pool.submit(run_subprocess, config, args): config for config in configs}
        for future in as_completed(futures):
            config, result = futures[future], future.result()
            summary["configs"].append(result)
            save(summary, summary_path)
            reserved_gib = result.get("max_reserved_bytes", 0) / 2**30
            print(f"{config['name']}: " + ("ERROR " + result["error"][-600:] if "error" in result else
                                           f"ran: {result['ran']}, {reserved_gib:.2f} GiB reserved, "
                                           f"{result['seconds']} s, "
                                           f"segments match: {result.get('replay', {}).get('segments_match')}"),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
