"""Snapshots in the torch.cuda.memory._dump_snapshot() format, made by hand (tests/fixtures/snapshots), read safely
and replayed: predicted segments and reserved peak beside the recorded ones."""

from __future__ import annotations

import gzip
import pickle
import runpy

import pytest

from helpers import FIXTURES
from vram_planner.allocator import parse_allocator_conf
from vram_planner.allocator.snapshot import SnapshotError, load_snapshot, parse_snapshot
from vram_planner.allocator.snapshot_replay import pick_device, replay_snapshot

MiB = 1024**2
SNAPSHOTS = FIXTURES / "snapshots"
KV_STEPS = [12 * MiB, 14 * MiB, 16 * MiB, 18 * MiB, 20 * MiB, 22 * MiB]


def replay(name: str, conf: str = "", device: int | None = None):
    snapshot = load_snapshot(SNAPSHOTS / name)
    return replay_snapshot(snapshot, pick_device(snapshot, device), parse_allocator_conf(conf))


def test_the_fixture_files_are_what_their_script_makes():
    made = runpy.run_path(str(SNAPSHOTS / "make_snapshots.py"))
    for name in made["SNAPSHOTS"]:
        assert (SNAPSHOTS / name).read_bytes() == made["snapshot_bytes"](name), name


def test_a_trace_replays_to_the_recorded_segments():
    """kv_cache_growth.pickle: three small tensors in one 2 MiB segment, then a KV cache grown 12..22 MiB by
    concatenation: the recorded segment_alloc events are the model's segments, 104 MiB at the peak."""
    result = replay("kv_cache_growth.pickle")
    assert result.predicted_segment_sizes == result.recorded.segment_sizes == [2 * MiB] + KV_STEPS
    assert result.predicted_max_reserved_bytes == result.recorded.max_reserved_bytes == 104 * MiB
    assert result.predicted_max_allocated_bytes == 3 * 100_352 + 42 * MiB
    assert (result.allocs, result.frees, result.unmatched_frees) == (9, 5, 0)
    assert result.recorded.reserved_before_bytes == 0 and result.notes == []


def test_a_gzip_snapshot_with_expandable_segments_replays_to_its_mapped_pages():
    """kv_cache_growth_expandable.pkl.gz: the same steps recorded under expandable_segments:True map a 2 MiB small
    page and three 20 MiB large pages (segment_map), which is what the model maps."""
    result = replay("kv_cache_growth_expandable.pkl.gz", "expandable_segments:True")
    assert result.predicted_segment_sizes == result.recorded.segment_sizes == [2 * MiB] + [20 * MiB] * 3
    assert result.predicted_max_reserved_bytes == result.recorded.max_reserved_bytes == 62 * MiB
    assert result.recorded.expandable and result.notes == []


def test_a_replay_with_other_settings_shows_the_difference():
    """The default-allocator recording replayed with expandable segments: 62 MiB predicted against 104 recorded,
    and a note that the recorded run did not use them."""
    result = replay("kv_cache_growth.pickle", "expandable_segments:True")
    assert result.predicted_max_reserved_bytes == 62 * MiB and result.recorded.max_reserved_bytes == 104 * MiB
    assert any("did not use expandable_segments" in note for note in result.notes)


def test_a_recording_begun_mid_run_says_what_the_model_leaves_out():
    """mid_run.pickle: the first free is of a block allocated before recording (not modeled), 20 MiB were
    reserved before the trace (the final segments minus the trace's net change); the empty_cache run of two
    segment_free events is replayed as one empty_cache()."""
    result = replay("mid_run.pickle")
    assert result.unmatched_frees == 1 and result.mirrored_releases == 1
    assert result.predicted_segment_sizes == result.recorded.segment_sizes == [30 * MiB, 20 * MiB]
    assert result.recorded.reserved_before_bytes == 20 * MiB and result.recorded.max_reserved_bytes == 50 * MiB
    assert result.predicted_max_reserved_bytes == 30 * MiB
    assert any("recording began mid-run: 1 free of blocks allocated before it, 20.00 MiB" in n for n in result.notes)


def test_frees_are_taken_from_free_requested_when_nothing_completes():
    """free_block records free_completed; a trace without any (an older recording) falls back to free_requested."""
    events = [{"action": "alloc", "addr": 1, "size": 5 * MiB, "stream": 0},
              {"action": "free_requested", "addr": 1, "size": 5 * MiB, "stream": 0},
              {"action": "alloc", "addr": 2, "size": 5 * MiB, "stream": 0}]
    snapshot = parse_snapshot({"device_traces": [events]})
    result = replay_snapshot(snapshot, 0, parse_allocator_conf(""))
    assert result.frees == 1 and result.predicted_segment_sizes == [20 * MiB]
    assert result.recorded.max_reserved_bytes is None and result.recorded.segment_sizes == []


def test_the_device_is_chosen_or_asked_for():
    """_memory_viz: the only device with events, else the one named."""
    snapshot = load_snapshot(SNAPSHOTS / "two_devices.pickle")
    with pytest.raises(SnapshotError, match="events for devices 0, 1; choose one with --device"):
        pick_device(snapshot, None)
    assert pick_device(snapshot, 1) == 1
    with pytest.raises(SnapshotError, match="no trace events for device 2; devices with events: 0, 1"):
        pick_device(snapshot, 2)
    with pytest.raises(SnapshotError, match="holds no trace events"):
        pick_device(parse_snapshot({"segments": [], "device_traces": [[]]}), None)


def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    """A snapshot comes from somewhere else: unpickling refuses every class (find_class), so a pickle built to
    call os.system never does."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            import os
            return os.system, (f"touch {marker}",)

    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [[Payload()]]}))
    with pytest.raises(SnapshotError, match=r"holds a Python object of class (posix|os)\.system"):
        load_snapshot(path)
    assert not marker.exists()


@pytest.mark.parametrize("content,reason", [
    (b"", "the file is empty"),
    (b"\x00\x01garbage\xff" * 10, "it is not a Python pickle"),
    (b'{"segments": []}', "it is not a Python pickle"),
    (gzip.compress(b"not a pickle", mtime=0), "it is not a Python pickle"),
    (b"\x1f\x8b\x08broken gzip", "it starts like gzip but does not decompress"),
    (pickle.dumps([1, 2, 3]), "it holds an array, not the dict"),
    (pickle.dumps({"hello": 1}), "it has neither device_traces nor segments"),
    (pickle.dumps({"device_traces": [[{"action": "alloc", "addr": 1}]]}), "event 0 of device 0 has size None"),
    (pickle.dumps({"device_traces": [["alloc"]]}), "event 0 of device 0 is not a dict with an action"),
    (pickle.dumps({"device_traces": {}}), "its device_traces is not a list of event lists"),
    (pickle.dumps({"segments": [{"address": -1, "total_size": 1}]}), "segment 0 has address -1"),
])
def test_a_file_that_is_not_a_snapshot_is_refused_in_one_line(tmp_path, content, reason):
    path = tmp_path / "file.pickle"
    path.write_bytes(content)
    with pytest.raises(SnapshotError) as caught:
        load_snapshot(path)
    assert reason in str(caught.value) and "\n" not in str(caught.value)
    assert str(caught.value).startswith(f"{path} is not a torch.cuda.memory._dump_snapshot() file")


def test_an_unreadable_path_is_refused(tmp_path):
    with pytest.raises(SnapshotError, match="cannot read the snapshot .*: No such file or directory"):
        load_snapshot(tmp_path / "missing.pickle")
    with pytest.raises(SnapshotError, match="cannot read the snapshot .*: Is a directory"):
        load_snapshot(tmp_path)


def _event(action: str, address: int, size: int) -> dict:
    return {"action": action, "addr": address, "size": size, "stream": 0}


def test_the_replay_puts_segments_where_the_recording_says_cudamalloc_put_them():
    """Best fit breaks ties by address (BlockComparatorSize), and the addresses are cudaMalloc's. Here a 12 MiB
    segment, then a 20 MiB one below it (cudaMalloc's addresses fall as often as they rise); the 12 MiB frees, and
    a 4 MiB request finds two free 12 MiB blocks: the one at the lower address, in the 20 MiB segment, takes it.
    So when the 8 MiB block frees, no 16 MiB block is left and the recording makes a 16 MiB segment. With made-up
    rising addresses the model put the 4 MiB block in the first segment and found room in the second."""
    upper, lower, third = 0x7F00_4000_0000, 0x7F00_2000_0000, 0x7F00_0000_0000
    events = [_event("segment_alloc", upper, 12 * MiB), _event("alloc", upper, 12 * MiB),
              _event("segment_alloc", lower, 20 * MiB), _event("alloc", lower, 8 * MiB),
              _event("free_requested", upper, 12 * MiB), _event("free_completed", upper, 12 * MiB),
              _event("alloc", lower + 8 * MiB, 4 * MiB),
              _event("free_requested", lower, 8 * MiB), _event("free_completed", lower, 8 * MiB),
              _event("segment_alloc", third, 16 * MiB), _event("alloc", third, 16 * MiB)]
    result = replay_snapshot(parse_snapshot({"device_traces": [events]}), 0, parse_allocator_conf(""))
    assert result.recorded.segment_sizes == [12 * MiB, 20 * MiB, 16 * MiB]
    assert result.predicted_segment_sizes == result.recorded.segment_sizes
    assert result.predicted_max_reserved_bytes == 48 * MiB


def test_a_gzip_that_unzips_past_the_cap_is_refused(tmp_path, monkeypatch):
    """A small file may unzip to any size (a gzip bomb): the unzipping stops one byte past the cap."""
    from vram_planner.allocator import snapshot

    monkeypatch.setattr(snapshot, "MAX_SNAPSHOT_BYTES", 1 << 20)
    path = tmp_path / "bomb.pickle.gz"
    path.write_bytes(gzip.compress(pickle.dumps({"segments": []}) + bytes(4 << 20)))
    assert path.stat().st_size < 64 << 10
    with pytest.raises(SnapshotError, match="it unzips to more than"):
        load_snapshot(path)
    monkeypatch.setattr(snapshot, "MAX_SNAPSHOT_BYTES", 8 << 20)  # under the cap it is read whole (and the pickle
    assert load_snapshot(path).device_traces == []                # stops at its end, before the padding)


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_device_is_refused_at_once(device):
    with pytest.raises(SnapshotError, match=f"cannot read the snapshot {device}: it is a device, not a file"):
        load_snapshot(device)


def test_a_torch_215_snapshot_with_annotations_and_host_memory_replays_the_same():
    """torch 2.15 records `annotate` trace entries (metadata put on a live allocation after the fact, addr its
    base) and adds the host allocator's `host_segments` and `host_traces`; none of them is device memory."""
    base = 0x7F00_4000_0000
    events = [_event("segment_alloc", base, 12 * MiB), _event("alloc", base, 12 * MiB),
              _event("free_requested", base, 12 * MiB), _event("free_completed", base, 12 * MiB),
              _event("alloc", base, 8 * MiB)]
    annotated = events[:2] + [{"action": "annotate", "addr": base, "size": 0, "stream": 0,
                               "user_metadata": "the KV cache"}] + events[2:]
    plain = replay_snapshot(parse_snapshot({"device_traces": [events]}), 0, parse_allocator_conf(""))
    newer = replay_snapshot(parse_snapshot({"device_traces": [annotated], "host_segments": [],
                                            "host_traces": [[{"action": "alloc", "addr": 1, "size": 4096}]]}),
                            0, parse_allocator_conf(""))
    assert (newer.allocs, newer.frees, newer.predicted_segment_sizes, newer.predicted_max_reserved_bytes) == (
        plain.allocs, plain.frees, plain.predicted_segment_sizes, plain.predicted_max_reserved_bytes) == (
        2, 1, [12 * MiB], 12 * MiB)
