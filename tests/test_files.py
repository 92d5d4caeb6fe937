"""vram_planner.files: every file a user names is read bounded in size and nesting (devices, oversized files and deep
JSON or YAML are one line at once), and a write target is refused before the work when it could not be written."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vram_planner import files
from vram_planner.cli.settings_file import read_settings_file
from vram_planner.errors import ProfileError, VramPlanError
from vram_planner.files import (MAX_NESTING, bounded_lines, check_json_lines_nesting, check_json_nesting, check_writable,
                                load_json, load_yaml, read_bytes, read_text)

DEVICES = ["/dev/zero", "/dev/urandom", "/dev/null", "/dev/full"]


def json_depth(value) -> int:
    """The nesting of a parsed JSON value, by walking it (what check_json_nesting counts without parsing)."""
    if isinstance(value, dict):
        return 1 + max((json_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((json_depth(v) for v in value), default=0)
    return 0


# JSON whose strings hold brackets, quotes and backslashes: what a bracket count that ignored strings would miscount.
TRICKY_TEXT = st.text(alphabet='[]{}"\\ab\n\u2714', max_size=12)
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | TRICKY_TEXT,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TRICKY_TEXT, inner, max_size=3),
                           max_leaves=30)


def nested(depth: int, kinds: str) -> str:
    """JSON nested `depth` deep, opening with the brackets `kinds` cycles through (arrays, objects or both)."""
    opening = "".join('{"k":' if kinds[i % len(kinds)] == "{" else "[" for i in range(depth))
    closing = "".join("}" if kinds[i % len(kinds)] == "{" else "]" for i in reversed(range(depth)))
    return opening + "1" + closing


@settings(max_examples=200, deadline=None)
@given(value=JSON_VALUES, indent=st.sampled_from([None, 1]))
def test_json_nesting_is_counted_outside_strings(value, indent):
    text = json.dumps(value, indent=indent, ensure_ascii=False)
    depth = json_depth(value)
    wrapped = nested(MAX_NESTING - depth, "[{") if depth < MAX_NESTING else None
    check_json_nesting(text, "x")  # never deeper than the cap: hypothesis' trees are shallow
    if wrapped is not None:  # the same value at exactly the cap, then one deeper
        at_cap = wrapped.replace("1", text, 1)
        assert load_json(at_cap, "x") is not None
        with pytest.raises(ProfileError, match=f"x is nested more than {MAX_NESTING} levels deep"):
            check_json_nesting(f"[{at_cap}]", "x")


SHALLOW = st.none() | st.integers() | TRICKY_TEXT | st.lists(TRICKY_TEXT, max_size=2) | st.just({"a": [[]]})


@st.composite
def spines(draw):
    """A value nested about MAX_NESTING deep along one spine, with shallow siblings at random levels: deep files
    whose opening brackets do not come in one run."""
    value = draw(JSON_VALUES)
    for _ in range(draw(st.integers(MAX_NESTING - 6, MAX_NESTING + 4))):
        siblings = draw(st.lists(SHALLOW, max_size=2))
        if draw(st.booleans()):
            value = [*siblings, value] if draw(st.booleans()) else [value, *siblings]
        else:
            value = {**{f"s{i}": v for i, v in enumerate(siblings)}, "spine": value}
    return value


@settings(max_examples=100, deadline=None)
@given(value=spines())
def test_nesting_near_the_cap_is_counted_exactly(value):
    text = json.dumps(value, ensure_ascii=False)
    if json_depth(value) > MAX_NESTING:
        with pytest.raises(ProfileError, match="nested more than"):
            check_json_nesting(text, "x")
    else:
        check_json_nesting(text, "x")


@settings(max_examples=30, deadline=None)
@given(depth=st.integers(MAX_NESTING + 1, 100_000), kinds=st.sampled_from(["[", "{", "[{", "{[["]))
def test_deep_json_is_refused_in_milliseconds(depth, kinds):
    text = nested(depth, kinds)
    start = time.perf_counter()
    with pytest.raises(ProfileError, match="nested more than"):
        load_json(text, "config.json")
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("text", ["- " * 100_000 + "a\n", "[" * 100_000 + "]" * 100_000,
                                  "a:\n" + "".join(f"{' ' * i}b:\n" for i in range(1, 200)),
                                  "{a: " * 5000 + "1" + "}" * 5000])
def test_deep_yaml_is_refused(text):
    start = time.perf_counter()
    with pytest.raises(ProfileError, match="run.yaml is nested more than"):
        load_yaml(text, "run.yaml")
    assert time.perf_counter() - start < 2


def test_yaml_at_the_cap_is_read():
    assert load_yaml("- " * MAX_NESTING + "a\n", "run.yaml") is not None


@pytest.mark.parametrize("device", DEVICES)
def test_devices_are_refused_before_a_byte_is_read(device):
    start = time.perf_counter()
    with pytest.raises(ProfileError, match=f"cannot read --config {device}: it is a device, not a file"):
        read_bytes(device, files.MAX_DATA_FILE_BYTES, "--config")
    with pytest.raises(VramPlanError, match=f"cannot read the log {device}: it is a device"):
        list(bounded_lines(device))
    assert time.perf_counter() - start < 1


def test_a_file_over_the_cap_is_refused_by_its_size(tmp_path):
    big = tmp_path / "config.json"
    with big.open("wb") as fh:
        fh.truncate(files.MAX_DATA_FILE_BYTES + 1)  # sparse: no disk, and read_bytes must not read it
    with pytest.raises(ProfileError, match="holds more than 16 MiB"):
        read_text(big)
    settings = tmp_path / "run.yaml"  # written by hand, and YAML parses at about 1 MiB a second: a smaller cap
    settings.write_text("beta: 0.0\n" + "#" * files.MAX_SETTINGS_BYTES)
    with pytest.raises(ProfileError, match="cannot read --config .*run.yaml: it holds more than 1 MiB"):
        read_settings_file(settings)
    log = tmp_path / "crash.log"
    with log.open("wb") as fh:
        fh.truncate(files.MAX_LOG_BYTES + 1)
    with pytest.raises(VramPlanError, match=r"the log .* holds more than 256 MiB.*; give its end instead \(tail"):
        next(bounded_lines(str(log)))


def test_a_pipe_is_read_up_to_the_cap(tmp_path):
    """A FIFO (`<(cmd)`) says nothing of its size: one byte past the cap is what refuses it."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # exec: the writer killed below is head itself; a head forked by sh outlived it, and the reader below could open
    # the FIFO against its write end and read an empty end of file (this failed so once, under load)
    writer = subprocess.Popen(["sh", "-c", f"exec head -c 2000 /dev/zero > {fifo}"])
    try:
        with pytest.raises(ProfileError, match="holds more than"):
            read_bytes(fifo, 1000)
    finally:
        writer.kill()
        writer.wait()
    writer = subprocess.Popen(["sh", "-c", f"printf 'a\\nb\\n' > {fifo}"])
    assert list(bounded_lines(str(fifo))) == ["a\n", "b\n"]
    writer.wait()


def test_stdin_from_a_device_is_refused(monkeypatch):
    with open("/dev/zero") as zero:
        monkeypatch.setattr("sys.stdin", zero)
        with pytest.raises(VramPlanError, match="cannot read stdin: it is a device"):
            next(bounded_lines("-"))


def test_a_log_is_read_up_to_its_cap(tmp_path):
    log = tmp_path / "crash.log"
    log.write_text("x\n" * 100)
    assert len(list(bounded_lines(str(log), limit=200))) == 100
    with pytest.raises(VramPlanError, match="holds more than"):
        list(bounded_lines(str(log), limit=199))


def test_text_that_is_not_utf8(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ProfileError, match="config.json is not a JSON file"):
        read_text(path, kind="a JSON file")


def test_an_immutable_target_is_refused_before_the_work(immutable_file):
    with pytest.raises(VramPlanError, match="cannot write --plot .*plan.png: the file there is read-only or immutable"):
        check_writable(immutable_file, "--plot")


@pytest.mark.parametrize("device", ["/dev/full", "/dev/null"])
def test_a_device_target_is_refused(tmp_path, device):
    """Renaming a finished file over /dev/full would replace the device itself, as root."""
    link = tmp_path / "plan.png"
    link.symlink_to(device)
    for target in (Path(device), link):
        with pytest.raises(VramPlanError, match="it is a device, not a file"):
            check_writable(target, "--out")


def test_json_lines_are_checked_line_by_line(tmp_path):
    """As pyarrow's reader takes them: a crowded but shallow line passes, a deep one is named by its number."""
    path = tmp_path / "data.jsonl"
    shallow = json.dumps({"prompt": [{"role": "user", "content": "[{"}] * 100})
    path.write_text(f'{{"prompt": "a"}}\n{shallow}\n')
    check_json_lines_nesting(path, "dataset")
    path.write_text(f'{{"prompt": "a"}}\n{shallow}\n{nested(20_000, "[{")}\n')
    with pytest.raises(ProfileError, match="dataset: line 3 is nested more than"):
        check_json_lines_nesting(path, "dataset")
    path.write_text(shallow * 2 + "\n")
    with pytest.raises(ProfileError, match="dataset: line 1 is longer than"):
        check_json_lines_nesting(path, "dataset", line_limit=len(shallow) + 10)
