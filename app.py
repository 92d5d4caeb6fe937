"""Run `vram-plan app` as a Hugging Face Space: a Space with `sdk: gradio` and `app_file: app.py` whose files are this
repository's. Spaces run `python app.py` and say where to listen in GRADIO_SERVER_NAME and GRADIO_SERVER_PORT.

Without `pip install .` (a Space installs only Gradio), the checkout itself is imported, with profiles/ as the
package data that an install puts at vram_planner/profile_data.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def use_the_checkout() -> None:
    """Import vram_planner from this folder when it is not installed."""
    if importlib.util.find_spec("vram_planner") is None:
        sys.path.insert(0, str(ROOT))
    if importlib.util.find_spec("vram_planner.profile_data") is None:
        data = types.ModuleType("vram_planner.profile_data")
        data.__path__ = [str(ROOT / "profiles")]
        sys.modules[data.__name__] = data


def main() -> int:
    use_the_checkout()
    from vram_planner.cli import main as cli

    host = os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0")
    return cli(["app", "--host", host, "--port", os.environ.get("GRADIO_SERVER_PORT", "7860")])


if __name__ == "__main__":
    sys.exit(main())
