"""What people read: rich tables, a bar of the peak, the GRPOConfig snippet. GiB throughout."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from vram_planner.cli.console import terminal
from vram_planner.errors import flag, spelled
from vram_planner.report.document import Report, per_gpu
from vram_planner.report.words import (change_effect, copy_verdict, first_micro_batch_line, footer_lines,
                                       near_boundary_reason, sentence, small_amount)
from vram_planner.model.grpo_config import python_snippet
from vram_planner.model.phases import (COMPONENTS, OUTSIDE_ALLOCATOR, PHASE_TITLES, component_label,
                                       outside_allocator_names)
from vram_planner.model.spec import TrainingConfig
from vram_planner.profiles import GpuProfile
from vram_planner.units import GiB

if TYPE_CHECKING:  # --maximize's report: its module loads only for --maximize
    from vram_planner.report.maximized import MaximizedPlanReport

BAR_WIDTH = 40
COMPONENT_STYLES = {"weights": "blue", "reference_weights": "cyan", "gradients": "magenta",
                    "optimizer_states": "red", "kv_cache": "yellow", "activations": "green",
                    "lm_head_buffers": "bright_green", "vllm_reservation": "bright_cyan",
                    "cuda_context": "bright_black", "nccl_buffers": "bright_black",
                    "vllm_communicators": "bright_black", "cublas_workspaces": "grey50", "allocator_overhead": "white"}


def _g(n_bytes: float) -> str:
    return f"{n_bytes / GiB:.2f}"


def _host_shortfall(report: Report) -> str | None:
    """'the host's RAM: ...' where the offloaded states need more than one node's RAM, else None."""
    launch = report.distributed
    if launch is None or launch.host_memory_bytes is None or launch.host_bytes <= launch.host_memory_bytes:
        return None
    return (f"the offloaded states need {_g(launch.host_bytes)} GiB of host RAM per node, more than its "
            f"{_g(launch.host_memory_bytes)} GiB")


def headline(report: Report, gpu: GpuProfile) -> Text:
    title = Text(f"{report.model} on {gpu.label} ({gpu.total_memory_gib:.2f} GiB){per_gpu(report)}, TRL "
                 f"{report.trl_version} GRPO\n", style="bold")
    if report.exact is not None:
        return exact_headline(report, title)
    peak_phase = PHASE_TITLES.get(report.peak_phase, report.peak_phase)
    if report.copy is not None and report.fits == report.copy.runs:  # the copy decided, nothing else refused it
        mark, style = ("✔ fits: ", "bold green") if report.fits else ("✘ does not fit: ", "bold red")
        title.append(mark, style=style)
        title.append(copy_verdict(report))
    elif report.fits:
        title.append("✔ fits: ", style="bold green")
        title.append(f"peak {_g(report.peak_bytes)} GiB in {peak_phase}, {_g(report.spare_bytes)} GiB spare "
                     f"(a safety margin of {_g(report.safety_margin_bytes)} GiB is kept free)")
    elif report.command == "plan":
        title.append("✘ nothing fits: ", style="bold red")
        card = (f"the smallest catalog card it fits is {report.smallest_fitting_gpu}"
                if report.smallest_fitting_gpu else "no catalog card holds it")
        title.append(f"the smallest config vram-plan knows (below) needs {_g(report.peak_bytes)} GiB; {card}")
    elif report.vllm is not None and report.vllm.problem:  # the trainer may fit; vLLM stops the run at start-up
        title.append("✘ does not fit: ", style="bold red")
        title.append(f"{report.vllm.problem}; the trainer's peak is {_g(report.peak_bytes)} GiB in {peak_phase}")
    elif (host := _host_shortfall(report)) is not None:  # the card holds it; the node's RAM does not
        title.append("✘ does not fit: ", style="bold red")
        title.append(f"{host}; each GPU's peak is {_g(report.peak_bytes)} GiB in {peak_phase}")
    else:
        title.append("✘ does not fit: ", style="bold red")
        over = (f"{_g(-report.spare_bytes)} GiB over the card" if report.spare_bytes < 0 else
                f"inside the {_g(report.safety_margin_bytes)} GiB safety margin")
        title.append(f"peak {_g(report.peak_bytes)} GiB in {peak_phase}, {over}; "
                     "`vram-plan plan` with the same flags finds the best config that fits")
    first = report.first_micro_batch
    if not report.fits and first is not None and (report.command == "check" or report.smallest_config_peak_bytes):
        title.append("\n" + first_micro_batch_line(first), style="red" if not first.fits else "")
    if report.near_boundary:
        title.append(f"\nNear the boundary: {near_boundary_reason(report)}; `vram-plan {report.command} --exact` "
                     "with the same flags traces the step and decides", style="yellow")
    return title


WHY_HELD = ("blocks the step freed, which it keeps cached until cudaMalloc fails (on a card with room, those too "
            "small for the next request pile up: each decoding step's shorter KV cache, say)")


def exact_headline(report: Report, title: Text) -> Text:
    """The verdict by the traced step's need, without a safety margin, and in one line what the run needs against
    what the allocator holds on this card, and why they differ."""
    exact, capacity = report.exact, report.capacity_bytes
    how = "traced, no safety margin"
    if report.command != "trace":
        how += f"; estimated {_g(report.peak_bytes)} GiB without --exact"
    if report.fits:
        title.append("✔ fits: ", style="bold green")
        title.append(f"the step needs {_g(exact.need_bytes)} GiB of the card's {_g(capacity)} GiB ({how})\n")
    else:
        title.append("✘ does not fit: ", style="bold red")
        title.append(f"the step needs {_g(exact.need_bytes)} GiB, {_g(exact.need_bytes - capacity)} GiB more than "
                     f"the card's {_g(capacity)} GiB ({how})\n")
    title.append(held_line(report))
    if report.kept_copy:
        title.append(f"\n{sentence(report.kept_copy)}")
    if report.exact_rung_above is not None:
        title.append("\n" + rung_above_line(report))
    return title


def held_line(report: Report) -> str:
    """What the run needs against what the allocator holds on this card, the figure nvidia-smi shows."""
    exact = report.exact
    components = report.phases[0].components if report.phases else {}
    held = exact.reserved_peak_bytes + sum(components.get(c, 0) for c in OUTSIDE_ALLOCATOR)
    outside = outside_allocator_names(components, "the allocator's segments")
    needs = (f"It needs {_g(exact.need_bytes)} GiB (tensors and cuBLAS workspaces peak at "
             f"{_g(exact.tensor_peak_bytes)} GiB, {outside} make the rest)")
    if not report.fits:
        return (f"{needs}; on a card with room the allocator would hold {_g(held)} GiB, "
                f"{_g(held - exact.need_bytes)} GiB of them {WHY_HELD}.")
    if held <= exact.need_bytes:
        return f"{needs}; on this card the allocator holds that much too (what nvidia-smi shows)."
    return (f"{needs}; on this card the allocator will hold {_g(held)} GiB (what nvidia-smi shows), "
            f"{_g(held - exact.need_bytes)} GiB more: {WHY_HELD}.")


def rung_above_line(report: Report) -> str:
    above = report.exact_rung_above
    knobs = ", ".join(f"{k} {v}" for k, v in above.settings.items()) or "the same knobs"
    if above.problem is not None:
        return f"The config ranked above the choice ({knobs}) could not be traced: {above.problem}."
    if above.fits:
        return (f"The config ranked above the estimate's choice ({knobs}) needs {_g(above.need_bytes)} GiB: it runs, "
                "so it is the choice.")
    return f"The config ranked above the choice ({knobs}) needs {_g(above.need_bytes)} GiB: it does not fit."


def changes_text(report: Report) -> Text:
    if not report.changes:
        return Text("Your config fits as it is." if report.fits else "")
    text = Text(f"Changes to your config (as given it needs {_g(report.requested_peak_bytes or 0)} GiB):\n",
                style="bold")
    for c in report.changes:
        text.append(f"  {c.knob}: {c.before} → {c.after}", style="bold")
        text.append(f"  {change_effect(c)}", style="yellow" if c.cost_bytes > 0 else "green" if c.saved_bytes else "")
        text.append(f"  ({c.reason})\n")
    return text


def breakdown_table(report: Report) -> Table:
    table = Table(title="Memory by phase (GiB)", title_justify="left", show_edge=False)
    table.add_column("component")
    for phase in report.phases:
        marker = " ◆" if phase.name == report.peak_phase else ""
        table.add_column(PHASE_TITLES.get(phase.name, phase.name) + marker, justify="right")
    for component in COMPONENTS:
        values = [p.components.get(component, 0) for p in report.phases]
        if any(values):
            table.add_row(Text(component_label(component), style=COMPONENT_STYLES[component]),
                          *(_g(v) for v in values))
    table.add_row(Text("total", style="bold"), *(Text(_g(p.total_bytes), style="bold") for p in report.phases))
    return table


def peak_bar(report: Report) -> Text:
    """One bar of the peak phase, coloured by component, against the card's capacity."""
    peak = next(p for p in report.phases if p.name == report.peak_phase)
    scale = max(report.capacity_bytes, peak.total_bytes)
    bar = Text("peak  ")
    used = 0
    for component in COMPONENTS:
        cells = round(peak.components.get(component, 0) / scale * BAR_WIDTH)
        bar.append("█" * cells, style=COMPONENT_STYLES[component])
        used += cells
    bar.append("░" * max(BAR_WIDTH - used, 0), style="bright_black")
    bar.append(f"  {_g(peak.total_bytes)} / {_g(report.capacity_bytes)} GiB")
    return bar


def footer(report: Report) -> Text:
    return Text("\n".join(spelled(line, flag) for line in footer_lines(report)), style="dim")


def render(report: Report, gpu: GpuProfile, train: TrainingConfig, hub_id: str,
           console: Console | None = None) -> None:
    console = console or terminal()
    console.print(Group(headline(report, gpu), Text(""), changes_text(report), breakdown_table(report),
                        peak_bar(report), Text("")))
    if report.fits or report.command == "plan":
        label = "GRPOConfig:" if report.fits else "The smallest config (it does not fit this card):"
        console.print(Text(label, style="bold"))
        print_code(python_snippet(train, hub_id), console)
        launch_text(report, train, console)
    console.print(footer(report))


def launch_text(report: Report, train: TrainingConfig, console: Console) -> None:
    """Several GPUs: TRL's accelerate config for the strategy and the line that starts the code above with it."""
    from vram_planner.model.accelerate_config import SCRIPT_FILE, accelerate_config_yaml

    launch, config = report.distributed, accelerate_config_yaml(train)
    if launch is None or config is None:
        return
    # the labels unwrapped too: each names the file the lines below it are
    console.print(Text(f"{launch.accelerate_config_file} ({launch.label}):", style="bold"), soft_wrap=True)
    print_code(config.rstrip("\n"), console)
    if launch.deepspeed_config is not None:
        console.print(Text(f"{launch.deepspeed_config_file} (the DeepSpeed config it names):", style="bold"),
                      soft_wrap=True)
        print_code(json.dumps(launch.deepspeed_config, indent=2), console)
    console.print(Text(f"Launch (the code above saved as {SCRIPT_FILE}):", style="bold"), soft_wrap=True)
    print_code(launch.launch_command, console)


def render_maximized(report: MaximizedPlanReport, gpu: GpuProfile, console: Console | None = None) -> bool:
    """`plan --maximize`: the value, the peak at it and what one step more needs (three decimals: they can be close);
    when nothing fits, that in one line and False."""
    console = console or terminal()
    m, budget = report.maximized, report.capacity_bytes - report.safety_margin_bytes
    where = f"{report.model} on {gpu.label} ({gpu.total_memory_gib:.2f} GiB){per_gpu(report)}"
    if m.value is None:
        fix = ("even with the plan's savers; a larger card (vram-plan gpus --model ...) or plain `vram-plan plan` "
               "(it also shortens completions and shrinks batches) finds what fits" if m.allow_savers else
               "--allow-savers lets the plan's savers make room")
        why = (f"it needs {_g3(m.next_peak_bytes)} GiB, {_g3(budget)} GiB fit with the safety margin"
               if m.limited_by == "memory" else m.limited_by)
        console.print(Text(f"✘ even {m.field} {m.next_value} does not fit {where}: {why}; {fix}", style="bold red"),
                      soft_wrap=True)
        return False
    from vram_planner.model.maximize import UNITS

    text = Text(f"Largest {m.field} that fits {where}: {m.value} {UNITS[m.field]}".rstrip(), style="bold")
    text.append(" (with the plan's savers, below)" if report.changes else "")
    if m.next_value is None:
        text.append(f"\n  peak {_g3(m.peak_bytes)} GiB at {m.value}, the largest valid value: {m.limited_by}")
    elif m.limited_by != "memory":
        text.append(f"\n  peak {_g3(m.peak_bytes)} GiB at {m.value}; at {m.next_value}: {m.limited_by}")
    else:
        text.append(f"\n  peak {_g3(m.peak_bytes)} GiB at {m.value}; at {m.next_value} it needs "
                    f"{_g3(m.next_peak_bytes)} GiB, {small_amount(m.next_peak_bytes - budget)} over the "
                    f"{_g3(budget)} GiB "
                    f"the card allows ({_g(report.capacity_bytes)} GiB less the {_g(report.safety_margin_bytes)} GiB "
                    "safety margin)")
    console.print(text, Text(""))
    return True


def _g3(n_bytes: float | None) -> str:
    return f"{(n_bytes or 0) / GiB:.3f}"


def print_code(code: str, console: Console) -> None:
    """Code people paste: never wrapped or cropped to the terminal's width (a wrapped comment is a SyntaxError)."""
    console.print(Text(code, style="cyan"), soft_wrap=True)


def _error_percent(error: float | None) -> str:
    if error is None:
        return "-"
    return "0.00%" if round(error, 4) == 0 else f"{error:+.2%}"  # no "-0.00%"


def trace_table(report: Report) -> Table:
    """Traced tensor bytes per phase, what the allocator model reserves for them, and the analytic model's tensor
    bytes; error = (analytic - trace) / trace."""
    table = Table(title="Per phase (GiB): trace against the analytic model, and what the allocator reserves",
                  title_justify="left", show_edge=False)
    for column in ("phase", "trace", "reserved", "analytic", "error", "peak moment (trace)"):
        table.add_column(column, justify="left" if column.startswith("p") else "right")
    for phase in report.phases:
        table.add_row(PHASE_TITLES.get(phase.name, phase.name), _g(phase.tensor_bytes or 0),
                      _g(phase.reserved_bytes or 0), _g(phase.analytic_tensor_bytes or 0),
                      _error_percent(phase.analytic_relative_error), phase.peak_moment)
    return table


def render_trace(report: Report, gpu: GpuProfile, console: Console | None = None) -> None:
    """The verdict, trace against analytic per phase, the breakdown with the overheads, the wall time, notes."""
    console = console or terminal()
    conf = f"PYTORCH_CUDA_ALLOC_CONF={report.allocator_conf}" if report.allocator_conf else "torch's defaults"
    seconds = Text(f"Traced in {report.seconds:.1f} s on the CPU. trace: tensor bytes (torch.cuda.memory_allocated);"
                   f" reserved: what a model of PyTorch's caching allocator ({conf}) reserves for them, the most "
                   "during the phase (torch.cuda.max_memory_reserved). The totals and the need add the CUDA "
                   f"context, which neither counts, from the calibration ({report.calibration}) or the GPU catalog; "
                   "the verdict is the need within the card.", style="dim")
    console.print(Group(headline(report, gpu), Text(""), trace_table(report), Text(""), breakdown_table(report),
                        peak_bar(report), Text(""), seconds, footer(report)))


def render_advice(advice, console: Console | None = None) -> None:  # advice: vram_planner.advise.diagnosis.Advice
    console = console or terminal()
    e = advice.error
    figures = [(name, getattr(e, name)) for name in ("tried_to_allocate", "total_capacity", "free", "process_in_use",
                                                     "allocated_by_pytorch", "reserved_unallocated")]
    text = Text(f"{e.kind.replace('_', ' ')}: ", style="bold red")
    text.append(", ".join(f"{name.replace('_', ' ')} {_g(value)} GiB" for name, value in figures if value is not None)
                or e.message[:200])
    parts = [text]
    if e.frames:
        parts.append(Text(f"in {e.frames[-1]}", style="dim"))
    if advice.attribution is not None:
        parts += attribution_lines(advice.attribution, e)
    parts += [Text(f"• {note}") for note in advice.diagnosis]
    parts += fixes_lines(advice.fixes, advice.fitting_config)
    console.print(Group(*parts))


def fixes_lines(fixes, fitting_config) -> list:  # fixes: list of vram_planner.advise.diagnosis.Fix
    """The ranked fixes as a table, and the config that fits."""
    parts: list = []
    if fixes:
        first = "those that remove that tensor first, then " if any(f.removes_culprit for f in fixes) else ""
        table = Table(title=f"Fixes: {first}the largest saving first", title_justify="left", show_edge=False)
        for column in ("change", "saves GiB", "cost", "why"):
            table.add_column(column, justify="right" if column == "saves GiB" else "left")
        for fix in fixes:
            why = f"removes that tensor: {fix.why}" if fix.removes_culprit else fix.why
            table.add_row(fix.change, "-" if fix.saves_bytes is None else _g(fix.saves_bytes), fix.cost, why)
        parts.append(table)
    if fitting_config:
        parts.append(Text("A config that fits: " + ", ".join(f"{k}={v}" for k, v in fitting_config.items()),
                          style="cyan"))
    return parts


def attribution_lines(found, error) -> list[Text]:  # found: vram_planner.advise.diagnosis.Attribution
    """The tensor beside the request, to the byte, what made it exact, and its moment with the live bytes then."""
    how = "exact to the message's rounding" if found.exact else f"{found.error:+.1%} off"
    lines = [Text(f"Most likely {found.culprit}, in {found.phase}.", style="bold"),
             Text(f"  {found.culprit_bytes:,} B = {found.culprit_bytes / GiB:.3f} GiB beside the "
                  f"{_g(found.requested_bytes)} GiB requested: {how}")]
    if found.assumption:
        lines.append(Text(f"  {found.assumption[0].upper()}{found.assumption[1:]}."))
    when = ("the first micro-batch of the first step, before any optimizer state exists" if found.first_micro_batch
            else "a micro-batch after the first (the earlier micro-batches' gradients exist, and from the second "
                 "optimizer step on its states)")
    moment = f" ({found.moment})" if found.moment else ""
    live = ""
    if found.live_bytes is not None:
        live = f"; the model counts {found.live_bytes / GiB:.2f} GiB of tensors alive then"
        if error.allocated_by_pytorch is not None:
            live += f" (the message: {_g(error.allocated_by_pytorch)} GiB allocated by PyTorch)"
    lines.append(Text(f"  When: {when}{moment}{live}."))
    return lines
