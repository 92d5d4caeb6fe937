"""Wall time of `vram-plan --gpu rtx3080-mobile --model Llama-3.2-1B` against `python -c "import torch"`.

Run with torch importable: python benchmarks/startup.py [--runs N] [--vram-plan PATH] [--out FILE]
Prints the median of N runs of each command and their ratio; the targets are a planner under 0.25 s and under
0.15x `import torch` on the same machine in the same run. It also times the libraries the planner cannot do
without (pydantic, click, rich), imported alone and doing the least a planner must (one pydantic model built and
validated, one rich table printed): the floor under any planner built on them.

The package's modules are byte-compiled first, as `pip install` does and as Python does on an editable install's
first run: a machine with PYTHONDONTWRITEBYTECODE set (this sandbox) would otherwise time the compiler.
"""

from __future__ import annotations

import argparse
import compileall
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PLAN = ["vram-plan", "--gpu", "rtx3080-mobile", "--model", "Llama-3.2-1B"]
TORCH = [sys.executable, "-c", "import torch"]
LIBRARIES = [sys.executable, "-c", "from pydantic import BaseModel; import click, rich.console, rich.table"]
# The least a planner built on them does: validate its input with one pydantic model, print one rich table.
LEAST_WORK = [sys.executable, "-c", """
import click
from pydantic import BaseModel, Field
from rich.console import Console
from rich.table import Table
Config = type("Config", (BaseModel,), {"__annotations__": {f"knob_{i}": int for i in range(40)},
                                      **{f"knob_{i}": Field(default=i, ge=0) for i in range(40)}})
Config(knob_1=3)
table = Table("phase", "GiB")
for i in range(12):
    table.add_row(str(i), f"{i / 3:.2f}")
Console().print(table)
"""]
PACKAGE = Path(__file__).resolve().parent.parent / "vram_planner"
PLANNER_TARGET_S, RATIO_TARGET = 0.25, 0.15


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
    compileall.compile_dir(PACKAGE, quiet=1)
    wall_times(plan_cmd, 1)  # warm the file cache
    plan = wall_times(plan_cmd, args.runs)
    torch = wall_times(TORCH, max(3, args.runs // 3))
    libraries = wall_times(LIBRARIES, max(3, args.runs // 3))
    least_work = wall_times(LEAST_WORK, max(3, args.runs // 3))
    plan_median, torch_median = statistics.median(plan), statistics.median(torch)
    ratio = plan_median / torch_median
    met = plan_median < PLANNER_TARGET_S and ratio < RATIO_TARGET
    lines = [
        f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, Python {platform.python_version()}",
        f"vram-plan --gpu rtx3080-mobile --model Llama-3.2-1B: median {plan_median:.3f} s "
        f"(min {min(plan):.3f}, max {max(plan):.3f}, {len(plan)} runs)",
        f'python -c "import torch":                          median {torch_median:.3f} s '
        f"(min {min(torch):.3f}, max {max(torch):.3f}, {len(torch)} runs)",
        f"pydantic + click + rich imports alone:            median {statistics.median(libraries):.3f} s "
        f"(min {min(libraries):.3f}, max {max(libraries):.3f}, {len(libraries)} runs)",
        f"those libraries validating one model, one table: median {statistics.median(least_work):.3f} s "
        f"(min {min(least_work):.3f}, max {max(least_work):.3f}, {len(least_work)} runs)",
        f"ratio planner / import torch: {ratio:.3f}  (targets: planner under {PLANNER_TARGET_S:.3f} s and under "
        f"{RATIO_TARGET:.2f}x import torch: {'met' if met else 'MISSED'})",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
