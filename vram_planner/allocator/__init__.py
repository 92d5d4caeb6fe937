"""A model of PyTorch's CUDA caching allocator: pure Python, torch-free, fast enough to replay a training step.

Written from c10/cuda/CUDACachingAllocator.cpp and c10/core/AllocatorConfig.{h,cpp} (see caching.py for what each
method follows); the configuration is read as torch 2.13 reads PYTORCH_CUDA_ALLOC_CONF (conf.py), and snapshots
written by torch.cuda.memory._dump_snapshot() are read by snapshot.py.
"""

from vram_planner.allocator.caching import CachingAllocator, OutOfMemory
from vram_planner.allocator.conf import AllocatorConf, parse_allocator_conf
from vram_planner.allocator.replay import ReplayError, ReplayResult, replay_events

__all__ = ["AllocatorConf", "CachingAllocator", "OutOfMemory", "ReplayError", "ReplayResult", "parse_allocator_conf",
           "replay_events"]
