"""The library API: one request in, one report out, the same calls the command line and the web page make.

    >>> from vram_planner import api
    >>> report = api.check("Llama-3.2-1B", "rtx3080-mobile", max_completion_length=1024)
    >>> report.fits, report.peak_bytes
    >>> report.to_dict() == json.loads(`vram-plan check --model Llama-3.2-1B --gpu rtx3080-mobile
    ...                                  --max-completion-length 1024 --json`)

Each function takes a `Request`, or the model, the card and the knobs (a mapping, keyword arguments, or both), named
as GRPOConfig's fields plus ours (vram_planner.request.Request lists them). Bad input raises a VramPlanError whose
text names the fields.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vram_planner import engine
from vram_planner.errors import ConfigError, VramPlanError, field_name
from vram_planner.model import search
from vram_planner.report.document import Report, plan_report, verdict_report
from vram_planner.request import Request, request_fields

if TYPE_CHECKING:
    from vram_planner.model.spec import TrainingConfig
    from vram_planner.model.verdict import Context
    from vram_planner.report.cards import CardsReport
    from vram_planner.model.ranking import Ranking
    from vram_planner.recipe import Recipe as RecipeReading
    from vram_planner.report.maximized import MaximizedPlanReport

__all__ = ["Request", "RecipeRequest", "Report", "Judged", "check", "plan", "maximize", "fitting_gpus", "trace", "rank",
           "gpus", "models", "recipe", "recipe_edits", "resolve", "resolve_gpu_count", "VramPlanError", "ConfigError"]


@dataclass(frozen=True, kw_only=True)
class RecipeRequest(Request):
    """The request a TRL recipe spells (`recipe`), with how the recipe was read: what it leaves out (evaluation, the
    training script's own keys) is the report's to say, as `vram-plan check --config recipe.yaml` says it."""

    reading: RecipeReading | None = None


@dataclass(frozen=True)
class Judged:
    """What a report describes, beside its document: the context it was judged in, the training config it shows
    (the plan's choice, or the config as given) and the engine's own answer (a Verdict, a Plan, ...)."""

    context: Context
    train: TrainingConfig
    result: Any


def check(model: str | dict[str, Any] | Request, gpu: str | None = None, settings: Mapping[str, Any] | None = None, *,
          exact: bool = False, progress: Callable[[str], None] | None = None, reward_seconds: float = 0.0,
          dataset_prompts: int | None = None, keep_copy: bool = False, **fields: Any) -> Report:
    """The verdict for exactly this configuration: `vram-plan check --json`'s document. Near the boundary, a copy of
    the exact engine kept for this model and these knobs (`keep_copy`) decides it (`.copy`).

    Args:
        model: a catalog name, a config.json path or folder, a hub id, a config.json's dict, or a whole Request.
        gpu: a catalog name, "auto" or a size like "24GiB".
        settings: knobs by field name (e.g. {"max_completion_length": 1024}); keyword arguments add to them.
        exact: judge by the traced step's need (`check --exact`; needs the train extra, seconds to a minute).
        progress: called with what the trace is doing (with `exact`).
        reward_seconds: seconds the reward functions take per completion, for the predicted step time.
        dataset_prompts: prompts in the dataset, for the predicted time of an epoch.
        keep_copy: with `exact`, also make the step's copy and keep it in the user's cache (`check --exact
            --keep-copy`; seconds to a minute more).

    Returns:
        The report: `.fits`, `.peak_bytes`, `.phases`, `.step_seconds`, ...; `.to_dict()` is the JSON document.
    """
    from vram_planner.report.speed import check_step_time

    request = _request(model, gpu, settings, fields)
    if keep_copy and not exact:
        raise ConfigError([engine.KEEP_COPY_WITHOUT_EXACT])
    if exact:
        from vram_planner.report.document import exact_check_report

        outcome = engine.check(*_engine_call(request), exact=True, progress=progress, keep_copy=keep_copy,
                               **_options(request))
        report = check_step_time(exact_check_report(outcome), outcome.analytic, reward_seconds, dataset_prompts)
        return _judged(report, outcome.traced.context, outcome.traced.train, outcome, request)
    context, train, fewest = resolve_gpu_count(request)
    verdict = engine.judged(context, train)
    report = check_step_time(_with_gpu_count(verdict_report(verdict), fewest, context), verdict, reward_seconds,
                             dataset_prompts)
    return _judged(report, context, train, verdict, request)


def plan(model: str | dict[str, Any] | Request, gpu: str | None = None, settings: Mapping[str, Any] | None = None, *,
         exact: bool = False, progress: Callable[[str], None] | None = None, optimize: str = "memory",
         reward_seconds: float = 0.0, dataset_prompts: int | None = None, **fields: Any) -> Report:
    """The best configuration that fits, starting from this one: `vram-plan plan --json`'s document.

    Args:
        model, gpu, settings: as `check` takes them.
        exact: trace the choice and the config ranked above it, and judge by their needs (`plan --exact`).
        progress: called with what the trace is doing (with `exact`).
        optimize: "memory", the config that keeps most of yours (the first saver that fits), or "speed", the config
            that fits with the least predicted time per optimizer step.
        reward_seconds, dataset_prompts: as `check` takes them.

    Returns:
        The report of the chosen config (or of the smallest, when nothing fits), with `.changes` that lead to it and
        `.alternatives`, every config that fits, fastest first.
    """
    from vram_planner.report.speed import check_optimize, plan_step_times

    check_optimize(optimize, exact=exact)
    request = _request(model, gpu, settings, fields)
    if exact:
        from vram_planner.report.document import exact_plan_report

        result = engine.plan(*_engine_call(request), exact=True, progress=progress, **_options(request))
        shown = result.plan.chosen or result.plan.smallest
        return _judged(exact_plan_report(result), result.plan.requested.context, shown.train, result, request)
    context, train, fewest = resolve_gpu_count(request)
    result = engine.planned(context, train)
    report, shown = plan_step_times(_with_gpu_count(plan_report(result), fewest, context), result, context, train,
                                    optimize, reward_seconds, dataset_prompts)
    return _judged(report, context, shown, result, request)


def rank(model: str | dict[str, Any] | Request, gpu: str | None = None, settings: Mapping[str, Any] | None = None, *,
         reward_seconds: float = 0.0, try_vllm: bool = True, **fields: Any) -> Ranking:
    """Every config that fits and trains what the plan would, fastest first by predicted seconds per optimizer step
    (what `plan --optimize speed` chooses from).

    Args:
        model, gpu, settings: as `check` takes them.
        reward_seconds: seconds the reward functions take per completion.
        try_vllm: weigh vLLM generation too.

    Returns:
        The ranking (vram_planner.model.ranking.Ranking): `.ranked`, `.fastest`, `.memory_choice`; NoSpeedFigures
        (a ProfileError) on a card without speed figures.
    """
    from vram_planner.model.ranking import rank_configs

    context, train = resolve(_request(model, gpu, settings, fields))
    return rank_configs(context, search.best_plan(context, train), reward_seconds, try_vllm)


def maximize(model: str | dict[str, Any] | Request, gpu: str | None = None, field: str = "max_completion_length",
             settings: Mapping[str, Any] | None = None, *, allow_savers: bool = False,
             **fields: Any) -> MaximizedPlanReport:
    """The largest value of one knob that fits the card: `vram-plan plan --maximize FIELD --json`'s document.

    Args:
        model, gpu, settings: as `check` takes them.
        field: max_completion_length, max_prompt_length, num_generations, per_device_train_batch_size or lora_r.
        allow_savers: let the plan's savers (smaller micro-batches, checkpointing, 8-bit AdamW, ...) make room.

    Returns:
        The plan at that value, with `.maximized` (`.value` is None when even the smallest valid value does not fit).
    """
    from vram_planner.model.maximize import maximizable_field
    from vram_planner.model.maximize import maximize as maximize_field
    from vram_planner.report.maximized import maximized_report

    request = _request(model, gpu, settings, fields)
    knob = maximizable_field(field)  # before a hub id is fetched for nothing
    context, train = resolve(request)
    result = maximize_field(context, train, knob, allow_savers)
    return _judged(maximized_report(result), context, result.plan.chosen.train if result.plan.chosen else train,
                   result, request)


def fitting_gpus(model: str | dict[str, Any] | Request, settings: Mapping[str, Any] | None = None, *,
                 maximize: str | None = None, allow_savers: bool = False, **fields: Any) -> CardsReport:
    """Every catalog card judged for this config, the smallest fitting card first: `vram-plan gpus --model M --json`.

    Args:
        model, settings: as `check` takes them (the request's gpu, if any, is left out: every card is judged).
        maximize: a knob `maximize` takes: each card's largest value of it instead of a verdict.
        allow_savers: with `maximize`, as `maximize` takes it.

    Returns:
        The cards: `.cards` (vram_planner.engine.CardFit each), `.fits` (some card fits); `.to_dict()` the rows.
    """
    from vram_planner.report.cards import CardsReport

    request = _request(model, None, settings, fields)
    _require_model(request)
    cards = engine.fitting_gpus(request.model, request.knobs, maximize, allow_savers, **_options(request))
    return CardsReport(cards=cards)


def trace(model: str | dict[str, Any] | Request, gpu: str | None = None, settings: Mapping[str, Any] | None = None,
          *, progress: Callable[[str], None] | None = None, **fields: Any) -> Report:
    """One GRPO step traced on fake tensors on the CPU, beside the analytic model: `vram-plan trace --json`.

    Args:
        model, gpu, settings: as `check` takes them; without a gpu, the local card (else rtx3080-mobile).
        progress: called with what the trace is doing.

    Returns:
        The traced report (engine "trace"), judged by the step's need; needs the train extra.
    """
    from vram_planner.report.document import trace_report

    request = _request(model, gpu, settings, fields)
    _require_model(request)
    outcome = engine.trace(request.model, request.gpu, request.knobs, progress=progress, **_options(request))
    return _judged(trace_report(outcome), outcome.traced.context, outcome.traced.train, outcome, request)


def recipe(recipe: str | Path | Mapping[str, Any], gpu: str | None = None, **fields: Any) -> RecipeRequest:
    """The request a TRL recipe spells, read as TRL runs it (`vram-plan check --config recipe.yaml`): TrlParser's
    YAML file, its keys as a mapping, or the training command's TRL arguments as one string; `fields` (ours) add to
    it or change it. The reports of check, plan, maximize and trace for it say in a note what the recipe leaves out.

        >>> api.check(api.recipe("recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml", "rtx4090"))
        >>> api.check(api.recipe("trl grpo --model_name_or_path Qwen/Qwen2.5-1.5B --use_peft --bf16 true", "rtx4090"))
    """
    from vram_planner.recipe import read_recipe

    reading = read_recipe(_recipe_values(recipe), fields)
    spelled = _request(None, gpu, reading.settings, fields)
    return RecipeRequest(**{name: getattr(spelled, name) for name in request_fields()}, reading=reading)


def recipe_edits(recipe: str | Path | Mapping[str, Any] | RecipeReading, report: Report) -> dict[str, Any]:
    """What to set in a recipe (as `recipe` takes it, or as vram_planner.recipe.read_recipe read it) for the choice of
    `plan(recipe(...))`, in the recipe's own names (the lines `vram-plan plan --config recipe.yaml` ends with, its
    JSON's `recipe_edits`); empty when the recipe is the choice.

        >>> report = api.plan(api.recipe("config_demo.yaml", "rtx4090"))
        >>> api.recipe_edits("config_demo.yaml", report)
        {'per_device_train_batch_size': 4, 'gradient_accumulation_steps': 16, ...}
    """
    from vram_planner.recipe import Recipe as RecipeReading
    from vram_planner.recipe import read_recipe
    from vram_planner.recipe import recipe_edits as edits

    result = getattr(report.judged, "result", None)
    if report.command != "plan" or getattr(result, "requested", None) is None:
        raise ConfigError(["recipe_edits takes the report api.plan gave for that recipe"])
    read = recipe if isinstance(recipe, RecipeReading) else read_recipe(_recipe_values(recipe), {})
    return edits(read, result.requested.train, report.judged.train)


def _recipe_values(recipe: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    # a recipe's keys: TrlParser's YAML file read, a command's TRL arguments parsed, or the mapping itself
    from vram_planner.files import MAX_SETTINGS_BYTES, load_yaml, read_text
    from vram_planner.recipe import is_recipe
    from vram_planner.trl_arguments import command_line_arguments, is_command_line

    values = recipe
    if isinstance(recipe, str) and is_command_line(recipe) and not _is_file(recipe):
        return command_line_arguments(recipe)
    if isinstance(recipe, (str, Path)):
        values = load_yaml(read_text(recipe, MAX_SETTINGS_BYTES, "the recipe", kind="a YAML file"), str(recipe))
    if not isinstance(values, Mapping) or not is_recipe(values):
        raise ConfigError(["a recipe is TrlParser's YAML: a mapping of TRL's arguments (model_name_or_path, ...)"])
    return values


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except OSError:  # a name too long for the system to look up is none of its files
        return False


def gpus() -> list[dict[str, Any]]:
    """The GPU catalog: `vram-plan gpus --json`'s rows (capacity in bytes as CUDA reports it).

    Returns:
        One dict per card: name, total_memory_gib, capacity_bytes, compute_capability, bf16, aliases, ...
    """
    from vram_planner.profiles import gpus as catalog
    from vram_planner.validation import to_jsonable

    return [{**{k: v for k, v in to_jsonable(g).items() if k != "note"}, "capacity_bytes": g.capacity_bytes}
            for g in catalog()]  # a note is a verdict's, on a size given in GB


def models() -> list[dict[str, Any]]:
    """The model catalog: `vram-plan models --json`'s rows.

    Returns:
        One dict per model: name, hub_id, aliases, params, and the architecture's sizes.
    """
    from vram_planner.model.resolve import catalog_architecture
    from vram_planner.profiles import models as catalog

    rows = []
    for entry in catalog():
        a = catalog_architecture(entry)
        rows.append({"name": entry.name, "hub_id": entry.hub_id, "aliases": entry.aliases, "params": a.params,
                     "model_type": a.model_type, "num_layers": a.num_layers, "hidden_size": a.hidden_size,
                     "num_attention_heads": a.num_attention_heads, "num_kv_heads": a.num_kv_heads,
                     "vocab_size": a.vocab_size, "tie_word_embeddings": a.tie_word_embeddings})
    return rows


def resolve(request: Request) -> tuple[Context, TrainingConfig]:
    """The context (model, card, TRL release, calibration, margin) and the validated training config of a request.

    Args:
        request: what to judge; its model and gpu must be given.

    Returns:
        (context, training config), as vram_planner.engine judges them.
    """
    context = _context(request)
    return context, engine.make_training(context, request.knobs)


def resolve_gpu_count(request: Request) -> tuple[Context, TrainingConfig, Any]:
    """As `resolve`, where num_gpus may be "auto": then the fewest GPUs of the card and the strategy that fit, and
    the search that chose them (vram_planner.model.fewest_gpus; None for a count given).

    Args:
        request: what to judge; its model and gpu must be given.

    Returns:
        (context, training config, the search or None).
    """
    context = _context(request)
    return (context, *engine.make_training_auto(context, request.knobs))


def _context(request: Request) -> Context:
    _require_model(request, gpu=True)
    return engine.make_context(request.model, request.gpu, **_options(request))


def _with_gpu_count(report: Report, fewest: Any, context: Context) -> Report:
    """With num_gpus "auto": what the search chose, and why, first among the notes."""
    if fewest is not None:
        from vram_planner.report.document import gpu_count_report

        report.num_gpus_auto = gpu_count_report(fewest)
        report.notes.insert(0, fewest.note(context.gpu.label))
    return report


def _request(model: Any, gpu: str | None, settings: Mapping[str, Any] | None, fields: dict[str, Any]) -> Request:
    if settings is not None and not isinstance(settings, Mapping):
        raise ConfigError([f"settings should be a mapping of field names to values (got {settings!r:.60})"])
    given = {**(settings or {}), **fields}
    if isinstance(model, Request):
        return model.with_fields(**({"gpu": gpu} if gpu is not None else {}), **given)
    return Request.of({"model": model, "gpu": gpu, **given})


def _require_model(request: Request, gpu: bool = False) -> None:
    missing = [name for name, value in (("model", request.model), ("gpu", request.gpu if gpu else "-"))
               if value is None or (isinstance(value, str) and not value.strip())]
    if missing:
        examples = {"model": "a catalog name such as Llama-3.2-1B, a config.json, a model folder or a hub id",
                    "gpu": "a catalog name such as rtx3080-mobile, auto, or a size such as 24GiB"}
        raise ConfigError([f"{field_name(name)} is needed: {examples[name]}" for name in missing])


def _options(request: Request) -> dict[str, Any]:
    calibration = request.calibration
    return {"trl_version": request.trl_version, "safety_margin": request.safety_margin,
            "calibration": Path(calibration) if isinstance(calibration, str) else calibration}


def _engine_call(request: Request) -> tuple[Any, Any, dict[str, Any]]:
    _require_model(request, gpu=True)
    return request.model, request.gpu, request.knobs


def _judged(report: Any, context: Context, train: TrainingConfig, result: Any, request: Request) -> Any:
    report.judged = Judged(context, train, result)
    reading = getattr(request, "reading", None)
    if reading is not None and (summary := reading.summary()) not in report.notes:
        report.notes.append(summary)  # as the command line's `--config recipe.yaml` says it
    return report
