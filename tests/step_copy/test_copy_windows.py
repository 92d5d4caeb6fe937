"""The windows a copy is traced with (make.windows: the installed transformers' DynamicCache layout) are those the
analytic architecture counts and `check` keys kept copies by, for every catalog model and fixture architecture
(Phi-3 names no layer types: every layer slides)."""

from __future__ import annotations

import json

import pytest

from helpers import FIXTURES
from vram_planner import engine
from vram_planner.profiles import model_catalog, model_config

pytestmark = pytest.mark.slow


def configs() -> list[tuple[str, dict]]:
    catalog = [(name, model_config(name)[0]) for name in sorted({entry.name for entry in model_catalog().values()})]
    return catalog + [(path.stem, json.loads(path.read_text())) for path in sorted(FIXTURES.glob("tiny-*.json"))]


def test_every_models_copy_slides_where_its_architecture_does():
    pytest.importorskip("transformers")
    from vram_planner.step_copy.make import windows

    checked = 0
    for name, config in configs():
        arch = engine.given_architecture(config)
        layers = windows(config)
        assert len(layers) == arch.num_layers, name
        assert sum(window is not None for window in layers) == arch.sliding_layers, name
        assert {window for window in layers if window} == ({arch.sliding_window} if arch.sliding_layers else set())
        checked += 1
    assert checked >= 38 + 9
