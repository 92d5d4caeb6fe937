"""Build what TRL builds (AutoModelForCausalLM) from a config dict, on the meta device (no memory, no download)."""

from __future__ import annotations

from typing import Any


def build_on_meta(config: dict[str, Any]):
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def parameter_count(model) -> int:
    """Unique parameters, tied weights once, as model.parameters() yields them."""
    return sum(p.numel() for p in model.parameters())


def linear_names(model) -> set[str]:
    import torch

    return {name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear) and ".layers." in name}
