"""`vram-plan trace` from the command line: check's JSON shape with the trace beside the analytic model, and
one-line errors for what cannot be traced."""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURES
from test_cli import one_line_error, run
from vram_planner.spec import TrainingConfig
from vram_planner.trace import trace_step

pytest.importorskip("trl")

TINY = FIXTURES / "tiny-llama-headdim.json"
SHORT = ["--per-device-train-batch-size", "2", "--num-generations", "2", "--max-prompt-length", "16",
         "--max-completion-length", "16"]


@pytest.fixture(scope="module")
def traced_directly():
    return trace_step(json.loads(TINY.read_text()), TrainingConfig(per_device_train_batch_size=2, num_generations=2,
                                                                   max_prompt_length=16, max_completion_length=16))


def test_trace_json_has_checks_shape_and_the_traced_bytes(capsys, traced_directly):
    code, out, _ = run(capsys, "check", "--gpu", "24GiB", "--model", str(TINY), *SHORT, "--json")
    check = json.loads(out)
    code, out, _ = run(capsys, "trace", "--gpu", "24GiB", "--model", str(TINY), *SHORT, "--json")
    trace = json.loads(out)
    assert code == 0 and trace["fits"] and trace["command"] == "trace" and trace["engine"] == "trace"
    assert set(check) <= set(trace) and trace["trace_seconds"] > 0
    assert [p["name"] for p in trace["phases"]] == [p.name for p in traced_directly.phases]
    for phase, direct in zip(trace["phases"], traced_directly.phases, strict=True):
        assert phase["tensor_bytes"] == direct.peak_bytes
        assert phase["components"]["cuda_context"] > 0  # the calibration's overheads make it a verdict
        assert phase["total_bytes"] == sum(phase["components"].values())
        assert abs(phase["analytic_relative_error"]) < 0.05
    assert trace["params"] == check["params"] and trace["config"] == check["config"]


def test_trace_prints_both_engines_and_its_wall_time(capsys):
    code, out, _ = run(capsys, "trace", "--gpu", "24GiB", "--model", str(TINY), *SHORT)
    assert code == 0
    assert "Traced tensors against the analytic model" in out and "Traced in" in out and "Memory by phase" in out


def test_a_trace_that_does_not_fit_exits_1(capsys):
    code, out, _ = run(capsys, "trace", "--gpu", "0.3GiB", "--model", str(TINY), *SHORT, "--json")
    assert code == 1 and not json.loads(out)["fits"]


@pytest.mark.parametrize("flags", [["--use-vllm"], ["--load-in-4bit", "--lora-r", "8"], ["--optim", "adamw_8bit"],
                                   ["--num-gpus", "2", "--zero-stage", "3"]])
def test_what_the_cpu_cannot_trace_is_one_line(capsys, flags):
    err = one_line_error(capsys, "trace", "--gpu", "24GiB", "--model", "Llama-3.2-1B", *flags)
    assert "cannot" in err and "vram-plan check" in err


def test_a_model_transformers_cannot_build_is_one_line(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "notamodel", "vocab_size": 1000, "hidden_size": 64,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}))
    err = one_line_error(capsys, "trace", "--gpu", "24GiB", "--model", str(config))
    assert "cannot build" in err and "notamodel" in err and len(err) < 400


def test_an_unknown_model_name_suggests_close_ones(capsys):
    err = one_line_error(capsys, "trace", "--gpu", "24GiB", "--model", "Llama-3.2-1b-instrct")
    assert "Llama-3.2-1B-Instruct" in err
