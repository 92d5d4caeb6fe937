"""The HTTP API's description (OpenAPI 3.1), built from the request's fields so that it names what the API reads."""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin, get_type_hints

from vram_planner.app.query import QUESTION_PARAMETERS, SPEED_PARAMETERS, TIMING_PARAMETERS, query_parameters
from vram_planner.request import Request

QUESTIONS = {"exact": ("boolean", "Judge by the traced step's need (needs the train extra; seconds to a minute)."),
             "keep_copy": ("boolean", "On /api/check with exact: also keep the step's copy, which later checks of the "
                                      "model and knobs at other lengths replay near the boundary."),
             "maximize": ("string", "On /api/plan and /api/gpus: the largest value that fits of max_completion_length, "
                                    "max_prompt_length, num_generations, per_device_train_batch_size or lora_r."),
             "allow_savers": ("boolean", "With maximize: let the plan's savers make room."),
             "optimize": ("string", "On /api/plan: memory (default), the config that keeps most of yours, or speed, "
                                    "the config that fits with the least predicted time per optimizer step."),
             "reward_seconds": ("number", "Seconds the reward functions take per completion, for the step time."),
             "dataset_prompts": ("integer", "Prompts in the dataset, for the predicted time of one epoch.")}
CONTEXT_HELP = {"model": "Catalog name (GET /api/models), hub id, or a config.json path where the server reads files.",
                "gpu": "Catalog name (GET /api/gpus), or a size like 24GiB.",
                "trl_version": "Plan for this TRL release (default: the installed one).",
                "safety_margin": "Share of the card kept free, 0 to 0.5 (default 0.05)."}
ERROR = {"description": "Bad input: one line naming the query's fields.",
         "content": {"application/json": {"schema": {"type": "object", "properties": {"error": {"type": "string"}},
                                                     "required": ["error"]}}}}


def _schema(annotation: Any) -> dict[str, Any]:
    members = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string"}
    found = [kinds[m] for m in members if m in kinds]
    if any(get_origin(m) is list for m in members):
        found.append("string")  # a comma-separated list of names
    return {"type": sorted(set(found)) if len(set(found)) > 1 else (found or ["string"])[0]}


def _parameters(names: tuple[str, ...]) -> list[dict[str, Any]]:
    hints = get_type_hints(Request)
    out = []
    for name in names:
        if name in QUESTIONS:
            kind, text = QUESTIONS[name]
            out.append({"name": name, "in": "query", "schema": {"type": kind}, "description": text})
        else:
            text = CONTEXT_HELP.get(name, "A GRPOConfig field (or ours); left out: TRL's default.")
            out.append({"name": name, "in": "query", "schema": _schema(hints[name]), "description": text,
                        "required": False})
    return out


def _get(summary: str, names: tuple[str, ...], answer: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "parameters": _parameters(names),
                    "responses": {"200": {"description": answer, "content": {"application/json": {}}},
                                  "400": ERROR}}}


def openapi_document() -> dict[str, Any]:
    """The API's OpenAPI description."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("vram-plan")
    except PackageNotFoundError:
        release = "unknown"
    fields = tuple(name for name in query_parameters() if name not in QUESTION_PARAMETERS)
    return {
        "openapi": "3.1.0",
        "info": {"title": "vram-plan", "version": release,
                 "description": "The GPU memory of GRPO fine-tuning with TRL. Each answer is the JSON document "
                                "`vram-plan <command> --json` prints, bytes as integers."},
        "paths": {
            "/api/check": _get("The verdict for exactly this config (`vram-plan check --json`).",
                               (*fields, "exact", "keep_copy", *TIMING_PARAMETERS), "The check document."),
            "/api/plan": _get("The best config that fits, or with maximize the largest value of one knob "
                              "(`vram-plan plan --json`).",
                              tuple(n for n in (*fields, *QUESTION_PARAMETERS) if n != "keep_copy"),
                              "The plan document."),
            "/api/gpus": _get("The GPU catalog; with model (and knobs, maximize), every card's verdict, the smallest "
                              "fitting card first (`vram-plan gpus --model M --json`).",
                              tuple(n for n in (*fields, *QUESTION_PARAMETERS)
                                    if n not in ("gpu", "exact", "keep_copy", *SPEED_PARAMETERS)),
                              "The cards."),
            "/api/models": {"get": {"summary": "The model catalog (`vram-plan models --json`).",
                                    "responses": {"200": {"description": "The models.",
                                                          "content": {"application/json": {}}}}}},
        },
    }
