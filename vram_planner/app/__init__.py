"""`vram-plan app`: a web page and an HTTP API beside it, on Gradio (the `app` extra), for what plan and check say.

query.py reads an HTTP query into the library's request (vram_planner.api), as the CLI reads its flags into one;
views.py turns reports into what the page shows; page.py is the Gradio page; server.py serves both, and openapi.py
describes the API. Only page.py and server.py import Gradio, and only `vram-plan app` imports them. Nothing here
imports the command line or click.
"""

from __future__ import annotations

import importlib.util
import os

from vram_planner.errors import VramPlanError

# Before any module of the package imports Gradio: a local tool does not report its use to anyone (and Gradio's
# analytics would wait on a network there may not be).
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

APP_EXTRA = "pip install 'vram-plan[app]'"
APP_PACKAGES = ("gradio", "fastapi", "uvicorn")


def require_app_extra() -> None:
    """Gradio and the server under it are installed, or one line says how to install them (found, not imported:
    importing Gradio takes seconds)."""
    for package in APP_PACKAGES:
        if importlib.util.find_spec(package) is None:
            raise VramPlanError(f"vram-plan app needs Gradio ({package} cannot be imported): {APP_EXTRA}")
