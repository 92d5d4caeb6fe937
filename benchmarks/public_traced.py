"""The public measurements traced: each published run that trained, its step traced as the row reads its settings,
with the least card it runs on (the need, what `check` predicts) and what the caching allocator holds on the row's
card (what nvidia-smi or W&B's GPU memory read there), beside the published number.

    .release-venvs/trl-0.14.0-transformers-4.48.2/bin/python benchmarks/public_traced.py   # the TRL 0.14 rows
    .release-venvs/trl-1.12.0-transformers-5.16.1/bin/python benchmarks/public_traced.py   # the TRL 1.12 rows
    python benchmarks/public_traced.py --rows oxen-h100-0.5b-full oxen-h100-1b-full      # some rows only

A row is traced under the installed TRL and transformers, so run this in the environment of the rows' TRL release
(benchmarks/trl_matrix.py --build-only --pair 0.14.0/4.48.2 makes it; its adamw_8bit rows need bitsandbytes there
too: `pip install --no-deps bitsandbytes`); rows of other releases are listed as not traced. The analytic answer
beside it is planned for the installed transformers too. On a card with room the allocator keeps what it freed until
cudaMalloc fails, so a number read there is the held figure, not the need; this says which of the two a published
number matches. A row that measured torch.cuda.max_memory_allocated() (measured_quantity "allocated": the tensors
alone, cuBLAS's workspaces among them) is set beside the trace's allocated peak instead (the traced phases'
Estimate.allocated_peak_bytes). A row that gives torch.cuda.max_memory_reserved() too (`measured_reserved_gib`: the
allocator's segments, no CUDA context) is set beside what the allocator model holds on the row's card, without the
context, in a table of its own below. Writes benchmarks/results/public_traced.txt for TRL 0.14,
public_traced-trl-X.txt for another release X.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
RESULTS = ROOT / "benchmarks" / "results" / "public_traced.txt"


def stand_in(settings: dict) -> dict:
    """The row's settings as the trace runs them: FlashAttention-2 has no CPU kernel, SDPA stands in (both keep q, k,
    v, the output and a float32 log-sum-exp per query for backward, no score matrix)."""
    if settings.get("attn_implementation") == "flash_attention_2":
        return {**settings, "attn_implementation": "sdpa"}
    return settings


def results_path(trl_version: str) -> Path:
    return RESULTS if trl_version == "0.14.0" else RESULTS.with_name(f"public_traced-trl-{trl_version}.txt")


def traced_row(row: dict, transformers_version: str) -> tuple[float, float, float, float, float]:
    """(check's peak, the traced need, what the allocator holds on the row's card or, for a row that measured the
    allocated peak, the trace's allocated peak, seconds, what the allocator model reserves at most on the row's card
    without the CUDA context), GiB but the seconds."""
    import public_measurements as pm

    from vram_planner import engine
    from vram_planner.units import gib

    settings = {**stand_in(row["settings"]), "transformers_version": transformers_version}
    started = time.perf_counter()
    outcome = engine.check(row["model"], row["gpu"], settings, trl_version=row["trl_version"], exact=True)
    allocated = pm.measured_quantity(row) == "allocated"
    compared = outcome.traced.estimate.allocated_peak_bytes if allocated else outcome.held_bytes
    return (gib(outcome.analytic.estimate.peak_bytes), gib(outcome.need_bytes), gib(compared),
            time.perf_counter() - started, gib(outcome.need.held_bytes))


def main(argv: list[str] | None = None) -> int:
    import torch
    import transformers
    import trl

    import public_measurements as pm
    from vram_planner.files import write_atomically
    from vram_planner.model.trl_releases import trl_release

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", help="row ids to trace (default: every run that trained)")
    args = parser.parse_args(argv)
    installed = trl_release(trl.__version__).version
    rows = [r for r in pm.load_rows(pm.DATA) if r["outcome"] == "fits" and (not args.rows or r["id"] in args.rows)]
    lines = [f"torch {torch.__version__} / transformers {transformers.__version__} / trl {trl.__version__}: the "
             "published runs that trained, traced (GiB)",
             f"{'row':34s}{'settings':80s}{'measured':>9s}{'check':>8s}{'need':>8s}{'held':>8s}"
             f"{'measured/held':>15s}{'s':>6s}"]
    print("\n".join(lines), flush=True)
    skipped, errors, reserved = [], [], []
    for row in rows:
        if trl_release(row["trl_version"]).version != installed:
            skipped.append(f"{row['id']} (TRL {row['trl_version']})")
            continue
        try:
            check_gib, need_gib, held_gib, seconds, reserved_gib = traced_row(row, transformers.__version__)
        except Exception as exc:  # noqa: BLE001 - one row that does not trace must not end the table
            lines.append(f"{row['id']:34s}not traced: {str(exc).splitlines()[0][:150]}")
        else:
            errors.append((row["measured_gib"] - held_gib) / held_gib)
            label = pm.short_settings(row["settings"]) + ("*" if stand_in(row["settings"]) != row["settings"] else "")
            label += " (allocated)" if pm.measured_quantity(row) == "allocated" else ""
            lines.append(f"{row['id']:34s}{label:80s}{row['measured_gib']:9.2f}"
                         f"{check_gib:8.2f}{need_gib:8.2f}{held_gib:8.2f}{errors[-1]:+15.1%}{seconds:6.0f}")
            if "measured_reserved_gib" in row:
                reserved.append((row["id"], row["measured_reserved_gib"], reserved_gib))
        print(lines[-1], flush=True)
    if errors:
        lines.append(f"measured against held: median |error| {statistics.median(abs(e) for e in errors):.1%} over "
                     f"{len(errors)} rows, from {min(errors):+.1%} to {max(errors):+.1%}")
    lines.append("* FlashAttention-2 traced (and planned) as SDPA, which has a CPU kernel and keeps the same tensors "
                 "for backward")
    lines.append("(allocated): the row measured torch.cuda.max_memory_allocated(); its 'held' is the trace's allocated "
                 "peak (tensors and cuBLAS workspaces)")
    if reserved:
        lines += ["", "torch.cuda.max_memory_reserved() against what the allocator model holds at most on the row's "
                  "card (GiB, neither with the CUDA context)",
                  f"{'row':34s}{'measured':>9s}{'held':>8s}{'measured/held':>15s}"]
        ratios = [measured / held - 1 for _, measured, held in reserved]
        lines += [f"{row_id:34s}{measured:9.2f}{held:8.2f}{ratio:+15.1%}"
                  for (row_id, measured, held), ratio in zip(reserved, ratios)]
        lines.append(f"median |error| {statistics.median(abs(r) for r in ratios):.1%} over {len(ratios)} rows, from "
                     f"{min(ratios):+.1%} to {max(ratios):+.1%}")
        print("\n".join(lines[-len(reserved) - 4:]))
    if skipped:
        lines.append(f"not traced here (another TRL release; run this in its environment): {', '.join(skipped)}")
        print(lines[-1])
    if not args.rows:
        write_atomically(results_path(installed), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
