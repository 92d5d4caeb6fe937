"""Where the verdict is decided: the analytic peak of `check` beside the exact need, over a broad grid.

    python benchmarks/boundary.py              # the whole grid (traces are cached; the first run takes a while)
    python benchmarks/boundary.py --quick      # the fixture architectures and the smallest catalog configs
    python benchmarks/boundary.py --models Qwen3-0.6B phi-2
    python benchmarks/boundary.py --from-needs   # the analytic side only, against the committed needs
    python benchmarks/boundary.py --add          # the committed needs, bisecting only the points they lack
    python benchmarks/boundary.py --suffix transformers-5.25 --models Qwen3-0.6B   # a table of its own (below)
    python benchmarks/boundary.py --configs "full c1024 B8" "lora c8192 B4"     # some configs only

For every point the step is traced and its need bisected with the caching allocator model (`check --exact`: the
least card capacity, CUDA context and cuBLAS workspaces included, on which the step runs), and printed beside the
analytic peak and the capacity from which `check` says "fits" (peak / (1 - safety margin)). A window is a point
where `check` says "fits" on a card the exact engine says is too small: fits-from below the need. Targets: no window;
the analytic peak never more than 1% below the need (the safety margin is left for the allocator model's own error
against a GPU); median |analytic - need| under 2%.

A run's batches are as long as their longest prompt, so it meets every prompt length up to max_prompt_length; where
the analytic model says a shorter one strands more in the prefill's segments (and that raises its estimate), the step
is traced at that length too ("POINT at pN") and the run's need is the larger: the table says where it came from.

Needs are cached in benchmarks/results/boundary-needs.json, keyed by the point and the versions of torch,
transformers, TRL and PEFT and the tracing and allocator code; the analytic side is recomputed on every run. Writes
boundary.txt (the table and the summary) and boundary.json next to the cache when the whole grid ran.

--from-needs traces nothing: it takes the committed needs as they are, whatever code they came from (the table's
last line names it), and recomputes the analytic side, so that a change to the analytic model alone is judged in
seconds. A point without a committed need is left out and said. --add bisects those points with the current code and
adds them to the committed needs, each with the key of the code that made it. The analytic side plans for the
transformers and TRL releases the needs were traced under (the needs' key names them), so a table traced under
other releases than the installed ones is rejudged as those releases run.

--suffix NAME keeps a table apart from the tested set's: its needs in boundary-needs-NAME.json, the table in
boundary-NAME.txt and .json, written when the points that ran are all those its needs hold. Run under another library
release (a newer transformers in its own environment), it shows that release at the boundary beside the grid
(results/boundary-transformers-5.25.txt: the Hub's kernels, which 5.25 loads by default); run in an old TRL release's
environment (benchmarks/trl_matrix.py --build-only --pair 0.14.0/4.48.2), that release
(results/boundary-trl-0.14.0.txt). A point the release cannot run (a knob it lacks) is said and left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import sys
from pathlib import Path

from accuracy import _code_only, load_cache, save_atomically, trace_key

from vram_planner.model.calibration import default_calibration

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FIXTURES = ROOT / "tests" / "fixtures"
# The CUDA context and cuBLAS workspaces of the need, a card with room for most points; judged with the default
# calibration, as `check` judges a card no probe has measured
CARD = "h100-80gb"
# One catalog model per family (and the architectures whose windows were measured), each across the knobs where
# the verdict turns: long completions, large micro-batches, several micro-batches per generation, a reference model,
# LoRA and full fine-tuning, eager attention and expandable segments.
MODELS = ("SmolLM2-135M", "Qwen2.5-0.5B", "Qwen3-0.6B", "Llama-3.2-1B", "DeepSeek-R1-Distill-Qwen-1.5B",
          "gemma-2-2b", "gemma-3-1b-it", "phi-2", "Phi-3-mini-4k-instruct", "Mistral-7B-v0.3")
BF16_LORA = {"dtype": "bfloat16", "lora_r": 16}
EXPANDABLE = "expandable_segments:True"
CONFIGS = {
    "full c1024 B8": {"dtype": "bfloat16", "max_completion_length": 1024},
    # TRL's defaults (float32 weights under autocast) with the 8-bit AdamW `plan` recommends first
    "fp32 full adamw_8bit": {"optim": "adamw_8bit"},
    # TRL's plain defaults, what a user who changes nothing runs: float32 weights, fused AdamW
    "fp32 full": {},
    "lora c4096 B16": {**BF16_LORA, "num_generations": 16, "per_device_train_batch_size": 16,
                       "max_completion_length": 4096},
    "lora c8192 B4": {**BF16_LORA, "num_generations": 4, "per_device_train_batch_size": 4,
                      "max_completion_length": 8192},
    "lora c256 B128": {**BF16_LORA, "num_generations": 16, "per_device_train_batch_size": 128,
                       "max_completion_length": 256},
    "lora p512 c2048 G16 S2 beta": {**BF16_LORA, "num_generations": 16, "per_device_train_batch_size": 8,
                                    "gradient_accumulation_steps": 2, "max_prompt_length": 512,
                                    "max_completion_length": 2048, "beta": 0.04},
    "fp32 lora c1024 eager": {"lora_r": 16, "attn_implementation": "eager", "max_completion_length": 1024},
    "lora c4096 B4 eager": {**BF16_LORA, "num_generations": 4, "per_device_train_batch_size": 4,
                            "max_completion_length": 4096, "attn_implementation": "eager"},
    "lora c2048 B32 expandable": {**BF16_LORA, "num_generations": 8, "per_device_train_batch_size": 32,
                                  "max_completion_length": 2048, "allocator_conf": EXPANDABLE},
    # What users run with expandable segments beyond LoRA with checkpointing: TRL's defaults (and with the 8-bit
    # AdamW `plan` recommends first), bf16 full fine-tuning with 8-bit AdamW, and LoRA with checkpointing off; where
    # pages stay mapped beside long-lived tensors made among transients (vram_planner/model/expandable_pages.py)
    "fp32 full expandable": {"allocator_conf": EXPANDABLE},
    "fp32 full adamw_8bit expandable": {"optim": "adamw_8bit", "allocator_conf": EXPANDABLE},
    "full c1024 B8 8bit expandable": {"dtype": "bfloat16", "max_completion_length": 1024, "optim": "adamw_8bit",
                                      "allocator_conf": EXPANDABLE},
    # A laptop card's step: four short completions a micro-batch, with expandable segments, where the free runs
    # beside each layer's checkpointed input keep a few MiB mapped, a large share of a step of a gigabyte or two
    "lora c256 B4 expandable": {**BF16_LORA, "num_generations": 4, "per_device_train_batch_size": 4,
                                "max_completion_length": 256, "allocator_conf": EXPANDABLE},
    "lora p1024 c384 B8 8bit": {**BF16_LORA, "num_generations": 8, "per_device_train_batch_size": 8,
                                "max_prompt_length": 1024, "max_completion_length": 384, "optim": "adamw_8bit"},
    "lora c1024 B16 nogc expandable": {**BF16_LORA, "num_generations": 16, "per_device_train_batch_size": 16,
                                       "max_completion_length": 1024, "gradient_checkpointing": False,
                                       "allocator_conf": EXPANDABLE},
    # Generation-bound: hundreds of short sequences generated at once (the generation batch is the micro-batch times
    # steps_per_generation), whose KV cache is cut from the segments the prefill and the previous step left
    "full p128 c192 B64 S8": {"dtype": "bfloat16", "num_generations": 8, "per_device_train_batch_size": 64,
                              "gradient_accumulation_steps": 2, "steps_per_generation": 8, "max_prompt_length": 128,
                              "max_completion_length": 192},
    "lora p64 c384 B32 S8": {**BF16_LORA, "num_generations": 8, "per_device_train_batch_size": 32,
                             "gradient_accumulation_steps": 4, "steps_per_generation": 8, "max_prompt_length": 64,
                             "max_completion_length": 384},
    # Prefill-bound: 512 prompts generated at once for a small micro-batch (64 steps per generation), where
    # generate()'s forward of the prompts asks for the largest blocks of the step (the MLP's, eager attention's)
    "lora p512 c128 B8 S64": {**BF16_LORA, "num_generations": 8, "per_device_train_batch_size": 8,
                              "gradient_accumulation_steps": 4, "steps_per_generation": 64, "max_prompt_length": 512,
                              "max_completion_length": 128},
    "lora p256 c128 B8 S64 eager": {**BF16_LORA, "num_generations": 8, "per_device_train_batch_size": 8,
                                    "gradient_accumulation_steps": 4, "steps_per_generation": 64,
                                    "max_prompt_length": 256, "max_completion_length": 128,
                                    "attn_implementation": "eager"},
    # Gradient checkpointing off under torch's default allocator, full fine-tuning and LoRA (the held-out sweeps'
    # worst without checkpointing: the loss forward's kept tensors cut from the segments the decoding left)
    "full c512 B16 nogc": {"dtype": "bfloat16", "num_generations": 8, "per_device_train_batch_size": 16,
                           "gradient_accumulation_steps": 4, "max_completion_length": 512,
                           "gradient_checkpointing": False},
    "lora c1024 B16 nogc": {**BF16_LORA, "num_generations": 16, "per_device_train_batch_size": 16,
                            "max_completion_length": 1024, "gradient_checkpointing": False},
}
# QLoRA, the 16 GB card's config: 4-bit NF4 weights, double-quantized, bf16 adapters (TRL casts them), at a long
# completion and at a short one for a large micro-batch. A table of their own (--suffix qlora --configs ...): the
# reserve's patterns were read off and fitted on 16-bit steps, and these are not in that fit.
QLORA_CONFIGS = {
    "qlora c1024 B8": {**BF16_LORA, "load_in_4bit": True, "max_completion_length": 1024},
    "qlora p256 c256 B32 G16": {**BF16_LORA, "load_in_4bit": True, "num_generations": 16,
                                "per_device_train_batch_size": 32, "max_prompt_length": 256,
                                "max_completion_length": 256},
}
# For the releases whose per_device_train_batch_size counts prompts (TRL 0.14: each micro-batch is B prompts' G
# completions, its loss merged with the reference's log-probs), the grid's batches would be G times larger: these are
# theirs, as the recipes of the time ran them (bf16 weights under accelerate's bf16 autocast, or TRL 0.14's own
# float32 without it; its LoRA with checkpointing fails, which `check` says), each within the card; run them with
# --configs in that release's environment.
AMP = {"dtype": "bfloat16", "mixed_precision": "bf16"}
PROMPT_BATCH_CONFIGS = {
    "amp full B1 G4 c786": {**AMP, "num_generations": 4, "gradient_accumulation_steps": 4,
                            "max_prompt_length": 256, "max_completion_length": 786},
    "amp lora B1 G4 c786": {**AMP, "lora_r": 16, "num_generations": 4, "gradient_accumulation_steps": 4,
                            "max_prompt_length": 256, "max_completion_length": 786},
    "amp 8bit gc B1 G4 c786": {**AMP, "optim": "adamw_8bit", "gradient_checkpointing": True, "num_generations": 4,
                               "gradient_accumulation_steps": 4, "max_prompt_length": 256,
                               "max_completion_length": 786},
    "amp lora B2 G4 c512": {**AMP, "lora_r": 16, "per_device_train_batch_size": 2, "num_generations": 4,
                            "gradient_accumulation_steps": 2, "max_completion_length": 512},
    "amp full gc B1 G8 c1024": {**AMP, "gradient_checkpointing": True, "num_generations": 8,
                                "max_completion_length": 1024},
    "amp lora B1 G16 c256": {**AMP, "lora_r": 16, "num_generations": 16, "max_completion_length": 256},
    "amp lora B1 G2 c2048": {**AMP, "lora_r": 16, "num_generations": 2, "max_completion_length": 2048},
    "bf16 full B1 G8 c1024": {"dtype": "bfloat16", "num_generations": 8, "max_completion_length": 1024},
    "fp32 defaults": {},
    "fp32 lora eager B1 G4 c1024": {"lora_r": 16, "attn_implementation": "eager", "num_generations": 4,
                                    "max_completion_length": 1024},
}
QUICK_CONFIGS = ("full c1024 B8",)
FIXTURE_CONFIGS = {
    "full beta": {"per_device_train_batch_size": 4, "num_generations": 4, "max_prompt_length": 32,
                  "max_completion_length": 256, "beta": 0.04},
    "lora B32": {"lora_r": 8, "per_device_train_batch_size": 32, "num_generations": 8, "max_prompt_length": 32,
                 "max_completion_length": 128},
    "qlora B16": {"lora_r": 8, "load_in_4bit": True, "dtype": "bfloat16", "per_device_train_batch_size": 16,
                  "num_generations": 8, "max_prompt_length": 32, "max_completion_length": 128},
}


def points(models: list[str], quick: bool, names: list[str] | None = None) -> list[tuple[str, str, dict]]:
    """(label, model, settings): the fixture architectures, then the catalog grid (of the configs `names`, where
    given, and then without the fixtures)."""
    out = [(f"{path.stem} {name}", str(path), settings) for path in sorted(FIXTURES.glob("tiny-*.json"))
           for name, settings in FIXTURE_CONFIGS.items()] if names is None else []
    configs = {name: CONFIGS[name] for name in QUICK_CONFIGS} if quick else CONFIGS
    if names is not None:
        configs = {name: {**CONFIGS, **PROMPT_BATCH_CONFIGS, **QLORA_CONFIGS}[name] for name in names}
    return out + [(f"{model} {name}", model, settings) for model in models for name, settings in configs.items()]


def need_key() -> str:
    """What a cached need depends on: the trace's key, and the allocator model's code."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "vram_planner" / "allocator").glob("*.py")):
        digest.update(_code_only(path.read_text()).encode())
    return f"{trace_key()} / allocator {digest.hexdigest()[:12]} / needs without the context, phases"


def committed_needs(from_needs: bool, path: Path) -> tuple[dict, str]:
    """The cached needs in `path` and the key they were made under: those of the current code, or with `from_needs`
    the committed ones whatever code made them."""
    if not from_needs:
        key = need_key()
        return load_cache(path, key), key
    data = json.loads(path.read_text()) if path.is_file() else {}
    return data.get("points", {}), data.get("key", "no committed needs")


def exact(model: str, settings: dict, cache: dict, label: str) -> dict:
    """What the allocator model needs and holds for the traced step, the CUDA context aside; each phase's traced
    tensor peak, and the phase where the step runs out on the capacity just below its need (the phase whose
    reserve decides it: benchmarks/reserve_fit.py fits the loss phase's on these)."""
    if label not in cache:
        from vram_planner import engine

        outcome = engine.check(model, CARD, settings, exact=True, calibration=default_calibration())
        cache[label] = {"allocator_need_bytes": outcome.need.capacity_bytes,
                        "allocator_held_bytes": outcome.need.held_bytes, "seconds": outcome.seconds,
                        "tensor_peak_bytes": {p.name: p.peak_bytes for p in outcome.result.phases},
                        "binding_phase": binding_phase(outcome)}
    return cache[label]


def binding_phase(outcome) -> str | None:
    """The phase where the allocator model runs out on one granule less than the need (None: nowhere, where the
    allocator is not monotone in the capacity)."""
    from vram_planner.allocator.replay import replay_events

    stream, conf, capacity = below_need(outcome)
    events = [(e.kind, e.block, e.size_bytes) for e in stream.events]
    below = replay_events(events, conf, capacity)
    return None if below.out_of_memory is None else stream.events[below.out_of_memory_event].phase


def below_need(outcome):
    """The traced step's stream with its cuBLAS workspaces, the allocator's settings, and the capacity one granule
    below the need: where the replay shows what decides the need."""
    from vram_planner.allocator import parse_allocator_conf
    from vram_planner.model.cublas import workspace_bytes
    from vram_planner.tracing.events import with_workspaces
    from vram_planner.allocator.need import granule_bytes

    conf = parse_allocator_conf(outcome.traced.train.allocator_conf, "--allocator-conf")
    capability = outcome.traced.context.gpu.compute_capability
    stream = with_workspaces(outcome.result.steady_stream(), workspace_bytes(capability))
    return stream, conf, outcome.need.capacity_bytes - granule_bytes(conf)


def heaviest_prompt(model: str, settings: dict, trl_version: str | None = None) -> int | None:
    """The shorter prompt at which the analytic model says the step may need more (the batches of a run are as long
    as their longest prompt: every length up to max_prompt_length comes), as `check --exact` traces it
    (engine.heavier_prompt_length); None where the longest needs the most."""
    from vram_planner import engine

    context = engine.make_context(model, CARD, trl_version=trl_version, calibration=default_calibration())
    return engine.heavier_prompt_length(context, engine.make_training(context, settings))


def shorter_label(label: str, prompt: int) -> str:
    return f"{label} at p{prompt}"


def shorter_need(label: str, model: str, settings: dict, cache: dict, prompt: int | None,
                 trace: bool = False) -> tuple[int, dict] | None:
    """The need at `prompt`, the shorter prompt the analytic model names (heaviest_prompt), with its length: from the
    cache, bisected when `trace` and the cache lacks it (None: none is named, or none is cached)."""
    if prompt is None or (not trace and shorter_label(label, prompt) not in cache):
        return None
    return prompt, exact(model, {**settings, "max_prompt_length": prompt}, cache, shorter_label(label, prompt))


def traced_release(key: str) -> dict:
    """The setting that plans for the transformers release a needs' key names, where it is not the installed one."""
    import transformers

    found = re.search(r"transformers (\S+?)/", key)
    if found is None or found.group(1) == transformers.__version__:
        return {}
    return {"transformers_version": found.group(1)}


def traced_trl(key: str) -> str | None:
    """The TRL release a needs' key names (None: none named, as the installed one is planned)."""
    found = re.search(r"trl (\S+?)/", key)
    return None if found is None else found.group(1)


def rejudged(needs: dict, release: dict, trl_version: str | None = None) -> list[tuple[dict, dict]]:
    """(row, settings) of every grid point `needs` holds, the analytic side planned for `release` (traced_release)
    and `trl_version`, as --from-needs judges them; silent on the points it leaves out."""
    out = []
    for label, model, settings in (points(list(MODELS), False) + points(list(MODELS), False, [*PROMPT_BATCH_CONFIGS])
                                   + points(list(MODELS), False, [*QLORA_CONFIGS])):
        if label in needs:
            settings = {**settings, **release}
            shorter = shorter_need(label, model, settings, needs, heaviest_prompt(model, settings, trl_version))
            out.append((row(label, model, settings, needs[label], shorter, trl_version), settings))
    return out


def row(label: str, model: str, settings: dict, traced: dict, shorter: tuple[int, dict] | None = None,
        trl_version: str | None = None) -> dict:
    """The default calibration's estimate (what `check` answers until a probe measures the card) beside the run's
    need, both with the CUDA context the GPU catalog gives the card: the step's with prompts of max_prompt_length,
    or `shorter`'s, (prompt length, traced), where that needs more. Planned for `trl_version` (None: the installed
    TRL, which traced the needs)."""
    from vram_planner import engine

    verdict = engine.check(model, CARD, settings, trl_version=trl_version, calibration=default_calibration())
    context = verdict.context.cuda_context.bytes
    need_prompt = None
    if shorter is not None and shorter[1]["allocator_need_bytes"] > traced["allocator_need_bytes"]:
        need_prompt, traced = shorter
    need, held = traced["allocator_need_bytes"] + context, traced["allocator_held_bytes"] + context
    peak = verdict.estimate.peak_bytes
    fits_from = verdict.fits_from_bytes
    return {"point": label, "attn_implementation": verdict.train.attn_implementation,
            "gradient_checkpointing": verdict.train.gradient_checkpointing,
            "analytic_bytes": peak, "fits_from_bytes": fits_from, "need_bytes": need,
            "held_bytes": held, "error": (peak - need) / need, "window": fits_from < need,
            # check flags a "fits" near the boundary on every card below the need where its band reaches the need
            "flagged": fits_from < need <= verdict.need_bound_bytes,
            "seconds": traced["seconds"], "need_prompt": need_prompt}


def table(rows: list[dict]) -> list[str]:
    gib = 2 ** 30
    lines = [f"{'point':50} {'analytic':>9} {'fits from':>9} {'need':>9} {'held':>9} {'error':>7}  window",
             f"{'':50} {'GiB':>9} {'GiB':>9} {'GiB':>9} {'GiB':>9}"]
    for r in rows:
        lines.append(f"{r['point']:50} {r['analytic_bytes'] / gib:9.2f} {r['fits_from_bytes'] / gib:9.2f} "
                     f"{r['need_bytes'] / gib:9.2f} {r['held_bytes'] / gib:9.2f} {r['error']:+7.1%}  "
                     + (("flagged " if r.get("flagged") else "WINDOW ") if r["window"] else "")
                     + (f"(needs the most at p{r['need_prompt']})" if r.get("need_prompt") else ""))
    return lines


def summary(rows: list[dict]) -> list[str]:
    if not rows:
        return ["", "no point ran"]
    errors = [r["error"] for r in rows]
    windows = [r for r in rows if r["window"]]
    flagged = [r for r in windows if r.get("flagged")]
    under = [r for r in rows if r["error"] < -0.01]
    worst = min(rows, key=lambda r: r["error"])
    return ["",
            f"{len(rows)} points: {len(windows)} window(s) (check says fits below the need); "
            f"{len(under)} with the analytic peak more than 1% below the need",
            f"windows flagged near the boundary (\"flagged\": check names --exact there): {len(flagged)} of "
            f"{len(windows)}; silent (\"WINDOW\"): {len(windows) - len(flagged)}",
            f"|analytic - need| / need: median {statistics.median(abs(e) for e in errors):.2%}, "
            f"worst under {worst['error']:+.1%} ({worst['point']}), worst over {max(errors):+.1%}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--quick", action="store_true", help="fixtures and one config per catalog model")
    parser.add_argument("--from-needs", action="store_true",
                        help="trace nothing: the committed needs, whatever code made them")
    parser.add_argument("--add", action="store_true",
                        help="the committed needs, whatever code made them; bisect the points they lack")
    parser.add_argument("--suffix", metavar="NAME", help="needs and table of their own (boundary-needs-NAME.json, "
                        "boundary-NAME.txt, written when every point its needs hold ran)")
    parser.add_argument("--configs", nargs="+", choices=[*CONFIGS, *PROMPT_BATCH_CONFIGS, *QLORA_CONFIGS],
                        metavar="CONFIG",
                        help="these configs only (no fixtures): the grid's, PROMPT_BATCH_CONFIGS or QLORA_CONFIGS")
    args = parser.parse_args()
    tail = f"-{args.suffix}" if args.suffix else ""
    cache_path = RESULTS / f"boundary-needs{tail}.json"
    cache, key = committed_needs(args.from_needs or args.add, cache_path)
    release, trl_version = traced_release(key), traced_trl(key)
    rows = []
    grid = points(args.models, args.quick, args.configs)
    for n, (label, model, settings) in enumerate(grid, 1):
        if args.from_needs and label not in cache:
            print(f"[{n}/{len(grid)}] {label}: no committed need", file=sys.stderr, flush=True)
            continue
        known = set(cache)
        try:
            traced = exact(model, settings, cache, label)
            prompt = heaviest_prompt(model, {**settings, **release}, trl_version)
            shorter = shorter_need(label, model, settings, cache, prompt, trace=not args.from_needs)
            if args.from_needs and prompt is not None and shorter is None:
                print(f"[{n}/{len(grid)}] {label}: no committed need at the shorter prompt that may need more",
                      file=sys.stderr, flush=True)
            rows.append(row(label, model, {**settings, **release}, traced, shorter, trl_version))
        except Exception as exc:  # a point the engines cannot run is reported, not fatal to the grid
            print(f"[{n}/{len(grid)}] {label}: {exc}", file=sys.stderr, flush=True)
            continue
        for name in sorted(set(cache) - known):
            if args.add:
                cache[name]["key"] = need_key()  # not the committed needs' code
            print(f"[{n}/{len(grid)}] {name}: need bisected in {cache[name]['seconds']:.1f} s", file=sys.stderr,
                  flush=True)
        if set(cache) != known:
            save_atomically(cache_path, json.dumps({"key": key, "points": cache}, indent=1))
    lines = table(rows) + summary(rows) + [f"needs from {key}"]
    print("\n".join(lines))
    whole = not args.quick and args.models == list(MODELS) and args.configs is None
    if args.suffix:  # a table of its own is every point its needs hold: a subset would overwrite it with less
        whole = {r["point"] for r in rows} >= {label for label in cache if not re.search(r" at p\d+$", label)}
        if not whole:
            print(f"boundary{tail}.txt not written: these points are a part of the {len(cache)} its needs hold "
                  "(run the models and configs it holds to write it)", file=sys.stderr)
    if whole:
        save_atomically(RESULTS / f"boundary{tail}.txt", "\n".join(lines) + "\n")
        save_atomically(RESULTS / f"boundary{tail}.json", json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
