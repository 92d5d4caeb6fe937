"""Reward functions for `vram-plan run`: the reasoning/answer format and correctness rewards of the GSM8K GRPO
recipe, and user functions named `module:function`, checked before a long run depends on them.

TRL calls each reward with the batch's `prompts`, `completions` (strings, or message lists for conversational
datasets) and every other dataset column as keyword arguments, and expects one float (or None) per completion.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from vram_planner.errors import VramPlanError

# The recipe's format: <reasoning> ... </reasoning> then <answer> ... </answer>, each on its own lines.
STRICT_FORMAT = re.compile(r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n?$", re.DOTALL)
SOFT_FORMAT = re.compile(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
FORMAT_REWARD, SOFT_FORMAT_REWARD, CORRECT_REWARD = 0.5, 0.25, 2.0

SYSTEM_PROMPT = ("Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>")

RewardFunction = Callable[..., list[float | None]]


def completion_text(completion: Any) -> str:
    """The generated text of a completion, plain or conversational."""
    if isinstance(completion, list):
        return "".join(str(message.get("content", "")) for message in completion if isinstance(message, dict))
    return str(completion)


def extract_answer(text: str) -> str:
    found = ANSWER.findall(text)
    return found[-1].strip() if found else ""


def format_reward(completions: list[Any], **_: Any) -> list[float]:
    """0.5 for the strict reasoning/answer layout, 0.25 for the tags in order, else 0."""
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        rewards.append(FORMAT_REWARD if STRICT_FORMAT.match(text) else
                       SOFT_FORMAT_REWARD if SOFT_FORMAT.search(text) else 0.0)
    return rewards


def correctness_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """2.0 when the text inside <answer> equals the dataset's `answer` column (numbers compared as numbers)."""
    return [CORRECT_REWARD if _same_answer(extract_answer(completion_text(c)), str(a)) else 0.0
            for c, a in zip(completions, answer, strict=True)]


def _same_answer(given: str, expected: str) -> bool:
    def number(text: str) -> float | None:
        try:
            return float(text.replace(",", "").replace("$", "").strip())
        except ValueError:
            return None

    a, b = number(given), number(expected)
    return a == b if a is not None and b is not None else given.strip() == expected.strip()


BUILT_IN: dict[str, RewardFunction] = {"format": format_reward, "correctness": correctness_reward}


def load_reward(spec: str) -> RewardFunction:
    """A built-in reward by name, or `module:function` from the Python path or a file path (`path/to/file.py:fn`)."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    module_name, _, function_name = spec.rpartition(":")
    if not module_name or not function_name:
        raise VramPlanError(f"reward {spec!r}: give a built-in ({', '.join(BUILT_IN)}) or module:function")
    try:
        if module_name.endswith(".py"):
            module = _module_from_file(module_name)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: any error on import is theirs to see in one line
        raise VramPlanError(f"reward {spec!r}: cannot import {module_name} ({type(exc).__name__}: {exc})") from exc
    function = getattr(module, function_name, None)
    if not callable(function):
        raise VramPlanError(f"reward {spec!r}: {module_name} has no function {function_name!r}")
    return function


def _module_from_file(path: str) -> Any:
    import importlib.util
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(path)
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def check_reward(function: RewardFunction, sample: dict[str, list[Any]], name: str) -> None:
    """Call a reward on a sample batch as TRL will, and require one number (or None) per completion."""
    completions = sample["completions"]
    try:
        result = function(**sample)
    except Exception as exc:
        raise VramPlanError(f"reward {name} fails on a sample batch: {type(exc).__name__}: {exc}") from exc
    if not isinstance(result, list | tuple) or len(result) != len(completions):
        got = f"{len(result)} values" if isinstance(result, list | tuple) else type(result).__name__
        raise VramPlanError(f"reward {name} must return one value per completion: {len(completions)} "
                            f"completions, got {got}")
    bad = [r for r in result if r is not None and not isinstance(r, int | float)]
    if bad:
        raise VramPlanError(f"reward {name} returned {type(bad[0]).__name__} values; it must return numbers")
