"""The prompts `vram-plan run` trains on: GSM8K (online), a bundled math sample, or a local file or folder.

Every source ends as a `datasets.Dataset` with a `prompt` column (and, for the built-in rewards, `answer`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vram_planner.errors import VramPlanError
from vram_planner.rewards import SYSTEM_PROMPT

BUNDLED = {"math-sample": "data/math_sample.jsonl"}


def load_prompts(spec: str) -> Any:
    """`gsm8k`, `math-sample`, a .jsonl/.json/.parquet file or a `save_to_disk` folder."""
    if spec == "gsm8k":
        return _gsm8k()
    import datasets

    # reading a local file takes a moment; its progress bars would only clutter the one line an error gets
    datasets.disable_progress_bars()
    try:
        return _local(spec)
    finally:
        datasets.enable_progress_bars()


def _local(spec: str) -> Any:
    from datasets import Dataset, load_from_disk

    if spec in BUNDLED:
        from vram_planner import profile_data

        return Dataset.from_json(str(Path(next(iter(profile_data.__path__))) / BUNDLED[spec]))
    path = Path(spec).expanduser()
    if not path.exists():
        raise VramPlanError(f"dataset {spec!r}: no such file or folder (or use gsm8k or math-sample)")
    try:
        if path.is_dir():
            dataset = load_from_disk(str(path))
        elif path.suffix in (".jsonl", ".json"):
            dataset = Dataset.from_json(str(path))
        elif path.suffix == ".parquet":
            dataset = Dataset.from_parquet(str(path))
        else:
            raise VramPlanError(f"dataset {spec!r}: read .jsonl, .json, .parquet or a save_to_disk folder")
    except VramPlanError:
        raise
    except Exception as exc:
        raise VramPlanError(f"dataset {spec!r} cannot be read: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    if hasattr(dataset, "column_names") and isinstance(dataset.column_names, dict):  # a DatasetDict
        dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
    return dataset


def _gsm8k() -> Any:
    """GSM8K as the GRPO recipe prepares it: the system format prompt, the question, the answer after ####."""
    from datasets import load_dataset

    try:
        data = load_dataset("openai/gsm8k", "main", split="train")
    except Exception as exc:
        raise VramPlanError(f"cannot download gsm8k ({type(exc).__name__}); use --dataset math-sample or a local "
                            "file") from exc
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
