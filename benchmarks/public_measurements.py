"""GPU memory that users measured and published for GRPO runs with TRL, against what vram-plan predicts for them.

    python benchmarks/public_measurements.py              # a table in the terminal
    python benchmarks/public_measurements.py --markdown   # the same table in Markdown, for the README

Reads benchmarks/data/public_measurements.toml (one row per published number, with its source, settings and what was
assumed) and runs `vram_planner.engine.check` on each row under the row's TRL release (and its transformers release,
or the tested set's: `transformers_for`). A run that trained is compared by relative error, (predicted - measured) /
measured. A run that crashed for memory only gives a floor (allocated + requested at the OOM, or the card's
capacity): its error is shown only when the prediction falls below that floor, and the verdict column says whether
vram-plan also calls it "does not fit". Most sources give the process's device memory (nvidia-smi, an OOM's figures),
set beside the need `check` predicts; a row whose number is torch.cuda.max_memory_allocated() (`measured_quantity =
"allocated"`) is set beside the allocated peak the estimate predicts (its tensors and cuBLAS workspaces: no allocator
reserve, no CUDA context), and the two kinds are summed up apart. Such a row may give torch.cuda.max_memory_reserved()
too (`measured_reserved_gib`), which benchmarks/public_traced.py sets beside what the allocator model holds. A row
that cannot be planned (its model is not in the catalog and the hub cannot be reached, say) says so, and why under
the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vram_planner import engine
from vram_planner.errors import VramPlanError
from vram_planner.model.resolve import resolve_model
from vram_planner.model.trl_releases import trl_release
from vram_planner.units import gib

DATA = Path(__file__).resolve().parent / "data" / "public_measurements.toml"
TESTED_SET = Path(__file__).resolve().parent.parent / "constraints.txt"
REQUIRED = ("id", "source", "model", "gpu", "trl_version", "settings", "measured_gib", "outcome")
OUTCOMES = ("fits", "oom")
# What a row's number measured: the process's device memory (the default), or torch.cuda.max_memory_allocated()
QUANTITIES = ("device", "allocated")
COLUMNS = ("source", "model", "GPU", "TRL", "settings", "measured GiB", "predicted GiB", "error", "verdict")

# Knob -> how the settings column writes it; a knob missing here is written knob=value.
SHORT = {"per_device_train_batch_size": "B", "gradient_accumulation_steps": "GA", "steps_per_generation": "S",
         "num_generations": "G", "max_prompt_length": "P", "max_completion_length": "C", "beta": "beta",
         "num_iterations": "iters", "lora_r": "LoRA r", "vllm_gpu_memory_utilization": "vLLM util",
         "num_gpus": "GPUs", "zero_stage": "ZeRO"}
DTYPES = {"bfloat16": "bf16 weights", "float16": "fp16 weights", "float32": "fp32 weights"}
ATTENTION = {"flash_attention_2": "FA2", "eager": "eager", "sdpa": "sdpa"}
DROPPED = {"lora_alpha", "lora_dropout", "lora_target_modules"}  # detail the notes give; the column stays short


@dataclass(frozen=True)
class Comparison:
    """One published number next to vram-plan's prediction for the same run."""

    row: dict[str, Any]
    predicted_gib: float | None = None
    capacity_gib: float | None = None
    predicted_fits: bool | None = None
    problem: str | None = None  # why the row could not be planned, in full (printed under the table)
    headline: str | None = None  # what the verdict column shows for a row that could not be planned

    @property
    def measured_gib(self) -> float:
        return float(self.row["measured_gib"])

    @property
    def quantity(self) -> str:
        return measured_quantity(self.row)

    @property
    def is_oom(self) -> bool:
        return self.row.get("outcome") == "oom"

    @property
    def error_pct(self) -> float | None:
        """Relative error of the peak; for an OOM only when the prediction is below the floor the OOM gives."""
        if self.predicted_gib is None or (self.is_oom and self.predicted_gib >= self.measured_gib):
            return None
        return (self.predicted_gib - self.measured_gib) / self.measured_gib * 100

    @property
    def verdict_agrees(self) -> bool | None:
        return None if self.predicted_fits is None else self.predicted_fits == (not self.is_oom)


def load_rows(path: Path) -> list[dict[str, Any]]:
    """The [[measurement]] rows of the data file."""
    with path.open("rb") as f:
        rows = tomllib.load(f).get("measurement", [])
    if not isinstance(rows, list) or not rows or not all(isinstance(row, dict) for row in rows):
        raise ValueError(f"{path} has no [[measurement]] rows, or rows that are not tables")
    return rows


def measured_quantity(row: dict[str, Any]) -> str:
    """What the row's number measured (QUANTITIES): the process's device memory unless the row says otherwise."""
    return row.get("measured_quantity", "device")


def row_problems(row: dict[str, Any]) -> str | None:
    """What makes a row unusable, in one line, or None."""
    missing = [key for key in REQUIRED if key not in row]
    if missing:
        return f"missing {', '.join(missing)}"
    if row["outcome"] not in OUTCOMES:
        return f"outcome must be one of {', '.join(OUTCOMES)} (got {row['outcome']!r})"
    if not isinstance(row["settings"], dict):
        return "settings must be a table of knobs"
    if measured_quantity(row) not in QUANTITIES:
        return f"measured_quantity must be one of {', '.join(QUANTITIES)} (got {row['measured_quantity']!r})"
    if not isinstance(row["measured_gib"], (int, float)) or row["measured_gib"] <= 0:
        return f"measured_gib must be a positive number (got {row['measured_gib']!r})"
    for field in ("measured_step_seconds", "measured_reserved_gib"):
        value = row.get(field, 1)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            return f"{field} must be a positive number (got {value!r})"
    return None


def compare(row: dict[str, Any]) -> Comparison:
    """vram-plan's verdict for the row's run; a row that cannot be planned carries the reason instead."""
    problem = row_problems(row)
    if problem:
        return Comparison(row, problem=problem, headline="bad row")
    try:
        resolve_model(row["model"])
    except VramPlanError as exc:
        return Comparison(row, problem=str(exc), headline="model not available")
    try:
        verdict = planned(row)
    except VramPlanError as exc:
        return Comparison(row, problem=str(exc), headline="error")
    except Exception as exc:  # noqa: BLE001 - the planner changes under this script; one row must not end the table
        return Comparison(row, problem=f"{type(exc).__name__}: {exc}", headline="internal error")
    allocated = measured_quantity(row) == "allocated"
    predicted = verdict.estimate.allocated_peak_bytes if allocated else verdict.estimate.peak_bytes
    return Comparison(row, predicted_gib=gib(predicted),
                      capacity_gib=gib(verdict.context.capacity_bytes), predicted_fits=verdict.fits)


def planned(row: dict[str, Any]) -> Any:
    """`check`'s verdict on the row's run (vram_planner.model.verdict.Verdict): under its TRL release and the
    transformers release transformers_for gives it."""
    assumed = transformers_for(row)
    known = {"transformers_version": assumed} if assumed else {}
    return engine.check(row["model"], row["gpu"], {**row["settings"], **known}, trl_version=row["trl_version"])


def transformers_for(row: dict[str, Any]) -> str | None:
    """The transformers release a row is planned under: the one its source shows; else the tested set's
    (constraints.txt) when that is of the TRL release's generation, so the table is one answer whichever release is
    installed here; else None (the newest of the TRL release's time)."""
    if row.get("transformers_version"):
        return row["transformers_version"]
    pinned = tested_transformers()
    if pinned and int(pinned.split(".")[0]) == trl_release(row["trl_version"]).transformers_major:
        return pinned
    return None


def planned_under(version: str | None) -> str:
    """How a table says which transformers release it plans under (`version`: tested_transformers())."""
    return f"transformers {version}, the tested set" if version else "the installed transformers"


def tested_transformers() -> str | None:
    """transformers' version in the tested set, None where the file or the pin is missing (an installed package)."""
    if not TESTED_SET.is_file():
        return None
    for line in TESTED_SET.read_text().splitlines():
        name, _, version = line.partition("==")
        if name.strip().lower() == "transformers" and version.strip():
            return version.strip()
    return None


def source_label(url: str) -> str:
    """'trl#3456' for a GitHub issue, 'trl PR 5759' for a pull request, the repository's name for a file in one,
    else the site's name."""
    parsed = urlparse(url)
    parts = parsed.path.strip("/").split("/")
    if parsed.netloc.endswith("github.com") and len(parts) >= 4 and parts[2] in ("issues", "pull"):
        return f"{parts[1]}#{parts[3]}" if parts[2] == "issues" else f"{parts[1]} PR {parts[3]}"
    if parsed.netloc.endswith("github.com") and len(parts) >= 2:
        return parts[1]
    return parsed.netloc.removeprefix("www.") or url


def short_settings(settings: dict[str, Any]) -> str:
    """The knobs a row sets, compactly: 'B=1 GA=4 G=4 P=256 C=786 bf16 weights FA2'."""
    words = []
    for knob, value in settings.items():
        if knob in DROPPED:
            continue
        if knob in SHORT:
            words.append(f"{SHORT[knob]}{'' if knob == 'lora_r' else '='}{value}")
        elif knob == "dtype":
            words.append(DTYPES.get(value, f"{value} weights"))
        elif knob == "attn_implementation":
            words.append(ATTENTION.get(value, value))
        elif knob == "mixed_precision":
            words.append("no AMP" if value == "no" else f"AMP {value}")
        elif knob == "gradient_checkpointing":
            words.append("GC" if value else "no GC")
        elif knob == "optim":
            words.append(str(value))
        elif knob == "load_in_4bit":
            words.append("4-bit" if value else "no 4-bit")
        elif isinstance(value, bool):
            words.append(knob if value else f"no {knob}")
        else:
            words.append(f"{knob}={value}")
    return " ".join(words) or "release defaults"


def measured_text(c: Comparison) -> str:
    if c.is_oom:
        return f">={c.measured_gib:.2f} (OOM)"
    return f"{c.measured_gib:.2f}" + (" allocated" if c.quantity == "allocated" else "")


def error_text(c: Comparison) -> str:
    if c.problem or c.predicted_gib is None:
        return ""
    error = c.error_pct
    if error is None:
        return "above the OOM floor"
    return f"{error:+.1f}%" + (" (below the OOM floor)" if c.is_oom else "")


def verdict_text(c: Comparison) -> str:
    """vram-plan's verdict and whether it matches what happened; a miss only the safety margin explains says so."""
    if c.problem:
        return f"{c.headline} (see below)"
    said = "fits" if c.predicted_fits else "does not fit"
    if c.verdict_agrees:
        return f"{said}: agrees"
    margin_only = not c.is_oom and c.predicted_gib is not None and c.predicted_gib <= (c.capacity_gib or 0)
    return f"{said}: disagrees" + (" (only the safety margin)" if margin_only else "")


def cells(c: Comparison, markdown: bool) -> list[str]:
    """One table row of text."""
    label = source_label(str(c.row.get("source", "")))
    source = f"[{label}]({c.row['source']})" if markdown and "source" in c.row else label
    predicted = "" if c.predicted_gib is None else f"{c.predicted_gib:.2f}"
    settings = c.row.get("settings")
    return [source, str(c.row.get("model", "")).split("/")[-1], str(c.row.get("gpu", "")),
            str(c.row.get("trl_version", "")), short_settings(settings) if isinstance(settings, dict) else "",
            measured_text(c) if isinstance(c.row.get("measured_gib"), (int, float)) else "",
            predicted, error_text(c), verdict_text(c)]


def summary(comparisons: list[Comparison]) -> str:
    """Median and worst absolute error over the runs that trained, and how often the verdict matched."""
    judged = [c for c in comparisons if c.verdict_agrees is not None]
    unplanned = len(comparisons) - len(judged)
    parts = []
    for quantity, what in (("device", "device memory of runs that trained"),
                          ("allocated", "allocated peaks (torch.cuda.max_memory_allocated)")):
        errors = [abs(c.error_pct) for c in comparisons
                  if not c.is_oom and c.error_pct is not None and c.quantity == quantity]
        if errors:
            parts.append(f"{what}: median |error| {statistics.median(errors):.1f}%, "
                         f"worst {max(errors):.1f}% over {len(errors)}")
    if judged:
        parts.append(f"verdict matches the outcome in {sum(bool(c.verdict_agrees) for c in judged)} of {len(judged)}")
    if unplanned:
        parts.append(f"{unplanned} row(s) not planned")
    return "; ".join(parts) + "."


def problem_lines(comparisons: list[Comparison]) -> list[str]:
    """Why each row that could not be planned was not, in full."""
    return [f"{c.row.get('id', '?')}: {c.headline}: {c.problem}" for c in comparisons if c.problem]


def markdown_table(comparisons: list[Comparison]) -> str:
    def line(values: list[str]) -> str:
        return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"

    lines = [line(list(COLUMNS)), line(["---"] * len(COLUMNS))]
    lines += [line(cells(c, markdown=True)) for c in comparisons]
    return "\n".join(lines + ["", summary(comparisons)] + [f"- {line}" for line in problem_lines(comparisons)])


def print_table(comparisons: list[Comparison], console: Console) -> None:
    table = Table(title="Published GRPO memory against vram-plan (GiB)")
    for column in COLUMNS:
        table.add_column(column, justify="right" if "GiB" in column or column == "error" else "left")
    for c in comparisons:
        table.add_row(*(escape(cell) for cell in cells(c, markdown=False)))
    console.print(table)
    console.print(summary(comparisons))
    for line in problem_lines(comparisons):
        console.print(line, markup=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the table in Markdown, for the README")
    parser.add_argument("--data", type=Path, default=DATA, help=f"measurements file (default: {DATA.name})")
    args = parser.parse_args()
    try:
        rows = load_rows(args.data)
    except (OSError, ValueError) as exc:  # tomllib.TOMLDecodeError is a ValueError
        print(f"error: cannot read the measurements: {exc}", file=sys.stderr)
        sys.exit(2)
    comparisons = [compare(row) for row in rows]
    if args.markdown:
        print(markdown_table(comparisons))
    else:
        print_table(comparisons, Console(width=200))


if __name__ == "__main__":
    main()
