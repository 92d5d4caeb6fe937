"""The prompts `vram-plan run` trains on: GSM8K (online), a bundled math sample, or a local file or folder.

Every source ends as a `datasets.Dataset` with a `prompt` column (and, for the built-in rewards, `answer`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vram_planner.errors import ProfileError, VramPlanError, first_line, json_kind
from vram_planner.files import MAX_DATA_FILE_BYTES, check_json_lines_nesting, check_json_nesting
from vram_planner.run.rewards import SYSTEM_PROMPT

BUNDLED = {"math-sample": "data/math_sample.jsonl"}


GSM8K = "openai/gsm8k"


def load_prompts(spec: str) -> Any:
    """`gsm8k`, `math-sample`, a .jsonl/.json/.parquet file or a `save_to_disk` folder."""
    if spec == "gsm8k":
        return _gsm8k()
    from datasets import Dataset, load_from_disk

    if spec in BUNDLED:
        from vram_planner import profile_data

        return Dataset.from_json(str(Path(next(iter(profile_data.__path__))) / BUNDLED[spec]))
    path = Path(spec).expanduser()
    if not path.exists():
        raise VramPlanError(f"dataset {spec!r}: no such file or folder (or use gsm8k or math-sample)")
    if not path.is_dir() and not path.is_file():
        raise VramPlanError(f"dataset {spec!r}: it is a device, not a file")
    if not path.is_dir() and path.suffix not in (".jsonl", ".json", ".parquet"):
        raise VramPlanError(f"dataset {spec!r}: read .jsonl, .json, .parquet or a save_to_disk folder")
    if path.suffix in (".jsonl", ".json") and path.is_file():
        check_json_lines_nesting(path, f"dataset {spec!r}")  # deep enough, the datasets reader ends the process
    try:
        with _datasets_logs_off():
            if path.is_dir():
                dataset = load_from_disk(str(path))
            elif path.suffix == ".parquet":
                dataset = Dataset.from_parquet(str(path))
            else:
                dataset = Dataset.from_json(str(path))
    except Exception as exc:  # the datasets library's own error names its internals; say what is wrong instead
        raise VramPlanError(f"dataset {spec!r} cannot be read: {_what_is_wrong(path, exc)}") from exc
    if isinstance(dataset.column_names, dict):  # a DatasetDict
        dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
    return dataset


@contextlib.contextmanager
def _datasets_logs_off() -> Iterator[None]:
    """The datasets library logs a parse error itself before raising it; the one line we print says it better."""
    from datasets.utils import logging as datasets_logging

    verbosity = datasets_logging.get_verbosity()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)
    try:
        yield
    finally:
        datasets_logging.set_verbosity(verbosity)


def _what_is_wrong(path: Path, exc: Exception) -> str:
    """What the JSON of a file gets wrong (by line), else the first line of the library's message."""
    if path.suffix in (".jsonl", ".json") and path.is_file():
        problem = first_json_problem(path)
        if problem:
            return problem
    return first_line(exc.__cause__ or exc, "the datasets library cannot parse it", 200)


def first_json_problem(path: Path) -> str | None:
    """Where a JSON (one document) or JSON Lines file stops being records of JSON objects, as the datasets library
    reads both; None when it is."""
    if path.stat().st_size > MAX_DATA_FILE_BYTES:  # too large to look through here: the library's words, then
        return None
    text = path.read_text(errors="replace")
    if not text.strip():
        return "the file is empty"
    try:
        check_json_nesting(text, "the file")
    except ProfileError as exc:
        return str(exc)
    try:
        document = json.loads(text)
    except json.JSONDecodeError as whole:
        if text.lstrip().startswith("["):  # one JSON array of records
            return f"line {whole.lineno} is not valid JSON ({whole.msg})"
    else:
        records = document if isinstance(document, list) else [document]
        kinds = [json_kind(record) for record in records if not isinstance(record, dict)]
        return f"it holds a JSON {kinds[0]} where each record should be an object" if kinds else None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            return f"line {number} is not valid JSON ({exc.msg}, column {exc.colno})"
        if not isinstance(record, dict):
            return f"line {number} is a JSON {json_kind(record)}, not an object with a prompt"
    return None


def _gsm8k() -> Any:
    """GSM8K as the GRPO recipe prepares it: the system format prompt, the question, the answer after ####."""
    import datasets

    from vram_planner.hub import hub_unreachable_reason, quiet_hub_logs

    # Offline, load_dataset would retry for half a minute, logging each try; offline mode reads the cache.
    offline = None if datasets.config.HF_HUB_OFFLINE else hub_unreachable_reason()
    if offline:
        raise VramPlanError(f"cannot download gsm8k ({offline}); use --dataset math-sample or a local file (or "
                            "HF_HUB_OFFLINE=1 for a copy in the local cache)")
    try:
        with quiet_hub_logs():
            data = datasets.load_dataset(GSM8K, "main", split="train")
    except Exception as exc:
        raise VramPlanError(f"cannot load gsm8k ({first_line(exc, limit=160)}); use --dataset math-sample or a "
                            "local file") from exc
    return data.map(lambda row: {
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}],
        "answer": row["answer"].split("####")[-1].strip(),
    })


def require_columns(dataset: Any, needed: set[str], what: str) -> None:
    missing = sorted(needed - set(dataset.column_names))
    if missing:
        raise VramPlanError(f"the dataset has no {', '.join(missing)} column ({what}); its columns: "
                            f"{', '.join(dataset.column_names)}")


def longest_prompt_tokens(dataset: Any, tokenizer: Any, limit: int = 2000) -> int:
    """Tokens of the longest prompt among the first `limit` rows, as the chat template renders them."""
    longest = 0
    for row in dataset.select(range(min(limit, len(dataset)))):
        prompt = row["prompt"]
        if isinstance(prompt, list) and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        else:
            ids = tokenizer(prompt if isinstance(prompt, str) else str(prompt))["input_ids"]
        longest = max(longest, len(ids))
    return longest


MESSAGE_SHAPE = '{"role": ..., "content": ...}'


def check_prompts(dataset: Any) -> bool:
    """Every prompt is non-empty text or a non-empty list of chat messages, the same kind in every row (TRL decides
    per batch from its first prompt); named by row. Returns whether the prompts are chat messages."""
    first: tuple[str, int] | None = None  # the kind of the first good row, and its number
    problems: list[tuple[int, str]] = []
    for row, prompt in enumerate(dataset["prompt"], start=1):
        problem = _prompt_problem(prompt)
        kind = "chat messages" if isinstance(prompt, list) else "plain-text"
        if problem is None and first is None:
            first = (kind, row)
        elif problem is None and kind != first[0]:
            problem = f"{kind} among {first[0]} prompts (row {first[1]}): use one kind in every row"
        if problem:
            problems.append((row, problem))
    if problems:
        row, problem = problems[0]
        more = f" (and {len(problems) - 1} more rows)" if len(problems) > 1 else ""
        raise VramPlanError(f"the dataset's prompt column, row {row}{more}: {problem}")
    return first is not None and first[0] == "chat messages"


def _prompt_problem(prompt: Any) -> str | None:
    """What is wrong with one prompt, or None: a string, or a list of chat messages as TRL reads them."""
    if prompt is None:
        return "no prompt (the value is null or missing)"
    if isinstance(prompt, str):
        return None if prompt.strip() else "the prompt is empty"
    if not isinstance(prompt, list):
        return f"the prompt is a {type(prompt).__name__}; give a string or a list of chat messages {MESSAGE_SHAPE}"
    if not prompt:
        return "the prompt is an empty list of messages"
    for number, message in enumerate(prompt, start=1):
        if not isinstance(message, dict):
            return f"message {number} is a {type(message).__name__}, not a chat message {MESSAGE_SHAPE}"
        if not isinstance(message.get("role"), str):
            return f"message {number} has no role (a chat message is {MESSAGE_SHAPE})"
        if not isinstance(message.get("content"), str | list):
            return f"message {number} has no content (a chat message is {MESSAGE_SHAPE})"
    return None
