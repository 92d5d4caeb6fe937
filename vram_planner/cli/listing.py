"""`vram-plan gpus` and `vram-plan models`: the catalogs as tables."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from vram_planner.model.resolve import catalog_architecture
from vram_planner.profiles import gpus, models


def print_gpus(console: Console | None = None) -> None:
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
    return json.dumps([{**g.model_dump(), "capacity_bytes": g.capacity_bytes} for g in gpus()], indent=2)


def models_json() -> str:
    rows = []
    for entry in models():
        a = catalog_architecture(entry)
        rows.append({"name": entry.name, "hub_id": entry.hub_id, "aliases": entry.aliases, "params": a.params,
                     "model_type": a.model_type, "num_layers": a.num_layers, "hidden_size": a.hidden_size,
                     "num_attention_heads": a.num_attention_heads, "num_kv_heads": a.num_kv_heads,
                     "vocab_size": a.vocab_size, "tie_word_embeddings": a.tie_word_embeddings})
    return json.dumps(rows, indent=2)
