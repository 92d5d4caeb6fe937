"""The public measurements the README compares against: every row well formed, planned offline where its model is in
the catalog, and the verdict agreeing with what happened on the rows whose settings the source states in full."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import benchmark_module
from vram_planner.model.spec import knob_names
from vram_planner.model.trl_releases import trl_release
from vram_planner.profiles import model_catalog



def _script():
    return benchmark_module("public_measurements")


SCRIPT_MODULE = _script()
ROWS = SCRIPT_MODULE.load_rows(SCRIPT_MODULE.DATA)


@pytest.mark.parametrize("row", ROWS, ids=[row.get("id", "?") for row in ROWS])
def test_every_row_is_well_formed(row):
    assert SCRIPT_MODULE.row_problems(row) is None
    assert set(row["settings"]) <= set(knob_names()), row["settings"]
    assert trl_release(row["trl_version"]).version
    assert row["source"].startswith("https://") and row.get("notes") and row.get("quote")


@pytest.mark.parametrize("row", [row for row in ROWS if row["model"].lower() in model_catalog()],
                         ids=lambda row: row["id"])
def test_catalog_rows_are_planned(row):
    comparison = SCRIPT_MODULE.compare(row)
    assert comparison.problem is None and comparison.predicted_gib > 0
    if row.get("confidence") == "high":  # the settings are the source's own: the verdict must agree
        assert comparison.predicted_fits is (row["outcome"] == "fits")


def test_the_readme_shows_the_table_as_planned_today():
    # The README's accuracy section is read as today's answer: a model change that moves a row moves the README too
    # (`python benchmarks/public_measurements.py --markdown`). Rows whose model needs the hub are left to the script.
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    comparisons = [SCRIPT_MODULE.compare(row) for row in ROWS]
    table = SCRIPT_MODULE.markdown_table(comparisons).splitlines()
    stale = [line for line, c in zip(table[2:], comparisons) if not c.problem and line not in readme]
    assert not stale, ("README's public-measurements table is not what the planner says today; paste "
                       "`python benchmarks/public_measurements.py --markdown` over it:\n" + "\n".join(stale))
    summary = SCRIPT_MODULE.summary(comparisons)
    assert summary[0].upper() + summary[1:] in readme


def test_a_row_without_its_transformers_is_planned_under_the_tested_set():
    # One table whatever is installed here: the source's release, else constraints.txt's when of the TRL release's
    # generation (TRL 0.14 runs on transformers 4, which the tested set does not pin: its own time's newest)
    pinned = SCRIPT_MODULE.tested_transformers()
    assert pinned and pinned.split(".")[0] == "5"
    newest = {"trl_version": "1.4.0"}
    assert SCRIPT_MODULE.transformers_for(newest) == pinned
    assert SCRIPT_MODULE.transformers_for({**newest, "transformers_version": "5.23.0"}) == "5.23.0"
    assert SCRIPT_MODULE.transformers_for({"trl_version": "0.14.0"}) is None


ALLOCATED = [row for row in ROWS if SCRIPT_MODULE.measured_quantity(row) == "allocated"]


@pytest.mark.parametrize("row", ALLOCATED[:1], ids=lambda row: row["id"])
def test_a_row_of_allocated_memory_is_set_beside_the_estimates_allocated_peak(row):
    # torch.cuda.max_memory_allocated() counts what the caching allocator hands out: the tensors and the cuBLAS
    # workspaces, never the allocator's reserve or the CUDA context, which the need beside device memory includes
    from vram_planner.units import gib

    comparison = SCRIPT_MODULE.compare(row)
    estimate = SCRIPT_MODULE.planned(row).estimate  # under the tested set's transformers, whichever is installed
    phase = max(estimate.phases, key=lambda p: p.tensor_bytes + p.components["cublas_workspaces"])
    assert comparison.predicted_gib == gib(estimate.allocated_peak_bytes)
    assert estimate.allocated_peak_bytes == phase.tensor_bytes + phase.components["cublas_workspaces"]
    assert estimate.tensor_peak_bytes < estimate.allocated_peak_bytes < estimate.peak_bytes
    assert SCRIPT_MODULE.measured_text(comparison).endswith(" allocated")


def test_a_row_measuring_something_else_is_refused_in_one_line():
    row = {**ALLOCATED[0], "measured_quantity": "nvidia-smi"}
    assert SCRIPT_MODULE.row_problems(row) == "measured_quantity must be one of device, allocated (got 'nvidia-smi')"


@pytest.mark.parametrize("value", [0, -1.5, "8.6", True])
def test_a_reserved_figure_that_is_no_positive_number_is_refused_in_one_line(value):
    row = {**ALLOCATED[0], "measured_reserved_gib": value}
    assert SCRIPT_MODULE.row_problems(row) == f"measured_reserved_gib must be a positive number (got {value!r})"


@pytest.mark.parametrize("row", [row for row in ROWS if "measured_reserved_gib" in row], ids=lambda row: row["id"])
def test_a_reserved_figure_is_the_sources_own_and_at_least_its_allocated_peak(row):
    """measured_reserved_gib is torch.cuda.max_memory_reserved() as the quoted line gives it, and the allocator never
    reserves less than it hands out."""
    assert f'"max_vram_reserved_gb": {row["measured_reserved_gib"]}' in row["quote"]
    assert row["measured_quantity"] == "allocated" and row["measured_reserved_gib"] >= row["measured_gib"]


# The CoursIA probe's runs of 2026-10-06, each a QLoRA step whose allocated peak the source read with
# torch.cuda.max_memory_allocated(): no allocator reserve in the number, so the estimate's tensors meet it closely
SAME_DAY = [row for row in ALLOCATED if "2026-10-06" in row["source"]]


@pytest.mark.parametrize("row", SAME_DAY, ids=lambda row: row["id"])
def test_the_estimate_meets_published_allocated_peaks_within_a_percent(row):
    comparison = SCRIPT_MODULE.compare(row)
    assert comparison.problem is None and abs(comparison.error_pct) < 1.0, comparison.error_pct
