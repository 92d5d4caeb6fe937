"""`vram-plan gpus` and `vram-plan models`: the catalogs as tables; `gpus --model M`: a config on every card."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from vram_planner.model.resolve import catalog_architecture
from vram_planner.profiles import gpus, models
from vram_planner.validation import to_jsonable

if TYPE_CHECKING:  # rich is imported where a table is printed: `--json` goes without it
    from rich.console import Console


def print_gpus(console: Console | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

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
    (console or Console()).print(table)


def print_models(console: Console | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Model catalog", title_justify="left", show_edge=False)
    table.add_column("name (hub ids work too)", no_wrap=True)
    for column in ("params", "layers", "heads/kv", "vocab", "tied"):
        table.add_column(column, justify="right")
    for entry in models():
        a = catalog_architecture(entry)
        table.add_row(entry.name, f"{a.params / 1e9:.2f}B", str(a.num_layers),
                      f"{a.num_attention_heads}/{a.num_kv_heads}", str(a.vocab_size),
                      "yes" if a.tie_word_embeddings else "no")
    (console or Console()).print(table)


def gpus_json() -> str:
    return json.dumps([{**to_jsonable(g), "capacity_bytes": g.capacity_bytes} for g in gpus()], indent=2)


def models_json() -> str:
    rows = []
    for entry in models():
        a = catalog_architecture(entry)
        rows.append({"name": entry.name, "hub_id": entry.hub_id, "aliases": entry.aliases, "params": a.params,
                     "model_type": a.model_type, "num_layers": a.num_layers, "hidden_size": a.hidden_size,
                     "num_attention_heads": a.num_attention_heads, "num_kv_heads": a.num_kv_heads,
                     "vocab_size": a.vocab_size, "tie_word_embeddings": a.tie_word_embeddings})
    return json.dumps(rows, indent=2)


def gpus_for_model(options: dict[str, Any]) -> int:
    """`gpus --model M [knobs] [--maximize FIELD]`: every card's verdict (or largest value) as a table or JSON; the
    exit code is 0 when some card fits, 1 when none does."""
    from vram_planner import api
    from vram_planner.cli.options import EXIT_DOES_NOT_FIT, EXIT_FITS, settings_from
    from vram_planner.errors import VramPlanError

    if options["allow_savers"] and options["maximize"] is None:
        raise VramPlanError("--allow-savers goes with --maximize FIELD")
    if not options["model"] and not options["config_file"]:
        raise VramPlanError("knobs and --maximize on `gpus` need --model (e.g. vram-plan gpus --model Llama-3.2-1B "
                            "--lora-r 16)")
    model, _, trl_version, knobs = settings_from("gpus", {**options, "gpu": None}, gpu_required=False)
    cards = api.fitting_gpus(model, knobs, options["maximize"], options["allow_savers"], trl_version=trl_version,
                             calibration=options["calibration"], safety_margin=options["safety_margin"])
    if options["json_output"]:
        label = _strategy(cards)
        print(json.dumps([_card_row(card, _card_strategy(card) if card.fewest else label) for card in cards],
                         indent=2))
    else:
        print_fitting(cards)
    return EXIT_FITS if any(card.fits for card in cards) else EXIT_DOES_NOT_FIT


def _strategy(cards: list[Any]) -> str | None:
    """'2 x ZeRO-3' where the bytes are per GPU of several (None on one plain GPU)."""
    from vram_planner.model.accelerate_config import strategy_label

    judged = next((card.verdict for card in cards if card.verdict is not None), None)
    return None if judged is None else strategy_label(judged.train)


def _card_strategy(card: Any) -> str | None:
    """The count and strategy `--num-gpus auto` chose for this card ('1 GPU' where one plain GPU fits)."""
    from vram_planner.model.accelerate_config import strategy_label

    return None if card.verdict is None else strategy_label(card.verdict.train) or "1 GPU"


def _card_row(card: Any, per_gpu: str | None) -> dict[str, Any]:  # card: vram_planner.api.CardFit
    row = {"name": card.name, "capacity_bytes": card.capacity_bytes, "fits": card.fits,
           "peak_bytes": _whole(card.peak_bytes), "spare_bytes": _whole(card.spare_bytes), "problem": card.problem,
           "per_gpu": per_gpu}
    if card.fewest is not None and card.verdict is not None:  # --num-gpus auto: the count and strategy chosen
        train = card.verdict.train
        row.update(num_gpus=train.num_gpus, strategy=train.distributed, offload_optimizer=train.offload_optimizer,
                   offload_param=train.offload_param)
    m = card.maximized
    if m is not None:
        row["maximized"] = {"field": m.field, "value": m.value, "peak_bytes": _whole(m.peak_bytes),
                            "next_value": m.next_value, "next_peak_bytes": _whole(m.next_peak_bytes),
                            "limited_by": m.limited_by}
    return row


def _whole(n_bytes: float | None) -> int | None:
    return None if n_bytes is None else round(n_bytes)


def print_fitting(cards: list[Any], console: Console | None = None) -> None:
    """The cards as `gpus_for_model` orders them, the smallest that fits first; those that cannot run the config
    at all below the table, grouped by reason."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from vram_planner.model.offload import MAX_GPUS_PER_NODE

    judged = next(card.verdict for card in cards if card.verdict is not None)
    context, field = judged.context, next((c.maximized.field for c in cards if c.maximized), None)
    what = f"the largest {field} on each card" if field else "every card"
    auto = any(card.fewest is not None for card in cards)
    label = _strategy(cards)
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
        counted = [_card_strategy(card) if card.fits else f"> {MAX_GPUS_PER_NODE}"] if auto else []
        table.add_row(card.name, f"{card.gpu.total_memory_gib:.2f}", *counted, *cells)
    console = console or Console()
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
