"""The console people read, on any terminal: symbols and bars fall back to ASCII where the console's encoding lacks
them (a legacy Windows console is cp1252, which has no check mark and no block), and a reader that goes away (`| head`)
is a broken pipe the command line answers with its own exit code, not rich's exit 1 (the "does not fit" code)."""

from __future__ import annotations

import codecs
import sys
from functools import lru_cache
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:  # rich loads when something is printed for people: `--json` and the refusals go without it
    from rich.console import Console

# What we print that some encodings lack, in ASCII. rich draws its tables in ASCII itself on such a console, and
# lays them out before the text is encoded: what can stand in a table cell or a bar keeps its one column.
ASCII_FALLBACKS = {"\u2714": "+", "\u2718": "x", "\u2192": "->", "\u25c6": "*", "\u2588": "#", "\u2591": ".",
                   "\u2022": "-", "\u2248": "~", "\u00d7": "x", "\u2026": "...", "\u2013": "-", "\u2014": "-",
                   "\u2264": "<=", "\u2265": ">=", "\u00b7": "."}
ERRORS = "vram-plan-ascii"


def _ascii_fallback(exc: UnicodeError) -> tuple[str, int]:
    """A codec error handler: each character the encoding lacks as its ASCII stand-in, its accent-free letter
    (é as e) or ?."""
    import unicodedata

    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    return "".join(ASCII_FALLBACKS.get(c) or unicodedata.normalize("NFKD", c).encode("ascii", "ignore").decode()
                   or "?" for c in exc.object[exc.start:exc.end]), exc.end


codecs.register_error(ERRORS, _ascii_fallback)


def encode_anywhere(*streams: TextIO) -> None:
    """Let `streams` that cannot encode all of Unicode write ASCII stand-ins instead of failing mid-answer."""
    for stream in streams:
        encoding = (getattr(stream, "encoding", None) or "utf-8").lower().replace("_", "-")
        if not encoding.startswith("utf") and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors=ERRORS)


class OutputClosed(Exception):  # noqa: N818 - not an error: the reader has what it wanted
    """The output's reader went away (`| head`): a BrokenPipeError, carried past click, which answers EPIPE with
    exit 1 (our "does not fit")."""


def terminal(stderr: bool = False) -> Console:
    """The console for what people read. Nothing we print means a `:name:` emoji code, so rich's emoji table (a
    few ms to load at every start) is never loaded."""
    return _terminal_class()(emoji=False, stderr=stderr)


@lru_cache(maxsize=1)
def _terminal_class() -> type[Console]:
    from rich.console import Console

    class Terminal(Console):
        """rich's Console, but a closed pipe is a BrokenPipeError for the command line to answer, not rich's
        SystemExit(1)."""

        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError("the reader of the output went away")

    return Terminal


def outputs_closed() -> None:
    """After a broken pipe: point stdout and stderr at /dev/null, so that Python's last flush at exit does not fail
    again and print a traceback of its own (the answer is given: nothing more is printed)."""
    import os

    for stream in (sys.stdout, sys.stderr):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # no file descriptor (a test's captured stream): no flush
            pass
