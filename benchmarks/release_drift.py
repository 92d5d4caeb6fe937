"""What a new release of transformers, TRL, PEFT, accelerate or torch changes in the trace, before users or CI meet it.

    python benchmarks/release_drift.py            # trace the fixture configs, compare with the tested set's figures
    python benchmarks/release_drift.py --record   # make the installed versions the reference (the tested set's)

Run it in a virtual environment with the new release installed (`pip install -e . transformers==X` over the tested
set of constraints.txt). Each config of the grid is traced under the installed libraries; every phase's tensor
components are printed beside the figures recorded under the tested set (benchmarks/results/release_drift.json),
with the analytic model's figure for the same config under the same release row, so a change shows as a row of
the table: where the trace moved and the analytic model followed (a row of profiles/transformers.toml or trl.toml
already describes it), and where it did not (a row to add). Exits 0 either way: it reports, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "release_drift.json"
FIXTURES = ROOT / "tests" / "fixtures"
# Small enough for seconds per trace; every phase runs (beta > 0), full and LoRA, float32 weights under autocast
# (where the KV cache's dtype moved in transformers 5.24) and bfloat16.
GRID = {
    "full-fp32": {"per_device_train_batch_size": 2, "num_generations": 2, "max_prompt_length": 16,
                  "max_completion_length": 24, "beta": 0.04},
    "lora-bf16": {"per_device_train_batch_size": 2, "num_generations": 2, "max_prompt_length": 16,
                  "max_completion_length": 24, "lora_r": 8, "dtype": "bfloat16"},
}
CATALOG = (("Qwen2.5-0.5B", {"per_device_train_batch_size": 2, "num_generations": 2, "max_completion_length": 64}),)


def points() -> list[tuple[str, str, dict]]:
    """(name, model, settings): every fixture architecture under each grid config, then a catalog model or two."""
    out = [(f"{path.stem}/{config}", str(path), settings)
           for path in sorted(FIXTURES.glob("tiny-*.json")) for config, settings in GRID.items()]
    return out + [(f"{model}/default", model, settings) for model, settings in CATALOG]


def measure(model: str, settings: dict) -> dict:
    """The traced and analytic tensor bytes per phase and component of one config, as the installed release runs
    it (the attention, the transformers row and the TRL row resolved as `check` resolves them)."""
    from vram_planner import engine
    from vram_planner.model.phases import TENSOR_COMPONENTS
    from vram_planner.profiles import model_config
    from vram_planner.tracing.step import trace_step

    context = engine.make_context(model, "h100-80gb")
    train = engine.make_training(context, settings)
    config, _, _ = model_config(model)
    traced = trace_step(config, train, context.release)
    analytic = engine.judge(context, train).estimate
    phases = {}
    for phase in traced.phases:
        estimated = next((p for p in analytic.phases if p.name == phase.name), None)
        phases[phase.name] = {name: [phase.components.get(name, 0),
                                     round(estimated.components.get(name, 0)) if estimated else None]
                              for name in TENSOR_COMPONENTS}
    return {"transformers_row": train.transformers.min_version, "attention": train.attn_implementation,
            "phases": phases}


def compare(recorded: dict, now: dict) -> list[str]:
    """One line per phase component whose traced bytes changed: recorded, now, and the analytic model's error now
    (the trace rounds every tensor to 512 bytes, so a tiny fixture's follows within a few percent)."""
    lines = []
    for name, point in now.items():
        before = recorded.get(name)
        if before is None:
            lines.append(f"{name}: not in the recorded figures")
            continue
        for phase, components in point["phases"].items():
            for component, (traced, analytic) in components.items():
                old = before["phases"].get(phase, {}).get(component, [None])[0]
                if old != traced:
                    error = f"{(analytic - traced) / traced:+.1%}" if analytic is not None and traced else "n/a"
                    lines.append(f"{name:34} {phase:10} {component:18} {old or 0:>14,} -> {traced:>14,}  "
                                 f"analytic {error}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="write the installed versions' figures as reference")
    args = parser.parse_args(argv)
    from vram_planner.tracing.step import engine_versions

    versions = engine_versions()
    figures = {}
    for name, model, settings in points():
        print(f"tracing {name}", file=sys.stderr, flush=True)
        figures[name] = measure(model, settings)
    if args.record:
        RESULTS.write_text(json.dumps({"versions": versions, "points": figures}, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(figures)} configs under {versions} in {RESULTS.relative_to(ROOT)}")
        return 0
    recorded = json.loads(RESULTS.read_text())
    print(f"recorded under {recorded['versions']}")
    print(f"traced now under {versions}")
    changed = compare(recorded["points"], figures)
    print("\n".join(changed) if changed else "no traced figure changed")
    print(f"{len(changed)} component(s) changed over {len(figures)} configs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
