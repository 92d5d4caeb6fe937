"""`--plot FILE.png`: stacked bars per phase, for people who would rather look than read."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

from vram_planner.report.document import Report, per_gpu
from vram_planner.errors import VramPlanError
from vram_planner.files import check_writable, write_atomically
from vram_planner.model.phases import COMPONENTS, PHASE_TITLES, component_label
from vram_planner.units import GiB

COMPONENT_COLOURS = {"weights": "#1f77b4", "reference_weights": "#17becf", "gradients": "#9467bd",
                     "optimizer_states": "#d62728", "kv_cache": "#bcbd22", "activations": "#2ca02c",
                     "lm_head_buffers": "#98df8a", "vllm_reservation": "#aec7e8", "cuda_context": "#7f7f7f",
                     "nccl_buffers": "#8c564b", "vllm_communicators": "#c49c94", "cublas_workspaces": "#a5a5a5",
                     "allocator_overhead": "#c7c7c7"}


FORMATS = (".png", ".svg", ".pdf")


def check_plot_target(path: Path) -> None:
    """Refuse a --plot target that could not be written, before any work: its format, matplotlib, the path."""
    if path.suffix.lower() not in FORMATS:
        raise VramPlanError(f"--plot {path}: write {', '.join(FORMATS[:-1])} or {FORMATS[-1]}")
    if importlib.util.find_spec("matplotlib") is None:
        raise VramPlanError("--plot needs matplotlib: pip install 'vram-plan[plot]'")
    check_writable(path, "--plot")


def plot_phases(report: Report, path: Path) -> Path:
    """Write the per-phase breakdown as stacked bars with the card's capacity as a line; atomic."""
    check_plot_target(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [PHASE_TITLES.get(p.name, p.name) for p in report.phases]
    fig, ax = plt.subplots(figsize=(2.2 + 1.8 * len(names), 5))
    bottoms = [0.0] * len(names)
    for component in COMPONENTS:
        values = [p.components.get(component, 0) / GiB for p in report.phases]
        if any(values):
            ax.bar(names, values, bottom=bottoms, label=component_label(component),
                   color=COMPONENT_COLOURS[component], edgecolor="white", linewidth=0.5)
            bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.axhline(report.capacity_bytes / GiB, color="black", linestyle="--", linewidth=1)
    ax.text(len(names) - 0.5, report.capacity_bytes / GiB, f" {report.gpu}: {report.capacity_bytes / GiB:.2f} GiB",
            va="bottom", ha="right", fontsize=8)
    ax.set_ylabel("GiB")
    ax.set_title(f"{report.model}: GRPO step memory by phase{per_gpu(report)} "
                 f"({'fits' if report.fits else 'does not fit'})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    image = io.BytesIO()
    try:
        fig.savefig(image, dpi=120, format=path.suffix.lower().lstrip("."))
    finally:
        plt.close(fig)
    return write_atomically(path, image.getvalue())
