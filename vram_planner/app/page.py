"""The Gradio page: pick a card and a model (or paste a config.json), set the knobs (or fill them from a pasted TRL
recipe), and see at once the verdict, the bars per phase, the plan's changes, the GRPOConfig to copy and the longest
completion that fits.

Every evaluation goes through the HTTP API's path (query.py): the page's fields become query parameters, read into the
same request, so the page, the API and the CLI judge the same config the same way.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, get_args, get_origin

import gradio as gr

from vram_planner import api
from vram_planner.app import views
from vram_planner.app.query import error_line, pasted_config, query_request
from vram_planner.errors import VramPlanError
from vram_planner.model.grpo_config import python_snippet
from vram_planner.model.spec import SAMPLING_KNOBS, TrainingConfig, knob_types
from vram_planner.model.trl_releases import NEWEST_KNOWN, trl_release, trl_releases, version_tuple
from vram_planner.profiles import GpuProfile, gpus, models
from vram_planner.report.document import Report
from vram_planner.request import DEFAULT_SAFETY_MARGIN, knob_fields

DEFAULT_GPU, DEFAULT_MODEL = "rtx3080-mobile", "Llama-3.2-1B"  # the command-line contract's first example
PASTED = "pasted config.json"
# The knobs' fields, grouped as people look for them; the knobs not named here open the list.
KNOB_GROUPS = (("Precision and memory", ("optim", "gradient_checkpointing", "use_reentrant", "dtype", "mixed_precision",
                                          "attn_implementation", "use_liger_kernel", "use_kernels",
                                          "cast_lm_head_to_fp32", "transformers_version")),
               ("Sampling", SAMPLING_KNOBS),
               ("LoRA and 4-bit weights", ("lora_", "load_in_4bit", "bnb_")),
               ("vLLM", ("use_vllm", "vllm_")),
               ("Several GPUs", ("num_gpus", "zero_stage", "fsdp", "ds3_", "reduce_bucket_size", "overlap_comm",
                                 "stage3_", "offload_", "host_memory")))
UNSET = ""  # a dropdown's value for "not given": the release's default


@dataclass(frozen=True)
class Knob:
    """One knob's field on the page."""

    name: str
    widget: Any  # the Gradio component

    def query_value(self, value: Any) -> str | None:
        """The query parameter's value for what the field holds; None when it is left to the default."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        return str(value).strip()

    def default_update(self, train: TrainingConfig) -> Any:
        """Show what the knob is when left unset, for the config just judged."""
        shown = default_text(train, self.name)
        if isinstance(self.widget, gr.Dropdown):
            return gr.update(choices=[(f"default ({shown})", UNSET), *choices_of(self.name)])
        return gr.update(placeholder=f"default: {shown}")


# What a field means where its name does not say it, in the page's words (the knobs are GRPOConfig's fields).
KNOB_HELP = {"max_prompt_length": "Longest prompt of your dataset, in tokens (default 256).",
             "optim": "transformers optimizer name, e.g. adamw_torch_fused, adamw_8bit.",
             "dtype": "Weights' dtype: float32 (TRL's default), bfloat16, float16.",
             "vllm_max_model_length": "vLLM's context (default: the model's, TRL 0.26+).",
             "reduce_bucket_size": "ZeRO: DeepSpeed's gradient reduction bucket, like 2e8, or auto (default 5e8).",
             "stage3_prefetch_bucket_size": "ZeRO-3: elements a prefetch round gathers ahead, like 5e7 (default), or "
                                            "auto.",
             "stage3_param_persistence_threshold": "ZeRO-3: parameters this small stay gathered, like 1e5 (default), "
                                                   "or auto.",
             "vllm_server_gpu": "Server mode: the card trl vllm-serve runs on (planned too).",
             "temperature": "Sampling without vLLM: each filter holds logits-sized tensors at every decoding step.",
             "top_k": "0: no top-k filter.",
             "min_p": "Empty: no min-p filter (0 still runs it).",
             "lora_target_modules": "Comma-separated module names, or all-linear.",
             "transformers_version": "Plan for this transformers release (default: the installed one, if of the TRL "
                                     "release's time).",
             "allocator_conf": "PYTORCH_CUDA_ALLOC_CONF of the run, e.g. expandable_segments:True."}


def default_text(train: TrainingConfig, name: str) -> str:
    """A knob's value in the judged config, in words (what leaving it unset gives)."""
    value = getattr(train, name)
    if name == "steps_per_generation" and value is None:
        return f"{train.steps_per_generation_resolved} (gradient_accumulation_steps)"
    if name == "lora_target_modules" and value is None:
        return "all-linear"
    if name in ("temperature", "top_k") and value is None:
        return str(getattr(train, f"sampling_{name}"))
    if name == "use_kernels" and value is None:  # as from_pretrained loads the model in this release
        return f"{'on' if train.transformers.hub_kernels else 'off'} in transformers {train.transformers.version}"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, Enum):
        return str(value.value)
    return "unset" if value is None else str(value)


def choices_of(name: str) -> list[tuple[str, str]]:
    """The values a knob takes when they are few: on/off, or the names TrainingConfig accepts."""
    if is_switch(name):
        return [("on", "true"), ("off", "false")]
    return [(choice, choice) for choice in field_choices(name) or ()]


def is_switch(name: str) -> bool:
    return bool in (knob_types()[name], *get_args(knob_types()[name]))


def field_choices(name: str) -> list[str] | None:
    """The names a TrainingConfig field accepts, from its Literal or Enum type; None for free values."""
    annotation = knob_types()[name]
    for member in (annotation, *get_args(annotation)):
        if get_origin(member) is Literal:
            return [str(v) for v in get_args(member)]
        if isinstance(member, type) and issubclass(member, Enum):
            return [str(m.value) for m in member]
    return None


def knob_widget(name: str) -> Any:
    if is_switch(name) or field_choices(name):
        return gr.Dropdown([("default", UNSET), *choices_of(name)], value=UNSET, label=name, elem_id=name)
    # Numbers too: a number field cannot be left empty (Gradio sends 0), and empty means TRL's default; the request
    # then reads the text, with its messages for a bad value.
    return gr.Textbox(label=name, elem_id=name, info=KNOB_HELP.get(name), max_lines=1)


def group_of(name: str) -> str:
    for title, prefixes in KNOB_GROUPS:
        if name.startswith(prefixes):
            return title
    return "Batch and lengths"


def _catalog_choices() -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str]]]:
    cards = [(f"{g.name} ({g.total_memory_gib:.2f} GiB)", g.name) for g in gpus()]
    catalog = [(f"{m.name} ({m.params_label})" if m.params_label else m.name, m.name) for m in models()]
    starts = sorted({r.min_version for r in trl_releases()} | {NEWEST_KNOWN}, key=version_tuple)
    releases = [(f"default ({trl_release(None).version})", UNSET), *((v, v) for v in reversed(starts))]
    return cards, catalog, releases


# Results beside the inputs on a wide screen; on a narrow one the two columns stack, the results first (the inputs
# run to some forty fields). The system's own fonts: the bundled web font's semi-bold face lacks glyphs.
SYSTEM_FONTS = ("system-ui", "-apple-system", "Segoe UI", "Roboto", "Helvetica Neue", "Arial", "sans-serif")
MONO_FONTS = ("ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "Liberation Mono", "monospace")
NARROW_PX = 900
CSS = f"""
#main_row {{ flex-wrap: wrap; align-items: flex-start; }}
#results {{ position: sticky; top: 0; }}
@media (max-width: {NARROW_PX}px) {{
  #main_row {{ flex-direction: column; }}
  #results {{ order: -1; position: static; }}
  #inputs, #results {{ min-width: 100% !important; }}
}}
#bars svg, #plan_bars svg {{ font-family: {", ".join(SYSTEM_FONTS)}; }}
"""


def theme() -> Any:
    """Gradio's default look with the system's fonts, fetched from nowhere."""
    return gr.themes.Default(font=list(SYSTEM_FONTS), font_mono=list(MONO_FONTS))


def build_page(allow_local_files: bool = True) -> gr.Blocks:
    """The page; its events evaluate the config on every change. Without `allow_local_files` the model field takes
    catalog names and hub ids only (a pasted config.json still works: it is not a file of the server's)."""
    cards, catalog, releases = _catalog_choices()
    where = "a hub id or a local config.json" if allow_local_files else "or a hub id"
    with gr.Blocks(title="vram-plan: will this GRPO run fit?") as page:
        gr.Markdown("## vram-plan: will this GRPO run fit?\nThe GPU memory of GRPO fine-tuning with TRL, phase by "
                    "phase, before you start it. Knobs are spelled like `GRPOConfig` fields; empty ones take TRL's "
                    "defaults.")
        with gr.Row(elem_id="main_row"):
            with gr.Column(scale=2, min_width=320, elem_id="inputs"):
                gpu = gr.Dropdown(cards, value=GpuProfile.from_name(DEFAULT_GPU).name, label="GPU",
                                  allow_custom_value=True, elem_id="gpu", info="A catalog card, or a size like 24GiB")
                model = gr.Dropdown(catalog, value=DEFAULT_MODEL, label="Model", allow_custom_value=True,
                                    elem_id="model", info=f"A catalog model, {where}")
                with gr.Accordion("…or paste a config.json", open=False):
                    pasted = gr.Textbox(label="config.json (used instead of the model above)", lines=6,
                                        elem_id="pasted_config")
                with gr.Accordion("…or fill the fields from a TRL recipe", open=False):
                    recipe = gr.Textbox(label="The recipe's YAML (trl grpo --config, open-r1's recipes), or the "
                                              "training command's TRL arguments (--use_peft --lora_r 16 ...)",
                                        lines=6, elem_id="recipe")
                    read_recipe = gr.Button("Read the recipe into the fields", elem_id="read_recipe")
                    recipe_note = gr.Markdown(elem_id="recipe_note")
                with gr.Row():
                    release = gr.Dropdown(releases, value=UNSET, label="trl_version", allow_custom_value=True,
                                          elem_id="trl_version")
                    margin = gr.Number(value=DEFAULT_SAFETY_MARGIN, label="safety_margin", minimum=0, maximum=0.5,
                                       step=0.01, elem_id="safety_margin", info="Share of the card kept free")
                knobs = _knob_fields()
            with gr.Column(scale=3, min_width=480, elem_id="results"):
                title = gr.Markdown(elem_id="title")
                verdict = gr.Markdown(elem_id="verdict")
                bars_title = gr.Markdown(elem_id="bars_title")
                bars = gr.HTML(elem_id="bars")
                with gr.Column(visible=False, elem_id="plan_column") as plan_column:
                    plan_title = gr.Markdown(elem_id="plan_bars_title")
                    plan_bars = gr.HTML(elem_id="plan_bars")
                gr.HTML(views.legend_html(), elem_id="legend")
                changes = gr.Markdown(elem_id="changes")
                longest = gr.Markdown(elem_id="longest")
                exact_button = gr.Button("Check exactly: trace the step (the train extra; seconds to a minute)",
                                         elem_id="exact_button", variant="secondary")
                keep_copy = gr.Checkbox(False, elem_id="keep_copy",
                                        label="…and keep the step's copy (seconds to a minute more): checks of this "
                                              "model and knobs at other lengths then replay it near the boundary")
                exact = gr.Markdown(elem_id="exact")
                code = gr.Code(language="python", label="GRPOConfig to copy", elem_id="code")
                notes = gr.Markdown(elem_id="notes")
                links = gr.Markdown(elem_id="api_links")
        inputs = [gpu, model, pasted, release, margin, *(k.widget for k in knobs)]
        outputs = [title, verdict, bars_title, bars, plan_column, plan_title, plan_bars, changes, longest, code, notes,
                   links, *(k.widget for k in knobs)]

        def evaluate(*values: Any) -> list[Any]:
            return page_outputs(knobs, allow_local_files, *values)

        gr.on([page.load, *(c.change for c in inputs)], evaluate, inputs, outputs, trigger_mode="always_last",
              show_progress="hidden", api_visibility="private")
        # a changed field makes the exact answer stale: it goes until asked for again
        gr.on([c.change for c in inputs], lambda: "", None, [exact], show_progress="hidden", api_visibility="private")

        def evaluate_exactly(keep: bool, *values: Any) -> str:
            return exact_output(knobs, allow_local_files, *values, keep_copy=keep)

        exact_button.click(evaluate_exactly, [keep_copy, *inputs], [exact], api_visibility="private")

        def fill(text: str) -> list[Any]:
            return recipe_fields(knobs, text)

        read_recipe.click(fill, [recipe], [recipe_note, model, pasted, release, *(k.widget for k in knobs)],
                          api_visibility="private")
    return page


def recipe_fields(knobs: list[Knob], text: str) -> list[Any]:
    """The page's fields as a pasted TRL recipe sets them (api.recipe: what it leaves unset is emptied), or a pasted
    TRL command line (trl_arguments), after a line on what was read; on a bad recipe, that line's error and the
    fields as they were."""
    from vram_planner.files import load_yaml
    from vram_planner.recipe import read_recipe
    from vram_planner.trl_arguments import command_line_arguments, is_command_line

    try:
        if is_command_line(text or ""):
            recipe = read_recipe(command_line_arguments(text), command_line=True)
        else:
            values = load_yaml(text or "", "the pasted recipe")
            if not isinstance(values, dict) or not values:
                raise VramPlanError("the pasted recipe holds no mapping of TRL's arguments")
            recipe = read_recipe(values)
    except VramPlanError as exc:
        return [f"✘ error: {views.page_words(error_line(exc))}", *(gr.update() for _ in range(3 + len(knobs)))]
    settings = recipe.settings
    model = settings.get("model")
    return [views.page_words(recipe.summary()), gr.update(value=model) if model else gr.update(), "",
            settings.get("trl_version") or UNSET, *(_field_text(settings.get(k.name)) for k in knobs)]


def _field_text(value: Any) -> str:
    """A field's text as its widget holds it: a switch's true/false, a list's names by commas, UNSET for none."""
    if value is None:
        return UNSET
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def _knob_fields() -> list[Knob]:
    by_group: dict[str, list[str]] = {}
    for name in knob_fields():
        by_group.setdefault(group_of(name), []).append(name)
    knobs = []
    for number, (title, names) in enumerate(sorted(by_group.items(), key=lambda g: g[0] != "Batch and lengths")):
        with gr.Accordion(title, open=number == 0):
            with gr.Row():
                knobs += [Knob(name, knob_widget(name)) for name in names]
    return knobs


def page_query(knobs: list[Knob], gpu: str, model: str, release: str, margin: float | None,
               values: tuple) -> list[tuple[str, str]]:
    """The API's query for what the page's fields hold."""
    margin = None if margin == DEFAULT_SAFETY_MARGIN else margin  # the default needs no parameter
    query = [("gpu", gpu or ""), ("model", model or ""), ("trl_version", release), ("safety_margin", margin)]
    query += [(k.name, k.query_value(v)) for k, v in zip(knobs, values)]
    return [(name, str(value)) for name, value in query if value not in (None, "")]


def page_request(knobs: list[Knob], allow_local_files: bool, gpu: str, model: str, pasted: str, release: str,
                 margin: float | None, values: tuple) -> tuple[api.Request, str | None]:
    """The request the fields hold, through the HTTP API's reading, and that API's query (None for a pasted
    config.json, which a query cannot carry)."""
    pasted = (pasted or "").strip()
    query = page_query(knobs, gpu, "" if pasted else model, release, margin, values)
    request, _ = query_request(query, allow_local_files)
    if not pasted:
        return request, urllib.parse.urlencode(query)
    config = pasted_config(pasted)
    named = config.get("_name_or_path")
    config = {**config, "_name_or_path": named if isinstance(named, str) and named.strip() else PASTED}
    return request.with_fields(model=config), None


def exact_output(knobs: list[Knob], allow_local_files: bool, gpu: str, model: str, pasted: str, release: str,
                 margin: float | None, *values: Any, keep_copy: bool = False) -> str:
    """The exact verdict (`check` with exact) of the config the fields hold, or the one-line reason there is none;
    with `keep_copy`, the step's copy kept too (`check --exact --keep-copy`)."""
    try:
        request, _ = page_request(knobs, allow_local_files, gpu, model, pasted, release, margin, values)
        return views.exact_markdown(api.check(request, exact=True, keep_copy=keep_copy))
    except VramPlanError as exc:
        return f"✘ error: {views.page_words(error_line(exc))}"


def page_outputs(knobs: list[Knob], allow_local_files: bool, gpu: str, model: str, pasted: str, release: str,
                 margin: float | None, *values: Any) -> list[Any]:
    """Every output of the page for what its fields hold."""
    try:
        request, api_query = page_request(knobs, allow_local_files, gpu, model, pasted, release, margin, values)
        shown = evaluate(request)
    except VramPlanError as exc:  # the request's own words, where the verdict goes
        cleared = ["", "", gr.update(visible=False), "", "", "", "", "", "", ""]
        return [gr.update(), f"### ✘ error: {views.page_words(error_line(exc))}", *cleared,
                *(gr.update() for _ in knobs)]
    return [*shown.outputs(api_query), *(k.default_update(shown.train) for k in knobs)]


@dataclass(frozen=True)
class Shown:
    """One evaluation: the config as given (check) and the plan, with what the page shows of them."""

    checked: Report
    planned: Report
    train: TrainingConfig
    snippet: str
    gpu: GpuProfile
    longest: str

    def outputs(self, api_query: str | None) -> list[Any]:
        plan_title = "With the plan's changes" if self.planned.fits else "The smallest config vram-plan knows"
        return [views.title_markdown(self.checked, self.gpu), views.verdict_markdown(self.checked, self.planned),
                views.bars_title(self.checked, "Your config"), views.bars_html(self.checked, "bars"),
                gr.update(visible=bool(self.planned.changes or not self.planned.fits)),
                views.bars_title(self.planned, plan_title), views.bars_html(self.planned, "plan_bars"),
                views.changes_markdown(self.planned), self.longest, self.snippet,
                views.page_words(views.launch_markdown(self.planned)) + views.notes_markdown(self.planned),
                _links(api_query)]


def evaluate(request: api.Request) -> Shown:
    """Judge the config as given and plan it, and find the longest completion that fits."""
    checked = api.check(request)
    planned = api.plan(request)
    longest = views.longest_markdown(*(_longest(request, savers) for savers in (False, True)))
    context = planned.judged.context
    snippet = python_snippet(planned.judged.train, context.arch.hub_id or context.model_id)
    return Shown(checked, planned, checked.judged.train, snippet, context.gpu, longest)


def _longest(request: api.Request, allow_savers: bool) -> Any:
    """The longest completion that fits (api.maximize's answer), or the one-line reason there is none."""
    try:
        return api.maximize(request, field="max_completion_length", allow_savers=allow_savers).maximized
    except VramPlanError as exc:
        return views.page_words(error_line(exc))


def _links(api_query: str | None) -> str:
    if api_query is None:
        return "The HTTP API takes a catalog name or a hub id for `model` (see [/api/openapi.json](/api/openapi.json))."
    return (f"The same as JSON: [/api/check?{api_query}](/api/check?{api_query}) · "
            f"[/api/plan?{api_query}](/api/plan?{api_query}) · the API's description: "
            "[/api/openapi.json](/api/openapi.json)")
