"""Starting the app's server as people start it, on a free port of 127.0.0.1, and asking it with bounded timeouts
(shared by the API and browser tests)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
START_SECONDS = 120  # importing Gradio and building the page: seconds, more on a busy 2-core machine
REQUEST_SECONDS = 30


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_server(command: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start `command` (which serves on the port in env or its flags), wait until the API answers, yield its URL,
    stop it. The server's output goes to `log`, shown when it does not start."""
    port = (env or {}).get("GRADIO_SERVER_PORT") or command[command.index("--port") + 1]
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        server = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + START_SECONDS
        while get(url + "/api/check")[0] != 400:  # up and answering: a query without gpu and model is bad input
            if server.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the server did not start (exit {server.poll()}):\n{log.read_text()}")
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=15)
    # what the command started stops with it (`vram-plan app` serves from a process of its own)
    deadline = time.monotonic() + 15
    while get(url + "/api/check")[0] is not None:
        assert time.monotonic() < deadline, f"{url} still answers after its command stopped"
        time.sleep(0.2)


def get(url: str) -> tuple[int | None, str]:
    """The status and the body; None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=REQUEST_SECONDS) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None, ""


def api_document(url: str, command: str, query: dict[str, object]) -> tuple[int, dict]:
    status, body = get(f"{url}/api/{command}?{urllib.parse.urlencode(query)}")
    assert status is not None, "the server stopped answering"
    return status, json.loads(body)
