"""The exact need at the completion lengths around a boundary, with the decoding steps grouped as the trace records
them and one by one.

    python benchmarks/completion_lengths.py     # prints the table, writes benchmarks/results/completion_lengths.txt

A run meets every completion length up to its max_completion_length (a batch decodes until its longest completion
ends), so where the need is not monotone in the length, "runs at the max" is not "the run fits". The trace records at
most MAX_CACHE_UPDATES cache updates (layers x decoding steps) and past that grows the cache in fewer steps of
several tokens each (vram_planner.tracing.cache_growth): each length is traced both ways, each in a cache of its
own, so that a flip the grouping made would show as a difference between the two columns.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "completion_lengths.txt"
MODEL, CARD = "Qwen3-0.6B", "3.70GiB"  # the grid's window: LoRA, 8-bit AdamW, 8 x 1,024-token prompts
SETTINGS = {"dtype": "bfloat16", "lora_r": 16, "num_generations": 8, "per_device_train_batch_size": 8,
            "max_prompt_length": 1024, "optim": "adamw_8bit"}
LENGTHS = (344, 368, 384, 392, 400, 408, 456, 504, 512)


def needs(updates: int) -> dict[int, tuple[int, bool]]:
    """{completion length: (the need's capacity in bytes, whether it runs on the card)} with the trace recording up
    to `updates` cache updates."""
    from vram_planner import engine
    from vram_planner.tracing import cache_growth

    saved, cache_growth.MAX_CACHE_UPDATES = cache_growth.MAX_CACHE_UPDATES, updates
    try:
        out = {}
        for length in LENGTHS:
            traced = engine.trace(MODEL, CARD, {**SETTINGS, "max_completion_length": length})
            out[length] = (traced.need.capacity_bytes, bool(traced.need.fits_card))
            print(f"  {updates} updates, {length} tokens: {traced.need.capacity_bytes / 2 ** 30:.4f} GiB", flush=True)
        return out
    finally:
        cache_growth.MAX_CACHE_UPDATES = saved


def main() -> int:
    from vram_planner.files import write_atomically
    from vram_planner.tracing.cache_growth import MAX_CACHE_UPDATES

    columns = {}
    for updates in (MAX_CACHE_UPDATES, 10 ** 9):
        with tempfile.TemporaryDirectory() as cache:  # no need of the other column's traces is reused
            os.environ["VRAM_PLAN_CACHE"] = cache
            columns[updates] = needs(updates)
    lines = [f"{MODEL} {' '.join(f'{k}={v}' for k, v in SETTINGS.items())}, on {CARD}: the need's capacity (GiB, "
             "the CUDA context excluded) per completion length",
             f"{'completion':>10s}{'grouped':>12s}{'runs':>6s}{'one by one':>12s}{'runs':>6s}"]
    for length in LENGTHS:
        (grouped, fits_grouped), (single, fits_single) = columns[MAX_CACHE_UPDATES][length], columns[10 ** 9][length]
        lines.append(f"{length:>10d}{grouped / 2 ** 30:>12.4f}{'yes' if fits_grouped else 'no':>6s}"
                     f"{single / 2 ** 30:>12.4f}{'yes' if fits_single else 'no':>6s}")
    write_atomically(RESULTS, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
