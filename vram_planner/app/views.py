"""What the page shows of a config, in words and bars, built from the documents `check --json` and `plan --json`
print (so the page and the API cannot disagree): the verdict, the parts of each phase, the plan's changes, the
longest completion that fits, the notes."""

from __future__ import annotations

import json
import re
from html import escape
from typing import Any

from vram_planner.errors import spelled
from vram_planner.report.document import Report, per_gpu
from vram_planner.report.plot import COMPONENT_COLOURS
from vram_planner.report.words import (change_effect, copy_verdict, first_micro_batch_line, footer_lines,
                                       near_boundary_reason, sentence)
from vram_planner.model.accelerate_config import SCRIPT_FILE
from vram_planner.model.phases import COMPONENTS, PHASE_TITLES, component_label
from vram_planner.profiles import GpuProfile
from vram_planner.units import GiB

FREE = "free"  # what is left of the card on top of a phase's bar
COMPONENT_LABELS = {c: component_label(c) for c in COMPONENTS}  # as the table and --plot name them
BAR_COLOURS = {COMPONENT_LABELS[c]: COMPONENT_COLOURS[c] for c in COMPONENTS} | {FREE: "#ececec"}
# Gradio's bar plot stacks the parts in the reverse order of their first rows, with no channel to set it, and fixes
# its colours to the parts of the first data it draws: every phase has a row for every part, zeros included, free
# first, then the parts from the top of the stack down to the weights.
STACK_FROM_TOP = (FREE, *(COMPONENT_LABELS[c] for c in reversed(COMPONENTS)))


def legend_html() -> str:
    """The parts and their colours, bottom of the stack first (the plot's own legend does not wrap)."""
    swatch = "display: inline-block; width: 0.8em; height: 0.8em; border: 1px solid #bbb; margin-right: 0.3em"
    items = [f'<span style="white-space: nowrap; margin-right: 0.9em"><span style="{swatch}; '
             f'background: {BAR_COLOURS[part]}"></span>{part}</span>' for part in reversed(STACK_FROM_TOP)]
    return f'<div style="font-size: 0.85em; line-height: 1.8">{" ".join(items)}</div>'


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GiB:.2f}"


def title_markdown(report: Report, gpu: GpuProfile) -> str:
    """What was judged: the model, the card (per GPU, with the strategy, on several) and the TRL release."""
    return (f"**{report.model}** on the {gpu.label} ({gpu.total_memory_gib:.2f} GiB){per_gpu(report)}, TRL "
            f"{report.trl_version} GRPO")


def verdict_markdown(checked: Report, planned: Report) -> str:
    """The verdict on the config as given and, when it does not fit, on the plan's."""
    lines = [f"### {_verdict(checked)}"]
    first = checked.first_micro_batch
    if not checked.fits and first is not None:  # a run can die before its first optimizer step
        lines.append(f"**{'First micro-batch' if first.fits else 'Before the first optimizer step'}:** "
                     f"{first_micro_batch_line(first)}.")
    if checked.near_boundary:
        lines.append(f"**Near the boundary:** {near_boundary_reason(checked)}; *Check exactly* traces the step and "
                     "decides.")
    if planned.changes and planned.fits:
        count = len(planned.changes)
        lines.append(f"**✔ With the plan's {count} change{'s' * (count != 1)} below it fits:** peak "
                     f"{gib(planned.peak_bytes)} GiB in {_phase_title(planned)}, {gib(planned.spare_bytes)} GiB spare.")
    elif not planned.fits:
        card = (f"the smallest catalog card it fits is the {planned.smallest_fitting_gpu}"
                if planned.smallest_fitting_gpu else "no catalog card holds it")
        lines.append(f"**✘ Nothing fits this card:** the smallest config vram-plan knows needs "
                     f"{gib(planned.peak_bytes)} GiB; {card}.")
    return "\n\n".join(lines)


def exact_markdown(report: Report) -> str:
    """`check --exact`: what the traced step needs against the card, and what the allocator will hold there."""
    exact = report.exact
    mark = "✔ Fits exactly" if report.fits else "✘ Does not fit exactly"
    kept = f" {sentence(report.kept_copy)}" if report.kept_copy else ""
    return (f"**{mark}:** the traced step needs {gib(exact.need_bytes)} GiB of the card's "
            f"{gib(report.capacity_bytes)} GiB (no safety margin; estimated {gib(report.peak_bytes)} GiB); the "
            f"allocator will hold {gib(exact.reserved_peak_bytes)} GiB besides the CUDA context (and NCCL's "
            f"buffers on several GPUs), as it keeps freed blocks cached until the card runs out. Traced in "
            f"{exact.seconds:.1f} s.{kept}")


def _verdict(report: Report) -> str:
    peak = f"peak {gib(report.peak_bytes)} of {gib(report.capacity_bytes)} GiB in {_phase_title(report)}"
    if report.copy is not None and report.fits == report.copy.runs:
        return f"{'✔ Fits' if report.fits else '✘ Does not fit as given'}: {copy_verdict(report)}"
    if report.fits:
        return (f"✔ Fits: {peak}, {gib(report.spare_bytes)} GiB spare (a safety margin of "
                f"{gib(report.safety_margin_bytes)} GiB is kept free)")
    over = (f"{gib(-report.spare_bytes)} GiB over the card" if report.spare_bytes < 0 else
            f"inside the {gib(report.safety_margin_bytes)} GiB safety margin")
    return f"✘ Does not fit as given: {peak}, {over}"


def _phase_title(report: Report) -> str:
    return PHASE_TITLES.get(report.peak_phase, report.peak_phase)


def phase_rows(report: Report) -> list[dict[str, Any]]:
    """Every part of every phase in GiB (zeros included), with what is left free of the card, in stacking order."""
    rows = []
    for phase in report.phases:
        title = PHASE_TITLES.get(phase.name, phase.name)
        gib_by_part = {COMPONENT_LABELS[c]: phase.components.get(c, 0) / GiB for c in COMPONENTS}
        gib_by_part[FREE] = max(report.capacity_bytes - phase.total_bytes, 0) / GiB
        rows += [{"phase": title, "GiB": round(value, 3), "part": part} for part, value in gib_by_part.items()]
    return sorted(rows, key=lambda row: STACK_FROM_TOP.index(row["part"]))


def bars_title(report: Report, what: str) -> str:
    return (f"**{what}:** {gib(report.peak_bytes)} GiB at the peak, {'fits' if report.fits else 'does not fit'} the "
            f"{gib(report.capacity_bytes)} GiB card (GiB per phase; on top, what is left free)")


def changes_markdown(planned: Report) -> str:
    """The plan's changes as a table, with the GiB each saves (or costs: a larger vLLM share)."""
    if not planned.changes:
        return "Your config fits as it is: the plan changes nothing." if planned.fits else ""
    rows = [f"| `{c.knob}` | {c.before} → **{c.after}** | {change_effect(c)} | {c.reason} |" for c in planned.changes]
    head = f"**The plan's changes** (as given the config needs {gib(planned.requested_peak_bytes or 0)} GiB):"
    return "\n".join([head, "", "| knob | change | peak | why |", "|---|---|---|---|", *rows])


def longest_markdown(as_given: Any, with_savers: Any) -> str:
    """The longest completion that fits, as given and with the plan's savers (vram_planner.model.maximize.Maximized
    or a one-line reason why there is none)."""
    return ("**Longest completion that fits:** " + _longest(as_given) + " as given; "
            + _longest(with_savers) + " with the plan's savers.")


def _longest(result: Any) -> str:
    if isinstance(result, str):
        return f"none ({result})"
    if result.value is None:
        return "not even 1 token"
    text = f"**{result.value:,} tokens** (peak {gib(result.peak_bytes)} GiB"
    if result.limited_by != "memory":
        return text + f"; limited by {result.limited_by})"
    return text + f"; {result.next_value:,} would need {gib(result.next_peak_bytes)} GiB)"


def launch_markdown(report: Report) -> str:
    """Several GPUs: TRL's accelerate config for the strategy and the line that starts the code with it, as `plan`
    prints them ('' on one GPU)."""
    launch = report.distributed
    if launch is None:
        return ""
    import yaml

    config = yaml.safe_dump(launch.accelerate_config, sort_keys=True)
    deepspeed = ("" if launch.deepspeed_config is None else
                 f"**{launch.deepspeed_config_file}** (the DeepSpeed config it names)\n\n"
                 f"```json\n{json.dumps(launch.deepspeed_config, indent=2)}\n```\n\n")
    return (f"**{launch.accelerate_config_file}** ({launch.label}: TRL's own accelerate config for it)\n\n"
            f"```yaml\n{config}```\n\n{deepspeed}**Launch** (the code above saved as {SCRIPT_FILE}):\n\n"
            f"```bash\n{launch.launch_command}\n```\n\n")


def notes_markdown(report: Report) -> str:
    """What was assumed and noted, as the CLI's footer says it, in the page's words."""
    return "  \n".join(page_words(spelled(line)) for line in footer_lines(report))


# A command-line flag in a report's notes (the JSON document's words): `--lora-r 16`, `--no-gradient-checkpointing`.
FLAG = re.compile(r"--(no-)?([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")


def page_words(text: str) -> str:
    """A text that names command-line flags, naming the page's fields instead (`--lora-r` is lora_r, and
    `--no-gradient-checkpointing` is gradient_checkpointing off); other flags stay as they are."""
    from vram_planner.request import request_fields

    fields = set(request_fields())

    def field(match: re.Match[str]) -> str:
        name = match.group(2).replace("-", "_")
        if name not in fields:
            return match.group(0)
        return f"{name} off" if match.group(1) else name

    return FLAG.sub(field, text)


def bars_html(report: Report, elem_id: str) -> str:
    """Each phase as a stacked bar of its parts in GiB, the card's free rest on top, and the card's capacity as a
    dashed line across every bar (a phase over the card rises above it). Each segment carries an aria-label
    ("phase: generation; GiB: 6.906; part: weights") that screen readers and the browser test read."""
    width, height, left, top, bottom = 640, 300, 48, 16, 28
    phases = report.phases
    capacity = report.capacity_bytes / GiB
    highest = max([capacity, *(p.total_bytes / GiB for p in phases)]) * 1.08 or 1.0
    scale = (height - top - bottom) / highest
    slot = (width - left - 8) / max(len(phases), 1)
    bar = min(slot * 0.6, 110)
    parts = ['<text x="4" y="12" font-size="11">GiB</text>']
    for tick in _ticks(highest):
        y = height - bottom - tick * scale
        parts.append(f'<line x1="{left}" x2="{width - 8}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>'
                     f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">{tick:g}</text>')
    for index, row in enumerate(_stacks(report)):
        x, base = left + slot * index + (slot - bar) / 2, height - bottom
        for part, value in row["parts"]:
            h = value * scale
            if value <= 0:
                continue
            base -= h
            label = f"phase: {row['phase']}; GiB: {round(value, 3)}; part: {part}"
            parts.append(f'<rect x="{x:.1f}" y="{base:.1f}" width="{bar:.1f}" height="{h:.1f}" '
                         f'fill="{BAR_COLOURS[part]}" aria-label="{escape(label)}"><title>{escape(label)}</title>'
                         "</rect>")
        parts.append(f'<text x="{x + bar / 2:.1f}" y="{height - bottom + 16}" text-anchor="middle" '
                     f'font-size="11">{escape(row["phase"])}</text>')
    y = height - bottom - capacity * scale
    parts.append(f'<line class="capacity" x1="{left}" x2="{width - 8}" y1="{y:.1f}" y2="{y:.1f}" stroke="#111" '
                 f'stroke-width="1.5" stroke-dasharray="6 4" aria-label="capacity: {capacity:.2f} GiB"/>'
                 f'<text x="{width - 10}" y="{y - 4:.1f}" text-anchor="end" font-size="11">{escape(report.gpu)}: '
                 f'{capacity:.2f} GiB</text>')
    return (f'<svg id="{elem_id}_svg" role="img" viewBox="0 0 {width} {height}" width="100%" '
            f'style="max-width: {width}px" xmlns="http://www.w3.org/2000/svg">{"".join(parts)}</svg>')


def _stacks(report: Report) -> list[dict[str, Any]]:
    """Per phase, its parts from the bottom of the stack up (the free rest last)."""
    rows = phase_rows(report)
    stacks = []
    for phase in report.phases:
        title = PHASE_TITLES.get(phase.name, phase.name)
        mine = [r for r in rows if r["phase"] == title]
        stacks.append({"phase": title, "parts": [(r["part"], r["GiB"]) for r in reversed(mine)]})
    return stacks


def _ticks(highest: float) -> list[float]:
    step = next(s for s in (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500) if highest / s <= 8)
    return [step * i for i in range(int(highest / step) + 1)]
