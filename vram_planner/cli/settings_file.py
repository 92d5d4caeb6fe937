"""`--config FILE`: the same keys as the flags, from YAML or JSON, or a TRL recipe (vram_planner.recipe)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vram_planner.errors import ConfigError, ProfileError, first_line
from vram_planner.files import MAX_SETTINGS_BYTES, load_json, load_yaml, read_text
from vram_planner.recipe import Recipe, is_recipe, read_recipe
from vram_planner.request import request_fields, unknown_setting_problems


def read_settings_file(path: Path | None, flags: dict[str, Any] | None = None,
                       trl_arguments: dict[str, Any] | None = None) -> tuple[dict[str, Any], Recipe | None]:
    """The settings, and a TRL recipe's reading where the file is one or TRL's command-line arguments are given
    (`flags`: the request's fields the command line gives, which a recipe is read for: vram_planner.recipe.
    read_recipe; `trl_arguments`: TRL's own, vram_planner.trl_arguments, which win over the file's as in TRL's
    parser). Keys may be spelled with dashes or underscores. No file and no TRL arguments: no settings."""
    if path is None:
        if not trl_arguments:
            return {}, None
        recipe = read_recipe(trl_arguments, flags, command_line=True)
        return {name: _checked("TRL's arguments", name, value) for name, value in recipe.settings.items()}, recipe
    text = read_text(path, MAX_SETTINGS_BYTES, "--config", kind="a YAML or JSON file")
    try:
        data = load_json(text, f"--config {path}") if path.suffix.lower() == ".json" else load_yaml(
            text, f"--config {path}")
    except ProfileError:
        raise
    except (json.JSONDecodeError, ValueError) as exc:
        raise ProfileError(f"--config {path} is not valid {path.suffix.lstrip('.').upper() or 'YAML'}: "
                           f"{first_line(exc)}") from exc
    if data is None or data == {}:  # an empty or all-comment file is the wrong file, or one not written yet
        raise ProfileError(f"--config {path} holds no settings; write the flags' keys in it (e.g. "
                           "per_device_train_batch_size: 4) or leave --config out")
    if not isinstance(data, dict):
        raise ProfileError(f"--config {path} must hold a mapping of settings, not a {type(data).__name__}")
    named = [key for key in data if not isinstance(key, str)]
    if named:  # YAML reads `?`, `1:` or `null:` as keys that are no setting's name
        raise ProfileError(f"--config {path}: {named[0]!r} is not a setting's name; write the flags' keys, e.g. "
                           "per_device_train_batch_size: 4")
    if trl_arguments:
        data = {**data, **trl_arguments}  # read_recipe underscores the file's keys, the later spelling winning
    if trl_arguments or is_recipe(data):
        recipe = read_recipe(data, flags, command_line=bool(trl_arguments))
        return {name: _checked(f"--config {path}", name, value) for name, value in recipe.settings.items()}, recipe
    settings = {str(k).replace("-", "_"): (str(k), v) for k, v in data.items()}
    # Keys that name no setting are refused by name, whatever their values' shapes, and before what the command
    # misses: a recipe's model is its model_name_or_path, TRL's name for it
    unknown = [name for name in settings if name not in request_fields()]
    if unknown:
        raise ConfigError(unknown_setting_problems(unknown))
    return {name: _checked(f"--config {path}", key, value) for name, (key, value) in settings.items()}, None


# Every setting is one string, number or boolean, as its flag takes; these few are names, and the LoRA targets may
# also be a list of names.
NAME_SETTINGS = {"gpu": "a catalog name or a size such as 24GiB", "model": "a catalog name, config.json or hub id"}
LIST_SETTINGS = {"lora_target_modules"}


def _checked(where: str, key: str, value: Any) -> Any:
    """The value if its shape suits the setting; a one-line error naming the key otherwise."""
    name = key.replace("-", "_")
    if name in NAME_SETTINGS:
        if value is None or isinstance(value, str):
            return value
        raise ProfileError(f"{where}: {key} should be {NAME_SETTINGS[name]}, not {_shape(value)}")
    if name in LIST_SETTINGS and isinstance(value, list):
        if all(isinstance(item, str) for item in value):
            return value
        raise ProfileError(f"{where}: {key} should be a list of module names, not a list holding "
                           + next(_shape(item) for item in value if not isinstance(item, str)))
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    expected = "one value or a list of module names" if name in LIST_SETTINGS else "one value, as its flag takes"
    raise ProfileError(f"{where}: {key} should be {expected}, not {_shape(value)}")


def _shape(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple, set)):
        return "a list"
    if isinstance(value, (bool, int, float)):
        return f"the number {value!r}" if not isinstance(value, bool) else f"{value!r}"
    return f"a {type(value).__name__}"
