"""`plan --optimize speed`, step_seconds in plan and check --json, the alternatives, and their errors."""

from __future__ import annotations

import pytest

from helpers import json_of, one_line_error, run


def test_check_json_gives_the_step_time_of_its_config(capsys, llama_1b_file):
    _, doc = json_of(capsys, "check", "--gpu", "rtx4090", "--model", str(llama_1b_file), "--reward-seconds", "0.5",
                     "--dataset-prompts", "1000")
    time = doc["step_time"]
    assert doc["step_seconds"] == time["step_seconds"] > 0
    assert time["seconds"]["rewards"] == pytest.approx(0.5 * 8)
    assert sum(time["seconds"].values()) == pytest.approx(doc["step_seconds"], rel=1e-3)
    assert {p["name"]: p["seconds"] for p in doc["phases"]} == {p: time["seconds"][p] for p in
                                                                ("generation", "training", "optimizer")}
    assert time["epoch_seconds"] == pytest.approx(1000 / 1 * doc["step_seconds"], rel=1e-3)  # 8 completions = 1 prompt
    assert doc["alternatives"] is None and time["efficiency"] == "priors"


def test_plan_json_ranks_the_alternatives_and_marks_its_choice(capsys, llama_1b_file):
    _, memory = json_of(capsys, "plan", "--gpu", "rtx3080-mobile", "--model", str(llama_1b_file))
    _, speed = json_of(capsys, "plan", "--gpu", "rtx3080-mobile", "--model", str(llama_1b_file),
                       "--optimize", "speed")
    assert memory["optimize"] == "memory" and speed["optimize"] == "speed"
    rows = speed["alternatives"]
    # speed also weighs vLLM generation: the memory plan's alternatives are among its own
    speed_keys = {(r["step_seconds"], r["peak_bytes"]) for r in rows}
    assert {(r["step_seconds"], r["peak_bytes"]) for r in memory["alternatives"]} <= speed_keys
    assert any(r["changes"].get("use_vllm") for r in rows)
    assert not any(r["changes"].get("use_vllm") for r in memory["alternatives"])
    fitting = [r for r in rows if r["fits"]]
    assert [r["step_seconds"] for r in fitting] == sorted(r["step_seconds"] for r in fitting)
    assert all(r["peak_bytes"] <= speed["capacity_bytes"] for r in fitting)
    assert [r["chosen"] for r in rows].count(True) == 1 and rows[0]["chosen"]  # speed: the fastest
    assert speed["step_seconds"] == rows[0]["step_seconds"] <= memory["step_seconds"]
    chosen_for_memory = [r for r in memory["alternatives"] if r["chosen"]]
    assert chosen_for_memory[0]["step_seconds"] == memory["step_seconds"]
    assert not rows[-1]["fits"] and rows[-1]["changes"] == {}  # the config as given, timed though it does not fit
    # the speed plan's document describes the fastest config: its config, its peak, its changes
    changed = {knob for knob in rows[0]["changes"]}
    assert {c["knob"].split(" + ")[0] for c in speed["changes"]} <= changed
    assert speed["peak_bytes"] == rows[0]["peak_bytes"]


def test_the_human_plan_shows_the_step_time_and_the_fastest_configs(capsys, llama_1b_file):
    code, out, _ = run(capsys, "plan", "--gpu", "rtx4090", "--model", str(llama_1b_file), "--dataset-prompts", "7473")
    assert code == 0
    assert "Predicted step time:" in out and "one epoch" in out and "Configs that fit, fastest first" in out


def test_speed_without_figures_is_one_line(capsys, llama_1b_file):
    err = one_line_error(capsys, "plan", "--gpu", "24GiB", "--model", str(llama_1b_file), "--optimize", "speed")
    assert "catalog card" in err
    _, doc = json_of(capsys, "plan", "--gpu", "24GiB", "--model", str(llama_1b_file))
    assert doc["step_seconds"] is None and "no memory bandwidth" in doc["step_time"]["problem"]
    assert "No step time" in run(capsys, "plan", "--gpu", "24GiB", "--model", str(llama_1b_file))[1]


@pytest.mark.parametrize("args", [("--optimize", "fast"), ("--reward-seconds", "-1"), ("--dataset-prompts", "0")])
def test_bad_speed_options_are_refused(capsys, llama_1b_file, args):
    code, out, err = run(capsys, "plan", "--gpu", "rtx4090", "--model", str(llama_1b_file), *args)
    assert code == 2 and "Traceback" not in err and args[0] in err


@pytest.mark.parametrize("other", [("--maximize", "max_completion_length"), ("--exact",)])
def test_speed_refuses_the_other_questions(capsys, llama_1b_file, other):
    err = one_line_error(capsys, "plan", "--gpu", "rtx4090", "--model", str(llama_1b_file), "--optimize", "speed",
                         *other)
    assert "--optimize speed" in err and other[0] in err
