"""Issue 25 item 7: the exact need held to a GPU. Boundary configs run on a card whose allocator is limited to the
need the allocator model bisects, less 2% and plus 2% (torch.cuda.set_per_process_memory_fraction): the step must
run out of memory below the need and run above it.

    python benchmarks/gpu_boundary.py prepare     # no GPU: each point's need, written to results/gpu/boundary-points.json
    python benchmarks/gpu_steps.py --points benchmarks/results/gpu/boundary-points.json --jobs 8 --out DIR   # the GPU
    python benchmarks/gpu_boundary.py table DIR/gpu_steps.json   # no GPU: the outcome table

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
                           "snapshot": False})
    out.write_text(json.dumps({"prompt_tokens": length, "card": CARD, "points": points}, indent=1) + "\n")


def table(measured: Path) -> list[str]:
    runs = json.loads(measured.read_text())
    lines = [f"{runs['device'].get('gpu')}, driver {runs['device'].get('driver')}, CUDA {runs['device'].get('cuda')}, "
             f"torch {runs['device'].get('torch')}, transformers {runs['device'].get('transformers')}, "
             f"TRL {runs['device'].get('trl')}, PEFT {runs['device'].get('peft')}", "",
             f"{'point':42} {'need GiB':>9} {'x0.98':>8} {'x1.02':>8}  bracketed"]
    by_point: dict[str, dict] = {}
    for run in runs["configs"]:
        outcome = "error" if "error" in run else ("ran" if run["ran"] else "OOM")
        by_point.setdefault(run["point"], {"need": run["need_bytes"]})[run["factor"]] = outcome
    bracketed = 0
    for point, seen in by_point.items():
        ok = seen.get(0.98) == "OOM" and seen.get(1.02) == "ran"
        bracketed += ok
        lines.append(f"{point:42} {seen['need'] / 2**30:9.3f} {seen.get(0.98, '-'):>8} {seen.get(1.02, '-'):>8}  "
                     f"{'yes' if ok else 'no'}")
    lines += ["", f"bracketed: {bracketed} of {len(by_point)} points"]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("prepare", "table"))
    parser.add_argument("measured", nargs="?", type=Path)
    args = parser.parse_args(argv)
    if args.what == "prepare":
        prepare(POINTS)
    else:
        print("\n".join(table(args.measured)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
