"""The HTTP API's reading of a query string: its parameters are the request's fields (GRPOConfig's spelling, plus
gpu, model, trl_version and safety_margin) and what to ask (exact, maximize, allow_savers); the answer is the report
`vram-plan check --json` or `plan --json` prints, and bad input is one line naming the fields."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from vram_planner import api
from vram_planner.errors import ConfigError, UnknownNameError, VramPlanError, one_line
from vram_planner.report.document import Report
from vram_planner.report.speed import check_optimize
from vram_planner.request import Request, request_fields

COMMANDS = ("check", "plan")
# What to ask besides the request: exact=true (the traced step's need decides, as with --exact; on check with
# keep_copy=true the step's copy kept, as with --keep-copy), and on plan maximize=FIELD with allow_savers. The command
# line's files (--config, --calibration, --plot) are not read or written over HTTP.
# The step time's parameters: what the rewards take (reward_seconds) and the dataset's size (dataset_prompts), and on
# /api/plan which config to recommend (optimize)
TIMING_PARAMETERS = ("reward_seconds", "dataset_prompts")
SPEED_PARAMETERS = ("optimize", *TIMING_PARAMETERS)
QUESTION_PARAMETERS = ("exact", "keep_copy", "maximize", "allow_savers", *SPEED_PARAMETERS)
HINT = "(query parameters are spelled as GRPOConfig fields, e.g. max_completion_length=1024, plus gpu and model)"
LOCAL_FILES_OFF = ("this server reads no files of its own: model takes a catalog name or a hub id; the app reads "
                   "config.json paths when started with --allow-local-files")


def query_parameters() -> tuple[str, ...]:
    """What a query may set: the request's fields (the calibration file aside) and the questions."""
    return tuple(name for name in request_fields() if name != "calibration") + QUESTION_PARAMETERS


def query_request(query: Iterable[tuple[str, str]], allow_local_files: bool = True) -> tuple[Request, dict[str, Any]]:
    """The request the parameters spell (the last of a repeated one counts) and the question's options; names are
    taken with dashes too (max-completion-length)."""
    known = query_parameters()
    values: dict[str, str] = {}
    for key, value in query:
        name = key.replace("-", "_")
        if name not in known:
            raise UnknownNameError("query parameter", key, sorted(known), hint=HINT)
        values[name] = value
    questions = {name: values.pop(name) for name in QUESTION_PARAMETERS if name in values}
    request = Request.of(values, from_text=True)
    if not allow_local_files:
        request = request.with_fields(model=without_local_files(request.model))
    return request, _questions(questions)


def without_local_files(model: Any) -> Any:
    """The model as a server that reads no files of its own takes it: a catalog name as it is, a hub id as the config
    the hub gives (no path of the same name is looked at), anything else refused before any file is looked at, so
    that the answer says nothing of what the server's disk holds."""
    if not isinstance(model, str) or not model.strip():
        return model
    from vram_planner.profiles import model_catalog

    text = model.strip()
    if text.lower() in model_catalog():
        return model
    if text.count("/") == 1 and not text.startswith((".", "/", "~")) and not text.endswith(".json"):
        from vram_planner.hub import fetch_hub_config

        return {**fetch_hub_config(text), "_name_or_path": text}
    names = sorted({entry.name for entry in model_catalog().values()})
    raise UnknownNameError("model", text, names, hint=f"({LOCAL_FILES_OFF})")


def _questions(values: dict[str, str]) -> dict[str, Any]:
    questions: dict[str, Any] = {}
    for name in ("exact", "keep_copy", "allow_savers"):
        if name in values:
            questions[name] = _boolean(name, values[name])
    if values.get("maximize", "").strip():
        questions["maximize"] = values["maximize"].strip()
    if questions.get("allow_savers") and "maximize" not in questions:
        raise ConfigError(["allow_savers goes with maximize=FIELD (plan without maximize already uses the savers)"])
    if values.get("optimize", "").strip():
        questions["optimize"] = values["optimize"].strip()
    for name, kind in (("reward_seconds", float), ("dataset_prompts", int)):
        if values.get(name, "").strip():
            questions[name] = _number(name, values[name], kind)
    return questions


def _number(name: str, text: str, kind: type) -> Any:
    """A number's text read as pydantic reads the request's numbers; a negative one is refused."""
    from pydantic import ValidationError

    from vram_planner.validation import validate

    try:
        value = validate(kind, text.strip())
    except ValidationError as exc:
        raise ConfigError([f"{name} should be a {'whole ' if kind is int else ''}number (got {text[:40]!r})"]) \
            from exc
    if (kind is int and value < 1) or (kind is float and not 0 <= value <= 3600):
        bounds = "at least 1" if kind is int else "between 0 and 3600"
        raise ConfigError([f"{name} should be {bounds} (got {text[:40]!r})"])
    return value


def _boolean(name: str, text: str) -> bool:
    """A switch's text read as the request's switches are (pydantic's booleans: true/false, 1/0, yes/no, on/off)."""
    from pydantic import ValidationError

    from vram_planner.validation import validate

    try:
        return validate(bool, text.strip() or "false")
    except ValidationError as exc:
        raise ConfigError([f"{name} should be true or false (got {text[:40]!r})"]) from exc


def query_report(command: str, query: Iterable[tuple[str, str]], allow_local_files: bool = True) -> Report:
    """Exactly the document `vram-plan <command> --json` prints for the request these parameters spell."""
    request, questions = query_request(query, allow_local_files)
    maximize = questions.get("maximize")
    if maximize is not None and command != "plan":
        raise ConfigError(["maximize goes with /api/plan"])
    if questions.get("keep_copy") and command != "check":
        raise ConfigError(["keep_copy goes with /api/check and exact=true"])
    if maximize is not None:
        check_optimize(questions.get("optimize", "memory"), maximize=True)  # refused in the CLI's words, not ignored
        if questions.get("exact"):
            raise ConfigError(["exact judges one config or the plan's choice, not maximize: ask /api/check with "
                               "exact=true and the value maximize finds"])
        return api.maximize(request, field=maximize, allow_savers=questions.get("allow_savers", False))
    speed = {name: questions[name] for name in TIMING_PARAMETERS if name in questions}
    if command == "plan":
        return api.plan(request, exact=questions.get("exact", False), optimize=questions.get("optimize", "memory"),
                        **speed)
    if "optimize" in questions:
        raise ConfigError(["optimize goes with /api/plan"])
    return api.check(request, exact=questions.get("exact", False), keep_copy=questions.get("keep_copy", False),
                     **speed)


def error_line(exc: VramPlanError) -> str:
    """One line for bad input, naming the fields as the query spells them."""
    return one_line(str(exc))


def pasted_config(text: str) -> dict[str, Any]:
    """A pasted config.json's dict, or one line saying why it is not one."""
    from vram_planner.errors import ProfileError, first_line
    from vram_planner.files import load_json

    try:
        config = load_json(text, "the pasted config.json")  # nesting bounded, as every config.json read
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ProfileError(f"the pasted config.json is not valid JSON: {first_line(exc)}") from exc
    if not isinstance(config, dict):
        raise ProfileError("the pasted config.json is not a config.json: it holds no JSON object")
    return config

