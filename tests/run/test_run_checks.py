"""`vram-plan run` checks everything it can before its first write or the smoke step: the output folder, the
dataset's prompts, the chat template, the rewards' outputs, the optional dependencies, the step flags."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from helpers import SMALL, bad_run, one_line_error, run

pytest.importorskip("trl")

INSTALL_HINT = "pip install 'vram-plan[train]'"


def a_previous_run(folder):
    """What a finished run leaves in its output folder."""
    (folder / "checkpoint-1").mkdir(parents=True)
    (folder / "checkpoint-1" / "model.safetensors").write_bytes(b"first run")
    (folder / "final").mkdir()
    (folder / "final" / "model.safetensors").write_bytes(b"first run, final")
    (folder / "vram-plan-log.jsonl").write_text('{"step": 1}\n')
    return folder


def run_into(capsys, model, out, *extra):
    return run(capsys, "run", "--model", str(model), "--dataset", "math-sample", "--output-dir", str(out), *SMALL,
               *extra)


# --- the output folder -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["below a file", "deeper below a file"])
def test_an_unwritable_output_dir_is_one_line_before_anything_runs(capsys, tiny_model_folder, tmp_path, where):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    out = a_file / "run" if where == "below a file" else a_file / "x" / "run"
    code, stdout, err = run_into(capsys, tiny_model_folder, out)
    assert code == 2 and stdout == "" and err.count("\n") == 1 and err.startswith("error: ")
    assert "--output-dir" in err and "a-file" in err and "Error" not in err and ".tmp" not in err


def test_an_output_dir_holding_a_run_is_refused_and_kept(capsys, tiny_model_folder, tmp_path):
    out = a_previous_run(tmp_path / "run")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    err = one_line_error(capsys, "run", "--model", str(tiny_model_folder), "--dataset", "math-sample",
                         "--output-dir", str(out), *SMALL)
    assert "--resume" in err and "--overwrite" in err and "checkpoint-1" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("leftover", ["final", "checkpoint-3"])
def test_a_trained_run_counts_as_a_run(capsys, tiny_model_folder, tmp_path, leftover):
    out = tmp_path / "run"
    (out / leftover).mkdir(parents=True)
    err = one_line_error(capsys, "run", "--model", str(tiny_model_folder), "--dataset", "math-sample",
                         "--output-dir", str(out), *SMALL)
    assert "--resume" in err and "--overwrite" in err and leftover in err


@pytest.mark.parametrize("leftover", ["accelerate_config.yaml", "vram-plan-log.jsonl"])
def test_a_run_stopped_before_its_first_checkpoint_is_started_again(capsys, tiny_model_folder, tmp_path, leftover):
    # nothing trained to continue from or keep: without --overwrite, and with --resume, it starts from the beginning
    out = tmp_path / "run"
    out.mkdir()
    (out / leftover).write_text("x")
    for resume in ((), ("--resume",)):
        code, _, err = run_into(capsys, tiny_model_folder, out, "--dry-run", *resume)
        assert code == 0, err


def test_a_folder_of_other_files_is_not_a_run(capsys, tiny_model_folder, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = run_into(capsys, tiny_model_folder, out, "--dry-run")
    assert code == 0, err


def test_resume_and_overwrite_together_is_one_line(capsys, tiny_model_folder, tmp_path):
    out = a_previous_run(tmp_path / "run")
    err = one_line_error(capsys, "run", "--model", str(tiny_model_folder), "--dataset", "math-sample",
                         "--output-dir", str(out), "--resume", "--overwrite", *SMALL)
    assert "--resume" in err and "--overwrite" in err and (out / "final").is_dir()


@pytest.mark.parametrize("exists", [True, False])
def test_resume_without_a_checkpoint_is_one_line(capsys, tiny_model_folder, tmp_path, exists):
    out = tmp_path / "run"
    if exists:
        out.mkdir()
        (out / "final").mkdir()
    err = one_line_error(capsys, "run", "--model", str(tiny_model_folder), "--dataset", "math-sample",
                         "--output-dir", str(out), "--resume", *SMALL)
    assert "--resume" in err and "checkpoint" in err and out.exists() == exists


@pytest.mark.slow
def test_a_second_run_keeps_the_first_resumes_it_or_starts_afresh(capsys, tiny_model_folder, tmp_path):
    out = tmp_path / "run"
    steps = ["--max-steps", "1", "--save-steps", "1"]
    code, _, err = run_into(capsys, tiny_model_folder, out, *steps)
    assert code == 0, err
    first = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert (out / "checkpoint-1").is_dir() and (out / "final" / "model.safetensors").is_file()

    code, _, err = run_into(capsys, tiny_model_folder, out, *steps)  # the same command again
    assert code == 2 and "--resume" in err and "--overwrite" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == first  # nothing overwritten

    code, _, err = run_into(capsys, tiny_model_folder, out, "--resume", "--max-steps", "2", "--save-steps", "1",
                            "--verbose")
    assert code == 0, err
    assert "Loading weights" in err  # --verbose shows the libraries' progress bars
    logged = [json.loads(line)["step"] for line in (out / "vram-plan-log.jsonl").read_text().splitlines()
              if "reward" in json.loads(line)]
    assert logged == [1, 2] and (out / "checkpoint-2").is_dir()  # step 1 kept, step 2 continued from it
    assert (out / "checkpoint-1" / "model.safetensors").read_bytes() == first[out / "checkpoint-1" /
                                                                               "model.safetensors"]

    (out / "notes.txt").write_text("mine")
    code, _, err = run_into(capsys, tiny_model_folder, out, "--overwrite", *steps)
    assert code == 0, err
    assert "Loading weights" not in err
    logged = [json.loads(line)["step"] for line in (out / "vram-plan-log.jsonl").read_text().splitlines()
              if "reward" in json.loads(line)]
    assert logged == [1] and not (out / "checkpoint-2").exists() and (out / "checkpoint-1").is_dir()
    assert (out / "notes.txt").read_text() == "mine"  # only the run's own files were removed


# --- the dataset --------------------------------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "1 + 1?"}]


@pytest.mark.parametrize(("second", "expected"), [
    ("", "empty"), ("   ", "empty"), (None, "no prompt"), (7, "int"), ([], "empty"), ({"text": "hi"}, "dict"),
    ([{"role": "user"}], "content"), ([{"content": "hi"}], "role"), (CHAT, "plain-text"),
])
def test_each_prompt_must_be_text_or_chat_messages_named_by_row(capsys, tiny_model_folder, tmp_path, second,
                                                                  expected):
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": "1 + 1?", "answer": "2"}, {"prompt": second, "answer": "2"}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    err = bad_run(capsys, tmp_path, tiny_model_folder, "--dataset", str(data))
    assert "row 2" in err and expected in err and "Error" not in err


def test_a_row_without_a_prompt_is_named(capsys, tiny_model_folder, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "1 + 1?", "answer": "2"}) + "\n" + json.dumps({"answer": "4"}) + "\n")
    err = bad_run(capsys, tmp_path, tiny_model_folder, "--dataset", str(data))
    assert "row 2" in err and "no prompt" in err


@pytest.mark.parametrize(("text", "expected"), [
    ('{"prompt": "a"}\n{"prompt": "b",\n', "line 2 is not valid JSON"),
    ('{"prompt": "a"}\nnot json\n', "line 2 is not valid JSON"),
    ('[{"prompt": "a"}, {"prompt": ]', "line 1 is not valid JSON"), ("", "empty"), ("\n\n", "empty"),
    ("3\n4\n", "line 1 is a JSON number"), ('[{"prompt": "a"}, 3]', "JSON number"),
])
def test_a_malformed_json_dataset_is_one_line_of_ours(capsys, tiny_model_folder, tmp_path, text, expected):
    data = tmp_path / ("data.json" if text.startswith("[") else "data.jsonl")
    data.write_text(text)
    err = bad_run(capsys, tmp_path, tiny_model_folder, "--dataset", str(data))
    assert expected in err
    assert "DatasetGenerationError" not in err and "Arrow" not in err and "Error" not in err


@pytest.mark.slow
def test_a_malformed_jsonl_dataset_prints_only_our_line(tiny_model_folder, tmp_path):
    import subprocess

    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b",\n')
    # a process of its own: the datasets library logs the parse error through a handler on the real stderr
    done = subprocess.run([sys.executable, "-m", "vram_planner", "run", "--model", str(tiny_model_folder),
                           "--dataset", str(data), "--output-dir", str(tmp_path / "run"), *SMALL],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ") and "line 2" in done.stderr


def test_gsm8k_without_a_network_is_one_line_within_seconds(capsys, tiny_model_folder, tmp_path, monkeypatch):
    import socket

    def no_network(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # nothing cached
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    started = time.perf_counter()
    err = bad_run(capsys, tmp_path, tiny_model_folder, "--dataset", "gsm8k")
    assert time.perf_counter() - started < 10
    assert "gsm8k" in err and "math-sample" in err and "ConnectionError" not in err


# --- the chat template --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_model_folder(tiny_model_folder, tmp_path_factory):
    """The tiny model with a chat template on its tokenizer."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny-chat-model")
    shutil.copytree(tiny_model_folder, folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    tokenizer.save_pretrained(folder)
    return folder


def chat_dataset(tmp_path):
    data = tmp_path / "chat.jsonl"
    rows = [{"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "1 + 1?"}],
             "answer": "2"}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data


def test_chat_prompts_need_a_tokenizer_with_a_chat_template(capsys, tiny_model_folder, tmp_path):
    err = bad_run(capsys, tmp_path, tiny_model_folder, "--dataset", str(chat_dataset(tmp_path)))
    assert "chat template" in err and str(tiny_model_folder) in err


def test_chat_prompts_pass_with_a_chat_template(capsys, chat_model_folder, tmp_path):
    code, _, err = run(capsys, "run", "--model", str(chat_model_folder), "--dataset", str(chat_dataset(tmp_path)),
                       "--output-dir", str(tmp_path / "run"), "--dry-run", *SMALL)
    assert code == 0, err


def test_a_chat_template_that_cannot_render_the_prompts_is_one_line(capsys, chat_model_folder, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "no-system-model"
    shutil.copytree(chat_model_folder, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                               "supported') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tokenizer.save_pretrained(folder)
    err = bad_run(capsys, tmp_path, folder, "--dataset", str(chat_dataset(tmp_path)))
    assert "System role not supported" in err and "row 1" in err


# --- the rewards --------------------------------------------------------------------------------------------------

def sample(conversational: bool = False) -> dict:
    from datasets import Dataset

    from vram_planner.run.rewards import sample_batch

    prompt = CHAT if conversational else "1 + 1?"
    return sample_batch(Dataset.from_list([{"prompt": prompt, "answer": "2"}]))


def check(*outputs):
    """Run check_rewards on reward functions returning each of `outputs`."""
    from vram_planner.run.rewards import check_rewards

    functions = {f"r{i}": (lambda value: lambda **kwargs: value)(output) for i, output in enumerate(outputs)}
    check_rewards(functions, sample())


@pytest.mark.parametrize(("output", "expected"), [
    (None, "returned None"), (1.0, "returned a float"), (math.nan, "returned a float"), ("good", "returned a str"),
    (["a", 1.0], "completion 1"), ([1.0, [2.0]], "completion 2"), ([1.0], "2 completions"),
    ([1.0, {"score": 2}], "dict"),
])
def test_a_reward_must_return_one_number_per_completion(output, expected):
    from vram_planner.errors import VramPlanError

    with pytest.raises(VramPlanError, match="r0") as raised:
        check(output)
    assert expected in str(raised.value) and "NoneType" not in str(raised.value)


@pytest.mark.parametrize("output", [
    [1.0, None], [math.nan, 1.0], [True, 0], (0.5, 2), [math.inf, -1.0],
])
def test_what_trl_turns_into_a_reward_tensor_is_accepted(output):
    check(output)


def test_numpy_and_torch_scalars_are_numbers_as_in_trl():
    import numpy as np
    import torch

    check([np.float32(0.5), np.int64(1)], [torch.tensor(0.5), 1.0], np.array([1.0, 2.0]))


def test_no_reward_scoring_any_completion_is_refused():
    from vram_planner.errors import VramPlanError

    with pytest.raises(VramPlanError, match="None or NaN"):
        check([None, None], [math.nan, None])
    check([None, None], [math.nan, 1.0])  # one score is enough for TRL


def test_the_sample_batch_carries_what_trl_passes():
    plain, chat = sample(), sample(conversational=True)
    for batch in (plain, chat):
        assert {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                "answer"} <= set(batch)
        assert len(batch["completions"]) == len(batch["completion_ids"]) == len(batch["answer"])
    assert all(isinstance(c, str) for c in plain["completions"])
    assert all(c[0]["role"] == "assistant" for c in chat["completions"])  # conversational completions


def test_a_reward_returning_none_stops_the_run_before_the_smoke_step(capsys, tiny_model_folder, tmp_path):
    module = tmp_path / "my_rewards.py"
    module.write_text("def nothing(completions, **kw):\n    return None\n")
    err = bad_run(capsys, tmp_path, tiny_model_folder, "--dataset", "math-sample", "--reward", f"{module}:nothing")
    assert "returned None" in err


# --- optional dependencies ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [["--optim", "adamw_8bit"], ["--load-in-4bit", "--lora-r", "16"], []])
def test_bitsandbytes_is_checked_before_anything_is_written(capsys, monkeypatch, tmp_path, flags):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    out = tmp_path / "run"
    # on a 16 GB laptop card the plan itself chooses adamw_8bit for Llama-3.2-1B (the README's headline)
    err = one_line_error(capsys, "run", "--gpu", "rtx3080-mobile", "--model", "Llama-3.2-1B", "--dataset",
                         "math-sample", "--output-dir", str(out), *flags)
    assert "bitsandbytes" in err and INSTALL_HINT in err and not out.exists()


@pytest.mark.parametrize("key", ["expandable_segments_reserve:0.5", "expandable_segments_reserve_by_class:[a:8G]"])
def test_a_key_the_installed_torch_refuses_is_refused_before_anything_is_written(capsys, tmp_path, key):
    """torch 2.14 and earlier refuse torch 2.15's keys only at the run's first CUDA allocation, after the model has
    loaded; the CPU wheel the suite runs is 2.13."""
    import torch

    out = tmp_path / "run"
    err = one_line_error(capsys, "run", "--gpu", "24GiB", "--model", "Llama-3.2-1B", "--dataset", "math-sample",
                         "--output-dir", str(out), "--allocator-conf", "expandable_segments:True," + key)
    assert err.strip() == (f"error: --allocator-conf: {key.partition(':')[0]} needs torch 2.15 or later, and torch "
                           f"{torch.__version__} is installed, which refuses it: pip install 'torch>=2.15', or leave "
                           "it out")
    assert not out.exists()


@pytest.mark.parametrize("package", ["torch", "transformers", "trl", "peft"])
@pytest.mark.parametrize("command", [
    ["run", "--gpu", "24GiB", "--model", "Llama-3.2-1B", "--dataset", "math-sample", "--dry-run"],
    ["probe"], ["probe", "--simulate", "--gpu", "h100", "--quick"], ["trace", "--model", "Llama-3.2-1B"],
])
def test_without_the_train_extra_every_command_gives_the_install_hint(capsys, monkeypatch, package, command):
    import importlib.metadata

    real_version = importlib.metadata.version

    def version(name):
        if name == package:
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setitem(sys.modules, package, None)
    err = one_line_error(capsys, *command)
    assert "NotFoundError" not in err
    assert f"needs torch, transformers, TRL and PEFT ({package} cannot be imported): {INSTALL_HINT}" in err


# --- flags --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_run_offers_no_json_or_plot(capsys, tmp_path, flag):
    err = one_line_error(capsys, "run", "--gpu", "24GiB", "--model", "Llama-3.2-1B", "--dataset", "math-sample",
                         "--dry-run", flag, *([str(tmp_path / "p.png")] if flag == "--plot" else []))
    assert flag in err


@pytest.mark.parametrize(("flag", "value"), [("--max-steps", "0"), ("--max-steps", "-2"), ("--save-steps", "0"),
                                             ("--save-steps", "-1")])
def test_step_counts_must_be_positive(capsys, tmp_path, flag, value):
    out = tmp_path / "run"
    err = one_line_error(capsys, "run", "--gpu", "24GiB", "--model", "Llama-3.2-1B", "--dataset", "math-sample",
                         "--output-dir", str(out), flag, value)
    assert flag in err and value in err and not out.exists()


# --- one progress line, on the main process -----------------------------------------------------------------------

def test_only_the_main_process_prints(capsys, monkeypatch, tmp_path):
    args = ["run", "--gpu", "h100", "--model", "Llama-3.2-1B", "--dataset", "math-sample", "--num-gpus", "2",
            "--output-dir", str(tmp_path / "run"), "--dry-run"]
    monkeypatch.setenv("WORLD_SIZE", "2")  # as `accelerate launch` starts each process
    monkeypatch.setenv("RANK", "1")
    code, stdout, err = run(capsys, *args)
    assert code == 0 and stdout == "" and err == ""
    monkeypatch.setenv("RANK", "0")
    code, stdout, _ = run(capsys, *args)
    assert code == 0 and "GRPOConfig(" in stdout


def test_the_progress_line_and_the_log_come_from_the_main_process_only(capsys, tmp_path):
    from transformers import TrainerControl, TrainerState

    from vram_planner.run.progress import JsonlLog, RichProgress

    logs = {"reward": 0.5, "step_time": 1.0}
    for main_process in (False, True):
        state = TrainerState(max_steps=1, global_step=1, is_world_process_zero=main_process)
        progress, log = RichProgress(1e9), JsonlLog(tmp_path / f"log-{main_process}.jsonl", 1e9)
        progress.on_train_begin(None, state, TrainerControl())
        for callback in (progress, log):
            callback.on_log(None, state, TrainerControl(), logs=logs)
        progress.on_train_end(None, state, TrainerControl())
        err = capsys.readouterr().err
        assert ("reward 0.500" in err) == main_process
        assert (tmp_path / f"log-{main_process}.jsonl").exists() == main_process


def test_the_log_has_the_measured_step_time_beside_the_predicted(tmp_path, monkeypatch):
    import json

    from transformers import TrainerControl, TrainerState

    from vram_planner.run import progress

    clock = iter([100.0, 130.0, 150.0, 190.0])  # start, then the time of each logged line
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    log = progress.JsonlLog(tmp_path / "log.jsonl", 1e9, predicted_step_seconds=9.5)
    for step in (1, 3, 5):
        log.on_log(None, TrainerState(global_step=step, is_world_process_zero=True), TrainerControl(), logs={})
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [line.get("measured_step_seconds") for line in lines] == [None, 10.0, 20.0]  # loading is no step
    assert {line["predicted_step_seconds"] for line in lines} == {9.5}


def test_a_run_predicts_its_step_time_on_a_catalog_card(llama_1b_file, tmp_path):
    from vram_planner import engine
    from vram_planner.run.setup import RunSetup

    setup = RunSetup(verdict=engine.check(str(llama_1b_file), "h100-80gb"), model_id=str(llama_1b_file),
                     dataset="math-sample", rewards=["format"], output_dir=tmp_path / "run")
    assert setup.predicted_step_seconds > 0
    sized = RunSetup(verdict=engine.check(str(llama_1b_file), "80GiB"), model_id=str(llama_1b_file),
                     dataset="math-sample", rewards=["format"], output_dir=tmp_path / "run")
    assert sized.predicted_step_seconds is None


# --- the extras ---------------------------------------------------------------------------------------------------

def train_extra() -> list[str]:
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return [re.split(r"[<>=!~;\[ ]", requirement)[0].lower() for requirement in extras["train"]]


def test_the_train_extra_installs_what_the_plan_recommends():
    from vram_planner.model.spec import Optimizer

    assert any(o.needs_bitsandbytes for o in Optimizer)  # the plan's adamw_8bit among them
    assert {"torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes"} <= set(train_extra())
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "pip install 'vram-plan[train]'" in readme and "bitsandbytes" in readme


def test_bitsandbytes_from_the_train_extra_imports_without_a_gpu():
    import importlib

    bitsandbytes = importlib.import_module("bitsandbytes")  # CI installs .[test], which includes .[train]
    assert bitsandbytes.optim.AdamW8bit is not None


QUIET_UNLESS_VERBOSE = ["an error, verbose=False", "a warning, verbose=True", "an error, verbose=True", "after the run"]


def lines_logged(warns: str, errs: str, stream: str, prelude: str = "") -> list[str]:
    """What a script prints to `stream` that logs a warning (through `warns`) and an error (through `errs`) inside
    `library_output(verbose)`, verbose False then True, and a warning after it: a process of its own, as pytest's
    handlers would catch the records in this one."""
    code = ("import logging, sys\nfrom vram_planner.run.launch import library_output\n" + prelude
            + "for verbose in (False, True):\n"
            "    with library_output(verbose):\n"
            f"        {warns}.warning('a warning, verbose=%s', verbose)\n"
            f"        {errs}.error('an error, verbose=%s', verbose)\n"
            f"{errs}.warning('after the run')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return getattr(done, stream).splitlines()


def test_warnings_of_libraries_that_never_set_logging_up_show_only_with_verbose():
    # bitsandbytes 0.50 logs such a warning when PEFT imports it on a CPU with AVX512-BF16; it reaches stderr through
    # logging's last-resort handler
    assert lines_logged("logging.getLogger('bitsandbytes.backends.cpu.ops')", "logging.getLogger('bitsandbytes')",
                        "stderr") == QUIET_UNLESS_VERBOSE


def test_warnings_of_a_logger_with_its_own_handler_show_only_with_verbose():
    # DeepSpeed's logger (stdout, no propagation, its level set when deepspeed is imported, which accelerate does
    # inside the run where DeepSpeed is installed) warns "Setting accelerator to CPU" on a machine without CUDA
    imported = ("def imported():\n"
                "    logger = logging.getLogger('DeepSpeed')\n"
                "    logger.setLevel(logging.WARNING)\n"
                "    logger.propagate = False\n"
                "    logger.handlers = [logging.StreamHandler(sys.stdout)]\n"
                "    return logger\n")
    assert lines_logged("imported()", "imported()", "stdout", imported) == QUIET_UNLESS_VERBOSE


def test_use_kernels_needs_the_kernels_package_that_transformers_loads_the_hubs_kernels_with(monkeypatch):
    import transformers.utils.import_utils as import_utils

    from vram_planner.errors import VramPlanError
    from vram_planner.model.spec import training_config
    from vram_planner.run.checks import check_dependencies

    low, high = import_utils.KERNELS_MIN_VERSION, import_utils.KERNELS_MAX_VERSION
    monkeypatch.setattr(import_utils, "is_kernels_available", lambda *args, **kwargs: False)
    with pytest.raises(VramPlanError) as refused:
        check_dependencies(training_config({"use_kernels": True}))
    assert str(refused.value).startswith(f"--use-kernels needs the kernels package ({low} or newer, below {high})")
    assert str(refused.value).endswith(f"pip install 'kernels>={low},<{high}'")
    check_dependencies(training_config({"use_kernels": False}))  # the torch code needs nothing more
    monkeypatch.setattr(import_utils, "is_kernels_available", lambda *args, **kwargs: True)
    check_dependencies(training_config({"use_kernels": True}))
