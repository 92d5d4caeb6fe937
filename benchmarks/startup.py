"""Wall time of `vram-plan --gpu rtx3080-mobile --model Llama-3.2-1B` against `python -c "import torch"`.

Run with torch importable: python benchmarks/startup.py [--runs N] [--vram-plan PATH] [--out FILE] [--instructions]
Prints the median of N runs of each command and their ratio; the targets are a planner under 0.25 s and under
0.15x `import torch` on the same machine in the same run (the commands take turns, so a machine whose speed drifts
slows both alike). It also times the same command with a knob given (`--lora-r 16`: pydantic validates it, so it
loads), and the libraries the README's command cannot do without (click, rich), imported alone and doing the least a
planner must (one rich table printed): the floor under any planner built on them, and `check --num-gpus auto` (whose
replays a later process reads back), its first run and a later one. With --instructions, valgrind
counts the instructions of the planner and of that floor: what vram-plan's own code costs, to the percent, on a busy
machine too.

The package's modules are byte-compiled first, as `pip install` does and as Python does on an editable install's
first run: a machine with PYTHONDONTWRITEBYTECODE set (this sandbox) would otherwise time the compiler.
"""

from __future__ import annotations

import argparse
import compileall
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLAN = ["vram-plan", "--gpu", "rtx3080-mobile", "--model", "Llama-3.2-1B"]
# `--num-gpus auto` replays DeepSpeed's buffers through the allocator model on each count it tries (a bisection each,
# kept in the cache folder for the next process): a 7B and an 8B model on consumer cards, which need several
AUTO = [["check", "--gpu", "rtx4090", "--model", "Qwen2.5-7B", "--num-gpus", "auto"],
        ["check", "--gpu", "16GiB", "--model", "Llama-3.1-8B", "--num-gpus", "auto"]]
KNOB = ["--lora-r", "16"]
TORCH = [sys.executable, "-c", "import torch"]
LIBRARIES = [sys.executable, "-c", "import click, rich.console, rich.table"]
# The least a planner built on them does: parse its command line, print one rich table.
LEAST_WORK = [sys.executable, "-c", """
import click
from rich.console import Console
from rich.table import Table
table = Table("phase", "GiB")
for i in range(12):
    table.add_row(str(i), f"{i / 3:.2f}")
Console().print(table)
"""]
PACKAGE = Path(__file__).resolve().parent.parent / "vram_planner"
PLANNER_TARGET_S, RATIO_TARGET = 0.25, 0.15


def wall_time(command: list[str], env: dict[str, str] | None = None, check: bool = True) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=check, stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start


def interleaved_wall_times(commands: dict[str, list[str]], runs: dict[str, int]) -> dict[str, list[float]]:
    """Wall times of each command, taken in rounds (a few of each per round): this machine's speed drifts by a
    third over minutes, and a ratio of medians taken minutes apart measures the drift."""
    times: dict[str, list[float]] = {name: [] for name in commands}
    rounds = max(runs.values())
    for round_ in range(rounds):
        for name, command in commands.items():
            if round_ * runs[name] // rounds != (round_ + 1) * runs[name] // rounds:
                times[name].append(wall_time(command))
    return times


def auto_gpus_lines(vram_plan: str, runs: int) -> list[str]:
    """`--num-gpus auto`'s wall time in a cache folder of its own: the first run (the catalogs parsed, every
    bisection made), then the runs after it (what an earlier process kept)."""
    lines = []
    for command in AUTO:
        first, later = [], []
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "VRAM_PLAN_CACHE": cache}
                # exit 1 is an answer (the config fits on no count), not a failure
                timed = [wall_time([vram_plan, *command], env, check=False) for _ in range(2)]
            first.append(timed[0])
            later.append(timed[1])
        lines.append(f"vram-plan {' '.join(command)}: first run median {statistics.median(first):.3f} s, "
                     f"later runs {statistics.median(later):.3f} s ({runs} each)")
    return lines


def instructions(command: list[str]) -> int | None:
    """User-space instructions the command executes (valgrind's cachegrind): unlike wall time, the same on a busy
    machine and an idle one, so a change's effect shows to the percent. None without valgrind."""
    if shutil.which("valgrind") is None:
        return None
    done = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                           *command], capture_output=True, text=True, check=True)
    match = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    return int(match.group(1).replace(",", "")) if match else None


def instruction_lines(plan_cmd: list[str]) -> list[str]:
    counts = {name: instructions(command) for name, command in
              (("planner", plan_cmd), ("knob", [*plan_cmd, *KNOB]), ("floor", LEAST_WORK),
               ("python", [sys.executable, "-c", "pass"]))}
    if None in counts.values():
        return ["instructions: valgrind is not installed"]
    above = counts["planner"] - counts["floor"]
    return [f"instructions (valgrind): planner {counts['planner'] / 1e6:,.0f} M, the libraries' least work "
            f"{counts['floor'] / 1e6:,.0f} M, python alone {counts['python'] / 1e6:,.0f} M; vram-plan's own code "
            f"{above / 1e6:,.0f} M ({above / counts['planner']:.0%} of the planner's); with --lora-r 16 "
            f"{counts['knob'] / 1e6:,.0f} M"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--vram-plan", default=shutil.which("vram-plan") or "vram-plan",
                        help="the vram-plan script to time (default: the one on PATH)")
    parser.add_argument("--instructions", action="store_true",
                        help="also count instructions under valgrind (load-independent; about 20 s)")
    args = parser.parse_args()
    plan_cmd = [args.vram_plan, *PLAN[1:]]
    compileall.compile_dir(PACKAGE, quiet=1)
    wall_time(plan_cmd)  # warm the file cache (and the parsed catalogs)
    few = max(3, args.runs // 3)
    times = interleaved_wall_times({"plan": plan_cmd, "knob": [*plan_cmd, *KNOB], "torch": TORCH,
                                    "libraries": LIBRARIES, "least_work": LEAST_WORK},
                                   {"plan": args.runs, "knob": few, "torch": few, "libraries": few, "least_work": few})
    plan, knob, torch, libraries, least_work = (times[k] for k in ("plan", "knob", "torch", "libraries", "least_work"))
    plan_median, torch_median = statistics.median(plan), statistics.median(torch)
    ratio = plan_median / torch_median
    met = plan_median < PLANNER_TARGET_S and ratio < RATIO_TARGET
    lines = [
        f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, Python {platform.python_version()}",
        f"vram-plan --gpu rtx3080-mobile --model Llama-3.2-1B: median {plan_median:.3f} s "
        f"(min {min(plan):.3f}, max {max(plan):.3f}, {len(plan)} runs)",
        f"the same with --lora-r 16 (pydantic validates it): median {statistics.median(knob):.3f} s "
        f"(min {min(knob):.3f}, max {max(knob):.3f}, {len(knob)} runs)",
        f'python -c "import torch":                          median {torch_median:.3f} s '
        f"(min {min(torch):.3f}, max {max(torch):.3f}, {len(torch)} runs)",
        f"click + rich imports alone:                       median {statistics.median(libraries):.3f} s "
        f"(min {min(libraries):.3f}, max {max(libraries):.3f}, {len(libraries)} runs)",
        f"those libraries printing one table:               median {statistics.median(least_work):.3f} s "
        f"(min {min(least_work):.3f}, max {max(least_work):.3f}, {len(least_work)} runs)",
        f"ratio planner / import torch: {ratio:.3f}  (targets: planner under {PLANNER_TARGET_S:.3f} s and under "
        f"{RATIO_TARGET:.2f}x import torch: {'met' if met else 'MISSED'})",
    ]
    lines += auto_gpus_lines(args.vram_plan, few)
    if args.instructions:
        lines += instruction_lines(plan_cmd)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
