"""The garbage collector paused around the exact path's work: off inside, on again after with what the work left in
cycles collected, and left alone where the caller had turned it off."""

from __future__ import annotations

import gc
import weakref

from vram_planner.tracing.collection import collection_paused


class Node:
    pass


def test_collection_is_off_inside_and_the_cycles_made_there_are_collected_after():
    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
        with collection_paused():  # nested: the outermost turns it back on
            assert not gc.isenabled()
        assert not gc.isenabled()
        a, b = Node(), Node()
        a.other, b.other = b, a
        left = weakref.ref(a)
        del a, b
        assert left() is not None  # a cycle: only a collection frees it
    assert gc.isenabled() and left() is None


def test_a_caller_that_turned_collection_off_keeps_it_off():
    gc.disable()
    try:
        with collection_paused():
            a = Node()
            a.itself = a
            left = weakref.ref(a)
            del a
        assert not gc.isenabled() and left() is not None
    finally:
        gc.enable()
        gc.collect()
