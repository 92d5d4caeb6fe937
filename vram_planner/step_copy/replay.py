"""A copied step judged as `check --exact` judges a traced one: its stream, with the cuBLAS workspaces, replayed
through the caching allocator model on the card, and the least capacity it runs in bisected. Pure Python.
"""

from __future__ import annotations

from vram_planner.allocator.conf import AllocatorConf
from vram_planner.allocator.need import Need, least_capacity
from vram_planner.allocator.replay import Replays, replay_events
from vram_planner.step_copy.document import StepCopy
from vram_planner.step_copy.layers import expanded
from vram_planner.step_copy.lengths import stream_at
from vram_planner.tracing.events import Event, SteadyStream, repeated_stream, with_workspaces


def copied_stream(copy: StepCopy, prompt: int, completion: int, depth: int, workspace_bytes: int) -> SteadyStream:
    """The step of a model `depth` layers deep at these lengths, as a trace there would give it, with the cuBLAS
    workspaces of `workspace_bytes` each where a real step allocates them. ValueError where the copy cannot make it:
    lengths it does not answer for (lengths.refusal), or a depth that is not the traced one plus whole periods."""
    copies, rest = divmod(depth - copy.layers, copy.period)
    if copies < 0 or rest or copies and copy.unit[1] + 2 > copy.layers:
        raise ValueError(f"a copy traced with {copy.layers} layers makes {copy.layers} + a multiple of "
                         f"{copy.period}, not {depth}")
    events = stream_at(copy, prompt, completion, depth)
    if copies:
        events = expanded(events, range(*copy.unit), copies)
    return with_workspaces(repeated_stream([Event(*e) for e in events]), workspace_bytes)


def runs_on(stream: SteadyStream, conf: AllocatorConf, card_bytes: int) -> bool:
    """Whether the allocator model replays the stream without running out where cudaMalloc can hand out
    `card_bytes`: one replay, the verdict without the need's bisection."""
    requests = [(e.kind, e.block, e.size_bytes) for e in stream.events]
    return replay_events(requests, conf, card_bytes, series=False).out_of_memory is None


def copied_need(stream: SteadyStream, conf: AllocatorConf, card_bytes: int) -> Need:
    """The least capacity the stream runs in (allocator.need.least_capacity), the card's replay its anchor."""
    replays = Replays([(e.kind, e.block, e.size_bytes) for e in stream.events], conf, kept=(card_bytes, None))
    return least_capacity(replays.events, conf, card_bytes, replays)
