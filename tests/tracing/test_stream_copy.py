"""benchmarks/stream_copy.py: a step at every size, length and depth changed at once, made torch-free from traces of a
shallow tiny model, request for request (tests/step_copy/test_copy_make.py holds the lengths and the depth alone)."""

from __future__ import annotations

import json

import pytest

from helpers import FIXTURES, benchmark_module

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench():
    return benchmark_module("stream_copy")


@pytest.fixture(scope="module")
def template(bench):
    pytest.importorskip("trl")
    config = json.loads((FIXTURES / "tiny-qwen3.json").read_text())
    return bench.StepTemplate(config, {**bench.BASE, **bench.KNOBS["full-fp32-beta"]})


def test_the_step_at_every_size_length_and_depth_changed_is_a_fresh_traces(bench, template):
    requests, aligned, other_size = bench.tried(template)
    assert aligned and other_size == 0 and requests > 15_000
