"""A step's need, traced: the step traced on fake tensors, replayed through the caching allocator model on a card, and
the least capacity it runs in bisected; several steps at once, each in a process of its own, where the machine has a
core for each (a trace and its replays are one Python thread's work, so two steps take two cores the time of one).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vram_planner.model.spec import TrainingConfig
from vram_planner.model.trl_releases import TrlRelease

# A step's trace does not depend on the card, only its replays do: a process that asks for the same step on another
# card (the web page's card picker, a notebook's loop over cards) replays the trace it already made instead of
# tracing again (seconds to a minute). The latest few are kept: a large model's trace holds a million events.
TRACES_KEPT = 4
_traces: OrderedDict[bytes, Any] = OrderedDict()
_traces_lock = threading.Lock()


@dataclass(frozen=True)
class StepNeed:
    """One traced step: its tensors per phase, what the allocator model reserves on the card, and its need."""

    result: Any  # vram_planner.tracing.step.TraceResult
    reserved: Any  # vram_planner.tracing.reserve.ReservedMemory
    need: Any  # vram_planner.allocator.need.Need


@dataclass(frozen=True)
class StepToTrace:
    """What a trace needs, all of it plain data, so that another process can trace it."""

    config: dict[str, Any]  # the model's config.json
    train: TrainingConfig
    release: TrlRelease | None
    card_bytes: int  # what cudaMalloc can hand out on the card: its capacity less the CUDA context and NCCL's buffers
    workspace_bytes: int  # one cuBLAS workspace on this card (vram_planner.model.cublas)
    zero_rank: int | None = None  # under ZeRO, the rank traced (trace_step's default: the loss phase's heaviest)


def step_need(step: StepToTrace, progress: Callable[[str], None] | None = None) -> StepNeed:
    """The step traced, its events (with the cuBLAS workspaces) replayed on the card and its need bisected."""
    from vram_planner.allocator import parse_allocator_conf
    from vram_planner.allocator.replay import Replays
    from vram_planner.tracing.collection import collection_paused
    from vram_planner.tracing.events import with_workspaces
    from vram_planner.allocator.need import least_capacity
    from vram_planner.tracing.reserve import reserved_memory
    from vram_planner.tracing.step import trace_step

    say = progress or (lambda what: None)
    conf = parse_allocator_conf(step.train.allocator_conf, "--allocator-conf")
    with collection_paused():
        result = traced_before(step)
        if result is None:
            result = trace_step(step.config, step.train, step.release, progress, step.zero_rank)
            keep_trace(step, result)
        else:
            say("using the trace this process made of the same step")
        say("replaying the allocations through the caching allocator model")
        stream = with_workspaces(result.steady_stream(), step.workspace_bytes)
        # the card's replay and the unlimited one serve both: the reserved figures and the need's bisection
        replays = Replays([(e.kind, e.block, e.size_bytes) for e in stream.events], conf,
                          kept=(step.card_bytes, None))
        reserved = reserved_memory(stream, conf, step.card_bytes, replays)
        say("bisecting the least memory the step runs in")
        need = least_capacity(replays.events, conf, step.card_bytes, replays)
    return StepNeed(result, reserved, need)


def _trace_key(step: StepToTrace) -> bytes | None:
    """What a trace depends on, the card apart; None where it cannot be told (the step is then traced again)."""
    try:
        return pickle.dumps((json.dumps(step.config, sort_keys=True), step.train, step.release, step.zero_rank))
    except (TypeError, ValueError, pickle.PicklingError):
        return None


def traced_before(step: StepToTrace) -> Any:
    """The trace this process made of the same step (vram_planner.tracing.step.TraceResult), or None."""
    key = _trace_key(step)
    with _traces_lock:
        if key is None or key not in _traces:
            return None
        _traces.move_to_end(key)
        return _traces[key]


def keep_trace(step: StepToTrace, result: Any) -> None:
    """Keep a step's trace for traced_before, the TRACES_KEPT latest."""
    key = _trace_key(step)
    if key is None:
        return
    with _traces_lock:
        _traces[key] = result
        _traces.move_to_end(key)
        while len(_traces) > TRACES_KEPT:
            _traces.popitem(last=False)


def forget_traces() -> None:
    """Drop the traces kept (a test that patches the libraries a trace runs wants its own)."""
    with _traces_lock:
        _traces.clear()


def step_needs(steps: Sequence[StepToTrace], progress: Callable[[str], None] | None = None) -> list[StepNeed]:
    """step_need of each step, in order: the first here (it reports `progress`), each other in a Python process of
    its own, started before it, where the machine has a core for each step still to trace; one after another where
    it has not, or where this process traced all but one of them before (traced_before). A process
    that fails or dies costs only time: its step is traced here again, where any error is raised as it would be."""
    to_trace = sum(traced_before(step) is None for step in steps)
    if to_trace < 2 or usable_cores() < to_trace:
        return [step_need(step, progress) for step in steps]
    with tempfile.TemporaryDirectory(prefix="vram-plan-trace-") as folder:
        started = []
        try:
            for index, step in enumerate(steps[1:], start=1):
                asked, answered = Path(folder, f"step{index}.pickle"), Path(folder, f"need{index}.pickle")
                asked.write_bytes(pickle.dumps(step))
                started.append((_started(asked, answered), answered))
            needs = [step_need(steps[0], progress)]
            if progress is not None:
                progress(f"waiting for the {'step' if len(started) == 1 else f'{len(started)} steps'} traced alongside")
            for (process, answered), step in zip(started, steps[1:]):
                answer = _read(answered) if process is not None and process.wait() == 0 else None
                if isinstance(answer, StepNeed):
                    keep_trace(step, answer.result)
                needs.append(answer if isinstance(answer, StepNeed) else step_need(step, progress))
            return needs
        finally:
            for process, _ in started:
                if process is not None and process.poll() is None:
                    process.terminate()
                    process.wait()


def _started(asked: Path, answered: Path) -> subprocess.Popen | None:
    """`python -m vram_planner.tracing.step_need ASKED ANSWERED`, importing this very package (its folder first on
    PYTHONPATH). Not multiprocessing's spawn, which runs the caller's main script again: a script without a __main__
    guard would run twice. Its output is not the user's: where it fails, the step traced here again says why. None
    where no process starts (an embedded interpreter without an executable, say)."""
    package_root = str(Path(__file__).resolve().parents[2])
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
        part for part in (package_root, os.environ.get("PYTHONPATH")) if part)}
    try:
        return subprocess.Popen([sys.executable, "-m", __name__, str(asked), str(answered)], env=environment,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        return None


def _read(answered: Path) -> Any:
    """The started process's answer; None where there is none to read (the step is then traced here)."""
    try:
        return pickle.loads(answered.read_bytes())
    except Exception:  # a missing or unreadable answer costs only the time to trace the step here
        return None


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform says, else the machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _answer(asked: Path, answered: Path) -> None:
    """A started process's work: the step in `asked` traced, its need pickled to `answered` (whole, or not at all)."""
    from vram_planner.files import write_atomically

    write_atomically(answered, pickle.dumps(step_need(pickle.loads(asked.read_bytes()))))


if __name__ == "__main__":
    # through the package's module, not this __main__: what it pickles names classes the parent can find
    from vram_planner.tracing import step_need as traced_here

    traced_here._answer(Path(sys.argv[1]), Path(sys.argv[2]))
