"""One server for both: the HTTP API (GET /api/check and /api/plan, the documents of `check --json` and
`plan --json`) and the Gradio page mounted at / on the same FastAPI app."""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Callable
from typing import Any

import click

from vram_planner.app import require_app_extra
from vram_planner.app.query import COMMANDS, error_line, query_report
from vram_planner.errors import VramPlanError, first_line
from vram_planner.validation import to_json

log = logging.getLogger(__name__)


def build_app() -> Any:
    """The FastAPI app: the API's routes, and the page at /."""
    import gradio as gr
    from fastapi import FastAPI

    from vram_planner.app.page import build_page

    server = FastAPI(title="vram-plan", docs_url=None, redoc_url=None, openapi_url=None)
    for command in COMMANDS:
        # a plain Starlette route: it takes the query as it comes, repeated and unknown names included
        server.add_route(f"/api/{command}", _document_route(command), methods=["GET"])
    # No server-side rendering: it would need Node.js beside Python, and the page renders in the browser anyway.
    return gr.mount_gradio_app(server, build_page(), path="/", ssr_mode=False, footer_links=["gradio", "settings"])


def _document_route(command: str) -> Callable[..., Any]:
    from starlette.concurrency import run_in_threadpool

    async def document(request: Any) -> Any:  # request: starlette.requests.Request
        """The document `vram-plan <command> --json` prints; bad input: 400 and the CLI's one-line message."""
        return await run_in_threadpool(_document, command, request.query_params.multi_items())

    return document


def _document(command: str, query: list[tuple[str, str]]) -> Any:
    from starlette.responses import JSONResponse, Response

    try:
        report = query_report(command, query)
    except (VramPlanError, click.ClickException) as exc:
        return JSONResponse({"error": error_line(exc)}, status_code=400)
    except Exception as exc:  # a bug, not bad input: said as the CLI says it, the traceback in the log
        log.exception("/api/%s failed", command)
        return JSONResponse({"error": f"internal error: {first_line(exc)}"}, status_code=500)
    return Response(to_json(report, indent=2) + "\n", media_type="application/json")


def check_address(host: str, port: int) -> None:
    """The address can be listened on, or one line says why, before seconds go into building the page."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise VramPlanError(f"cannot serve on {host}:{port}: {exc.strerror or first_line(exc)}; pick another --port "
                            "(or --host)") from exc


def serve(host: str, port: int) -> None:
    """Serve the page and the API until interrupted."""
    require_app_extra()
    check_address(host, port)
    import uvicorn

    app = build_app()
    shown = f"[{host}]" if ":" in host else host
    print(f"vram-plan app: http://{shown}:{port}/ (the API: /api/check and /api/plan; Ctrl+C stops it)",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
