"""Offload and `--num-gpus auto` on the command line: the host's RAM refused with both numbers, the accelerate config
with the offload as TRL's files spell it, and the count and strategy that auto chose in the JSON and in `gpus`."""

from __future__ import annotations

import pytest
import yaml

from helpers import json_of, launched, one_line_error, run
from vram_planner.units import GiB

MODEL = ["--gpu", "h100", "--model", "Qwen2.5-7B"]
OFFLOADS = [(["--zero-stage", "2", "--offload-optimizer", "cpu"], "ZeRO-2 + offload: optimizer"),
            (["--zero-stage", "3", "--offload-optimizer", "cpu"], "ZeRO-3 + offload: optimizer"),
            (["--zero-stage", "3", "--offload-optimizer", "cpu", "--offload-param", "cpu"],
             "ZeRO-3 + offload: optimizer, parameters"),
            (["--fsdp", "--offload-param", "cpu"], "FSDP2 + CPU offload")]


@pytest.mark.parametrize(("flags", "label"), OFFLOADS, ids=[label for _, label in OFFLOADS])
def test_the_host_that_cannot_hold_the_offloaded_states_is_refused_with_both_numbers(capsys, flags, label):
    code, roomy = json_of(capsys, "check", *MODEL, "--num-gpus", "2", *flags, "--host-memory", "4TiB")
    launch = roomy["distributed"]
    assert code == 0 and roomy["fits"] and launch["label"] == f"2 x {label}"
    need = launch["host_bytes"]
    assert launch["host_memory_bytes"] == 4 * 1024 * GiB and need > 0
    code, tight = json_of(capsys, "check", *MODEL, "--num-gpus", "2", *flags, "--host-memory", f"{need - 1}B")
    assert code == 1 and not tight["fits"] and tight["peak_bytes"] == roomy["peak_bytes"]
    code, out, _ = run(capsys, "check", *MODEL, "--num-gpus", "2", *flags, "--host-memory", f"{need - 1}B")
    words = " ".join(out.split())
    assert code == 1
    assert f"need {need / GiB:.2f} GiB per node, which does not fit in {(need - 1) / GiB:.2f} GiB" in words
    assert (f"✘ does not fit: the offloaded states need {need / GiB:.2f} GiB of host RAM per node, more than its "
            f"{(need - 1) / GiB:.2f} GiB; each GPU's peak is {roomy['peak_bytes'] / GiB:.2f} GiB") in words


@pytest.mark.parametrize(("flags", "label"), OFFLOADS, ids=[label for _, label in OFFLOADS])
def test_the_printed_accelerate_config_launches_the_offload(capsys, tmp_path, flags, label):
    _, document = json_of(capsys, "plan", *MODEL, "--num-gpus", "4", *flags, "--host-memory", "4TiB")
    config = document["distributed"]["accelerate_config"]
    args = launched(yaml.safe_dump(config), tmp_path)
    if "--fsdp" in flags:
        assert config["fsdp_config"]["fsdp_offload_params"] is True and args.fsdp_offload_params in (True, "true")
        return
    assert config["deepspeed_config"]["offload_optimizer_device"] == args.offload_optimizer_device == "cpu"
    expected = "cpu" if "--offload-param" in flags else "none"
    assert config["deepspeed_config"]["offload_param_device"] == args.offload_param_device == expected


def test_offload_without_a_strategy_that_offloads_is_one_clear_line(capsys):
    err = one_line_error(capsys, "check", *MODEL, "--num-gpus", "2", "--offload-optimizer", "cpu")
    assert "--offload-optimizer cpu needs --zero-stage 2 or 3" in err
    err = one_line_error(capsys, "check", *MODEL, "--num-gpus", "two")
    assert "neither a whole number of GPUs nor auto" in err
    err = one_line_error(capsys, "check", *MODEL, "--num-gpus", "auto", "--exact")
    assert "--num-gpus auto is answered by plan, check (without --exact)" in err


def test_plan_num_gpus_auto_says_what_it_chose_in_the_json_and_the_text(capsys):
    code, document = json_of(capsys, "plan", *MODEL, "--num-gpus", "auto", "--host-memory", "32GiB")
    chosen = document["num_gpus_auto"]
    assert code == 0 and chosen["fits"] and chosen["num_gpus"] > 1
    assert chosen["num_gpus"] == document["distributed"]["num_gpus"] == document["assumptions"]["num_gpus"]
    assert chosen["strategy"] == document["distributed"]["strategy"]
    last = chosen["tried"][-1]
    assert last["fits"] and last["num_gpus"] == chosen["num_gpus"] and last["peak_bytes"] == document["peak_bytes"]
    assert not any(t["fits"] for t in chosen["tried"][:-1])
    # offload fails on the host's RAM, not on the card: each try says what the node would need
    assert all((t["host_bytes"] > 32 * GiB) == (t["offload_optimizer"] == "cpu" or t["offload_param"] == "cpu")
               for t in chosen["tried"])
    _, out, _ = run(capsys, "plan", *MODEL, "--num-gpus", "auto", "--host-memory", "32GiB")
    assert f"--num-gpus auto: {document['distributed']['label']}, the fewest" in " ".join(out.split())
    # the count it chose, given as a count, fits as the same strategy
    flags = {"zero2": ["--zero-stage", "2"], "zero3": ["--zero-stage", "3"], "fsdp": ["--fsdp"], "ddp": []}
    code, again = json_of(capsys, "check", *MODEL, "--num-gpus", str(chosen["num_gpus"]),
                          *flags[chosen["strategy"]], "--host-memory", "32GiB")
    assert code == 0 and again["peak_bytes"] == document["peak_bytes"]


def test_gpus_num_gpus_auto_gives_each_card_its_count_and_strategy(capsys, monkeypatch):
    code, rows = json_of(capsys, "gpus", "--model", "Qwen2.5-7B", "--num-gpus", "auto", "--host-memory", "32GiB")
    assert code == 0
    fitting = [row for row in rows if row["fits"]]
    assert fitting and all(row["num_gpus"] >= 1 and row["strategy"] for row in fitting)
    h100 = next(row for row in rows if row["name"] == "h100-80gb")
    assert h100["per_gpu"].startswith(f"{h100['num_gpus']} x ") and h100["num_gpus"] > 1
    monkeypatch.setenv("COLUMNS", "200")
    _, out, _ = run(capsys, "gpus", "--model", "Qwen2.5-7B", "--num-gpus", "auto", "--host-memory", "32GiB")
    assert "per GPU, the fewest of each card that fit (--num-gpus auto)" in out
    _, plain, _ = run(capsys, "gpus", "--model", "Qwen2.5-7B")
    assert "--num-gpus auto finds the fewest of each card" in plain and "--num-gpus auto finds" not in out
    assert h100["per_gpu"] in next(line for line in out.splitlines() if line.lstrip(" ").startswith("h100-80gb "))
    err = one_line_error(capsys, "gpus", "--model", "Qwen2.5-7B", "--num-gpus", "auto", "--maximize",
                         "max_completion_length")
    assert "--num-gpus auto" in err
