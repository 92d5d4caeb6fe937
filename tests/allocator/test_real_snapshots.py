"""The model against real allocator traces: torch.cuda.memory._snapshot() of TRL 1.16 GRPOTrainer runs (two
optimizer steps each) on an H100 80GB with torch 2.11.0+cu130 (tests/fixtures/snapshots/h100, made and reduced by
benchmarks/gpu_steps.py). Replayed with the settings each run recorded, the model makes exactly the recorded
segments, in order, and reaches exactly the recorded reserved peak."""

from __future__ import annotations

import pytest

from helpers import H100_SNAPSHOTS, h100_snapshot
from vram_planner.allocator import parse_allocator_conf
from vram_planner.allocator.snapshot_replay import pick_device, replay_snapshot

MiB = 1024**2
# file: (segments recorded, reserved peak in bytes): what the H100 did, read from each file's trace and segments.
RECORDED = {
    "Llama-3.2-1B-full.pkl.gz": (225, 21_118_320_640),
    "Llama-3.2-1B-lora16-expandable.pkl.gz": (102, 5_639_241_728),
    "Llama-3.2-1B-lora16.pkl.gz": (105, 5_666_504_704),
    "Qwen2.5-0.5B-full-expandable.pkl.gz": (263, 8_659_140_608),
    "Qwen2.5-0.5B-full.pkl.gz": (280, 8_921_284_608),
    "Qwen2.5-0.5B-lora16.pkl.gz": (93, 2_470_445_056),
    "SmolLM2-135M-lora16.pkl.gz": (62, 763_363_328),
}


def test_every_recording_is_listed():
    assert sorted(path.name for path in H100_SNAPSHOTS.glob("*.pkl.gz")) == sorted(RECORDED)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECORDED))
def test_a_real_h100_trace_replays_to_the_recorded_segments_and_peak(name):
    """The replay reads PYTORCH_CUDA_ALLOC_CONF from the snapshot's allocator_settings (expandable_segments:True for
    the runs named so, torch's defaults for the others) and predicts every recorded segment_alloc or segment_map
    size in order and the reserved peak, to the byte."""
    snapshot = h100_snapshot(name)
    assert snapshot.allocator_conf_text == ("expandable_segments:True" if "expandable" in name else "")
    conf = parse_allocator_conf(snapshot.allocator_conf_text)
    result = replay_snapshot(snapshot, pick_device(snapshot, None), conf)
    segments, peak_bytes = RECORDED[name]
    assert len(result.recorded.segment_sizes) == segments and result.recorded.max_reserved_bytes == peak_bytes
    assert result.predicted_segment_sizes == result.recorded.segment_sizes
    assert result.predicted_max_reserved_bytes == peak_bytes
    assert result.unmatched_frees == 0 and result.recorded.reserved_before_bytes == 0
