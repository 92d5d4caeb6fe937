"""Domain errors. Their text is written for the user; the CLI prints it as one line."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

# A field's name inside a message, marked so that each face spells it for its reader: the field's own name in Python
# and over HTTP (str() of the error), the flag on the command line (`worded(flag)`).
_FIELD = re.compile("\x02([a-z0-9_]+)\x03")


def field_name(name: str) -> str:
    """`name` marked as a field of the request, for a message that each face words in its own terms."""
    return f"\x02{name}\x03"


def flag(name: str) -> str:
    """The command-line flag that sets a field."""
    return "--" + name.replace("_", "-")


def spelled(text: str, spell: Callable[[str], str] = str) -> str:
    """A message with its marked field names spelled by `spell` (as they are: the field names)."""
    return _FIELD.sub(lambda m: spell(m.group(1)), text)


class VramPlanError(Exception):
    """Base class: anything the user can fix by changing their input (exit code 2). Its text names fields as the
    Python API and the HTTP API name them; `worded(flag)` names the command line's flags instead."""

    def __str__(self) -> str:
        return spelled(super().__str__())

    def worded(self, spell: Callable[[str], str]) -> str:
        """The message with each field it names spelled by `spell`."""
        return spelled(super().__str__(), spell)


class UnknownNameError(VramPlanError):
    """A catalog name that matches nothing; carries the closest known names."""

    def __init__(self, kind: str, name: str, known: Iterable[str], hint: str = "",
                 suggestions: list[str] | None = None) -> None:
        self.kind = kind
        self.name = name
        self.suggestions = closest_names(name, known) if suggestions is None else suggestions
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:76] + "...'"
        text = f"unknown {kind} {shown}"
        if self.suggestions:
            text += "; did you mean " + ", ".join(repr(s) for s in self.suggestions) + "?"
        if hint:
            text += f" {hint}"
        super().__init__(text)


class ConfigError(VramPlanError):
    """One or more invalid settings, all reported at once."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


class ProfileError(VramPlanError):
    """A data file (catalog, model config, calibration, --config) that cannot be read or is malformed."""


class HubUnavailableError(VramPlanError):
    """A hub id that could not be resolved (no network, no such repo, or transformers missing)."""


# A setting's name shares its vocabulary with the rest (max_, _length, num_): below difflib's default resemblance a
# suggestion names an unrelated setting (do_eval -> model, save_strategy -> zero_stage, loss_type -> dtype)
SETTING_CUTOFF = 0.6


def closest_names(name: str, known: Iterable[str], limit: int = 3, cutoff: float = 0.5) -> list[str]:
    """The known names closest to `name`, compared case-insensitively: those at least `cutoff` alike (difflib's
    ratio), else those that contain it or that it contains."""
    by_lower: dict[str, str] = {}
    for k in known:
        by_lower.setdefault(k.lower(), k)
    import difflib  # only a refusal suggests names: not at every start

    query = name.lower()
    if not query.strip():  # every name holds the empty string: no name is closer than another
        return []
    matches = difflib.get_close_matches(query, list(by_lower), n=limit, cutoff=cutoff)
    if not matches:
        matches = [k for k in by_lower if query in k or k in query][:limit]
    return [by_lower[m] for m in matches]


def json_kind(value: Any) -> str:
    """What a value read from JSON is, in JSON's words: object, array, string, number, boolean, null."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def short_repr(value: Any, limit: int = 40) -> str:
    """A user's value for a message, cut short so that a 300-digit number or a long path still leaves one readable
    line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def first_line(exc: BaseException | str, default: str = "no reason given", limit: int = 300) -> str:
    """What went wrong in the words of whoever raised it, on one line and without the exception's class name (the
    traceback is what --debug is for)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):  # "1 validation error for X:" and then the reason
        lines[0] += " " + lines[1]
    return (lines[0] if lines else default)[:limit]


def one_line(message: str) -> str:
    """A message as the one line the command line's contract promises, whatever it quotes (a path or a value with a
    newline); the web app's HTTP API answers bad input with the same line."""
    return " ".join(line.strip() for line in message.strip().splitlines() if line.strip())
