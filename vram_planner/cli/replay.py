"""`vram-plan replay SNAPSHOT`: a torch.cuda.memory._dump_snapshot() through the allocator model, beside what the
recorded allocator did."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click
from pydantic import BaseModel, ConfigDict

from vram_planner.cli.options import PATH

if TYPE_CHECKING:
    from vram_planner.allocator.snapshot_replay import SnapshotReplay

SHOWN_SIZES = 24  # segment sizes a person reads before "... N more"


class ReplayReport(BaseModel):
    """What `vram-plan replay --json` prints: bytes throughout; recorded figures null where the snapshot lacks them."""

    model_config = ConfigDict(defer_build=True)

    snapshot: str
    device: int
    allocator_conf: str
    allocator_conf_source: str
    allocs: int
    frees: int
    predicted_segment_sizes: list[int]
    predicted_max_reserved_bytes: int
    predicted_max_allocated_bytes: int
    recorded_segment_sizes: list[int] | None
    recorded_max_reserved_bytes: int | None
    recorded_reserved_before_bytes: int | None
    segment_count_difference: int | None
    segment_bytes_difference: int | None
    max_reserved_difference_bytes: int | None
    unmatched_frees: int
    mirrored_releases: int
    notes: list[str]


@click.command("replay")
@click.argument("snapshot", type=PATH)
@click.option("--allocator-conf", help="PYTORCH_CUDA_ALLOC_CONF text to replay with (default: that environment "
                                       "variable, else the setting the snapshot records, else torch's defaults).")
@click.option("--device", type=click.IntRange(min=0), help="The CUDA device whose trace to replay (default: the "
                                                            "only one with events).")
@click.option("--json", "json_output", is_flag=True, help="Print one JSON document (figures in bytes).")
def replay(snapshot: Path, allocator_conf: str | None, device: int | None, json_output: bool) -> None:
    """Replay a memory snapshot's allocations and frees through the caching-allocator model: the segments and
    reserved peak it predicts, and the recorded ones beside them."""
    from vram_planner.allocator.conf import parse_allocator_conf
    from vram_planner.allocator.snapshot import load_snapshot
    from vram_planner.allocator.snapshot_replay import pick_device, replay_snapshot

    text, source = _conf_text(allocator_conf)
    conf = parse_allocator_conf(text, source=source) if source else None  # a bad flag fails before any reading
    snap = load_snapshot(snapshot)
    chosen = pick_device(snap, device)
    if conf is None:
        text = snap.allocator_conf_text or ""
        source = "snapshot" if text else "default"
        conf = parse_allocator_conf(text, source="the snapshot's PYTORCH_CUDA_ALLOC_CONF (override it with "
                                                 "--allocator-conf)")
    report = _report(snapshot, replay_snapshot(snap, chosen, conf), text, source)
    if json_output:
        click.echo(report.model_dump_json(indent=2))
    else:
        _render(report)


def _conf_text(flag: str | None) -> tuple[str, str | None]:
    """The allocator conf to replay with and where it came from; no source defers to the snapshot's."""
    from vram_planner.allocator.conf import environment_conf

    return (flag, "--allocator-conf") if flag is not None else environment_conf()


def _report(path: Path, result: SnapshotReplay, conf_text: str, source: str) -> ReplayReport:
    recorded = result.recorded
    known = bool(recorded.segment_sizes) or recorded.max_reserved_bytes is not None
    predicted = result.predicted_segment_sizes
    return ReplayReport(
        snapshot=str(path), device=result.device, allocator_conf=conf_text, allocator_conf_source=source,
        allocs=result.allocs, frees=result.frees, predicted_segment_sizes=predicted,
        predicted_max_reserved_bytes=result.predicted_max_reserved_bytes,
        predicted_max_allocated_bytes=result.predicted_max_allocated_bytes,
        recorded_segment_sizes=recorded.segment_sizes if known else None,
        recorded_max_reserved_bytes=recorded.max_reserved_bytes,
        recorded_reserved_before_bytes=recorded.reserved_before_bytes,
        segment_count_difference=len(predicted) - len(recorded.segment_sizes) if known else None,
        segment_bytes_difference=sum(predicted) - sum(recorded.segment_sizes) if known else None,
        max_reserved_difference_bytes=(result.predicted_max_reserved_bytes - recorded.max_reserved_bytes
                                       if recorded.max_reserved_bytes is not None else None),
        unmatched_frees=result.unmatched_frees, mirrored_releases=result.mirrored_releases, notes=result.notes)


def _render(report: ReplayReport) -> None:
    """For people: GiB for totals, MiB for segment sizes, said in the labels."""
    from rich.table import Table

    from vram_planner.cli.console import terminal
    from vram_planner.units import GiB, MiB

    console = terminal()
    conf = repr(report.allocator_conf) if report.allocator_conf else "torch's defaults"
    origin = {"default": "", "snapshot": " (as the snapshot records)"}.get(report.allocator_conf_source,
                                                                          f" (from {report.allocator_conf_source})")
    console.print(f"[bold]Replay of {report.snapshot}, device {report.device}[/bold]: {report.allocs} allocations "
                  f"and {report.frees} frees through the allocator model, allocator conf {conf}{origin}")
    table = Table(show_edge=False)
    for column in ("", "predicted", "recorded", "difference"):
        table.add_column(column, justify="right" if column else "left")
    recorded = report.recorded_segment_sizes

    def row(label: str, predicted: float, recorded_value: float | None, unit: float, digits: int) -> None:
        cells = [f"{predicted / unit:.{digits}f}"]
        cells += (["-", "-"] if recorded_value is None else
                  [f"{recorded_value / unit:.{digits}f}", f"{(predicted - recorded_value) / unit:+.{digits}f}"])
        table.add_row(label, *cells)

    row("segments (count)", len(report.predicted_segment_sizes), None if recorded is None else len(recorded), 1, 0)
    segment_bytes = sum(report.predicted_segment_sizes), None if recorded is None else sum(recorded)
    reserved_bytes = report.predicted_max_reserved_bytes, report.recorded_max_reserved_bytes
    for label, figures in (("segments", segment_bytes), ("max reserved", reserved_bytes)):
        unit, name = (GiB, "GiB") if max(f or 0 for f in figures) >= GiB else (MiB, "MiB")
        row(f"{label} ({name})", figures[0], figures[1], unit, 2)
    console.print(table)
    console.print(f"predicted_segment_sizes (MiB, in order of creation): {_sizes(report.predicted_segment_sizes, MiB)}")
    if recorded is not None:
        console.print(f"recorded_segment_sizes (MiB, in order of creation): {_sizes(recorded, MiB)}")
    for note in report.notes:
        console.print(f"Note: {note}")


def _sizes(sizes: list[int], unit: int) -> str:
    shown = ", ".join(f"{size / unit:g}" for size in sizes[:SHOWN_SIZES])
    more = f", ... {len(sizes) - SHOWN_SIZES} more" if len(sizes) > SHOWN_SIZES else ""
    return (shown + more) or "none"
