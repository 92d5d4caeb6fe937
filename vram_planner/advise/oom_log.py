"""Finding and reading an out-of-memory error in a log: PyTorch's messages old and new, vLLM's, cuBLAS/cuDNN's and
bitsandbytes', with the traceback frames above them. Reads any size of log in bounded memory."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel

from vram_planner.errors import VramPlanError

SIZE = r"(\d+(?:\.\d+)?)\s*(bytes|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)"
UNIT_BYTES = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
              "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
RANK_PREFIX = re.compile(r"^\s*\[rank\d+\]:\s?")
# torch >= 2.1: "... Tried to allocate 1.90 GiB. GPU 0 has a total capacity of 15.73 GiB of which 1.02 GiB is free.
# Process 4242 has 14.70 GiB memory in use. [Including non-PyTorch memory, this process has ...] Of the allocated
# memory 11.82 GiB is allocated by PyTorch, and 2.41 GiB is reserved by PyTorch but unallocated."
CURRENT = re.compile(rf"Tried to allocate {SIZE}\.? GPU (\d+) has a total capacity of {SIZE} of which {SIZE} is free")
PROCESS = re.compile(rf"Process (\d+) has {SIZE} memory in use")
THIS_PROCESS = re.compile(rf"this process has {SIZE} memory in use")
ALLOCATED = re.compile(rf"Of the allocated memory {SIZE} is allocated by PyTorch, and {SIZE} is reserved by "
                       r"PyTorch but unallocated")
# torch 1.x / 2.0: "Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.21 GiB already allocated;
# 3.12 MiB free; 14.56 GiB reserved in total by PyTorch)"
OLD = re.compile(rf"Tried to allocate {SIZE} \(GPU (\d+); {SIZE} total capacity; {SIZE} already allocated; "
                 rf"{SIZE} free; (?:{SIZE} allowed; )?{SIZE} reserved in total by PyTorch\)")
OTHER_KINDS: list[tuple[str, re.Pattern[str]]] = [
    ("vllm_kv_cache", re.compile(r"larger than the maximum number of tokens that can be stored in KV cache|"
                                 r"No available memory for the cache blocks", re.I)),
    ("vllm_gpu_memory_utilization", re.compile(r"less than desired GPU memory utilization", re.I)),
    ("cublas", re.compile(r"CUBLAS_STATUS_ALLOC_FAILED")),
    ("cudnn", re.compile(r"CUDNN_STATUS_(?:ALLOC_FAILED|NOT_ENOUGH_WORKSPACE|INTERNAL_ERROR)")),
    ("bitsandbytes", re.compile(r"bitsandbytes.*(?:out of memory|CUDA error)|(?:out of memory|CUDA error).*bitsandbytes",
                                re.I)),
]
FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
ERROR_LINE = re.compile(r"OutOfMemoryError|out of memory|Tried to allocate|CUBLAS_STATUS_ALLOC_FAILED|"
                        r"CUDNN_STATUS_|KV cache|cache blocks|GPU memory utilization", re.I)
CONTEXT_LINES = 80  # traceback frames kept above the error
# The transformers release a log names: `pip freeze` (transformers==4.52.3), `transformers env` ("- `transformers`
# version: 4.52.3"), a dist-info path (transformers-4.52.3.dist-info), a script's own print ("transformers 4.52.3")
# pip freeze's "trl==0.14.0", a wheel or dist-info path's "trl-0.14.0", `trl env`'s "TRL version: 0.14.0"
TRL_VERSION = re.compile(r"(?<![\w-])trl`?(?:==|-|\s+version:?\s*|:\s*|\s+)v?(\d+\.\d+(?:\.\d+)?)(?!\.?\d)(?!\w)", re.I)
TRANSFORMERS_VERSION = re.compile(r"(?<![\w-])transformers`?(?:==|-|\s+version:?\s*|:\s*|\s+)v?(\d+\.\d+(?:\.\d+)?)"
                                  r"(?!\.?\d)(?!\w)", re.I)


class OomError(BaseModel):
    """The figures of one out-of-memory error, in bytes (None where the message does not say)."""

    kind: Literal["cuda_oom", "vllm_kv_cache", "vllm_gpu_memory_utilization", "cublas", "cudnn", "bitsandbytes"]
    message: str
    gpu_index: int | None = None
    tried_to_allocate: int | None = None  # as printed: the segment asked of CUDA, rounded to the figure's decimals
    tried_to_allocate_exact: bool = False  # tried_to_allocate is the tensor's own bytes (a snapshot's oom event)
    total_capacity: int | None = None
    free: int | None = None
    process_in_use: int | None = None
    allocated_by_pytorch: int | None = None
    reserved_unallocated: int | None = None
    reserved_total: int | None = None
    other_processes: dict[int, int] = {}  # pid -> bytes in use
    frames: list[str] = []  # "file:line in function", innermost last
    expandable_segments: bool = False
    transformers_version: str | None = None  # the transformers release the log names, where it names one
    trl_version: str | None = None  # the TRL release the log names, where it names one


def size_bytes(number: str, unit: str) -> int:
    return round(float(number) * UNIT_BYTES[unit])


def read_log(lines: Iterable[str]) -> OomError:
    """The last out-of-memory error in a log, with the frames above it (bounded memory whatever the log's size)."""
    window: deque[str] = deque(maxlen=CONTEXT_LINES)
    found: tuple[list[str], str] | None = None
    expandable = False
    seen_text = False
    transformers_version = trl_version = None
    for raw in lines:
        line = RANK_PREFIX.sub("", raw.rstrip("\n"))[:4000]
        seen_text = seen_text or bool(line.strip())
        if named := TRANSFORMERS_VERSION.search(line):
            transformers_version = named.group(1)
        if named := TRL_VERSION.search(line):
            trl_version = named.group(1)
        # PyTorch's own message suggests the setting; only a line that sets it says it was on
        expandable = expandable or ("expandable_segments:True" in line.replace(" ", "")
                                    and "try setting" not in line)
        if ERROR_LINE.search(line):
            found = (list(window), line)
        window.append(line)
    if not seen_text:
        raise VramPlanError("the log is empty")
    if found is None:
        raise VramPlanError("no out-of-memory error found in the log (PyTorch, vLLM, cuBLAS/cuDNN or bitsandbytes)")
    before, line = found
    error = parse_error(line)
    frames = [f"{m.group(1).rsplit('site-packages/', 1)[-1]}:{m.group(2)} in {m.group(3)}"
              for m in map(FRAME.search, before) if m]
    return error.model_copy(update={"frames": frames, "expandable_segments": expandable,
                                    "transformers_version": transformers_version, "trl_version": trl_version})


def parse_error(line: str) -> OomError:
    """The figures of one error line."""
    if m := CURRENT.search(line):
        error = OomError(kind="cuda_oom", message=line.strip(), tried_to_allocate=size_bytes(*m.group(1, 2)),
                         gpu_index=int(m.group(3)), total_capacity=size_bytes(*m.group(4, 5)),
                         free=size_bytes(*m.group(6, 7)))
        processes = {int(p.group(1)): size_bytes(*p.group(2, 3)) for p in PROCESS.finditer(line)}
        update: dict[str, object] = {}
        if own := THIS_PROCESS.search(line):
            update["process_in_use"] = size_bytes(*own.group(1, 2))
        if a := ALLOCATED.search(line):
            update["allocated_by_pytorch"] = size_bytes(*a.group(1, 2))
            update["reserved_unallocated"] = size_bytes(*a.group(3, 4))
        if "process_in_use" not in update and len(processes) == 1:
            update["process_in_use"] = next(iter(processes.values()))
            processes = {}
        elif "process_in_use" in update:
            # the process's own line repeats its figure; the others are other processes
            processes = {pid: n for pid, n in processes.items() if n != update["process_in_use"]}
        update["other_processes"] = processes
        return error.model_copy(update=update)
    if m := OLD.search(line):
        allocated, reserved = size_bytes(*m.group(6, 7)), size_bytes(*m.group(12, 13))
        return OomError(kind="cuda_oom", message=line.strip(), tried_to_allocate=size_bytes(*m.group(1, 2)),
                        gpu_index=int(m.group(3)), total_capacity=size_bytes(*m.group(4, 5)),
                        allocated_by_pytorch=allocated, free=size_bytes(*m.group(8, 9)), reserved_total=reserved,
                        reserved_unallocated=max(reserved - allocated, 0))
    for kind, pattern in OTHER_KINDS:
        if pattern.search(line):
            return OomError(kind=kind, message=line.strip())  # type: ignore[arg-type]
    if m := re.search(rf"Tried to allocate {SIZE}", line):
        return OomError(kind="cuda_oom", message=line.strip(), tried_to_allocate=size_bytes(*m.group(1, 2)))
    return OomError(kind="cuda_oom", message=line.strip())
