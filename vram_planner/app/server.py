"""One server for both: the HTTP API (GET /api/check and /api/plan, the documents of `check --json` and
`plan --json`; /api/gpus and /api/models, the catalogs, and with model= every card's verdict; /api/openapi.json, its
description) and the Gradio page mounted at / on the same FastAPI app."""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Callable
from typing import Any

from vram_planner import api
from vram_planner.app import require_app_extra
from vram_planner.app.openapi import openapi_document
from vram_planner.app.query import COMMANDS, SPEED_PARAMETERS, error_line, query_report, query_request
from vram_planner.errors import ConfigError, VramPlanError, first_line
from vram_planner.validation import to_json

log = logging.getLogger(__name__)
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def local_files_default(host: str) -> bool:
    """Model paths are read by default only when the server listens on this machine alone."""
    return host in LOCAL_HOSTS


def build_app(allow_local_files: bool = True) -> Any:
    """The FastAPI app: the API's routes, and the page at /."""
    import gradio as gr
    from fastapi import FastAPI

    from vram_planner.app.page import CSS, build_page, theme

    server = FastAPI(title="vram-plan", docs_url=None, redoc_url=None, openapi_url=None)
    for command in COMMANDS:
        # a plain Starlette route: it takes the query as it comes, repeated and unknown names included
        server.add_route(f"/api/{command}", _route(lambda query, c=command: query_report(c, query, allow_local_files)),
                         methods=["GET"])
    server.add_route("/api/gpus", _route(lambda query: _gpus(query, allow_local_files)), methods=["GET"])
    server.add_route("/api/models", _route(lambda query: _models(query)), methods=["GET"])
    server.add_route("/api/openapi.json", _route(lambda query: openapi_document()), methods=["GET"])
    # No server-side rendering: it would need Node.js beside Python, and the page renders in the browser anyway.
    return gr.mount_gradio_app(server, build_page(allow_local_files), path="/", ssr_mode=False,
                               footer_links=["gradio", "settings"], theme=theme(), css=CSS)


def _gpus(query: list[tuple[str, str]], allow_local_files: bool) -> Any:
    """The GPU catalog; with model= (and knobs, maximize), every card's verdict for that config."""
    if not query:
        return api.gpus()
    request, questions = query_request(query, allow_local_files)
    if questions.get("exact") or questions.get("keep_copy"):
        raise ConfigError(["exact and keep_copy judge one card: ask /api/check with exact=true"])
    timed = [name for name in SPEED_PARAMETERS if name in questions]
    if timed:
        raise ConfigError([f"{timed[0]} goes with /api/plan and /api/check: /api/gpus judges memory on every card"])
    if request.gpu is not None:
        raise ConfigError(["/api/gpus judges every card: leave gpu out (or ask /api/check with it)"])
    return api.fitting_gpus(request, maximize=questions.get("maximize"),
                            allow_savers=questions.get("allow_savers", False))


def _models(query: list[tuple[str, str]]) -> Any:
    if query:
        raise ConfigError([f"/api/models takes no query parameters (got {query[0][0]!r})"])
    return api.models()


def _route(answer: Callable[[list[tuple[str, str]]], Any]) -> Callable[..., Any]:
    from starlette.concurrency import run_in_threadpool

    async def route(request: Any) -> Any:  # request: starlette.requests.Request
        """The answer as JSON; bad input: 400 and one line naming the query's fields."""
        return await run_in_threadpool(_document, request.url.path, answer, request.query_params.multi_items())

    return route


def _document(path: str, answer: Callable[[list[tuple[str, str]]], Any], query: list[tuple[str, str]]) -> Any:
    import json

    from starlette.responses import JSONResponse, Response

    try:
        document = answer(query)
    except VramPlanError as exc:
        return JSONResponse({"error": error_line(exc)}, status_code=400)
    except Exception as exc:  # a bug, not bad input: said as the CLI says it, the traceback in the log
        log.exception("%s failed", path)
        return JSONResponse({"error": f"internal error: {first_line(exc)}"}, status_code=500)
    if hasattr(document, "to_json"):
        text = document.to_json(indent=2)
    else:
        text = to_json(document, indent=2) if not isinstance(document, (list, dict)) else json.dumps(document, indent=2)
    return Response(text + "\n", media_type="application/json")


def check_address(host: str, port: int) -> None:
    """The address can be listened on, or one line says why, before seconds go into building the page."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise VramPlanError(f"cannot serve on {host}:{port}: {exc.strerror or first_line(exc)}; pick another --port "
                            "(or --host)") from exc


def serve(host: str, port: int, allow_local_files: bool | None = None) -> None:
    """Serve the page and the API until interrupted; model paths are read when `allow_local_files` (by default
    only on a local address)."""
    require_app_extra()
    check_address(host, port)
    import uvicorn

    local_files = local_files_default(host) if allow_local_files is None else allow_local_files
    app = build_app(local_files)
    shown = f"[{host}]" if ":" in host else host
    files = "reads model paths" if local_files else "reads no model paths (--allow-local-files to read them)"
    print(f"vram-plan app: http://{shown}:{port}/ (the API: /api/check, /api/plan, /api/gpus, /api/models, "
          f"described at /api/openapi.json; it {files}; Ctrl+C stops it)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
