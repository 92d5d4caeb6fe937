"""Ctrl+C and SIGTERM during a run: a checkpoint of the steps done, and the exact command that resumes it."""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's time limit, `kill`), handled as Ctrl+C is."""


class RunInterrupted(Exception):
    """Ctrl+C or SIGTERM while training: what was trained is saved in `checkpoint` (None before the first step)."""

    def __init__(self, exit_code: int, signal_name: str, step: int, checkpoint: Path | None) -> None:
        super().__init__(f"{signal_name} at step {step}")
        self.exit_code, self.signal_name, self.step, self.checkpoint = exit_code, signal_name, step, checkpoint


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises Terminated in the main thread while training, so the run saves a checkpoint and says where."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class StopAtStepEnd:
    """Ctrl+C or SIGTERM in a launched rank: every rank stops at the end of the same optimizer step and saves the
    checkpoint with the others. Raised mid-step, as in one process, each rank stops inside a different collective
    (2 gloo ranks: one saved while the other all-reduced, "gloo::EnforceNotMet ... Is there a distributed collective
    mismatch"), so a signal only marks the request, and the ranks all-reduce it at each step's end (one integer per
    optimizer step)."""

    def __init__(self, save: bool = True) -> None:
        self.save = save  # the smoke step stops without a checkpoint: it trained nothing to keep
        self.signal_name: str | None = None  # of this rank; the first signal names it
        self.stopped_at: int | None = None

    @property
    def exit_code(self) -> int:
        return 130 if self.signal_name == "Ctrl+C" else 143

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        import signal

        def mark(signum: int, frame: Any) -> None:
            self.signal_name = self.signal_name or ("Ctrl+C" if signum == signal.SIGINT else "SIGTERM")

        previous = {sig: signal.signal(sig, mark) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        import torch
        import torch.distributed as dist
        from accelerate import PartialState

        requested = torch.tensor([int(self.signal_name is not None)], device=PartialState().device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(requested, op=dist.ReduceOp.MAX)
        if requested.item():
            control.should_save, control.should_training_stop = self.save, True
            self.stopped_at = state.global_step


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl+C and SIGTERM wait while a checkpoint is written: a second one (pressed again, or the first forwarded to
    each rank by torch's launcher, which the terminal's already reached) would cut it short, leaving a checkpoint
    that cannot be resumed."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def interrupted_message(stop: RunInterrupted, argv: list[str]) -> str:
    """Where the interrupted run's training is, and the exact command that continues it (or starts it again)."""
    again = [arg for arg in argv if arg not in ("--resume", "--overwrite")]
    if stop.checkpoint is None:
        return (f"{stop.signal_name} at step {stop.step}: nothing was trained to keep; start it again with:\n"
                f"{shlex.join(['vram-plan', *again])}")
    return (f"{stop.signal_name} at step {stop.step}: training so far is saved in {stop.checkpoint}; continue with:\n"
            f"{shlex.join(['vram-plan', *again, '--resume'])}")
