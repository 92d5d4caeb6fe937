"""`vram-plan replay SNAPSHOT`: the JSON document, the human output, where the allocator conf comes from, and one
line on stderr with exit code 2 for anything that is not a snapshot it can replay."""

from __future__ import annotations

import json
import pickle
import sys

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from helpers import FIXTURES, one_line_error, run

# Protocol 4, then a BYTEARRAY8 opcode whose length is 5.9e18 bytes: hypothesis found it printing a second line
DAMAGED_BYTEARRAY = b"\x80\x04\x96z\xcd8!\x91\xa6\xd6Q"

MiB = 1024**2
SNAPSHOTS = FIXTURES / "snapshots"
KV = str(SNAPSHOTS / "kv_cache_growth.pickle")
FIELDS = {"snapshot", "device", "allocator_conf", "allocator_conf_source", "allocs", "frees",
          "predicted_segment_sizes", "predicted_max_reserved_bytes", "predicted_max_allocated_bytes",
          "recorded_segment_sizes", "recorded_max_reserved_bytes", "recorded_reserved_before_bytes",
          "segment_count_difference", "segment_bytes_difference", "max_reserved_difference_bytes",
          "unmatched_frees", "mirrored_releases", "notes"}


@pytest.fixture(autouse=True)
def _no_alloc_conf_in_the_environment(monkeypatch):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)


def test_json_has_predicted_recorded_and_differences(capsys):
    code, out, err = run(capsys, "replay", KV, "--json")
    doc = json.loads(out)
    assert code == 0 and err == "" and set(doc) == FIELDS
    assert doc["predicted_segment_sizes"] == doc["recorded_segment_sizes"] == [2 * MiB] + [
        n * MiB for n in (12, 14, 16, 18, 20, 22)]
    assert doc["predicted_max_reserved_bytes"] == doc["recorded_max_reserved_bytes"] == 104 * MiB
    assert (doc["segment_count_difference"], doc["segment_bytes_difference"],
            doc["max_reserved_difference_bytes"]) == (0, 0, 0)
    assert (doc["allocator_conf"], doc["allocator_conf_source"]) == ("", "default")


def test_the_flag_sets_the_allocator_conf_and_the_difference_shows(capsys):
    code, out, _ = run(capsys, "replay", KV, "--json", "--allocator-conf", "expandable_segments:True")
    doc = json.loads(out)
    assert code == 0 and doc["allocator_conf_source"] == "--allocator-conf"
    assert doc["predicted_segment_sizes"] == [2 * MiB] + [20 * MiB] * 3
    assert (doc["segment_count_difference"], doc["segment_bytes_difference"]) == (-3, -42 * MiB)
    assert doc["max_reserved_difference_bytes"] == -42 * MiB


def test_the_environment_variable_is_the_default_conf(capsys, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    doc = json.loads(run(capsys, "replay", KV, "--json")[1])
    assert doc["allocator_conf_source"] == "PYTORCH_CUDA_ALLOC_CONF"
    assert doc["predicted_max_reserved_bytes"] == 62 * MiB


def test_without_flag_or_variable_the_snapshots_own_setting_is_used(capsys):
    doc = json.loads(run(capsys, "replay", str(SNAPSHOTS / "kv_cache_growth_expandable.pkl.gz"), "--json")[1])
    assert (doc["allocator_conf"], doc["allocator_conf_source"]) == ("expandable_segments:True", "snapshot")
    assert doc["segment_count_difference"] == 0 and doc["max_reserved_difference_bytes"] == 0


def test_human_output_says_its_units(capsys):
    code, out, _ = run(capsys, "replay", str(SNAPSHOTS / "mid_run.pickle"))
    assert code == 0
    assert "predicted_segment_sizes (MiB, in order of creation): 30, 20" in out
    assert "recorded_segment_sizes (MiB, in order of creation): 30, 20" in out
    assert "max reserved (MiB)" in out and "recording began mid-run" in " ".join(out.split())


def test_the_device_flag_picks_a_device(capsys):
    doc = json.loads(run(capsys, "replay", str(SNAPSHOTS / "two_devices.pickle"), "--device", "1", "--json")[1])
    assert doc["device"] == 1 and doc["predicted_segment_sizes"] == [2 * MiB]


def bad_files(tmp_path) -> dict[str, str]:
    files = {"random bytes": bytes(range(256)) * 4, "empty": b"", "json": b'{"segments": []}',
             "a class": (SNAPSHOTS / "with_a_class.pickle").read_bytes(),
             "a list": pickle.dumps([1, 2]), "no events": pickle.dumps({"segments": [], "device_traces": [[]]})}
    paths = {}
    for name, content in files.items():
        path = tmp_path / f"{name.replace(' ', '-')}.pickle"
        path.write_bytes(content)
        paths[name] = str(path)
    paths["missing"] = str(tmp_path / "missing.pickle")
    paths["a folder"] = str(tmp_path)
    paths["below a file"] = str(tmp_path / "empty.pickle" / "snapshot.pickle")
    return paths


@pytest.mark.parametrize("case", ["random bytes", "empty", "json", "a class", "a list", "no events", "missing",
                                  "a folder", "below a file"])
def test_what_is_not_a_snapshot_is_one_line_and_exit_2(capsys, tmp_path, case):
    err = one_line_error(capsys, "replay", bad_files(tmp_path)[case])
    assert "Error" not in err and "Traceback" not in err and "Exception" not in err


@pytest.mark.parametrize("args,message", [
    (["--allocator-conf", "backend:cudaMallocAsync"], "--allocator-conf 'backend:cudaMallocAsync': "
                                                      "backend:cudaMallocAsync is a different allocator"),
    (["--allocator-conf", "max_split_size_mb:5"], "max_split_size_mb must be at least 20 MiB"),
    (["--allocator-conf", "expandable:True"], "unknown key 'expandable'; did you mean expandable_segments"),
    (["--device", "3"], "no trace events for device 3; devices with events: 0"),
    (["--device", "-1"], "--device"),
])
def test_bad_options_are_one_line_and_exit_2(capsys, args, message):
    err = one_line_error(capsys, "replay", KV, *args)
    assert message in err


def test_a_bad_environment_variable_is_named(capsys, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:2")
    err = one_line_error(capsys, "replay", KV)
    assert err.startswith("error: PYTORCH_CUDA_ALLOC_CONF 'garbage_collection_threshold:2': garbage_collection_thr")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=2048), st.binary(max_size=64).map(lambda b: b"\x80\x04" + b),
                      st.text(max_size=200).map(str.encode)))
@example(data=DAMAGED_BYTEARRAY)
def test_random_bytes_are_refused_in_one_line(capsys, tmp_path, data):
    """Whatever the bytes (pickle-looking ones too), one line on stderr and exit code 2."""
    path = tmp_path / "random.pickle"
    path.write_bytes(data)
    err = one_line_error(capsys, "replay", str(path))
    assert "Traceback" not in err and "internal error" not in err


def test_what_cpython_prints_while_it_unpickles_a_damaged_stream_stays_off_stderr(capsys, tmp_path, monkeypatch):
    # CPython 3.11 may print a SystemError through sys.excepthook as it frees the BYTEARRAY8 of exabytes it could not
    # allocate (allocator/snapshot.py _unpickle), at random (an unset field decides): a stand-in for the unpickler's
    # load prints as CPython does, then fails as it does
    from vram_planner.allocator import snapshot

    def load(self):
        sys.excepthook(SystemError, SystemError("deallocated bytearray object has exported buffers"), None)
        raise MemoryError

    monkeypatch.setattr(snapshot._DataOnlyUnpickler, "load", load)
    path = tmp_path / "damaged.pickle"
    path.write_bytes(DAMAGED_BYTEARRAY)
    hook = sys.excepthook  # the interpreter's, or one a library installed (torch.distributed's, after a trace)
    assert "it is not a Python pickle" in one_line_error(capsys, "replay", str(path))
    assert sys.excepthook is hook
