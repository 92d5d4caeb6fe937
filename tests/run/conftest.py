"""Fixtures of the run's tests."""

from __future__ import annotations

import pytest

from vram_planner import engine
from vram_planner.run.setup import RunSetup


@pytest.fixture
def setup(tmp_path):
    """A run of SmolLM2-135M on a T4 with micro-batches of 8 sequences of up to 512 completion tokens."""
    verdict = engine.check("SmolLM2-135M", "t4", {"per_device_train_batch_size": 8, "num_generations": 8,
                                                "max_completion_length": 512})
    return RunSetup(verdict=verdict, model_id="SmolLM2-135M", dataset="math-sample", rewards=["format"],
                    output_dir=tmp_path / "run")
