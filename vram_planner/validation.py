"""Pydantic at the edges, without pydantic at start-up.

The specs (the training config, the catalogs' cards, models and TRL releases, calibrations, the CUDA context table)
are frozen standard-library dataclasses whose annotations carry their rules as `Annotated` metadata; the reports are
plain dataclasses. Pydantic validates the specs where data comes in (a dict from the library API or a config file, a
profile file on a cache miss) and writes JSON; it is imported then, and only then. `vram-plan plan` with no knobs
has nothing of the user's to validate, reads the shipped catalogs as validated objects (vram_planner/profile_cache.py)
and checks the configs its search derives with the same rules without pydantic (spec.with_changes), so it never
loads pydantic, which was half of its start-up.

The metadata classes below follow pydantic's documented protocol for custom types (`__get_pydantic_core_schema__`),
so the rules are pydantic's own (`Field` constraints, before/after validators), declared once beside each field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from functools import lru_cache
from typing import Any


class Rules:
    """pydantic.Field's constraints for one field (gt, ge, lt, le, pattern, min_length, ...)."""

    def __init__(self, **constraints: Any) -> None:
        self.constraints = constraints

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from typing import Annotated

        from pydantic import Field

        return handler(Annotated[source, Field(**self.constraints)])

    def admits(self, value: Any) -> bool:
        """Whether pydantic would surely accept this number for the field: a quick guard for values the planner
        derives from valid ones (False for anything it cannot judge, which then goes to pydantic)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            return False
        checks = {"gt": value.__gt__, "ge": value.__ge__, "lt": value.__lt__, "le": value.__le__}
        return (set(self.constraints) <= set(checks) and abs(value) != float("inf")
                and all(checks[name](bound) is True for name, bound in self.constraints.items()))

    def __repr__(self) -> str:
        return f"Rules({', '.join(f'{k}={v!r}' for k, v in self.constraints.items())})"


class Before:
    """A function run on the raw input before the field's type is checked (pydantic's BeforeValidator)."""

    def __init__(self, function: Callable[[Any], Any]) -> None:
        self.function = function

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_before_validator_function(self.function, handler(source))


class After:
    """A function run on the checked value; it raises ValueError to refuse it (pydantic's AfterValidator)."""

    def __init__(self, function: Callable[[Any], Any]) -> None:
        self.function = function

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_after_validator_function(self.function, handler(source))


@lru_cache(maxsize=None)
def _adapter(cls: type) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(cls)


def validate(cls: type, data: Any) -> Any:
    """`data` (a mapping, or already an instance) as a `cls`; pydantic's ValidationError when it is not one."""
    return _adapter(cls).validate_python(data)


def to_json(obj: Any, indent: int | None = None) -> str:
    """The JSON text of a spec, as pydantic writes it (enums by value, paths as strings)."""
    return _adapter(type(obj)).dump_json(obj, indent=indent).decode()


def to_jsonable(obj: Any) -> Any:
    """A spec as JSON-ready Python values."""
    return _adapter(type(obj)).dump_python(obj, mode="json")


# pydantic words a dataclass's errors as a function call's; a spec's reader knows fields, as of a pydantic model
_MODEL_WORDING = {"unexpected_keyword_argument": "Extra inputs are not permitted", "missing_argument": "Field required"}


def error_message(error: dict[str, Any]) -> str:
    """One of ValidationError.errors()' messages, worded as for a pydantic model."""
    return _MODEL_WORDING.get(error["type"], error["msg"])


def field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))

