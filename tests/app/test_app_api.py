"""The HTTP API of a running server (started as a Space starts it: `python app.py`) against the CLI's `--json`
documents, and bad input as a 400 with the CLI's one-line message."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import run
from serving import ROOT, api_document, free_port, get, running_server

pytestmark = pytest.mark.slow  # the server imports Gradio: seconds

# Each config as query parameters (GRPOConfig spelling); the CLI gets the same as flags.
CONFIGS = [
    ("check", {"gpu": "rtx3080-mobile", "model": "Llama-3.2-1B", "max_completion_length": 1024}),
    ("plan", {"gpu": "rtx3080-mobile", "model": "Llama-3.2-1B", "max_completion_length": 1024}),
    ("plan", {"gpu": "t4", "model": "Qwen3-0.6B", "lora_r": 16, "load_in_4bit": True,
              "lora_target_modules": "q_proj,v_proj"}),
    ("check", {"gpu": "24GiB", "model": "Qwen2.5-0.5B-Instruct", "use_vllm": True,
               "vllm_gpu_memory_utilization": 0.3, "gradient_checkpointing": False}),
    ("plan", {"gpu": "rtx4060", "model": "Llama-3.1-8B"}),  # nothing fits: the smallest card that does
    ("check", {"gpu": "a100-80gb", "model": "Qwen2.5-1.5B-Instruct", "trl_version": "0.14", "beta": 0.04,
               "num_generations": 4, "per_device_train_batch_size": 2, "safety_margin": 0.1}),
]
LLAMA = {"gpu": "rtx3080-mobile", "model": "Llama-3.2-1B"}
BAD = {
    "unknown-gpu": {"gpu": "rtx3080-mobil", "model": "Llama-3.2-1B"},
    "unknown-model": {"gpu": "rtx3080-mobile", "model": "Lama-3.2-1B"},
    "not-a-number": LLAMA | {"max_completion_length": "abc"},
    "unknown-optimizer": LLAMA | {"optim": "adamw_9bit"},
    "negative-beta": LLAMA | {"beta": -0.5},
    "generations-trl-refuses": LLAMA | {"num_generations": 3},
    "margin-out-of-range": LLAMA | {"safety_margin": 0.9},
    "unknown-trl-release": LLAMA | {"trl_version": "0.9"},
    "no-gpu": {"model": "Llama-3.2-1B"},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("app-api") / "server.log"
    env = {"GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port)}
    with running_server([sys.executable, str(ROOT / "app.py")], log, env) as url:
        yield url


def flags(query: dict[str, object]) -> list[str]:
    """The CLI's flags for query parameters."""
    args = []
    for name, value in query.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else flag.replace("--", "--no-", 1))
        else:
            args += [flag, str(value)]
    return args


def as_query(query: dict[str, object]) -> dict[str, object]:
    return {k: str(v).lower() if isinstance(v, bool) else v for k, v in query.items()}


@pytest.mark.parametrize(("command", "query"), CONFIGS, ids=[f"{c}-{q['model']}-{q['gpu']}" for c, q in CONFIGS])
def test_the_api_returns_exactly_the_clis_json_document(server, capsys, command, query):
    code, out, err = run(capsys, command, *flags(query), "--json")
    assert code in (0, 1), err
    status, document = api_document(server, command, as_query(query))
    assert status == 200
    assert document == json.loads(out)


@pytest.mark.parametrize("query", BAD.values(), ids=BAD)
def test_bad_input_is_a_400_with_the_clis_one_line_message(server, capsys, query):
    code, out, err = run(capsys, "check", *flags(query))
    assert code == 2 and out == "" and err.count("\n") == 1
    status, answer = api_document(server, "check", as_query(query))
    assert status == 400 and list(answer) == ["error"]
    assert f"error: {answer['error']}\n" == err


def test_an_unknown_parameter_is_a_400_naming_the_closest(server):
    status, answer = api_document(server, "plan", LLAMA | {"max_completion_lenght": 9})
    assert status == 400 and "did you mean 'max_completion_length'" in answer["error"]


def test_the_page_is_served_beside_the_api(server):
    status, page = get(server + "/")
    assert status == 200 and "<html" in page.lower()
    status, _ = get(server + "/api/nothing")
    assert status == 404
