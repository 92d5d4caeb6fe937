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
