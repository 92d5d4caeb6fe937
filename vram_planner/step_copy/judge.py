"""`check`'s verdict from a kept copy of the exact engine: where the estimate lies near the boundary and a copy of
this model's step under these knobs is kept (store), the step is made at the config's lengths and depth and replayed
once through the allocator model on the card. Pure Python: `check` stays torch-free.
"""

from __future__ import annotations

import time
from dataclasses import replace

from vram_planner.allocator import parse_allocator_conf
from vram_planner.model.cublas import workspace_bytes
from vram_planner.model.verdict import ReplayedCopy, Verdict
from vram_planner.step_copy.replay import copied_stream, runs_on
from vram_planner.step_copy.store import copy_key, kept


def replayed(verdict: Verdict, prompts: list[int]) -> Verdict:
    """The verdict decided by a kept copy where the estimate is near the boundary and one answers for this config
    (the step runs where it runs with batches of each of `prompts`' longest prompt, as `check --exact` traces a
    shorter one where it may need more); the estimate's verdict otherwise."""
    if not verdict.near_boundary or verdict.train.num_gpus > 1:
        return verdict
    context, train = verdict.context, verdict.train
    try:
        key = copy_key(context.arch, train, context.release)
    except ValueError:  # no copy can be made of it
        return verdict
    found = kept(key)
    if found is None:
        return verdict
    copy, made = found
    start = time.perf_counter()
    workspace = workspace_bytes(context.gpu.compute_capability)
    try:
        streams = [copied_stream(copy, prompt, train.max_completion_length, context.arch.num_layers, workspace)
                   for prompt in prompts]
    except ValueError:  # lengths or a depth the copy does not make
        return verdict
    conf = parse_allocator_conf(train.allocator_conf)
    runs = all(runs_on(stream, conf, context.allocatable_bytes(train)) for stream in streams)
    return replace(verdict, replayed=ReplayedCopy(runs, made, time.perf_counter() - start,
                                                  sum(len(s.events) for s in streams)))
