"""The Gradio page: pick a card and a model (or paste a config.json), set the knobs, and see at once the verdict,
the bars per phase, the plan's changes, the GRPOConfig to copy and the longest completion that fits.

Every evaluation goes through the HTTP API's path (query.py): the page's fields become query parameters, read by the
CLI's own options, so the page, the API and the CLI judge the same config the same way.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import click
import gradio as gr
import pandas as pd

from vram_planner import api
from vram_planner.app import views
from vram_planner.app.query import error_line, knob_parameters, options_from_query, query_report
from vram_planner.cli.options import resolve, settings_from
from vram_planner.cli.plan import judge_report
from vram_planner.cli.report import Report
from vram_planner.errors import ProfileError, VramPlanError, first_line
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.grpo_config import python_snippet
from vram_planner.model.spec import TrainingConfig, knob_types
from vram_planner.model.trl_releases import NEWEST_KNOWN, trl_release, trl_releases, version_tuple
from vram_planner.model.verdict import DEFAULT_SAFETY_MARGIN
from vram_planner.profiles import GpuProfile, gpus, models

DEFAULT_GPU, DEFAULT_MODEL = "rtx3080-mobile", "Llama-3.2-1B"  # the command-line contract's first example
PASTED = "pasted config.json"
# The knobs' fields, grouped as people look for them; the knobs not named here open the list.
KNOB_GROUPS = (("Precision and memory", ("optim", "gradient_checkpointing", "dtype", "mixed_precision",
                                          "attn_implementation", "use_liger_kernel", "transformers_version")),
               ("LoRA and 4-bit weights", ("lora_", "load_in_4bit", "bnb_")),
               ("vLLM", ("use_vllm", "vllm_")),
               ("Several GPUs", ("num_gpus", "zero_stage", "fsdp", "offload_", "host_memory")))
UNSET = ""  # a dropdown's value for "not given": the release's default


@dataclass(frozen=True)
class Knob:
    """One knob's field on the page."""

    param: click.Option
    widget: Any  # the Gradio component

    @property
    def name(self) -> str:
        return self.param.name

    def query_value(self, value: Any) -> str | None:
        """The query parameter's value for what the field holds; None when it is left to the default."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        return str(value).strip()

    def default_update(self, train: TrainingConfig) -> Any:
        """Show what the knob is when left unset, for the config just judged."""
        shown = default_text(train, self.name)
        if isinstance(self.widget, gr.Dropdown):
            return gr.update(choices=[(f"default ({shown})", UNSET), *choices_of(self.param)])
        return gr.update(placeholder=f"default: {shown}")


def default_text(train: TrainingConfig, name: str) -> str:
    """A knob's value in the judged config, in words (what leaving it unset gives)."""
    value = getattr(train, name)
    if name == "steps_per_generation" and value is None:
        return f"{train.steps_per_generation_resolved} (gradient_accumulation_steps)"
    if name == "lora_target_modules" and value is None:
        return "all-linear"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, Enum):
        return str(value.value)
    return "unset" if value is None else str(value)


def choices_of(param: click.Option) -> list[tuple[str, str]]:
    """The values a knob takes when they are few: on/off, or the names TrainingConfig accepts."""
    if param.secondary_opts:
        return [("on", "true"), ("off", "false")]
    names = field_choices(param.name)
    return [(name, name) for name in names or ()]


def field_choices(name: str) -> list[str] | None:
    """The names a TrainingConfig field accepts, from its Literal or Enum type; None for free values."""
    annotation = knob_types()[name]
    for member in (annotation, *get_args(annotation)):
        if get_origin(member) is Literal:
            return [str(v) for v in get_args(member)]
        if isinstance(member, type) and issubclass(member, Enum):
            return [str(m.value) for m in member]
    return None


def knob_widget(param: click.Option) -> Any:
    label = param.name
    if param.secondary_opts or field_choices(param.name):
        return gr.Dropdown([("default", UNSET), *choices_of(param)], value=UNSET, label=label, elem_id=label)
    # Numbers too: a number field cannot be left empty (Gradio sends 0), and empty means TRL's default; the CLI's
    # options then parse the text, with the CLI's messages for a bad value.
    return gr.Textbox(label=label, elem_id=label, info=param.help, max_lines=1)


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


def build_page() -> gr.Blocks:
    """The page; its events evaluate the config on every change."""
    cards, catalog, releases = _catalog_choices()
    with gr.Blocks(title="vram-plan: will this GRPO run fit?") as page:
        gr.Markdown("## vram-plan: will this GRPO run fit?\nThe GPU memory of GRPO fine-tuning with TRL, phase by "
                    "phase, before you start it. Knobs are spelled like `GRPOConfig` fields; empty ones take TRL's "
                    "defaults.")
        with gr.Row():
            with gr.Column(scale=2, min_width=320):
                gpu = gr.Dropdown(cards, value=GpuProfile.from_name(DEFAULT_GPU).name, label="GPU",
                                  allow_custom_value=True, elem_id="gpu", info="A catalog card, or a size like 24GiB")
                model = gr.Dropdown(catalog, value=DEFAULT_MODEL, label="Model", allow_custom_value=True,
                                    elem_id="model", info="A catalog model, a hub id or a local config.json")
                with gr.Accordion("…or paste a config.json", open=False):
                    pasted = gr.Textbox(label="config.json (used instead of the model above)", lines=6,
                                        elem_id="pasted_config")
                with gr.Row():
                    release = gr.Dropdown(releases, value=UNSET, label="trl_version", allow_custom_value=True,
                                          elem_id="trl_version")
                    margin = gr.Number(value=DEFAULT_SAFETY_MARGIN, label="safety_margin", minimum=0, maximum=0.5,
                                       step=0.01, elem_id="safety_margin", info="Share of the card kept free")
                knobs = _knob_fields()
            with gr.Column(scale=3, min_width=480):
                title = gr.Markdown(elem_id="title")
                verdict = gr.Markdown(elem_id="verdict")
                bars_title = gr.Markdown(elem_id="bars_title")
                bars = _bar_plot("bars")
                with gr.Column(visible=False, elem_id="plan_column") as plan_column:
                    plan_title = gr.Markdown(elem_id="plan_bars_title")
                    plan_bars = _bar_plot("plan_bars")
                gr.HTML(views.legend_html(), elem_id="legend")
                changes = gr.Markdown(elem_id="changes")
                longest = gr.Markdown(elem_id="longest")
                exact_button = gr.Button("Check exactly: trace the step (the train extra; seconds to a minute)",
                                         elem_id="exact_button", variant="secondary")
                exact = gr.Markdown(elem_id="exact")
                code = gr.Code(language="python", label="GRPOConfig to copy", elem_id="code")
                notes = gr.Markdown(elem_id="notes")
                links = gr.Markdown(elem_id="api_links")
        inputs = [gpu, model, pasted, release, margin, *(k.widget for k in knobs)]
        outputs = [title, verdict, bars_title, bars, plan_column, plan_title, plan_bars, changes, longest, code, notes,
                   links, *(k.widget for k in knobs)]

        def evaluate(*values: Any) -> list[Any]:
            return page_outputs(knobs, *values)

        gr.on([page.load, *(c.change for c in inputs)], evaluate, inputs, outputs, trigger_mode="always_last",
              show_progress="hidden", api_visibility="private")
        # a changed field makes the exact answer stale: it goes until asked for again
        gr.on([c.change for c in inputs], lambda: "", None, [exact], show_progress="hidden", api_visibility="private")

        def evaluate_exactly(*values: Any) -> str:
            return exact_output(knobs, *values)

        exact_button.click(evaluate_exactly, inputs, [exact], api_visibility="private")
    return page


def _bar_plot(elem_id: str) -> Any:
    # Only the data changes after this: Gradio 6.31 keeps drawing a bar plot's old data when an update also changes
    # its other properties (its title, its y range), so those stay fixed and the free part shows the card's size;
    # the legend is views.legend_html, which wraps where the plot's own would be cut off.
    return gr.BarPlot(x="phase", y="GiB", color="part", color_map=views.BAR_COLOURS, colors_in_legend=[],
                      y_title="GiB", x_title="", sort=list(views.PHASE_TITLES.values()), elem_id=elem_id, height=300)


def _knob_fields() -> list[Knob]:
    by_group: dict[str, list[click.Option]] = {}
    for param in knob_parameters():
        by_group.setdefault(group_of(param.name), []).append(param)
    knobs = []
    for number, (title, params) in enumerate(sorted(by_group.items(), key=lambda g: g[0] != "Batch and lengths")):
        with gr.Accordion(title, open=number == 0):
            with gr.Row():
                knobs += [Knob(p, knob_widget(p)) for p in params]
    return knobs


def page_query(knobs: list[Knob], gpu: str, release: str, margin: float | None, values: tuple) -> list[tuple[str, str]]:
    """The API's query for what the page's fields hold, the model aside."""
    margin = None if margin == DEFAULT_SAFETY_MARGIN else margin  # the default needs no parameter
    query = [("gpu", gpu or ""), ("trl_version", release), ("safety_margin", margin)]
    query += [(k.name, k.query_value(v)) for k, v in zip(knobs, values)]
    return [(name, str(value)) for name, value in query if value not in (None, "")]


def exact_output(knobs: list[Knob], gpu: str, model: str, pasted: str, release: str, margin: float | None,
                 *values: Any) -> str:
    """The exact verdict (`check --exact`) of the config the fields hold, or the one-line reason there is none."""
    query = page_query(knobs, gpu, release, margin, values)
    try:
        with model_parameter(model, pasted) as model_query:
            return views.exact_markdown(query_report("check", [model_query, *query, ("exact", "true")]))
    except (VramPlanError, click.ClickException) as exc:
        return f"✘ error: {error_line(exc)}"


@contextlib.contextmanager
def model_parameter(model: str, pasted: str) -> Iterator[tuple[str, str]]:
    """The query's model: the field's, or a pasted config.json written to a folder for as long as it is read."""
    pasted = (pasted or "").strip()
    with tempfile.TemporaryDirectory(prefix="vram-plan-app-") as folder:
        yield "model", pasted_model(pasted, Path(folder)) if pasted else model or ""


def page_outputs(knobs: list[Knob], gpu: str, model: str, pasted: str, release: str, margin: float | None,
                 *values: Any) -> list[Any]:
    """Every output of the page for what its fields hold."""
    query = page_query(knobs, gpu, release, margin, values)
    pasted = (pasted or "").strip()
    try:
        with model_parameter(model, pasted) as model_query:
            shown = evaluate_query([model_query, *query], pasted_name(pasted) if pasted else None)
    except (VramPlanError, click.ClickException) as exc:  # what the CLI would say, where the verdict goes
        cleared = ["", None, gr.update(visible=False), "", None, "", "", "", "", ""]
        return [gr.update(), f"### ✘ error: {error_line(exc)}", *cleared, *(gr.update() for _ in knobs)]
    api_query = None if pasted else urllib.parse.urlencode([model_query, *query])
    return [*shown.outputs(api_query), *(k.default_update(shown.train) for k in knobs)]


def pasted_model(text: str, folder: Path) -> str:
    """A pasted config.json, checked, as a model folder the CLI's path reads."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"the {PASTED} is not valid JSON: {first_line(exc)}") from exc
    ModelArchitecture.from_config(config, name=PASTED)  # refused here, in the words of the pasted config
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def pasted_name(text: str) -> str:
    """The name a pasted config goes by: its hub id when it says one."""
    name = json.loads(text).get("_name_or_path")
    return name if isinstance(name, str) and name.strip() else PASTED


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
                views.bars_title(self.checked, "Your config"), _frame(self.checked),
                gr.update(visible=bool(self.planned.changes or not self.planned.fits)),
                views.bars_title(self.planned, plan_title), _frame(self.planned), views.changes_markdown(self.planned),
                self.longest, self.snippet, views.launch_markdown(self.planned) + views.notes_markdown(self.planned),
                _links(api_query)]


def evaluate_query(query: list[tuple[str, str]], name: str | None) -> Shown:
    """Judge the config as given and plan it, through the API's path; `name` renames a pasted config."""
    options = options_from_query("plan", query)
    context, train = resolve("plan", options)
    if name is not None:
        context = replace(context, model_id=name, arch=replace(context.arch, name=name, hub_id=name))
    checked, _ = judge_report("check", context, train)
    planned, shown_train = judge_report("plan", context, train)
    model, gpu, trl_version, knobs = settings_from("plan", options)
    options = {"trl_version": trl_version, "safety_margin": context.safety_margin}
    longest = views.longest_markdown(*(_longest(model, gpu, knobs, savers, options) for savers in (False, True)))
    snippet = python_snippet(shown_train, context.arch.hub_id or context.model_id)
    return Shown(checked, planned, train, snippet, context.gpu, longest)


def _longest(model: str, gpu: str, knobs: dict[str, Any], allow_savers: bool, options: dict[str, Any]) -> Any:
    """The longest completion that fits (api.maximize), or the one-line reason there is none."""
    try:
        return api.maximize(model, gpu, "max_completion_length", knobs, allow_savers=allow_savers, **options)
    except VramPlanError as exc:
        return error_line(exc)


def _frame(report: Report) -> pd.DataFrame:
    return pd.DataFrame(views.phase_rows(report))


def _links(api_query: str | None) -> str:
    if api_query is None:
        return "The HTTP API takes a catalog name, a hub id or a config.json path for `model`."
    return (f"The same as JSON: [/api/check?{api_query}](/api/check?{api_query}) · "
            f"[/api/plan?{api_query}](/api/plan?{api_query})")
