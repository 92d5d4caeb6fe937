"""Running the allocator model's replays on a thread of their own, at a shallow depth of Python's frame stack.

CPython (3.11 on) keeps a thread's Python frames in 16 KiB chunks and unmaps a chunk as soon as the stack returns
below it (`_PyThreadState_PopFrame`), so a loop whose calls straddle a chunk's edge maps and unmaps memory on every
call, and touches the new pages. A replay makes a few calls per allocator event; at one depth of a hypothesis test
the bisection of a ZeRO-2 step mapped 96,000 chunks (2.7 s where 0.6 s do, two thirds of it in the kernel). Where
the edge falls depends on whoever calls (a notebook, the web page, a test runner), so the bisections start on a new
thread, whose first chunk holds all their frames.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

Params = ParamSpec("Params")
Result = TypeVar("Result")


def on_own_stack(call: Callable[Params, Result]) -> Callable[Params, Result]:
    """`call`, run on a new thread each time and waited for; what it raises is raised in the caller. The thread is
    a daemon: an interrupted caller (Ctrl-C, a test's alarm) does not wait for it to end."""

    @functools.wraps(call)
    def run(*args: Params.args, **kwargs: Params.kwargs) -> Result:
        outcome: list = []

        def target() -> None:
            try:
                outcome.append((True, call(*args, **kwargs)))
            except BaseException as error:  # handed to the caller as it is
                outcome.append((False, error))

        thread = threading.Thread(target=target, name=f"vram-plan {call.__name__}", daemon=True)
        thread.start()
        thread.join()
        returned, value = outcome[0]
        if returned:
            return value
        raise value

    return run
