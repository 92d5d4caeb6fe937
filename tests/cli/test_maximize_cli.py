"""`vram-plan plan --maximize FIELD` and `vram-plan gpus --model M`: the printed answer, the JSON documents, the exit
codes, the impossible case in one line and bad input in one line."""

from __future__ import annotations

import json
import time

import pytest

from helpers import one_line_error, run
from test_cli_fuzz import _offline  # noqa: F401 (autouse: no hub and no nvidia-smi, as on CI)
from test_cli_fuzz import BAD_KNOBS, EXTREME_KNOBS, answered, refused
from vram_planner import engine
from vram_planner.profiles import gpus

PLAN_FIELDS = {"fits", "peak_bytes", "capacity_bytes", "params", "trainable_params", "phases", "config",
               "grpo_config_valid", "calibration", "changes"}
LORA = ["--lora-r", "16", "--dtype", "bfloat16"]
LAPTOP = ["--gpu", "rtx3080-mobile", "--model", "Llama-3.2-1B"]


def test_the_answer_is_printed_with_its_peak_and_the_next_step(capsys):
    code, out, _ = run(capsys, "plan", *LAPTOP, *LORA, "--maximize", "max_completion_length")
    answer = engine.maximize("Llama-3.2-1B", "rtx3080-mobile", "max_completion_length", {"lora_r": 16,
                                                                                       "dtype": "bfloat16"})
    assert code == 0
    assert "Largest max_completion_length that fits" in out and f": {answer.value} tokens" in out
    assert f"peak {answer.peak_bytes / 1024**3:.3f} GiB at {answer.value}" in out
    assert f"at {answer.next_value} it needs {answer.next_peak_bytes / 1024**3:.3f} GiB" in out
    assert f"max_completion_length={answer.value}," in out  # the GRPOConfig to paste holds the value


@pytest.mark.parametrize("field,savers", [("max_completion_length", False), ("per_device_train_batch_size", True),
                                          ("lora_r", False)])
def test_json_is_the_plan_document_plus_the_answer(capsys, field, savers):
    code, out, _ = run(capsys, "plan", *LAPTOP, *LORA, "--maximize", field, "--json",
                       *(["--allow-savers"] if savers else []))
    doc = json.loads(out)
    maximized = doc["maximized"]
    assert code == 0 and PLAN_FIELDS <= set(doc) and doc["fits"]
    assert {"field", "value", "peak_bytes", "next_peak_bytes"} <= set(maximized) and maximized["field"] == field
    value = doc["peft_config"]["r"] if field == "lora_r" else doc["config"][field]
    assert value == maximized["value"] and maximized["peak_bytes"] == doc["peak_bytes"] <= doc["capacity_bytes"]
    if maximized["next_value"] is not None:
        assert maximized["next_peak_bytes"] > doc["capacity_bytes"] - doc["safety_margin_bytes"]


def test_with_the_savers_the_document_lists_their_changes(capsys):
    code, out, _ = run(capsys, "plan", *LAPTOP, "--maximize", "max_completion_length", "--allow-savers", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["changes"] and doc["maximized"]["allow_savers"]
    assert doc["config"]["max_completion_length"] == doc["maximized"]["value"]
    assert "max_completion_length" not in {c["knob"] for c in doc["changes"]}  # savers, not shorter completions


def test_even_one_token_not_fitting_is_one_line_and_exit_1(capsys):
    code, out, err = run(capsys, "plan", *LAPTOP, "--maximize", "max_completion_length")
    assert code == 1 and err == "" and out.count("\n") == 1
    assert out.startswith("✘ even max_completion_length 1 does not fit") and "--allow-savers" in out
    code, out, _ = run(capsys, "plan", *LAPTOP, "--maximize", "max_completion_length", "--json")
    doc = json.loads(out)
    assert code == 1 and not doc["fits"] and doc["maximized"]["value"] is None
    assert doc["maximized"]["next_value"] == 1 and doc["maximized"]["next_peak_bytes"] > doc["capacity_bytes"] * 0.95


@pytest.mark.parametrize("field,other", [("max_prompt_length", 512), ("max_completion_length", 256)])
@pytest.mark.parametrize("savers", [False, True])
def test_a_length_stops_at_vllms_context(capsys, field, other, savers):
    # was "internal error: min() arg is an empty sequence" for the prompt, and a 4714-token completion vLLM cannot
    # generate in its 1024-token context
    a40 = ["--gpu", "a40", "--model", "Llama-3.2-1B", "--use-vllm", "--vllm-max-model-length", "1024"]
    code, out, err = run(capsys, "plan", *a40, "--maximize", field, "--json", *(["--allow-savers"] if savers else []))
    maximized = json.loads(out)["maximized"]
    assert code == 0 and err == "" and maximized["value"] == 1024 - other and maximized["next_value"] is None
    assert maximized["limited_by"] == (f"vLLM's context of 1024 tokens (--vllm-max-model-length) less the "
                                       f"{other}-token {'completion' if other == 512 else 'prompt'}")
    length = ["--max-prompt-length" if field == "max_prompt_length" else "--max-completion-length", str(1024 - other)]
    assert run(capsys, "check", *a40, *length)[0] == 0  # check agrees the answer runs
    assert "exceed --vllm-max-model-length 1024" in one_line_error(capsys, "check", *a40, length[0],
                                                                   str(1025 - other))


@pytest.mark.parametrize("args,expected", [
    (["--maximize", "max_completion"], "did you mean 'max_completion_length'"),
    (["--maximize", "beta"], "--maximize beta is not supported"),
    (["--maximize", "lora_r"], "--maximize lora_r needs LoRA: give --lora-r"),
    (["--allow-savers"], "--allow-savers goes with --maximize"),
    (["--maximize", "max_completion_length", "--max-prompt-length", "200000"], "already fills the model's context"),
    (["--maximize", "num_generations", "--per-device-train-batch-size", "3"], "must be evenly divisible"),
])
def test_bad_maximize_requests_are_one_line(capsys, args, expected):
    assert expected in one_line_error(capsys, "plan", *LAPTOP, *args)


def test_maximize_belongs_to_plan_only(capsys):
    assert "No such option '--maximize'" in one_line_error(capsys, "check", *LAPTOP, "--maximize", "lora_r")


def test_gpus_with_a_model_lists_every_card_smallest_fitting_first(capsys):
    code, out, _ = run(capsys, "gpus", "--model", "Llama-3.2-1B", *LORA, "--json")
    rows = json.loads(out)
    assert code == 0 and sorted(r["name"] for r in rows) == sorted(g.name for g in gpus())
    assert all({"name", "capacity_bytes", "fits", "peak_bytes"} <= set(r) for r in rows)
    fitting = [r for r in rows if r["fits"]]
    assert rows[:len(fitting)] == fitting
    assert [r["capacity_bytes"] for r in fitting] == sorted(r["capacity_bytes"] for r in fitting)
    assert all(r["peak_bytes"] <= r["capacity_bytes"] for r in fitting)
    assert all(r["peak_bytes"] is None or r["peak_bytes"] > 0.95 * r["capacity_bytes"] for r in rows[len(fitting):])
    code, out, _ = run(capsys, "gpus", "--model", "Llama-3.2-1B", *LORA)
    assert code == 0 and "every card, smallest that fits first" in out
    assert out.index(fitting[0]["name"]) < out.index(fitting[-1]["name"])  # the table keeps the order


def test_gpus_with_maximize_gives_each_card_its_largest_value(capsys):
    code, out, _ = run(capsys, "gpus", "--model", "Qwen2.5-0.5B", *LORA, "--maximize", "max_completion_length",
                       "--json")
    rows = json.loads(out)
    assert code == 0
    for row in rows[::9]:
        if row["problem"] is None:
            alone = engine.maximize("Qwen2.5-0.5B", row["name"], "max_completion_length",
                                 {"lora_r": 16, "dtype": "bfloat16"})
            assert row["maximized"]["value"] == alone.value and row["fits"] == alone.fits


def test_gpus_exit_1_when_no_card_fits(capsys):
    code, out, _ = run(capsys, "gpus", "--model", "Llama-3.1-8B", "--max-completion-length", "100000", "--json")
    assert code == 1 and not any(row["fits"] for row in json.loads(out))


@pytest.mark.parametrize("args,expected", [
    (["--lora-r", "16"], "need --model"),
    (["--maximize", "lora_r"], "need --model"),
    (["--model", "Llama-3.2-1B", "--maximize", "num_gens"], "did you mean 'num_generations'"),
    (["--model", "Llama-3.2-1B", "--allow-savers"], "--allow-savers goes with --maximize"),
    (["--model", "Llama-3.2-1B", "--per-device-train-batch-size", "3"], "must be evenly divisible"),
    (["--model", "Llama-3.2-1b-typo"], "unknown model"),
])
def test_bad_gpus_requests_are_one_line(capsys, args, expected):
    assert expected in one_line_error(capsys, "gpus", *args)


def test_gpus_without_a_model_is_still_the_catalog(capsys):
    code, out, _ = run(capsys, "gpus", "--json")
    assert code == 0 and {r["name"] for r in json.loads(out)} == {g.name for g in gpus()}


def test_gpus_with_a_model_answers_in_well_under_a_second_or_two(capsys):
    run(capsys, "gpus", "--model", "Llama-3.2-1B", "--json")  # imports and catalogs, once
    started = time.perf_counter()
    code, _, _ = run(capsys, "gpus", "--model", "Llama-3.2-1B", "--json")
    assert code in (0, 1) and time.perf_counter() - started < 2  # ~0.1 s unloaded; 2 busy cores leave room


# the knobs `gpus --model` takes: every bad one but the --gpu flags (which gpus refuses as no such option)
CARDLESS_BAD_KNOBS = [flags for flags in BAD_KNOBS if "--gpu" not in flags]


# the refusal is about the knob, not about the options under test
OUR_OPTIONS = ("No such option '--maximize'", "No such option '--allow-savers'", "No such option '--model'")


@pytest.mark.parametrize("flags", BAD_KNOBS, ids=" ".join)
def test_bad_knobs_with_maximize(capsys, flags):
    err = refused(capsys, ["plan", "--gpu", "24GiB", "--model", "Llama-3.2-1B", "--maximize", "max_completion_length",
                           "--allow-savers", *flags])
    assert not any(option in err for option in OUR_OPTIONS), err


@pytest.mark.parametrize("flags", CARDLESS_BAD_KNOBS, ids=" ".join)
def test_bad_knobs_with_gpus(capsys, flags):
    err = refused(capsys, ["gpus", "--model", "Llama-3.2-1B", "--maximize", "num_generations", *flags])
    assert not any(option in err for option in OUR_OPTIONS), err


@pytest.mark.parametrize("flags", EXTREME_KNOBS, ids=" ".join)
@pytest.mark.parametrize("field", ["max_completion_length", "per_device_train_batch_size", "num_generations"])
def test_extreme_knobs_are_maximized_within_seconds(capsys, field, flags):
    args = ["plan", "--gpu", "24GiB", "--model", "Llama-3.2-1B", "--maximize", field, "--allow-savers", *flags]
    if answered(capsys, args) == 2:  # refused for the knob's own sake (a prompt longer than the model's context)
        assert not any(option in refused(capsys, args) for option in OUR_OPTIONS)
