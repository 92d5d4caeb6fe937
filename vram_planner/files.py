"""Files in and out. Out: written so that a run that dies leaves either the old file or the new one, never half of
one, to targets checked before the work. In: every file a user names is read through here, bounded in size and in
nesting, so that /dev/zero, a 10 GB file or JSON nested 100,000 deep is one line at once, not memory without end or
a recursion error."""

from __future__ import annotations

import os
import re
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vram_planner.errors import ProfileError, VramPlanError, first_line
from vram_planner.units import GiB, MiB

# The most each kind of file may hold. A config.json or a calibration is kilobytes (a vision model's config.json with
# its processor settings, tens of KiB), parsed by json's C scanner.
MAX_DATA_FILE_BYTES = 16 * MiB
# What people write by hand, --config files and catalogs: the largest shipped catalog is 30 KiB, and YAML parses at
# about 1 MiB a second even with LibYAML (TOML faster).
MAX_SETTINGS_BYTES = 1 * MiB
# An OOM log may be a whole run's stdout: 256 MiB is a million steps' log lines, and reading them takes about 30 s
# (read_log keeps only a window; the time is in its patterns, line by line).
MAX_LOG_BYTES = 256 * MiB
LOG_TAIL = "; give its end instead (tail -n 100000 LOG | vram-plan advise -)"
# torch.cuda.memory._dump_snapshot() pickles, after gunzip: the largest, with every event's stack frames, run to
# hundreds of MiB.
MAX_SNAPSHOT_BYTES = 2 * GiB
# JSON or YAML nesting: the deepest shipped config.json or calibration goes 4 levels; Python's own parsers recurse
# and fail near 1,000 (PyYAML's near 500), and what walks the value afterwards would too.
MAX_NESTING = 64


def write_atomically(path: Path, text: str | bytes) -> Path:
    """Write `text` (or bytes) to a temporary file beside `path`, flush it to disk, then rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_writable(path: Path, what: str, hint: str = "") -> None:
    """Refuse, in one line naming `what` (a flag) and `path`, a file target that write_atomically could not write:
    checked before any work, by creating (and removing) a file where it would go, since permissions do not stop
    root. `hint` says how to fix it."""
    hint = f"; {hint}" if hint else ""
    if path.is_dir():
        raise VramPlanError(f"{what} {path} is a folder; give a file name{hint}")
    if path.exists() and not path.is_file():  # renaming over /dev/full would replace the device, as root
        raise VramPlanError(f"cannot write {what} {path}: it is a device, not a file{hint}")
    if path.is_file() and not os.access(path, os.W_OK):  # an immutable file (chattr +i) refuses root too
        raise VramPlanError(f"cannot write {what} {path}: the file there is read-only or immutable{hint}")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:  # write_atomically creates the missing folders
        folder = folder.parent
    if not folder.is_dir():
        raise VramPlanError(f"cannot write {what} {path}: {folder} is a file, not a folder{hint}")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".vram-plan-check.")
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise VramPlanError(f"cannot write {what} {path}: no file can be created in {folder} ({reason}){hint}"
                            ) from exc
    os.close(fd)
    os.unlink(tmp)


def read_bytes(path: Path | str, limit: int, what: str = "", error: type[VramPlanError] = ProfileError) -> bytes:
    """The bytes of the file at `path`, at most `limit` of them. A device (/dev/zero), a folder, a file larger than
    `limit` or one that cannot be opened is `error` in one line naming `what` (a flag, or a kind of file) and the
    path, at once: a device is refused before a byte is read, a regular file by its size."""
    label = f"{what} {path}" if what else str(path)
    try:
        with open(path, "rb") as fh:
            _check_kind(os.fstat(fh.fileno()), label, limit, error)
            data = fh.read(limit + 1)  # a FIFO or a /proc file says nothing of its size: read one byte past
    except OSError as exc:
        raise error(f"cannot read {label}: {exc.strerror or exc}") from exc
    if len(data) > limit:
        raise error(_too_large(label, limit))
    return data


def read_text(path: Path | str, limit: int = MAX_DATA_FILE_BYTES, what: str = "", kind: str = "text",
              error: type[VramPlanError] = ProfileError) -> str:
    """The file as UTF-8 text, bounded as read_bytes; bytes that are not UTF-8 are one line saying the file is not
    `kind` (e.g. "a JSON file")."""
    data = read_bytes(path, limit, what, error)
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        label = f"{what} {path}" if what else str(path)
        raise error(f"{label} is not {kind} (its bytes are not UTF-8 text)") from exc


def bounded_lines(path: str, limit: int = MAX_LOG_BYTES, what: str = "the log") -> Iterator[str]:
    """A log's lines, from a file or `-` for stdin, 64 KiB at most at a time, undecodable bytes replaced; one line
    of refusal for a device (stdin included, unless it is a terminal someone pastes into) and past `limit` bytes."""
    import io

    label = "stdin" if path == "-" else f"{what} {path}"
    try:
        stream = (io.TextIOWrapper(sys.stdin.buffer, errors="replace") if path == "-"
                  else open(path, errors="replace"))  # noqa: SIM115 (closed below, after the generator is drained)
    except OSError as exc:
        raise VramPlanError(f"cannot read {path}: {exc.strerror}") from exc
    with stream:
        if not stream.isatty():
            _check_kind(os.fstat(stream.fileno()), label, limit, VramPlanError, LOG_TAIL)
        read = 0
        for line in iter(lambda: stream.readline(65536), ""):
            read += len(line)  # characters: bytes for the ASCII of a log, and a bound either way
            if read > limit:
                raise VramPlanError(_too_large(label, limit) + LOG_TAIL)
            yield line


def _check_kind(info: os.stat_result, label: str, limit: int, error: type[VramPlanError], hint: str = "") -> None:
    if stat.S_ISDIR(info.st_mode):
        raise error(f"cannot read {label}: it is a folder, not a file")
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISFIFO(info.st_mode) or stat.S_ISSOCK(info.st_mode)):  # a pipe
        raise error(f"cannot read {label}: it is a device, not a file")
    if info.st_size > limit:
        raise error(_too_large(label, limit) + hint)


def _too_large(label: str, limit: int) -> str:
    size = f"{limit // GiB} GiB" if limit % GiB == 0 else f"{limit // MiB} MiB"
    return f"cannot read {label}: it holds more than {size}, the most vram-plan reads from such a file"


def load_json(text: str, label: str) -> Any:
    """JSON text's value, refused in one line (ProfileError) when nested deeper than MAX_NESTING; a
    json.JSONDecodeError for text that is not JSON, as json.loads raises it."""
    import json

    check_json_nesting(text, label)
    return json.loads(text)


# A JSON string (its brackets are not nesting), as the unrolled loop that runs in re's inner loop, with no nested
# repetition to backtrack in; then everything but brackets, and the two kinds as one.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_AS_PARENS = str.maketrans("[]{}", "()()")


def check_json_nesting(text: str, label: str) -> None:
    """Refuse, before parsing, JSON nested deeper than MAX_NESTING (brackets left open count as levels too). In C
    loops: the brackets outside strings, then up to MAX_NESTING passes that each take the innermost pairs away (a
    pass in Python over each bracket took seconds for 16 MiB); a file of 16 MiB of brackets takes about a second."""
    if text.count("[") + text.count("{") <= MAX_NESTING:
        return
    brackets = _NOT_BRACKETS.sub("", _JSON_STRING.sub("", text)).translate(_AS_PARENS)
    run = "(" * (MAX_NESTING + 1)  # the usual deep file, at once, and what most deep ones become after a pass
    for _ in range(MAX_NESTING):
        if run in brackets:
            break
        brackets, before = brackets.replace("()", ""), brackets
        if brackets == before:
            break
    if run in brackets or "()" in brackets or brackets.count("(") > MAX_NESTING:
        raise ProfileError(f"{label} is nested more than {MAX_NESTING} levels deep; no file vram-plan reads is")


def check_json_lines_nesting(path: Path, label: str, line_limit: int = MAX_DATA_FILE_BYTES) -> None:
    """Refuse a JSON or JSON Lines file with a line nested deeper than MAX_NESTING, reading it line by line as
    pyarrow's JSON reader does (the datasets library's), which recurses and crashes the process near 20,000 levels.
    A line with no more brackets than the cap cannot be deeper, so counting them passes over a 100 MB file in a
    second; only a crowded line is scanned."""
    with open(path, "rb") as fh:
        for number, line in enumerate(iter(lambda: fh.readline(line_limit), b""), start=1):
            if line.count(b"[") + line.count(b"{") <= MAX_NESTING:
                continue
            if len(line) >= line_limit and not line.endswith(b"\n"):
                raise ProfileError(f"{label}: line {number} is longer than {line_limit // MiB} MiB; a record is "
                                   "one line of JSON, kilobytes long")
            check_json_nesting(line.decode(errors="replace"), f"{label}: line {number}")


def load_yaml(text: str, label: str) -> Any:
    """YAML text's value (as yaml.safe_load reads it), refused in one line when it is not YAML (`label` names it) or
    nested deeper than MAX_NESTING: counted over the parser's events, which come without recursion (PyYAML's composer
    recurses, and fails near 500 levels; LibYAML's scanner stops flow nesting at 1,000 itself, with its own words)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # LibYAML's, where PyYAML was built with it: 3x faster
    deeper = ProfileError(f"{label} is nested more than {MAX_NESTING} levels deep; no file vram-plan reads is")
    depth = 0
    try:
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_NESTING:
                    raise deeper
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
        return yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader, LibYAML's or PyYAML's
    except yaml.YAMLError as exc:
        if "maximum nesting depth" in str(getattr(exc, "problem", "")):
            raise deeper from exc
        raise ProfileError(f"{label} is not valid YAML: {first_line(exc)}") from exc
