"""cuBLAS workspaces: memory the caching allocator holds for matrix products, beyond every tensor and the context.

torch gives each (cuBLAS handle, stream) pair a workspace at its first matrix product (CublasHandlePool.cpp,
getCurrentCUDABlasHandle and getNewWorkspace), allocated through the caching allocator and kept until the process
ends: CUBLAS_WORKSPACE_CONFIG's size, by default :4096:8 (32 MiB) on compute capability 9.0 exactly
(parseChosenWorkspaceSize's `sm90`) and :4096:2:16:8 (8 MiB + 128 KiB) on every other card. Handles belong to
threads: a training step multiplies on the Python thread (the forward passes, generation) and on autograd's thread
for the device (the backward), so from the first backward on two exist. Recorded on an H100 with torch 2.11
(tests/fixtures/snapshots/h100): 32 MiB at the first forward product, 32 MiB at the first backward product, never
freed. cuBLASLt's own 1 MiB (CUBLASLT_WORKSPACE_SIZE) comes only with products that go through cuBLASLt (Qwen2's
biased projections did, Llama's unbiased ones did not): 2 MiB at most, left out.
"""

from __future__ import annotations

SM90_WORKSPACE_BYTES = 4096 * 1024 * 8
DEFAULT_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
# The Python thread and autograd's device thread: each gets its own handle, so its own workspace.
TRAINING_THREADS = 2


def workspace_bytes(compute_capability: str) -> int:
    """One thread's cuBLAS workspace on a card of this compute capability ("" when unknown), in bytes."""
    return SM90_WORKSPACE_BYTES if compute_capability.strip() == "9.0" else DEFAULT_WORKSPACE_BYTES


def cublas_workspace_bytes(compute_capability: str) -> int:
    """What a GRPO step's cuBLAS handles hold on a card of this compute capability, in bytes."""
    return TRAINING_THREADS * workspace_bytes(compute_capability)
