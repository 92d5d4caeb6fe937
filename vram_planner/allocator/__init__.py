"""A model of PyTorch's CUDA caching allocator: pure Python, torch-free, fast enough to replay a training step.

Written from c10/cuda/CUDACachingAllocator.cpp and c10/core/AllocatorConfig.{h,cpp} (see caching.py for what each
method follows); the configuration is read as torch 2.13 reads PYTORCH_CUDA_ALLOC_CONF (conf.py), and snapshots
written by torch.cuda.memory._dump_snapshot() are read by snapshot.py.
"""

from vram_planner.allocator.conf import AllocatorConf, parse_allocator_conf

__all__ = ["AllocatorConf", "CachingAllocator", "OutOfMemory", "ReplayError", "ReplayResult", "parse_allocator_conf",
           "replay_events"]
# The allocator itself loads when it is used: `plan` and `check` only read a PYTORCH_CUDA_ALLOC_CONF text.
_LAZY = {"CachingAllocator": "caching", "OutOfMemory": "caching", "ReplayError": "replay", "ReplayResult": "replay",
         "replay_events": "replay"}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
