"""Model configs from the Hugging Face hub, through transformers (imported only here)."""

from __future__ import annotations

from typing import Any

from vram_planner.errors import HubUnavailableError


def fetch_hub_config(hub_id: str) -> dict[str, Any]:
    """The config.json of a hub repository as a dict; a clear error when offline or unknown."""
    try:
        from transformers import AutoConfig
    except ImportError as exc:
        raise HubUnavailableError(
            f"{hub_id!r} is not in the catalog, and reading it from the hub needs transformers "
            "(pip install 'vram-plan[train]'); or pass a local config.json") from exc
    try:
        config = AutoConfig.from_pretrained(hub_id)
    except OSError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HubUnavailableError(
            f"cannot read {hub_id!r} from the Hugging Face hub ({reason[:200]}); "
            "check the id and the network, or pass a local config.json or model folder") from exc
    except ValueError as exc:
        raise HubUnavailableError(f"transformers cannot read the config of {hub_id!r}: {exc}") from exc
    return config.to_dict()
