"""Pure functions of a model and a config, remembered: the step-time model's work and the configs derived from one."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def remembered_work(function: Callable[..., T]) -> Callable[..., T]:
    """`function`, remembered for the 4,096 sets of arguments it met last (a config with a list of LoRA targets,
    which cannot be a key, is worked out afresh). The work of a pass depends on the model and the config alone, not
    on the card's factors: a probe's fit weighs the same samples' work under thousands of factor sets, and plan ranks
    many configs."""
    cached = functools.lru_cache(maxsize=4096)(function)

    @functools.wraps(function)
    def work(*args: Any) -> T:
        try:
            return cached(*args)
        except TypeError:  # unhashable arguments (a function that raised one itself raises it again)
            return function(*args)

    return work
