"""Model names to architectures: a catalog name or alias, a hub id, a config.json file or a model folder."""

from __future__ import annotations

from vram_planner.model.architecture import ModelArchitecture
from vram_planner.profiles import ModelEntry, model_config, read_json


def resolve_model(name: str) -> ModelArchitecture:
    """A catalog name or alias, a hub id, a config.json file or a model folder."""
    config, display_name, hub_id = model_config(name)
    return ModelArchitecture.from_config(config, name=display_name, hub_id=hub_id)


def catalog_architecture(entry: ModelEntry) -> ModelArchitecture:
    """The architecture of one catalog model, read from its config.json."""
    return ModelArchitecture.from_config(read_json(entry.config_path), name=entry.name, hub_id=entry.hub_id)
