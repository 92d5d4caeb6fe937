"""The allocator model's bisections run at a shallow depth of the frame stack, whatever the depth of their caller."""

from __future__ import annotations

import sys

import pytest

from vram_planner.allocator.need import least_capacity
from vram_planner.allocator.own_stack import on_own_stack
from vram_planner.allocator.replay import ALLOC, FREE


def _depth() -> int:
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return depth


def _called_at_depth(depth: int, call):
    return call() if depth == 0 else _called_at_depth(depth - 1, call)


@on_own_stack
def _own_depth() -> int:
    return _depth()


def test_a_call_runs_at_the_same_shallow_depth_from_any_caller():
    shallow, deep = _own_depth(), _called_at_depth(400, _own_depth)
    assert shallow == deep < 10
    assert _called_at_depth(400, _depth) > 400  # the same call without its own stack


def test_what_the_call_raises_reaches_the_caller_as_it_is():
    @on_own_stack
    def refuses(n: int) -> int:
        raise ValueError(f"no {n}")

    with pytest.raises(ValueError, match="no 3"):
        refuses(3)


def test_a_bisection_is_the_same_on_its_own_stack():
    events = [(ALLOC, 0, 3 << 20), (ALLOC, 1, 5 << 20), (FREE, 0, 0), (ALLOC, 2, 4 << 20), (FREE, 1, 0),
              (FREE, 2, 0)]
    need = least_capacity(events)
    unwrapped = least_capacity.__wrapped__(events)
    assert (need.capacity_bytes, need.tensor_peak_bytes, need.held_bytes) == (
        unwrapped.capacity_bytes, unwrapped.tensor_peak_bytes, unwrapped.held_bytes)
    assert need.capacity_bytes >= need.tensor_peak_bytes > 0
