"""Reading a torch.cuda.memory._dump_snapshot() file: a pickle of plain data, perhaps gzip-compressed.

The format (torch/cuda/memory.py, _snapshot's docstring, and _memory_viz.py of torch 2.13): a dict with "segments"
(the allocator's segments when the snapshot was taken: device, address, total_size, stream, segment_type,
is_expandable, blocks) and "device_traces" (per device, the TraceEntry dicts recorded since
_record_memory_history: action in alloc, free_requested, free_completed, segment_alloc, segment_free, segment_map,
segment_unmap, snapshot, oom; addr, size, stream, frames), plus "allocator_settings" in recent releases; torch 2.15
adds `annotate` entries (metadata put on a live allocation) and the host allocator's "host_segments" and
"host_traces", none of them device memory, so the replay passes them by. A snapshot
is a file from somewhere else: it is unpickled with every class refused, so it can hold only dicts, lists, tuples,
strings, numbers, booleans and None, and nothing in it can run.
"""

from __future__ import annotations

import gzip
import io
import pickle
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from vram_planner.errors import VramPlanError, first_line, json_kind
from vram_planner.files import MAX_SNAPSHOT_BYTES, read_bytes
from vram_planner.units import GiB

ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap", "snapshot", "oom")
SIZED_ACTIONS = frozenset(ACTIONS) - {"snapshot", "oom"}
GZIP_MAGIC = b"\x1f\x8b"
FRAMES_KEPT = 24  # innermost frames kept per allocation: where a tensor was made is near the top


class SnapshotError(VramPlanError):
    """A file that is not a memory snapshot this model can replay."""


# One trace event: (action, address, size in bytes, stream).
TraceEvent = tuple[str, int, int, int]


@dataclass(frozen=True)
class Segment:
    """A segment of the snapshot's final state."""

    device: int
    address: int
    total_size: int
    is_expandable: bool
    # (address, size, allocated, requested size) where the file lists its blocks: the size is the allocator's block,
    # the requested size the tensor's own bytes (the block's size where the file leaves it out)
    blocks: tuple[tuple[int, int, bool, int], ...] = ()


@dataclass
class Snapshot:
    """The parts of a snapshot a replay needs."""

    device_traces: list[list[TraceEvent]]
    segments: list[Segment] = field(default_factory=list)
    has_segments: bool = False  # the file carried a "segments" list (even an empty one)
    allocator_conf_text: str | None = None  # the PYTORCH_CUDA_ALLOC_CONF the run used, where the file says
    # (device, event index) -> where an alloc was made ("file:line in function", innermost first), where recorded
    frames: dict[tuple[int, int], tuple[str, ...]] = field(default_factory=dict)
    # (device, event index) -> the bytes CUDA still had free at an oom event
    device_free: dict[tuple[int, int], int] = field(default_factory=dict)

    def devices_with_events(self) -> list[int]:
        return [device for device, events in enumerate(self.device_traces) if events]


class _DataOnlyUnpickler(pickle.Unpickler):
    """Unpickles builtin containers and scalars only: any class or persistent id is refused."""

    def find_class(self, module: str, name: str):
        raise SnapshotError(f"it holds a Python object of class {module}.{name}; a memory snapshot holds only "
                            "dicts, lists, numbers and strings, and vram-plan runs nothing from a file")

    def persistent_load(self, pid):
        raise SnapshotError("it refers to outside objects (a persistent id); a memory snapshot does not")


def free_action(events: list[TraceEvent]) -> str:
    """The event that returns a block to its pool: free_completed, or free_requested in a trace without them."""
    return "free_completed" if any(e[0] == "free_completed" for e in events) else "free_requested"


def load_snapshot(path: Path) -> Snapshot:
    """The snapshot in `path` (a .pickle, or gzip-compressed); SnapshotError in one line for anything else."""
    data = read_bytes(path, MAX_SNAPSHOT_BYTES, "the snapshot", SnapshotError)
    try:
        return parse_snapshot(_unpickle(_decompress(data)))
    except SnapshotError as exc:
        raise SnapshotError(f"{path} is not a torch.cuda.memory._dump_snapshot() file: {exc}") from exc


def _decompress(data: bytes) -> bytes:
    if not data:
        raise SnapshotError("the file is empty")
    if len(data) > MAX_SNAPSHOT_BYTES:
        raise SnapshotError(f"it is larger than {MAX_SNAPSHOT_BYTES // 2**30} GiB")
    if not data.startswith(GZIP_MAGIC):
        return data
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as unzipped:
            data = unzipped.read(MAX_SNAPSHOT_BYTES + 1)  # a small file may unzip to any size
    except (OSError, EOFError, zlib.error) as exc:
        raise SnapshotError(f"it starts like gzip but does not decompress ({first_line(exc)})") from exc
    if len(data) > MAX_SNAPSHOT_BYTES:
        raise SnapshotError(f"it unzips to more than {MAX_SNAPSHOT_BYTES // GiB} GiB, the most vram-plan reads")
    return data


def _unpickle(data: bytes) -> object:
    # A damaged stream can ask for a BYTEARRAY8 of exabytes: CPython 3.11 then frees the half-made bytearray before
    # setting its export count (PyByteArray_FromStringAndSize), and its dealloc, reading that count unset, may print
    # "SystemError: deallocated bytearray object has exported buffers" through sys.excepthook (PyErr_Print), at random:
    # a second line on stderr beside the refusal. Nothing of the file's is worth printing there, so the hook is mute.
    hook = sys.excepthook
    sys.excepthook = _mute
    try:
        return _DataOnlyUnpickler(io.BytesIO(data)).load()
    except SnapshotError:
        raise
    except Exception as exc:  # a damaged or foreign byte stream fails in many ways: all mean "not a pickle"
        raise SnapshotError("it is not a Python pickle") from exc
    finally:
        sys.excepthook = hook


def _mute(*exc_info) -> None:
    pass


def parse_snapshot(data: object) -> Snapshot:
    """Check the unpickled data has the snapshot's shape and keep what a replay needs."""
    if not isinstance(data, dict):
        kind = json_kind(data)
        raise SnapshotError(f"it holds {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not the dict of segments and "
                            "device_traces a snapshot is")
    if "device_traces" not in data and "segments" not in data:
        raise SnapshotError("it has neither device_traces nor segments")
    traces = data.get("device_traces", [])
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise SnapshotError("its device_traces is not a list of event lists")
    device_traces = [[_event(e, device, index) for index, e in enumerate(t)] for device, t in enumerate(traces)]
    frames, device_free = _frames_and_free(traces)
    raw_segments = data.get("segments", [])
    if not isinstance(raw_segments, list):
        raise SnapshotError("its segments is not a list")
    settings = data.get("allocator_settings")
    conf_text = settings.get("PYTORCH_CUDA_ALLOC_CONF") if isinstance(settings, dict) else None
    return Snapshot(device_traces, [_segment(s, i) for i, s in enumerate(raw_segments)], "segments" in data,
                    conf_text if isinstance(conf_text, str) else None, frames, device_free)


def _frames_and_free(traces: list[list[dict]]) -> tuple[dict[tuple[int, int], tuple[str, ...]],
                                                        dict[tuple[int, int], int]]:
    """The recorded frames of each alloc and oom event (each distinct stack kept once), and each oom's free bytes."""
    frames: dict[tuple[int, int], tuple[str, ...]] = {}
    device_free: dict[tuple[int, int], int] = {}
    stacks: dict[tuple[str, ...], tuple[str, ...]] = {}
    for device, events in enumerate(traces):
        for index, event in enumerate(events):
            action = event["action"]
            if action == "oom" and isinstance(event.get("device_free"), int):
                device_free[device, index] = event["device_free"]
            raw = event.get("frames") if action in ("alloc", "oom") else None
            if raw and isinstance(raw, list):
                stack = tuple(f"{f.get('filename')}:{f.get('line')} in {f.get('name')}" for f in raw[:FRAMES_KEPT]
                              if isinstance(f, dict))
                frames[device, index] = stacks.setdefault(stack, stack)
    return frames, device_free


def _event(event: object, device: int, index: int) -> TraceEvent:
    where = f"event {index} of device {device}"
    if not isinstance(event, dict) or not isinstance(event.get("action"), str):
        raise SnapshotError(f"{where} is not a dict with an action")
    action = event["action"]
    if action not in SIZED_ACTIONS:
        return action, 0, _int(event.get("size", 0), where, "size"), 0
    return (action, _int(event.get("addr"), where, "addr"), _int(event.get("size"), where, "size"),
            _int(event.get("stream", 0), where, "stream"))


def _segment(segment: object, index: int) -> Segment:
    where = f"segment {index}"
    if not isinstance(segment, dict):
        raise SnapshotError(f"{where} is not a dict")
    raw_blocks = segment.get("blocks")
    blocks = tuple(_block(b, where) for b in raw_blocks if isinstance(b, dict)) if isinstance(raw_blocks, list) else ()
    return Segment(_int(segment.get("device", 0), where, "device"), _int(segment.get("address"), where, "address"),
                   _int(segment.get("total_size"), where, "total_size"), segment.get("is_expandable") is True,
                   blocks)


def _block(block: dict, where: str) -> tuple[int, int, bool, int]:
    size = _int(block.get("size"), where, "size")
    requested = block.get("requested_size", size)
    return (_int(block.get("address"), where, "address"), size, block.get("state") != "inactive",
            _int(requested, where, "size") if requested is not None else size)


def _int(value: object, where: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SnapshotError(f"{where} has {name} {value!r:.40}, not a whole number of bytes"
                            if name == "size" else f"{where} has {name} {value!r:.40}, not a non-negative integer")
    return value
