"""Event streams as two traces (or a trace and a copy) are compared: blocks numbered by their first event, each run of
frees in block order, request for request. Events are (kind, block, bytes, phase, moment, layer) tuples. Pure Python.
"""

from __future__ import annotations


def numbered(events: list[tuple]) -> list[tuple]:
    """The events with their blocks numbered by their first event, as two traces number them apart."""
    named: dict[int, int] = {}
    return [(e[0], named.setdefault(e[1], len(named)), *e[2:]) for e in events]


def with_free_runs_sorted(events: list[tuple]) -> list[tuple]:
    """The events with each run of frees in block order: a run frees the same blocks in whatever order Python's
    garbage collection drops them, which leaves the allocator as it was."""
    out: list[tuple] = []
    run: list[tuple] = []
    for event in [*events, ("end", -1, 0, "", "")]:
        if event[0] == "free":
            run.append(event)
            continue
        out += sorted(run, key=lambda e: e[1])
        run = []
        out.append(event)
    return out[:-1]


def renumbered(events: list[tuple]) -> list[tuple]:
    """The events as a comparison reads them: numbered, each run of frees in block order."""
    return with_free_runs_sorted(numbered(events))


def request_for_request(made: list[tuple], fresh: list[tuple]) -> tuple[bool, int]:
    """(whether a made stream makes a fresh trace's requests in its order, in the same blocks, phases, moments and
    layers; how many are of another size, every one where they are not aligned)."""
    aligned = len(made) == len(fresh) and all(a[:2] == b[:2] and a[3:] == b[3:] for a, b in zip(made, fresh))
    return aligned, sum(a[2] != b[2] for a, b in zip(made, fresh)) if aligned else len(fresh)
