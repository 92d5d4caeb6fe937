"""`--config FILE`: the same keys as the flags, from YAML or JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vram_planner.errors import ProfileError


def read_settings_file(path: Path) -> dict[str, Any]:
    """Keys may be spelled with dashes or underscores."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"cannot read --config {path}: {exc}") from exc
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except (json.JSONDecodeError, ValueError) as exc:
        raise ProfileError(f"--config {path} is not valid {path.suffix.lstrip('.').upper() or 'YAML'}: "
                           f"{str(exc).splitlines()[0]}") from exc
    except Exception as exc:  # yaml.YAMLError, without importing yaml at module import
        raise ProfileError(f"--config {path} is not valid YAML: {str(exc).splitlines()[0]}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ProfileError(f"--config {path} must hold a mapping of settings, not a {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}
