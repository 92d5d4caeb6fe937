"""The cuBLAS workspaces a step holds, as torch sizes them and as a real H100 run allocated them."""

from __future__ import annotations

import pytest

from helpers import h100_snapshot
from vram_planner import engine
from vram_planner.model.cublas import cublas_workspace_bytes, workspace_bytes
from vram_planner.tracing.events import ALLOC, LOADING, Event, SteadyStream, with_workspaces

MiB = 2**20


def test_sizes_follow_parse_chosen_workspace_size():
    assert workspace_bytes("9.0") == 32 * MiB  # :4096:8 on compute capability 9.0
    for other in ("8.9", "8.0", "7.5", "10.0", "12.0", ""):
        assert workspace_bytes(other) == 8 * MiB + 128 * 1024  # :4096:2:16:8
    assert cublas_workspace_bytes("9.0") == 64 * MiB


@pytest.mark.parametrize("snapshot", ["Qwen2.5-0.5B-lora16.pkl.gz", "Llama-3.2-1B-lora16.pkl.gz"])
def test_a_real_h100_step_holds_two_sets_of_workspaces_that_are_never_freed(snapshot):
    events = h100_snapshot(snapshot).device_traces[0]
    allocs = [(i, address, size) for i, (action, address, size, _) in enumerate(events) if action == "alloc"]
    freed_after = {}
    for i, (action, address, _, _) in enumerate(events):
        if action == "free_completed":
            freed_after.setdefault(address, []).append(i)

    def kept(index: int, address: int) -> bool:
        return not any(i > index for i in freed_after.get(address, []))

    kept_workspaces = [i for i, address, size in allocs if size == workspace_bytes("9.0") and kept(i, address)]
    assert len(kept_workspaces) == 2  # one per thread that multiplies: Python's and autograd's
    # the second comes with the first backward, long after the first forward product of generation
    assert kept_workspaces[1] - kept_workspaces[0] > len(events) // 4


def test_check_counts_them_on_every_phase_by_the_cards_compute_capability():
    for gpu, capability in (("h100-80gb", "9.0"), ("rtx4090", "8.9")):
        verdict = engine.check("Qwen2.5-0.5B", gpu)
        assert {p.components["cublas_workspaces"] for p in verdict.estimate.phases} == {
            cublas_workspace_bytes(capability)}
        assert verdict.estimate.peak_bytes == pytest.approx(max(p.total_bytes for p in verdict.estimate.phases))


def test_the_traced_stream_allocates_them_at_the_first_product_and_the_first_backward():
    step = [Event(ALLOC, 1, 100, LOADING, "weights"), Event(ALLOC, 2, 10, "generation", "prefill"),
            Event(ALLOC, 3, 10, "training", "forward")]
    stream = SteadyStream(step + [e._replace(block=e.block + 10) for e in step[1:]],
                          {LOADING: (0, 1), "generation": (3, 4), "training": (4, 5)}, 3)
    grown = with_workspaces(stream, 32 * MiB)
    assert [(e.phase, e.size_bytes) for e in grown.events] == [
        (LOADING, 100), ("generation", 32 * MiB), ("generation", 10), ("training", 32 * MiB), ("training", 10),
        ("generation", 10), ("training", 10)]
    assert grown.second_step == 5 and grown.spans == {LOADING: (0, 1), "generation": (5, 6), "training": (6, 7)}
    assert len({e.block for e in grown.events}) == len(grown.events)
