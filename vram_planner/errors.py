"""Domain errors. Their text is written for the user; the CLI prints it as one line."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class VramPlanError(Exception):
    """Base class: anything the user can fix by changing their input (exit code 2)."""


class UnknownNameError(VramPlanError):
    """A catalog name that matches nothing; carries the closest known names."""

    def __init__(self, kind: str, name: str, known: Iterable[str], hint: str = "") -> None:
        self.kind = kind
        self.name = name
        self.suggestions = closest_names(name, known)
        text = f"unknown {kind} {name!r}"
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


def closest_names(name: str, known: Iterable[str], limit: int = 3) -> list[str]:
    """The known names closest to `name`, compared case-insensitively."""
    by_lower: dict[str, str] = {}
    for k in known:
        by_lower.setdefault(k.lower(), k)
    query = name.lower()
    matches = difflib.get_close_matches(query, list(by_lower), n=limit, cutoff=0.5)
    if not matches:
        matches = [k for k in by_lower if query in k or k in query][:limit]
    return [by_lower[m] for m in matches]
