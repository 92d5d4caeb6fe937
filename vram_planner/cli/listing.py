"""`vram-plan gpus` and `vram-plan models`: the catalogs as tables; `gpus --model M`: a config on every card."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from vram_planner.model.resolve import catalog_architecture
from vram_planner.profiles import gpus, models

if TYPE_CHECKING:  # rich is imported where a table is printed: `--json` goes without it
    from rich.console import Console


def print_gpus(console: Console | None = None) -> None:
    from rich.table import Table

    from vram_planner.cli.console import terminal

    table = Table(title="GPU catalog (GiB as CUDA reports them; --gpu takes a name, an alias or a size)",
                  title_justify="left", show_edge=False)
    table.add_column("name", no_wrap=True)
    table.add_column("GiB", justify="right")
    for column in ("cc", "bf16", "FA2", "segment", "also"):
        table.add_column(column)
    for g in gpus():
        also = min(g.aliases, key=len, default="")
        table.add_row(g.name, f"{g.total_memory_gib:.2f}", g.compute_capability, "yes" if g.bf16 else "no",
                      "yes" if g.flash_attention_2 else "no", g.segment, also)
    (console or terminal()).print(table)


def print_models(console: Console | None = None) -> None:
    from rich.table import Table

    from vram_planner.cli.console import terminal

    table = Table(title="Model catalog", title_justify="left", show_edge=False)
    table.add_column("name (hub ids work too)", no_wrap=True)
    for column in ("params", "layers", "heads/kv", "vocab", "tied"):
        table.add_column(column, justify="right")
    for entry in models():
        a = catalog_architecture(entry)
        table.add_row(entry.name, f"{a.params / 1e9:.2f}B", str(a.num_layers),
                      f"{a.num_attention_heads}/{a.num_kv_heads}", str(a.vocab_size),
                      "yes" if a.tie_word_embeddings else "no")
    (console or terminal()).print(table)


def gpus_json() -> str:
    from vram_planner import api

    return json.dumps(api.gpus(), indent=2)


def models_json() -> str:
    from vram_planner import api

    return json.dumps(api.models(), indent=2)


def gpus_for_model(options: dict[str, Any]) -> int:
    """`gpus --model M [knobs] [--maximize FIELD]`: every card's verdict (or largest value) as a table or JSON; the
    exit code is 0 when some card fits, 1 when none does."""
    from vram_planner import api
    from vram_planner.cli.options import EXIT_DOES_NOT_FIT, EXIT_FITS, request_from
    from vram_planner.errors import VramPlanError

    if options["allow_savers"] and options["maximize"] is None:
        raise VramPlanError("--allow-savers goes with --maximize FIELD")
    if not options["model"] and not options["config_file"] and not options.get("trl_arguments"):
        raise VramPlanError("knobs and --maximize on `gpus` need --model (e.g. vram-plan gpus --model Llama-3.2-1B "
                            "--lora-r 16)")
    request = request_from("gpus", {**options, "gpu": None}, gpu_required=False)
    report = api.fitting_gpus(request, maximize=options["maximize"], allow_savers=options["allow_savers"])
    cards = report.cards
    if options["json_output"]:
        print(report.to_json(indent=2))
    else:
        print_fitting(cards)
    return EXIT_FITS if any(card.fits for card in cards) else EXIT_DOES_NOT_FIT


def print_fitting(cards: list[Any], console: Console | None = None) -> None:
    """The cards as `gpus_for_model` orders them, the smallest that fits first; those that cannot run the config
    at all below the table, grouped by reason."""
    from rich.table import Table

    from vram_planner.cli.console import terminal
    from rich.text import Text

    from vram_planner.model.offload import MAX_GPUS_PER_NODE
    from vram_planner.report.cards import card_strategy, strategy

    judged = next(card.verdict for card in cards if card.verdict is not None)
    context, field = judged.context, next((c.maximized.field for c in cards if c.maximized), None)
    what = f"the largest {field} on each card" if field else "every card"
    auto = any(card.fewest is not None for card in cards)
    label = strategy(cards)
    per_gpu = ", per GPU, the fewest of each card that fit (--num-gpus auto)" if auto else (
        "" if label is None else f", per GPU, {label}")
    title = Text(f"{context.model_id or context.arch.name}, TRL {context.release.version}{per_gpu}: {what}, smallest "
                 "that fits first (GiB)", style="italic")
    table = Table(show_edge=False)
    table.add_column("card", no_wrap=True)
    table.add_column("GiB", justify="right")
    if auto:
        table.add_column("GPUs")
    for column in ([f"largest {field}", "peak", "next", "next needs"] if field else ["verdict", "peak", "spare"]):
        table.add_column(column, justify="left" if column == "verdict" else "right")
    refused: dict[str, list[str]] = {}
    for card in cards:
        if card.problem:
            refused.setdefault(card.problem.replace(card.gpu.label, "the card"), []).append(card.name)
            continue
        cells = _maximized_cells(card) if field else _verdict_cells(card)
        counted = [card_strategy(card) if card.fits else f"> {MAX_GPUS_PER_NODE}"] if auto else []
        table.add_row(card.name, f"{card.gpu.total_memory_gib:.2f}", *counted, *cells)
    console = console or terminal()
    console.print(title, table)
    for reason, names in refused.items():
        console.print(Text(f"✘ cannot run on {', '.join(names)}: {reason}", style="dim"))
    if not auto and label is None and any(card.verdict is not None and not card.fits for card in cards):
        console.print(Text("Where one GPU does not hold it, --num-gpus auto finds the fewest of each card and the "
                           "strategy (DDP, ZeRO, FSDP2, with or without offload) that fit.", style="dim"))


def _gib(n_bytes: float | None, digits: int = 2) -> str:
    from vram_planner.units import GiB

    return "-" if n_bytes is None else f"{n_bytes / GiB:.{digits}f}"


def _verdict_cells(card: Any) -> list[Any]:
    from rich.text import Text

    if card.fits:
        verdict = Text("✔ fits", style="green")
    elif card.spare_bytes < 0:
        verdict = Text("✘ does not fit", style="red")
    else:
        verdict = Text("✘ inside the safety margin", style="yellow")
    return [verdict, _gib(card.peak_bytes), _gib(card.spare_bytes)]


def _maximized_cells(card: Any) -> list[Any]:
    """The value, its peak, the next valid value and what it needs (three decimals: one token more is little)."""
    from rich.text import Text

    m = card.maximized
    largest = Text(str(m.value), style="green") if m.fits else Text("✘ none", style="red")
    following = "-" if m.next_value is None else str(m.next_value)
    return [largest, _gib(m.peak_bytes, 3), following, _gib(m.next_peak_bytes, 3)]
