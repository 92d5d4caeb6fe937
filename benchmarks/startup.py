"""Wall time of `vram-plan --gpu rtx3080-mobile --model Llama-3.2-1B` against `python -c "import torch"`.

Run with torch importable: python benchmarks/startup.py [--runs N] [--vram-plan PATH] [--out FILE]
Prints the median of N runs of each command and their ratio; the planner's target is under 0.3 s.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PLAN = ["vram-plan", "--gpu", "rtx3080-mobile", "--model", "Llama-3.2-1B"]
TORCH = [sys.executable, "-c", "import torch"]


def wall_times(command: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--vram-plan", default=shutil.which("vram-plan") or "vram-plan",
                        help="the vram-plan script to time (default: the one on PATH)")
    args = parser.parse_args()
    plan_cmd = [args.vram_plan, *PLAN[1:]]
    wall_times(plan_cmd, 1)  # warm the file cache
    plan = wall_times(plan_cmd, args.runs)
    torch = wall_times(TORCH, max(3, args.runs // 3))
    plan_median, torch_median = statistics.median(plan), statistics.median(torch)
    lines = [
        f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, Python {platform.python_version()}",
        f"vram-plan --gpu rtx3080-mobile --model Llama-3.2-1B: median {plan_median:.3f} s "
        f"(min {min(plan):.3f}, max {max(plan):.3f}, {len(plan)} runs)",
        f'python -c "import torch":                          median {torch_median:.3f} s '
        f"(min {min(torch):.3f}, max {max(torch):.3f}, {len(torch)} runs)",
        f"ratio planner / import torch: {plan_median / torch_median:.3f}  "
        f"(target: planner under 0.300 s: {'met' if plan_median < 0.3 else 'MISSED'})",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
