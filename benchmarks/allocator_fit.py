"""The analytic model's allocator reserve, fitted over replays of traced steps through the caching allocator model.

    python benchmarks/allocator_fit.py                    # the grid of benchmarks/accuracy.py (about 30 minutes)
    python benchmarks/allocator_fit.py --models SmolLM2-135M --quick
    python benchmarks/allocator_fit.py --write            # also store the coefficients in the default calibration
    python benchmarks/allocator_fit.py --cached-only      # fit again on the points already replayed

For each point of the accuracy grid the step is traced on fake tensors and its allocations replayed through
vram_planner.allocator. Per phase, bisection finds the least memory cudaMalloc must be able to hand out for the
phase's allocations to succeed: the replay runs unlimited up to the phase, then with that capacity through it, where
torch frees its cached segments and retries before it fails (so what earlier phases left cached costs nothing, but
what they left alive, and where, does). The phase's reserve is that memory less the phase's traced tensor peak.

It fits, per phase and allocator setting (torch's defaults, expandable_segments:True), the reserve as a non-negative
linear function of the phase's analytic components (an allocation pattern each: weights loaded once, a KV cache
grown by concatenation, activations freed in reverse, ...), prints the fit's error against the replays beside the
flat 12% it replaces, and writes benchmarks/results/allocator_fit.json (replays cached in allocator-replays.json,
keyed like the accuracy traces plus the allocator model's code).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy import MODELS, MODELS_DIR, RESULTS, _code_only, extras, grid, load_cache, save_atomically  # noqa: E402
from accuracy import trace_key as tracing_key  # noqa: E402

from vram_planner.allocator import CachingAllocator, OutOfMemory, parse_allocator_conf  # noqa: E402
from vram_planner.model.architecture import ModelArchitecture  # noqa: E402
from vram_planner.model.calibration import default_calibration  # noqa: E402
from vram_planner.model.generation_patterns import GENERATION_PATTERNS  # noqa: E402
from vram_planner.probe.fit import ProbePoint  # noqa: E402
from vram_planner.model.phases import TENSOR_COMPONENTS, estimate  # noqa: E402
from vram_planner.model.spec import TrainingConfig  # noqa: E402
from vram_planner.model.trl_releases import trl_release  # noqa: E402
from vram_planner.units import GiB, MiB  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"default": "", "expandable_segments": "expandable_segments:True"}
PRECISION_BYTES = 2 * MiB  # the large pool's rounding (kRoundLarge): finer answers mean nothing
FLAT_FRACTION = 0.12  # what the fitted function replaces
CALIBRATION = ROOT / "profiles" / "calibrations" / "default.json"


def replay_key() -> str:
    digest = hashlib.sha256()
    for path in sorted((ROOT / "vram_planner" / "allocator").glob("*.py")):
        digest.update(_code_only(path.read_text()).encode())
    return f"{tracing_key()} / allocator {digest.hexdigest()[:12]}"


def _prefix(events: list, start: int, conf) -> tuple[CachingAllocator, dict]:
    """The allocator and the live addresses after events [0, start), replayed without a limit."""
    allocator, addresses = CachingAllocator(conf, None), {}
    for kind, block, size in events[:start]:
        if kind == "alloc":
            addresses[block] = allocator.malloc(size)
        else:
            allocator.free(addresses.pop(block))
    return allocator, addresses


def _survives(state: tuple[CachingAllocator, dict], events: list, capacity_bytes: int) -> bool:
    allocator, addresses = copy.deepcopy(state)
    allocator.capacity_bytes = capacity_bytes
    try:
        for kind, block, size in events:
            if kind == "alloc":
                addresses[block] = allocator.malloc(size)
            else:
                allocator.free(addresses.pop(block))
    except OutOfMemory:
        return False
    return True


# Larger micro-batches, where fragmentation grows past what one to four sequences show: on an H100 a TRL step of
# Qwen2.5-0.5B with 80 sequences ran out of memory at the reserve fitted without them and ran with the replay's
# requirement (benchmarks/results/gpu/h100-trl-steps.json).
LARGE_BATCH_MODELS = ("SmolLM2-135M", "Qwen2.5-0.5B", "Llama-3.2-1B")


def large_batches(models: list[str]) -> list[ProbePoint]:
    """16 and 64 sequences per micro-batch, full and LoRA, short and long completions, checkpointing on."""
    return [ProbePoint(model, TrainingConfig(per_device_train_batch_size=batch, num_generations=batch,
                                             max_completion_length=completion, lora_r=lora))
            for model in models if model in LARGE_BATCH_MODELS for batch in (16, 64) for lora in (None, 16)
            for completion in (128, 512)]


def phase_requirement(events: list, span: tuple[int, int], conf, floor_bytes: int) -> int:
    """The least capacity with which the span's allocations succeed, to PRECISION_BYTES."""
    state = _prefix(events, span[0], conf)
    inside = events[span[0]:span[1]]
    low = floor_bytes - 1  # fails: the tensors alone need the floor
    high = floor_bytes + max(floor_bytes // 8, 64 * MiB)
    while not _survives(state, inside, high):
        low, high = high, high + (high - floor_bytes) * 2
    while high - low > PRECISION_BYTES:
        middle = (low + high) // 2
        if _survives(state, inside, middle):
            high = middle
        else:
            low = middle
    return high


def replayed(point, cache: dict) -> dict:
    """Per setting and phase: the traced tensor peak, the replay's requirement, and the analytic components."""
    if point.label in cache:
        return cache[point.label]
    from vram_planner.tracing.step import trace_step

    config = json.loads((MODELS_DIR / f"{point.model}.json").read_text())
    result = trace_step(config, point.train, trl_release())
    stream = result.steady_stream()
    events = [(e.kind, e.block, e.size_bytes) for e in stream.events]
    live, peaks = 0, {}
    for i, e in enumerate(stream.events):  # the allocated peak inside each span: the bisection's floor
        live += -(-e.size_bytes // 512) * 512 * (1 if e.kind == "alloc" else -1)
        for phase, (start, end) in stream.spans.items():
            if start <= i < end:
                peaks[phase] = max(peaks.get(phase, 0), live)
    entry = {"phases": {}}
    for phase in result.phases:
        span = stream.spans.get(phase.name)
        if span is None:
            continue
        needs = {name: phase_requirement(events, span, parse_allocator_conf(text), peaks[phase.name])
                 for name, text in SETTINGS.items()}
        entry["phases"][phase.name] = {"traced_bytes": phase.peak_bytes, "span_peak_bytes": peaks[phase.name],
                                       "requirement_bytes": needs}
    cache[point.label] = entry
    return entry


def analytic_components(point) -> dict[str, dict[str, float]]:
    config = json.loads((MODELS_DIR / f"{point.model}.json").read_text())
    arch = ModelArchitecture.from_config(config, name=point.model)
    est = estimate(arch, point.train, trl_release(), default_calibration(), 80 * GiB)
    return {p.name: {c: p.components.get(c, 0.0) for c in TENSOR_COMPONENTS} for p in est.phases}


IDENTIFIABLE_SHARE = 0.05  # a component the grid never makes 5% of a phase cannot be told apart from noise
MAX_RESERVE_PER_BYTE = 1.0  # freed blocks are released before cudaMalloc fails: no pattern reserves twice its size


def bounded_least_squares(x: np.ndarray, y: np.ndarray, upper: float) -> np.ndarray:
    """min |x a - y| with 0 <= a <= upper, by an active set (numpy has no bounded solver and scipy is not a
    dependency): solve on the free columns, pin the worst violator to its bound, repeat."""
    a, free = np.zeros(x.shape[1]), list(range(x.shape[1]))
    while free:
        pinned = [i for i in range(x.shape[1]) if i not in free]
        rest = y - x[:, pinned] @ a[pinned] if pinned else y
        solved = np.linalg.lstsq(x[:, free], rest, rcond=None)[0]
        violation = np.maximum(-solved, solved - upper)
        if violation.max() <= 0:
            a[free] = solved
            return a
        worst = free[int(np.argmax(violation))]
        a[worst] = 0.0 if solved[free.index(worst)] < 0 else upper
        free.remove(worst)
    return a


def fit(rows: list[dict], setting: str) -> dict[str, dict[str, float]]:
    """Per phase: the coefficient of each analytic component in the reserve (bytes of reserve per byte). A component
    the grid never makes a real share of the phase takes the phase's median reserve per byte."""
    coefficients = {}
    for phase in sorted({r["phase"] for r in rows}):
        mine = [r for r in rows if r["phase"] == phase]
        traced = np.array([r["traced"] for r in mine], dtype=float)
        y = np.array([r["requirement"][setting] for r in mine], dtype=float) - traced
        shares = {c: max(r["components"][c] / r["traced"] for r in mine) for c in TENSOR_COMPONENTS}
        known = [c for c in TENSOR_COMPONENTS if shares[c] >= IDENTIFIABLE_SHARE]
        typical = float(np.clip(np.median(y / traced), 0, MAX_RESERVE_PER_BYTE))
        x = np.array([[r["components"][c] for c in known] for r in mine])
        # Relative weights: a 0.1 GiB miss on a 1 GiB step matters as much as 1 GiB on a 10 GiB one.
        a = bounded_least_squares(x / traced[:, None], y / traced, MAX_RESERVE_PER_BYTE)
        fitted = {c: float(v) for c, v in zip(known, a)}
        coefficients[phase] = {c: round(fitted.get(c, typical), 4) for c in TENSOR_COMPONENTS
                               if round(fitted.get(c, typical), 4) > 0}
    return coefficients


def errors(rows: list[dict], setting: str, reserve) -> list[float]:
    """(predicted - replayed) / replayed requirement, predicted = analytic tensors + reserve(row)."""
    out = []
    for r in rows:
        analytic = sum(r["components"].values())
        out.append((analytic + reserve(r) - r["requirement"][setting]) / r["requirement"][setting])
    return out


def summary(rows: list[dict], coefficients: dict) -> list[str]:
    lines = [f"{'setting':<21}{'phase':<12}{'fitted: median':>15}{'worst':>9}{'flat 12%: median':>18}{'worst':>9}"
             f"{'points':>8}"]
    for setting in SETTINGS:
        for phase in sorted({r["phase"] for r in rows}):
            mine = [r for r in rows if r["phase"] == phase]
            coef = coefficients[setting].get(phase, {})
            fitted = errors(mine, setting, lambda r: sum(coef.get(c, 0) * v for c, v in r["components"].items()))
            flat = errors(mine, setting, lambda r: FLAT_FRACTION * sum(r["components"].values()))
            lines.append(f"{setting:<21}{phase:<12}{statistics.median(map(abs, fitted)):>15.2%}"
                         f"{max(fitted, key=abs):>+9.2%}{statistics.median(map(abs, flat)):>18.2%}"
                         f"{max(flat, key=abs):>+9.2%}{len(mine):>8}")
    return lines


def main() -> None:
    sys.setrecursionlimit(1_000_000)  # deepcopy walks the allocator's block lists (prev/next) recursively
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--quick", action="store_true", help="short completions only, no extras")
    parser.add_argument("--write", action="store_true", help=f"store the coefficients in {CALIBRATION.name}")
    parser.add_argument("--cached-only", action="store_true", help="fit on the points already replayed, trace none")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    points = grid(args.models, args.quick)
    if not args.quick:
        points += extras(args.models[:2]) + large_batches(args.models)
    cache_path, key = args.out / "allocator-replays.json", replay_key()
    cache = load_cache(cache_path, key)
    rows = []
    if args.cached_only:
        points = [point for point in points if point.label in cache]
    for i, point in enumerate(points, 1):
        print(f"[{i}/{len(points)}] {point.label}", file=sys.stderr, flush=True)
        entry = replayed(point, cache)
        save_atomically(cache_path, json.dumps({"key": key, "points": cache}, indent=1))
        components = analytic_components(point)
        for phase, figures in ((p, f) for p, f in entry["phases"].items() if p in components):
            rows.append({"point": point.label, "phase": phase, "traced": figures["traced_bytes"],
                         "requirement": figures["requirement_bytes"], "components": components[phase]})
    coefficients = {setting: fit(rows, setting) for setting in SETTINGS}
    lines = summary(rows, coefficients)
    print("\n".join(lines))
    document = {"key": key, "coefficients": coefficients, "summary": lines, "rows": rows}
    save_atomically(args.out / "allocator_fit.json", json.dumps(document, indent=1))
    if args.write:
        calibration = json.loads(CALIBRATION.read_text())
        # the loss phase under torch's defaults, and generation's patterns, are fitted on whole steps' needs
        # (benchmarks/reserve_fit.py)
        shipped = calibration["allocator_reserve"]["default"]
        coefficients["default"]["training"] = shipped["training"]
        coefficients["default"]["generation"].update(
            {name: value for name, value in shipped["generation"].items() if name in GENERATION_PATTERNS})
        calibration["allocator_reserve"] = coefficients
        save_atomically(CALIBRATION, json.dumps(calibration, indent=2) + "\n")


if __name__ == "__main__":
    main()
