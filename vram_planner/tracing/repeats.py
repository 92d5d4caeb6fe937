"""Repeated forwards counted without running them again: the scoring passes run the same forward on chunk after
chunk of the generation batch (64 chunks where steps_per_generation is 64), and on fake tensors each costs a second
or more on this machine's CPU, while what it allocates and frees is the same every time.

A forward is replayed only once two calls in a row with the same inputs (shapes, strides, dtypes; the same other
arguments) made and freed the same storages in the same order, at the same tags and moments, freed nothing made
before them, and left alive only the storages of what they returned and what their caller freed before making
anything else (autocast's casts of the weights, freed as the caller's autocast region ends); and only for a call that
begins at the tag and moment one of the two began at. A replay counts those steps again with new blocks
(`LiveBytes.replay`), frees what the caller would have freed as it ends, and makes the returned tensors anew where the
recorded call made them, so the events, peaks and splits are those of running it (a run of frees in another order,
which leaves the allocator as it was); tests/tracing/test_repeats.py holds a traced step with replays to the same step
traced without.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from vram_planner.tracing.counter import ALLOC, FREE, PEAK, LiveBytes, Script

REPLAY = True  # off: every call runs (tests compare both)


@dataclass(frozen=True)
class _Recorded:
    steps: tuple[tuple[Any, ...], ...]  # the script, each block numbered by its allocation's order in the call
    bases: dict[int, tuple[int, torch.dtype, torch.device]]  # kept block -> (elements, dtype, device) of its storage
    # per returned tensor: (its base's index, size, stride, storage offset)
    views: tuple[tuple[int, tuple[int, ...], tuple[int, ...], int], ...]
    returned: Any  # what the call returned, its tensors as _Slot(i) for views[i]
    # what it made, kept alive and did not return: (index, bytes, tag, its block in the events)
    left: tuple[tuple[int, int, str, int], ...] = ()
    end: tuple[str, str, str] = ("", "", "")  # the counter's tag, moment and phase as the call left them


@dataclass(frozen=True)
class _Slot:
    index: int


@dataclass(frozen=True)
class _Mapping:
    kind: type
    parts: dict[str, Any]


@contextlib.contextmanager
def repeated_calls_replayed(tracker: LiveBytes, owner: Any) -> Iterator[None]:
    """`owner.forward` replays calls whose two predecessors with the same inputs did the same (see the module)."""
    if not REPLAY:
        yield
        return
    forward = owner.forward
    instance_forward = owner.__dict__.get("forward")
    agreed: dict[Any, tuple[_Recorded, set[tuple[str, str]]]] = {}  # with the (tag, moment) the two began at
    last: dict[Any, tuple[Any, ...] | None] = {}  # what the last call with these inputs did: steps, end, start
    unsettled: list[tuple[Any, _Recorded | None, int, tuple[str, str]]] = []  # the call before, and its events then

    def settle() -> None:
        """The call before, with the frees of what it left to its caller, compared with the one before it."""
        if unsettled:
            key, recorded, events_then, start = unsettled.pop()
            recorded = recorded and _left_freed(recorded, tracker.events[events_then:])
            done = None if recorded is None else (recorded.steps, recorded.end)
            before = last.get(key)
            if done is not None and before is not None and before[:2] == done:
                agreed[key] = (recorded, {before[2], start})
            last[key] = None if done is None else (*done, start)

    def replaying(*args: Any, **kwargs: Any) -> Any:
        settle()
        key = _inputs_key(args, kwargs, tracker)
        if key is None:
            return forward(*args, **kwargs)
        # A call that begins where one of the two agreeing calls began does what they did (what it counts under the
        # tag and moment it begins at is in their steps, which agreed)
        start = (tracker.tag, tracker.moment)
        if key in agreed and start in agreed[key][1]:
            return _replayed(tracker, agreed[key][0])
        with tracker.recording() as script:
            returned = forward(*args, **kwargs)
        unsettled.append((key, _recorded(tracker, script, returned), len(tracker.events), start))
        return returned

    owner.forward = replaying
    try:
        yield
    finally:
        if instance_forward is None:
            del owner.forward
        else:
            owner.forward = instance_forward


def _inputs_key(args: tuple[Any, ...], kwargs: dict[str, Any], tracker: LiveBytes) -> Any:
    """What decides a call's allocations, hashable; None where an argument is not one this module can compare."""
    parts = [tracker.phase, torch.is_grad_enabled()]
    for name, value in [(None, a) for a in args] + sorted(kwargs.items()):
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return None
            parts.append((name, tuple(value.shape), value.stride(), value.dtype, value.device.type))
        elif value is None or isinstance(value, (bool, int, float, str)):
            parts.append((name, type(value), value))
        else:
            return None
    return tuple(parts)


def _recorded(tracker: LiveBytes, script: Script, returned: Any) -> _Recorded | None:
    """The call's script with its blocks numbered in order, what it keeps, and how to make what it returned; None
    where a replay could not do the same (it freed what it did not make, kept what it did not return, returned what
    this module cannot rebuild, or rewrote what was counted)."""
    if script.broken:
        return None
    tensors: list[torch.Tensor] = []
    shape = _shape(returned, tensors)
    if shape is None or any(t.requires_grad for t in tensors):
        return None
    order: dict[int, int] = {}
    freed: set[int] = set()
    steps = []
    for step in script.steps:
        if step[0] == ALLOC:
            order[step[1]] = len(order)
        elif step[0] == FREE:
            if step[1] not in order:
                return None
            freed.add(step[1])
        steps.append(step if step[0] == PEAK else (step[0], order[step[1]], *step[2:]))
    kept = {order[block] for block in order if block not in freed}
    bases: dict[int, tuple[int, torch.dtype, torch.device]] = {}
    views = []
    for t in tensors:
        try:
            block, raw = tracker.block_of(t)
        except KeyError:
            return None
        if block not in order or order[block] not in kept or raw % t.element_size():
            return None
        index = order[block]
        bases.setdefault(index, (raw // t.element_size(), t.dtype, t.device))
        if bases[index][1] != t.dtype:
            return None
        views.append((index, tuple(t.shape), t.stride(), t.storage_offset()))
    made = {step[1]: step for step in script.steps if step[0] == ALLOC}  # by block in the events
    left = tuple((order[block], made[block][2], made[block][3], block)
                 for block in order if order[block] in kept - set(bases))
    return _Recorded(tuple(steps), bases, tuple(views), shape, left, script.end)


def _left_freed(recorded: _Recorded, events_after: list[Any]) -> _Recorded | None:
    """The recording with the frees of what the call left alive but did not return (autocast's casts of the
    weights, freed when the caller's autocast region ends), where those frees came first after it returned: a
    replay frees them as it ends. None where something was made before they were all freed."""
    if not recorded.left:
        return recorded
    blocks = {block: (index, raw, tag) for index, raw, tag, block in recorded.left}
    frees = []
    for event in events_after:
        if len(frees) == len(blocks) or event.kind != FREE:
            break
        if event.block in blocks:
            index, raw, tag = blocks[event.block]
            frees.append((FREE, index, raw, tag, event.phase, event.moment, event.layer))
    if len(frees) != len(blocks):
        return None
    # autocast frees its casts in its cache's hash order: frees in a row leave the allocator the same in any order
    return replace(recorded, steps=recorded.steps + tuple(sorted(frees)), left=())


def _shape(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with each tensor replaced by a _Slot (its place in `tensors`); None where something in it is not a
    tensor, a plain value, or a tuple, list, dict (by name) or transformers ModelOutput of those."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        parts = [_shape(v, tensors) for v in value]
        return None if any(p is None and v is not None for p, v in zip(parts, value)) else type(value)(parts)
    if (isinstance(value, dict) and (type(value) is dict or _is_model_output(value))
            and all(isinstance(k, str) for k in value)):  # rebuilt as keyword arguments
        parts = {k: _shape(v, tensors) for k, v in value.items()}
        if any(parts[k] is None and value[k] is not None for k in value):
            return None
        return _Mapping(type(value), parts)
    return None


def _is_model_output(value: Any) -> bool:
    from transformers.utils import ModelOutput

    return isinstance(value, ModelOutput)


def _rebuilt(shape: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(shape, _Slot):
        return tensors[shape.index]
    if isinstance(shape, list):
        return [_rebuilt(v, tensors) for v in shape]
    if isinstance(shape, _Mapping):
        return shape.kind(**{k: _rebuilt(v, tensors) for k, v in shape.parts.items()})
    if isinstance(shape, tuple):
        return tuple(_rebuilt(v, tensors) for v in shape)
    return shape


def _replayed(tracker: LiveBytes, recorded: _Recorded) -> Any:
    bases: dict[int, torch.Tensor] = {}

    def maker(index: int) -> Callable[[], None]:
        elements, dtype, device = recorded.bases[index]
        return lambda: bases.__setitem__(index, torch.empty(elements, dtype=dtype, device=device))

    tracker.replay(list(recorded.steps), {index: maker(index) for index in recorded.bases}, recorded.end)
    tensors = [bases[index].as_strided(size, stride, offset) for index, size, stride, offset in recorded.views]
    return _rebuilt(recorded.returned, tensors)
