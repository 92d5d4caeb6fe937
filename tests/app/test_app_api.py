"""The HTTP API of a running server (started as a Space starts it: `python app.py`) against the CLI's `--json`
documents, and bad input as a 400 with the CLI's one-line message."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import run
from serving import ROOT, api_document, free_port, get, running_server
from vram_planner.app import views

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


# Where click parses the flag, the command line says it in click's words; elsewhere both say the library's line.
CLICK_PARSED = {"not-a-number", "margin-out-of-range", "no-gpu"}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_a_400_with_one_line_naming_the_fields(server, capsys, name):
    query = BAD[name]
    code, out, err = run(capsys, "check", *flags(query))
    assert code == 2 and out == "" and err.count("\n") == 1
    status, answer = api_document(server, "check", as_query(query))
    assert status == 400 and list(answer) == ["error"] and "--" not in answer["error"]
    if name not in CLICK_PARSED:
        assert views.page_words(err) == f"error: {answer['error']}\n"


def test_an_unknown_parameter_is_a_400_naming_the_closest(server):
    status, answer = api_document(server, "plan", LLAMA | {"max_completion_lenght": 9})
    assert status == 400 and "did you mean 'max_completion_length'" in answer["error"]


def test_the_catalogs_and_every_cards_verdict(server, capsys):
    for command in ("gpus", "models"):
        _, out, _ = run(capsys, command, "--json")
        status, body = get(f"{server}/api/{command}")
        assert status == 200 and json.loads(body) == json.loads(out)
    code, out, _ = run(capsys, "gpus", "--model", "Qwen2.5-0.5B", "--lora-r", "16", "--maximize",
                       "max_completion_length", "--json")
    status, rows = api_document(server, "gpus", {"model": "Qwen2.5-0.5B", "lora_r": 16,
                                                 "maximize": "max_completion_length"})
    assert status == 200 and rows == json.loads(out) and rows[0]["maximized"]["value"] > 0
    status, answer = api_document(server, "gpus", LLAMA)
    assert status == 400 and "leave gpu out" in answer["error"]


def test_plan_maximizes_on_request(server, capsys):
    query = LLAMA | {"lora_r": 16, "dtype": "bfloat16", "maximize": "max_completion_length"}
    code, out, _ = run(capsys, "plan", *flags({k: v for k, v in query.items() if k != "maximize"}), "--maximize",
                       "max_completion_length", "--json")
    status, document = api_document(server, "plan", query)
    assert status == 200 and document == json.loads(out) and document["maximized"]["value"] > 0


def test_the_api_describes_itself(server):
    status, body = get(f"{server}/api/openapi.json")
    description = json.loads(body)
    assert status == 200 and description["openapi"].startswith("3.")
    assert set(description["paths"]) == {"/api/check", "/api/plan", "/api/gpus", "/api/models"}
    names = {p["name"] for p in description["paths"]["/api/plan"]["get"]["parameters"]}
    assert {"gpu", "model", "max_completion_length", "lora_r", "maximize", "exact"} <= names
    kinds = {p["name"]: p["schema"]["type"] for p in description["paths"]["/api/check"]["get"]["parameters"]}
    assert kinds["max_completion_length"] == "integer" and kinds["use_vllm"] == "boolean"


def test_the_page_is_served_beside_the_api(server):
    status, page = get(server + "/")
    assert status == 200 and "<html" in page.lower()
    status, _ = get(server + "/api/nothing")
    assert status == 404
