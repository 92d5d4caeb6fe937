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


def interrupted_message(stop: RunInterrupted, argv: list[str]) -> str:
    """Where the interrupted run's training is, and the exact command that continues it (or starts it again)."""
    again = [arg for arg in argv if arg not in ("--resume", "--overwrite")]
    if stop.checkpoint is None:
        return (f"{stop.signal_name} at step {stop.step}: nothing was trained to keep; start it again with:\n"
                f"{shlex.join(['vram-plan', *again])}")
    return (f"{stop.signal_name} at step {stop.step}: training so far is saved in {stop.checkpoint}; continue with:\n"
            f"{shlex.join(['vram-plan', *again, '--resume'])}")
