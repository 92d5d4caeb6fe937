"""`--plot FILE.png`: stacked bars per phase, for people who would rather look than read."""

from __future__ import annotations

import os
from pathlib import Path

from vram_planner.errors import VramPlanError
from vram_planner.estimate import COMPONENTS, PHASE_TITLES
from vram_planner.report import Report
from vram_planner.units import GiB

COMPONENT_COLOURS = {"weights": "#1f77b4", "reference_weights": "#17becf", "gradients": "#9467bd",
                     "optimizer_states": "#d62728", "kv_cache": "#bcbd22", "activations": "#2ca02c",
                     "lm_head_buffers": "#98df8a", "vllm_reservation": "#aec7e8", "cuda_context": "#7f7f7f",
                     "allocator_overhead": "#c7c7c7"}


def plot_phases(report: Report, path: Path) -> Path:
    """Write the per-phase breakdown as stacked bars with the card's capacity as a line; atomic."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise VramPlanError("--plot needs matplotlib: pip install 'vram-plan[plot]'") from exc
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise VramPlanError(f"--plot {path}: write .png, .svg or .pdf")
    names = [PHASE_TITLES.get(p.name, p.name) for p in report.phases]
    fig, ax = plt.subplots(figsize=(2.2 + 1.8 * len(names), 5))
    bottoms = [0.0] * len(names)
    for component in COMPONENTS:
        values = [p.components.get(component, 0) / GiB for p in report.phases]
        if any(values):
            ax.bar(names, values, bottom=bottoms, label=component.replace("_", " "),
                   color=COMPONENT_COLOURS[component], edgecolor="white", linewidth=0.5)
            bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.axhline(report.capacity_bytes / GiB, color="black", linestyle="--", linewidth=1)
    ax.text(len(names) - 0.5, report.capacity_bytes / GiB, f" {report.gpu}: {report.capacity_bytes / GiB:.2f} GiB",
            va="bottom", ha="right", fontsize=8)
    ax.set_ylabel("GiB")
    ax.set_title(f"{report.model}: GRPO step memory by phase ({'fits' if report.fits else 'does not fit'})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}{path.suffix}")
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path
