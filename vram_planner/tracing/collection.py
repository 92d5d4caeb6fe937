"""Python's cyclic garbage collector paused while the exact path makes millions of objects that live on: the trace's
events and the replays' tuples. Each automatic collection of the oldest generation walks every tracked object, and
the events are millions (a NamedTuple, unlike a plain tuple, is never untracked); a trace then spends a fifth of its
time collecting nothing. What cycles the work leaves are collected once, when it is done. Pure Python."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic collection inside; one full collection after, where collection was on (nested: the outermost)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()
