"""The committed per-GPU tables are what today's model prints: a change to the model regenerates them (they had drifted
twice before anyone noticed)."""

from __future__ import annotations

import pytest

from helpers import benchmark_module


@pytest.mark.parametrize("script", ["zero_states", "offload_states"])
def test_committed_table_is_what_the_model_prints_today(script):
    module = benchmark_module(script)
    committed = module.TABLE.read_text().splitlines()
    today = module.table_rows()
    # the last line says whether DeepSpeed was importable to compare its own functions: the environment's, not the model's
    assert today[:-1] == committed[:-1], f"regenerate it: python benchmarks/{script}.py"
