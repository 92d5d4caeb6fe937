"""Issue 25 item 7: the exact need held to a GPU. Boundary configs run on a card whose allocator is limited to the
need the allocator model bisects, less 2% and plus 2% (torch.cuda.set_per_process_memory_fraction): the step must
run out of memory below the need and run above it.

    python benchmarks/gpu_boundary.py prepare     # no GPU: each point's need, written to results/gpu/boundary-points.json
    python benchmarks/gpu_steps.py --points benchmarks/results/gpu/boundary-points.json --jobs 8 --out DIR   # the GPU
    python benchmarks/gpu_boundary.py table DIR/gpu_steps.json   # no GPU: the outcome table

The points file also holds two eager-attention points measured at two needs each (`placement`): with autograd's
cuBLAS workspace made at the training phase's first event (shipped) and at the backward's first product (as the H100
snapshots show; commit 347efbe): where the GPU runs and runs out says which placement the allocator model should use.

The GPU runs TRL's own step (benchmarks/gpu_steps.py: `vram-plan run`'s path, every completion forced to full
length) with every prompt the data's longest, so the step is the one traced here: the points' max_prompt_length is
that prompt's token count under the same tokenizer. The need excludes the CUDA context (the allocator's limit is what
set_per_process_memory_fraction caps), and includes cuBLAS's workspaces, which torch allocates through the caching
allocator.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
POINTS = ROOT / "benchmarks" / "results" / "gpu" / "boundary-points.json"
FACTORS = (0.98, 1.02)
CARD = "h100-80gb"
# Short generations, so each run takes seconds: every fixture architecture, and catalog models at large micro-batches
CATALOG = [
    ("SmolLM2-135M", "lora c256 B128", {"dtype": "bfloat16", "lora_r": 16, "num_generations": 16,
                                         "per_device_train_batch_size": 128, "max_completion_length": 256}),
    ("Qwen2.5-0.5B", "lora c256 B128", {"dtype": "bfloat16", "lora_r": 16, "num_generations": 16,
                                         "per_device_train_batch_size": 128, "max_completion_length": 256}),
    ("Qwen3-0.6B", "lora c256 B64 beta", {"dtype": "bfloat16", "lora_r": 16, "num_generations": 16,
                                          "per_device_train_batch_size": 64, "max_completion_length": 256,
                                          "beta": 0.04}),
    ("Llama-3.2-1B", "lora c256 B64", {"dtype": "bfloat16", "lora_r": 16, "num_generations": 16,
                                        "per_device_train_batch_size": 64, "max_completion_length": 256}),
    ("SmolLM2-135M", "full c512 B8", {"dtype": "bfloat16", "max_completion_length": 512}),
    ("Qwen2.5-0.5B", "full c512 B8", {"dtype": "bfloat16", "max_completion_length": 512}),
    ("Qwen2.5-0.5B", "fp32 full", {}),
    ("Llama-3.2-1B", "fp32 lora c256 eager", {"lora_r": 16, "attn_implementation": "eager",
                                               "max_completion_length": 256}),
]


def prompt_tokens() -> int:
    from helpers import math_sample_tokenizer

    from vram_planner.run.train_data import load_prompts, longest_prompt_tokens

    return longest_prompt_tokens(load_prompts("math-sample"), math_sample_tokenizer())


def prepare(out: Path) -> None:
    from boundary import FIXTURE_CONFIGS, FIXTURES

    from vram_planner import engine
    from vram_planner.model.calibration import default_calibration

    length = prompt_tokens()
    grid = [(str(path.relative_to(ROOT)), name, settings) for path in sorted(FIXTURES.glob("tiny-*.json"))
            for name, settings in FIXTURE_CONFIGS.items()] + CATALOG
    points = []
    for model, name, settings in grid:
        settings = {**settings, "max_prompt_length": length}
        outcome = engine.check(model, CARD, settings, exact=True, calibration=default_calibration())
        need = outcome.need.capacity_bytes
        label = f"{Path(model).stem if model.endswith('.json') else model} {name}"
        print(f"{label}: need {need / 2**30:.3f} GiB (allocator), {outcome.seconds:.1f} s", flush=True)
        for factor in FACTORS:
            points.append({"name": f"{label} x{factor}", "point": label, "model": model, "settings": settings,
                           "allocator_conf": settings.get("allocator_conf", ""), "factor": factor,
                           "need_bytes": need, "limit_bytes": int(need * factor), "same_prompts": True,
                           # the fixtures' histories are small: the next GPU's snapshots show where the allocator
                           # model's reserve for their full fine-tuning went 20% over the H200's
                           "snapshot": model.endswith(".json")})
    earlier = json.loads(out.read_text()) if out.is_file() else {}
    kept = [point for point in earlier.get("points", []) if "placement" in point]  # needs of another commit's code
    document = {"prompt_tokens": length, "card": CARD, "points": kept + points}  # the decisive runs first
    if "placement_note" in earlier:
        document["placement_note"] = earlier["placement_note"]
    out.write_text(json.dumps(document, indent=1) + "\n")


def traced_peaks(point: dict) -> tuple[int, int | None]:
    """The traced step's allocated peak and what the allocator model holds for it under the run's limit (bytes):
    replayed_peaks of the point's exact check."""
    from vram_planner import engine
    from vram_planner.model.calibration import default_calibration

    outcome = engine.check(point["model"], CARD, point["settings"], exact=True, calibration=default_calibration())
    return replayed_peaks(outcome, point["limit_bytes"])


def replayed_peaks(outcome, limit_bytes: int) -> tuple[int, int | None]:
    """An exact check's traced step replayed under `limit_bytes`: its allocated peak and what the allocator model
    holds (bytes). On a card with room it would hold far more (a decoding step's larger cache cannot reuse the last
    one's block, so the cache grows until cudaMalloc fails), which the GPU, capped at the limit, could not. None where
    the model runs out under the limit (a point whose need came from another commit's code)."""
    from vram_planner.allocator import parse_allocator_conf
    from vram_planner.allocator.replay import replay_events
    from vram_planner.model.cublas import workspace_bytes
    from vram_planner.tracing.events import with_workspaces

    capability = outcome.traced.context.gpu.compute_capability
    stream = with_workspaces(outcome.result.steady_stream(), workspace_bytes(capability))
    replay = replay_events([(e.kind, e.block, e.size_bytes) for e in stream.events],
                           parse_allocator_conf(outcome.traced.train.allocator_conf, "--allocator-conf"), limit_bytes)
    return replay.max_allocated_bytes, None if replay.out_of_memory is not None else replay.max_reserved_bytes


def gpu_last_step_peaks(run: dict) -> tuple[int, int]:
    """What PyTorch had allocated and reserved at the peaks of the last step the GPU ran (bytes)."""
    last = max(row["step"] for row in run["phases"])
    rows = [row for row in run["phases"] if row["step"] == last]
    return max(row["allocated_peak_bytes"] for row in rows), max(row["reserved_peak_bytes"] for row in rows)


def table(measured: Path) -> list[str]:
    """Per point: the need, what happened at -2% and +2%, and the GPU's allocated and reserved peaks (last step of
    the +2% run) beside the trace's and the allocator model's (traced here, so this machine's versions)."""
    runs = json.loads(measured.read_text())
    device = runs["device"]
    lines = [f"{device.get('gpu')}, driver {device.get('driver')}, CUDA {device.get('cuda')}, torch {device.get('torch')}, "
             f"transformers {device.get('transformers')}, TRL {device.get('trl')}, PEFT {device.get('peft')}", "",
             "Each point's step run with the allocator limited to the exact need -2% and +2% (MiB; allocated and "
             "reserved: the GPU's last step of the +2% run beside the trace's and the allocator model's replay under the "
             "same limit)",
             f"{'point':30} {'need':>6} {'x0.98':>5} {'x1.02':>5} {'ok':>3} {'alloc':>6} {'trace':>6} {'err':>6} "
             f"{'reserv':>6} {'model':>6} {'err':>6}"]
    by_point: dict[str, dict] = {}
    for run in runs["configs"]:
        outcome = "error" if "error" in run else ("ran" if run["ran"] else "OOM")
        by_point.setdefault(run["point"], {"run": run})[run["factor"]] = outcome
        if run["factor"] == 1.02:
            by_point[run["point"]]["run"] = run
    bracketed = ran_below = out_above = 0
    errors: list[float] = []
    held_errors: list[float] = []
    for point, seen in by_point.items():
        run = seen["run"]
        ok = seen.get(0.98) == "OOM" and seen.get(1.02) == "ran"
        bracketed += ok
        ran_below += seen.get(0.98) == "ran"
        out_above += seen.get(1.02) == "OOM"
        cells = f"{point[:30]:30} {run['need_bytes'] / 2**20:6.0f} {seen.get(0.98, '-'):>5} {seen.get(1.02, '-'):>5} " \
                f"{'yes' if ok else 'no':>3}"
        if run.get("phases") and seen.get(1.02) == "ran":
            gpu_allocated, gpu_reserved = gpu_last_step_peaks(run)
            traced_allocated, held = traced_peaks(run)
            errors.append(traced_allocated / gpu_allocated - 1)
            if held is not None:
                held_errors.append(held / gpu_reserved - 1)
            cells += f" {gpu_allocated / 2**20:6.0f} {traced_allocated / 2**20:6.0f} " \
                     f"{traced_allocated / gpu_allocated - 1:+6.1%} {gpu_reserved / 2**20:6.0f} " + (
                         f"{'OOM':>6}" if held is None else f"{held / 2**20:6.0f} {held / gpu_reserved - 1:+6.1%}")
        lines.append(cells)
    lines += ["", f"bracketed: {bracketed} of {len(by_point)} points; ran below the need: {ran_below}; out of memory "
                  f"above it: {out_above}",
              f"traced allocated peak against the GPU's: median {sorted(errors)[len(errors) // 2]:+.1%}, "
              f"from {min(errors):+.1%} to {max(errors):+.1%} over {len(errors)} points" if errors else "",
              f"the allocator model's reserved peak under the same limit against the GPU's: median "
              f"{sorted(held_errors)[len(held_errors) // 2]:+.1%}, from {min(held_errors):+.1%} to "
              f"{max(held_errors):+.1%} over {len(held_errors)} points" if held_errors else ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("prepare", "table"))
    parser.add_argument("measured", nargs="?", type=Path)
    parser.add_argument("--write", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    if args.what == "prepare":
        prepare(POINTS)
    else:
        text = "\n".join(table(args.measured))
        print(text)
        if args.write:
            args.write.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
