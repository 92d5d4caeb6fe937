"""The command line in-process: exit codes, one-line errors, JSON contract, files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vram_planner.cli import main

JSON_FIELDS = {"fits", "peak_bytes", "capacity_bytes", "params", "trainable_params", "phases", "config",
               "grpo_config_valid", "calibration"}


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(capsys, *args) -> str:
    code, out, err = run(capsys, *args)
    assert code == 2, (out, err)
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    return err


def test_plan_is_the_default_command(capsys, llama_1b_file):
    code, out, _ = run(capsys, "--gpu", "15.73GiB", "--model", str(llama_1b_file))
    assert code == 0 and "fits" in out and "GRPOConfig(" in out and "Memory by phase" in out


def test_json_carries_the_contract_fields(capsys, llama_1b_file):
    code, out, _ = run(capsys, "plan", "--gpu", "15.73GiB", "--model", str(llama_1b_file), "--json")
    doc = json.loads(out)
    assert code == 0 and JSON_FIELDS <= set(doc)
    assert doc["fits"] and doc["peak_bytes"] <= doc["capacity_bytes"] and doc["params"] == 1_235_814_400
    peak = max(p["total_bytes"] for p in doc["phases"])
    assert peak == doc["peak_bytes"]
    assert doc["grpo_config_valid"] and doc["config"]["num_generations"] == 8
    assert doc["changes"] and all(c["saved_bytes"] > 0 for c in doc["changes"])


def test_check_exit_code_says_whether_it_fits(capsys, llama_1b_file):
    assert run(capsys, "check", "--gpu", "15.73GiB", "--model", str(llama_1b_file))[0] == 1  # fp32 full FT
    assert run(capsys, "check", "--gpu", "15.73GiB", "--model", str(llama_1b_file), "--lora-r", "16",
               "--dtype", "bfloat16")[0] == 0


def test_check_judges_exactly_the_given_config(capsys, llama_1b_file):
    _, out, _ = run(capsys, "check", "--gpu", "80GiB", "--model", str(llama_1b_file), "--json",
                    "--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "2", "--beta", "0.04")
    doc = json.loads(out)
    assert doc["config"]["per_device_train_batch_size"] == 4 and doc["config"]["beta"] == 0.04
    assert "scoring" in [p["name"] for p in doc["phases"]] and doc["changes"] == []


def test_nothing_fits_exits_1_and_names_a_card(capsys, llama_1b_file):
    code, out, _ = run(capsys, "--gpu", "1GiB", "--model", str(llama_1b_file), "--json")
    doc = json.loads(out)
    assert code == 1 and not doc["fits"] and doc["smallest_config_peak_bytes"] > 0
    assert doc["smallest_fitting_gpu"]


@pytest.mark.parametrize("args,expected", [
    (["--num-generations", "1"], "--num-generations must be at least 2"),
    (["--per-device-train-batch-size", "3"], "must be divisible by --num-generations"),
    (["--max-completion-length", "-5"], "--max-completion-length should be greater than 0"),
    (["--load-in-4bit"], "--load-in-4bit needs LoRA"),
    (["--bnb-4bit-quant-type", "nf4"], "need --load-in-4bit"),
    (["--lora-alpha", "32"], "need --lora-r"),
    (["--optim", "adamw8bit"], "did you mean 'adamw_8bit'"),
    (["--dtype", "bf16"], "did you mean 'bfloat16'"),
    (["--num-generation", "4"], "--num-generations"),
    (["--zero-stage", "2", "--fsdp", "--num-gpus", "2"], "choose one of --zero-stage and --fsdp"),
    (["--safety-margin", "0.9"], "--safety-margin"),
])
def test_impossible_knobs(capsys, llama_1b_file, args, expected):
    err = one_line_error(capsys, "--gpu", "16GiB", "--model", str(llama_1b_file), *args)
    assert expected in err


def test_missing_gpu_and_model(capsys):
    assert "needs --gpu and --model" in one_line_error(capsys, "plan")


def test_bad_sizes_and_files(capsys, tmp_path, llama_1b_file):
    assert "memory size" in one_line_error(capsys, "--gpu", "-3GiB", "--model", str(llama_1b_file))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert "cannot read" in one_line_error(capsys, "--gpu", "16GiB", "--model", str(broken))
    folder = tmp_path / "empty-model"
    folder.mkdir()
    assert "has no config.json" in one_line_error(capsys, "--gpu", "16GiB", "--model", str(folder))
    not_decoder = tmp_path / "config.json"
    not_decoder.write_text(json.dumps({"model_type": "bert"}))
    assert "lacks" in one_line_error(capsys, "--gpu", "16GiB", "--model", str(not_decoder))


def test_unknown_model_suggests(capsys):
    err = one_line_error(capsys, "--gpu", "16GiB", "--model", "Llama-3.2-1b-typo")
    assert "unknown model" in err


def test_hub_id_offline_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = one_line_error(capsys, "--gpu", "16GiB", "--model", "someone/not-a-real-model-xyz")
    assert "someone/not-a-real-model-xyz" in err


def test_gpu_auto_without_a_driver(capsys, llama_1b_file, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert "nvidia-smi" in one_line_error(capsys, "--gpu", "auto", "--model", str(llama_1b_file))


def test_config_file_yaml_and_flags_override(capsys, tmp_path, llama_1b_file):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {llama_1b_file}\ngpu: 80GiB\nper-device-train-batch-size: 4\nnum_generations: 4\n"
                   "lora_target_modules: q_proj,v_proj\nlora_r: 8\n")
    code, out, _ = run(capsys, "check", "--config", str(cfg), "--num-generations", "2", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["config"]["per_device_train_batch_size"] == 4 and doc["config"]["num_generations"] == 2
    assert doc["peft_config"]["target_modules"] == ["q_proj", "v_proj"]


@pytest.mark.parametrize("text,expected", [("per_device_train_batch: 4\n", "did you mean --per-device-train-batch-size"),
                                           ("- a\n- b\n", "must hold a mapping"), ("a: [\n", "not valid YAML")])
def test_bad_config_files(capsys, tmp_path, llama_1b_file, text, expected):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    assert expected in one_line_error(capsys, "--gpu", "16GiB", "--model", str(llama_1b_file), "--config", str(cfg))


def test_plot_writes_a_png(capsys, tmp_path, llama_1b_file):
    target = tmp_path / "plots" / "plan.png"
    code, _, _ = run(capsys, "--gpu", "15.73GiB", "--model", str(llama_1b_file), "--plot", str(target))
    assert code == 0 and target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(target.parent.iterdir()) == [target]  # no temporary file left behind


def test_debug_shows_the_traceback(llama_1b_file):
    with pytest.raises(Exception):
        main(["--debug", "--gpu", "16GiB", "--model", str(llama_1b_file), "--num-generations", "1"])


def test_plan_and_check_never_import_torch_transformers_or_trl(llama_1b_file):
    code = ("import sys, contextlib, io\n"
            "from vram_planner.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    main(['--gpu', '16GiB', '--model', {str(llama_1b_file)!r}])\n"
            f"    main(['check', '--gpu', '16GiB', '--model', {str(llama_1b_file)!r}, '--json'])\n"
            "heavy = [m for m in ('torch', 'transformers', 'trl', 'peft') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bare_command_shows_help(capsys):
    code, out, _ = run(capsys)
    assert code == 0 and "Usage: vram-plan" in out and "plan" in out


def test_catalogs_as_tables_and_json(capsys):
    code, out, _ = run(capsys, "gpus")
    assert code == 0 and "rtx3080-mobile" in out and "15.73" in out
    code, out, _ = run(capsys, "gpus", "--json")
    cards = {g["name"]: g for g in json.loads(out)}
    assert cards["rtx3080-mobile-16gb"]["total_memory_gib"] == 15.73
    code, out, _ = run(capsys, "models", "--json")
    models = {m["name"]: m for m in json.loads(out)}
    assert models["Llama-3.2-1B"]["params"] == 1_235_814_400


def test_unknown_gpu_suggests(capsys, llama_1b_file):
    err = one_line_error(capsys, "--gpu", "rtx3080-mobil", "--model", str(llama_1b_file))
    assert "did you mean" in err and "rtx3080-mobile" in err
