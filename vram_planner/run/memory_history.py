"""On CUDA, `run` records the caching allocator's history, and when memory runs out writes torch's snapshot of it to
the run's folder before anything is freed: `vram-plan advise DIR/oom-snapshot.pickle.gz` then says what was on the
card.

torch 2.13's contract (torch/cuda/memory.py; torch/csrc/cuda/Module.cpp): `_record_memory_history(enabled="all",
context=..., stacks=..., max_entries=N)` keeps the last N alloc/free/segment/oom events (a ring), with the Python
frames of each alloc when context="alloc"; `_record_memory_history(enabled=None)` stops it. An observer attached by
`torch._C._cuda_attach_out_of_memory_observer(fn)` is called as fn(device, requested_bytes, device_total_bytes,
device_free_bytes) inside the allocator, after it has tried freeing its cache and before it raises
OutOfMemoryError, so every tensor of the failed step is still alive; torch has no call to detach it, so one observer
is attached per process and writes only while a run records.
"""

from __future__ import annotations

import contextlib
import gzip
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from vram_planner.errors import first_line
from vram_planner.files import write_atomically

OOM_SNAPSHOT_NAME = "oom-snapshot.pickle.gz"
# Trace events kept (a ring: the oldest go first). No ring holds a long generation's start: each decoding step makes
# ~180 events per layer (the H200 run of SmolLM2-135M: 5,313 per token over 30 layers, so 1024-token completions
# make 5.4 million), while a micro-batch's forward and backward make ~600 per layer (~18,000 there) and the failed
# step's tensors are made within those. So the ring holds the last micro-batches and decoding steps, and advise
# counts the blocks made before it by the plan's sizes (vram_planner/advise/roles.py: weights, gradients, states).
# Host memory, torch 2.13 (c10/core/CachingDeviceAllocator.h): a TraceEntry is 136 bytes, 272 MB for the full ring
# (frames add a few KiB per recorded stack); the out-of-memory snapshot turns the ring into Python dicts (~440 bytes
# each, ~0.9 GB while it is pickled) and pickles ~72 bytes per event (the H200 run's 2,000,000 made 144 MB), which
# gzip's fastest level writes in about a tenth of that: a file people copy off the machine (advise reads either form).
MAX_ENTRIES = 2_000_000
MAX_ENTRIES_WITH_FRAMES = 500_000


@dataclass
class OomSnapshots:
    """Where the observer writes, and what it wrote: the paths, and the reason a write failed."""

    target: Path | None = None
    written: list[Path] = field(default_factory=list)
    failed: str | None = None
    attached: bool = False


OBSERVER = OomSnapshots()  # one per process: torch keeps every observer attached for good


def write_oom_snapshot(device: int, requested_bytes: int, device_total_bytes: int, device_free_bytes: int) -> None:
    """The observer: torch's snapshot, pickled and gzip-compressed, written atomically to the recording run's
    folder. Called inside the allocator while the error is being raised, so it never raises itself."""
    import torch

    target = OBSERVER.target
    if target is None:
        return
    try:
        data = gzip.compress(pickle.dumps(torch.cuda.memory._snapshot()), compresslevel=1)
        write_atomically(target, data)
        OBSERVER.written.append(target)
    except Exception as exc:  # noqa: BLE001 (a full disk must not hide the out-of-memory error being raised)
        OBSERVER.failed = first_line(exc)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@contextlib.contextmanager
def memory_history(target: Path, frames: bool = False) -> Iterator[OomSnapshots]:
    """Record the allocator's history while the block runs (with each allocation's Python frames if `frames`), and
    write the snapshot to `target` if memory runs out; off CUDA, nothing."""
    if not cuda_available():
        yield OBSERVER
        return
    import torch

    torch.cuda.memory._record_memory_history(enabled="all", context="alloc" if frames else None, stacks="python",
                                             max_entries=MAX_ENTRIES_WITH_FRAMES if frames else MAX_ENTRIES,
                                             clear_history=True)
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)  # CUDA builds of torch have it
    if not OBSERVER.attached and attach is not None:
        attach(write_oom_snapshot)
        OBSERVER.attached = True
    OBSERVER.target, OBSERVER.written = target, []
    OBSERVER.failed = None if OBSERVER.attached else "this torch build has no out-of-memory observer"
    try:
        yield OBSERVER
    finally:
        OBSERVER.target = None
        torch.cuda.memory._record_memory_history(enabled=None)
