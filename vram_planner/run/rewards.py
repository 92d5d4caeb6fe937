"""Reward functions for `vram-plan run`: the reasoning/answer format and correctness rewards of the GSM8K GRPO
recipe, and user functions named `module:function`, checked before a long run depends on them.

TRL calls each reward with the batch's `prompts`, `completions` (strings, or message lists for conversational
datasets) and every other dataset column as keyword arguments, and expects one float (or None) per completion.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

from vram_planner.errors import VramPlanError, first_line, short_repr

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
        raise VramPlanError(f"reward {spec!r}: cannot import {module_name}: {first_line(exc)}") from exc
    except SystemExit as exc:  # a script's `sys.exit(main())` run on import
        raise VramPlanError(f"reward {spec!r}: importing {module_name} calls sys.exit({short_repr(exc.code)}); "
                            "put that call under `if __name__ == \"__main__\":`") from exc
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


SAMPLE_COMPLETIONS = ("<reasoning>\n1 + 1 = 2\n</reasoning>\n<answer>\n2\n</answer>\n", "2")


def sample_batch(dataset: Any) -> dict[str, Any]:
    """The keyword arguments TRL 1.16 passes each reward, for two completions of the dataset's first prompt: the
    recipe's layout and a bare answer, as messages when the prompts are (GRPOTrainer._calculate_rewards)."""
    from transformers import TrainerState

    row = dataset[0]
    count = len(SAMPLE_COMPLETIONS)
    completions: list[Any] = list(SAMPLE_COMPLETIONS)
    if isinstance(row["prompt"], list):
        completions = [[{"role": "assistant", "content": text}] for text in SAMPLE_COMPLETIONS]
    columns = {c: [row[c]] * count for c in dataset.column_names if c not in ("prompt", "completion", "completion_ids")}
    return {"prompts": [row["prompt"]] * count, "completions": completions,
            "completion_ids": [list(text.encode()) for text in SAMPLE_COMPLETIONS], **columns,
            "trainer_state": TrainerState(), "log_extra": _ignore, "log_metric": _ignore}


def _ignore(*args: Any, **kwargs: Any) -> None:
    """Stands in for the trainer's log_extra and log_metric."""


def check_rewards(rewards: dict[str, RewardFunction], sample: dict[str, Any]) -> None:
    """Each reward returns what TRL can score on a sample batch, and together they score at least one completion
    (TRL leaves a completion every reward returns None or NaN for unscored: if all are, nothing is trained)."""
    scored = [False] * len(sample["completions"])
    for name, function in rewards.items():
        scored = [done or not math.isnan(value) for done, value in zip(scored, check_reward(function, sample, name),
                                                                          strict=True)]
    if not any(scored):
        raise VramPlanError(f"the rewards ({', '.join(rewards)}) returned only None or NaN on a sample batch: TRL "
                            "scores no completion then and trains on nothing; return a number where a reward applies")


def check_reward(function: RewardFunction, sample: dict[str, Any], name: str) -> list[float]:
    """Call a reward on a sample batch as TRL 1.16 does and read its output as TRL does: one value per completion,
    None as NaN, each one a number torch makes a float32 of. Returns the values."""
    try:
        output = function(**sample)
    except Exception as exc:
        raise VramPlanError(f"reward {name} fails on a sample batch: {_describe(exc)} (--debug shows where)") from exc
    except SystemExit as exc:  # it would end the trainer, mid-run, with its own exit code
        raise VramPlanError(f"reward {name} calls sys.exit({short_repr(exc.code)}) on a sample batch; a reward "
                            "returns one number per completion, it does not end the program") from exc
    count = len(sample["completions"])
    if output is None or isinstance(output, str | bytes | dict) or not isinstance(output, Iterable):
        raise VramPlanError(f"reward {name} returned {_a(output)} instead of a list with one number (or None) per "
                            f"completion")
    values = [value if value is not None else math.nan for value in output]  # as TRL reads them
    if len(values) != count:
        raise VramPlanError(f"reward {name} must return one value per completion: {count} completions, got "
                            f"{len(values)} values")
    for index, value in enumerate(values, start=1):
        if not _is_number(value):
            raise VramPlanError(f"reward {name} returned {_a(value)} for completion {index}; TRL needs a number (or "
                                "None) per completion")
    return [float(value) for value in values]


def _is_number(value: Any) -> bool:
    """What torch.tensor(rewards, dtype=torch.float32) takes as one element: a real number, numpy's or torch's."""
    import warnings

    import torch

    try:
        with warnings.catch_warnings():  # torch.tensor of a tensor warns; TRL would too, once, at the first step
            warnings.simplefilter("ignore")
            return torch.tensor(value, dtype=torch.float32).ndim == 0
    except (TypeError, ValueError, RuntimeError):
        return False


def _a(value: Any) -> str:
    """A value's kind for a message: None, or 'a str ('good')'."""
    if value is None:
        return "None"
    shown = repr(value)
    return f"a {type(value).__name__} ({shown[:40]}{'...' if len(shown) > 40 else ''})"


def _describe(exc: Exception) -> str:
    """A user function's error in words: its message (a missing keyword or column for KeyError)."""
    if isinstance(exc, KeyError):
        return f"no key {exc}"
    return first_line(exc, "an error without a message", 200)
