"""TRL's own command-line arguments on vram-plan's command line: parsed as TRL's parser parses them, and read as a
recipe with those keys is."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import shlex
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import CLASS_NAME, json_of, one_line_error, run
from vram_planner.cli import main
from vram_planner.trl_arguments import split_trl_arguments, trl_command_line
from vram_planner.request import request_fields
from vram_planner.trl_names import BOOLEAN_ARGUMENTS, LIST_ARGUMENTS, SHARED_ARGUMENTS

# What a user pastes from `trl grpo ...`: Qwen2.5-1.5B LoRA in bfloat16
PASTED = ["--model_name_or_path", "Qwen2.5-1.5B", "--use_peft", "--lora_r", "32", "--lora_target_modules", "q_proj",
          "k_proj", "v_proj", "--bf16", "true", "--dtype", "bfloat16", "--per_device_train_batch_size=8",
          "--num-generations", "8", "--max_completion_length", "512", "--learning_rate", "1e-6", "--output_dir",
          "out", "--report_to", "none", "--gradient_checkpointing_kwargs", '{"use_reentrant": false}']
# the same as a recipe file's keys
PASTED_RECIPE = {"model_name_or_path": "Qwen2.5-1.5B", "use_peft": True, "lora_r": 32,
                 "lora_target_modules": ["q_proj", "k_proj", "v_proj"], "bf16": True, "dtype": "bfloat16",
                 "per_device_train_batch_size": 8, "num_generations": 8, "max_completion_length": 512,
                 "learning_rate": 1e-6, "output_dir": "out", "report_to": ["none"],
                 "gradient_checkpointing_kwargs": {"use_reentrant": False}}


@pytest.fixture(autouse=True)
def no_default_accelerate_config(monkeypatch, tmp_path):
    # a pasted accelerate launch or trl grpo reads $HF_HOME/accelerate/default_config.yaml where no config is named
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


def _installed_trl_classes():
    pytest.importorskip("trl")
    from trl import GRPOConfig, ModelConfig, ScriptArguments
    from trl.scripts.grpo import GRPOScriptArguments
    from trl.scripts.utils import DatasetMixtureConfig

    return GRPOScriptArguments, ScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig


def test_the_argument_kinds_are_those_of_the_installed_trl():
    # the booleans as the installed TRL's dataclasses type them, the arguments its parser takes several values of,
    # and the names shared with the request's fields (older releases' are in the tables too; the installed ones must
    # all be, and no installed argument is a list the parser takes one value of)
    booleans, names = set(), set()
    for cls in _installed_trl_classes():
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            names.add(field.name)
            if bool in {hints[field.name], *typing.get_args(hints[field.name])}:
                booleans.add(field.name)
    several = {action.dest for action in _trl_parser()._actions if action.nargs == "+"}
    assert booleans <= BOOLEAN_ARGUMENTS, sorted(booleans - BOOLEAN_ARGUMENTS)
    assert several == LIST_ARGUMENTS & names
    assert names & set(request_fields()) <= SHARED_ARGUMENTS <= set(request_fields())


@functools.lru_cache(maxsize=1)
def _trl_parser():
    from trl import TrlParser

    return TrlParser(_installed_trl_classes()[:1] + _installed_trl_classes()[2:])


# Values of each kind that TRL's parser takes, as typed on a command line
BOOLEAN_WORDS = st.sampled_from(["true", "false", "True", "FALSE", "yes", "no", "t", "f", "y", "n", "1", "0"])
ARGUMENT = st.one_of(
    st.tuples(st.sampled_from(["use_peft", "bf16", "load_in_4bit", "use_vllm", "gradient_checkpointing",
                               "disable_dropout", "push_to_hub", "log_completions"]),
              st.one_of(st.just([]), BOOLEAN_WORDS.map(lambda word: [word]))),
    st.tuples(st.sampled_from(["per_device_train_batch_size", "num_generations", "lora_r", "max_steps",
                               "gradient_accumulation_steps", "max_completion_length", "seed"]),
              st.integers(-1, 4096).map(lambda n: [str(n)])),
    st.tuples(st.sampled_from(["beta", "learning_rate", "temperature", "vllm_gpu_memory_utilization",
                               "lora_dropout"]),
              st.sampled_from(["0.04", "1e-06", "0.7", "0", "2.5e-5", "-0.5"]).map(lambda x: [x])),
    st.sampled_from([("dtype", ["bfloat16"]), ("optim", ["adamw_8bit"]), ("attn_implementation", ["sdpa"]),
                     ("output_dir", ["out/dir"]), ("run_name", ["my-run"])]),
    st.tuples(st.sampled_from(["lora_target_modules", "reward_funcs", "lora_modules_to_save"]),
              st.lists(st.sampled_from(["q_proj", "v_proj", "accuracy", "none", "all-linear"]), min_size=1,
                       max_size=3)),
    st.tuples(st.just("gradient_checkpointing_kwargs"),
              st.sampled_from(['{"use_reentrant": false}', '{"use_reentrant": true}']).map(lambda x: [x])),
    st.tuples(st.sampled_from(["no_gradient_checkpointing", "no_ds3_gather_for_generation"]), st.just([])),
)


@settings(max_examples=150, deadline=None)
@given(arguments=st.lists(ARGUMENT, min_size=1, max_size=6), dashes=st.booleans(), inline=st.booleans())
def test_the_values_are_those_trls_own_parser_reads(arguments, dashes, inline):
    # the installed TRL's TrlParser (HfArgumentParser) on the same command line: every argument's value, with what
    # TrainingArguments and ModelConfig make of it after parsing (JSON mappings read; one LoRA target is its name)
    parser = _trl_parser()
    bare = {action.dest for action in parser._actions if action.nargs == "?"}  # TRL 1.16's bf16 wants a value
    argv = []
    for name, values in arguments:
        values = values or ([] if name in bare or name.startswith("no_") else ["true"])
        option = "--" + (name.replace("_", "-") if dashes else name)
        argv += [f"{option}={values[0]}"] if inline and len(values) == 1 else [option, *values]
    ours, parsed = split_trl_arguments(argv, {"--gpu", "--model"})
    assert ours == []
    namespace = vars(parser.parse_args(argv))
    for key, value in parsed.items():
        theirs = namespace[key]
        if key == "gradient_checkpointing_kwargs":
            theirs = json.loads(theirs)
        if key == "lora_target_modules" and len(theirs) == 1:
            theirs = theirs[0]
        # a number as the field's type has it (0 for a float's 0.0 is the same to the request), a boolean only so
        assert value == theirs and isinstance(value, bool) == isinstance(theirs, bool), (key, value, theirs)


def test_the_commands_own_options_stay_its_own_and_unknown_ones_are_clicks_to_name():
    ours, trl = split_trl_arguments(["--gpu", "24GiB", "--lora-r", "8", "--use-peft", "--beta", "-0.5", "--foo_bar",
                                     "3", "--no_ds3_gather_for_generation"], {"--gpu", "--lora-r"})
    assert ours == ["--gpu", "24GiB", "--lora-r", "8", "--foo_bar", "3"]
    assert trl == {"use_peft": True, "beta": -0.5, "ds3_gather_for_generation": False}


def test_trls_command_line_is_judged_as_the_same_keys_in_a_recipe_file(capsys, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps(PASTED_RECIPE))
    code, doc = json_of(capsys, "check", "--gpu", "rtx4090", *PASTED)
    file_code, file_doc = json_of(capsys, "check", "--gpu", "rtx4090", "--config", str(recipe))
    assert (code, {**doc, "notes": doc["notes"][:-1]}) == (file_code, {**file_doc, "notes": file_doc["notes"][:-1]})
    assert doc["peft_config"]["r"] == 32 and doc["peft_config"]["target_modules"] == ["q_proj", "k_proj", "v_proj"]
    assert doc["notes"][-1] == "Read as TRL's arguments: 3 of them move no GPU memory here and are left out"
    assert file_doc["notes"][-1].startswith("Read as a TRL recipe: 3 of its keys")
    code, out, err = run(capsys, "check", "--gpu", "rtx4090", *PASTED)
    assert code in (0, 1) and err == "" and "Note: Read as TRL's arguments" in out


def test_trls_arguments_win_over_the_config_file_as_in_trls_parser(capsys, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps(PASTED_RECIPE))
    _, doc = json_of(capsys, "check", "--gpu", "rtx4090", "--config", str(recipe), "--per_device_train_batch_size",
                     "16", "--use_peft", "false")
    edited = tmp_path / "edited.yaml"
    edited.write_text(json.dumps({**PASTED_RECIPE, "per_device_train_batch_size": 16, "use_peft": False}))
    _, edited_doc = json_of(capsys, "check", "--gpu", "rtx4090", "--config", str(edited))
    assert doc["config"] == edited_doc["config"] and doc["peft_config"] is None
    assert doc["config"]["per_device_train_batch_size"] == 16
    # and our own flags win over both
    _, flagged = json_of(capsys, "check", "--gpu", "rtx4090", "--config", str(recipe), "--per_device_train_batch_size",
                         "16", "--per-device-train-batch-size", "24")
    assert flagged["config"]["per_device_train_batch_size"] == 24


@pytest.mark.parametrize("gpu", ["rtx4060-laptop", "rtx3080-mobile"])
def test_the_plans_arguments_added_to_the_command_make_it_the_plans_choice(capsys, gpu):
    command = ["--model_name_or_path", "Qwen2.5-1.5B", "--per_device_train_batch_size", "8",
               "--max_completion_length", "1024", "--gradient_checkpointing", "false"]
    code, out, _ = run(capsys, "plan", "--gpu", gpu, *command)
    _, planned = json_of(capsys, "plan", "--gpu", gpu, *command)
    line = out.split("Add to the TRL command's arguments")[1].splitlines()[1]
    assert line == trl_command_line(planned["recipe_edits"]) and planned["recipe_edits"]
    code, checked = json_of(capsys, "check", "--gpu", gpu, *command, *shlex.split(line))
    same = ("config", "peft_config", "quantization_config", "peak_bytes")
    assert (code == 0) == planned["fits"] and {k: checked[k] for k in same} == {k: planned[k] for k in same}


@pytest.mark.parametrize("arguments, said", [
    (["--use_peft", "maybe"], "--use_peft takes yes/no, true/false, t/f, y/n or 1/0"),
    (["--lora_r"], "--lora_r takes one value, as TRL's parser does"),
    (["--lora_r", "8", "16"], "--lora_r takes one value, as TRL's parser does (got 2: 8 16)"),
    (["--no_gradient_checkpointing", "3"], "--no_gradient_checkpointing takes no value"),
    (["--gradient_checkpointing_kwargs", "{use_reentrant"], "is not a JSON mapping"),
    (["--gradient_checkpointing_kwargs", '{"a": ' * 5000], "is nested more than"),
    (["--lora_target_modules"], "--lora_target_modules needs one or more values"),
    (["--deepspeed", "ds.json"], "the DeepSpeed config ds.json is not a file here"),
    (["--fsdp", "full_shard auto_wrap"], "the Trainer's FSDP options are not read"),
    (["--multi_gpu=yes"], "--multi_gpu takes no value (accelerate launch's switch)"),
    (["--num_processes"], "--num_processes takes one value, as accelerate launch does"),
    (["--num_processes", "0", "--multi_gpu"], "num_processes 0 is not a number of processes"),
    (["--accelerate_config", "zer3"], "did you mean zero3"),
    (["--accelerate_config", "fsdp1"], "fsdp_version 1 is not planned"),
    (["--mixed_precision", "fp8"], "mixed_precision 'fp8' is not planned (FP8 training)"),
    (["--use_megatron_lm"], "use_megatron_lm True is not planned"),
    (["--use_deepspeed", "--offload_optimizer_device", "nvme"], "offload_optimizer_device 'nvme' is not planned"),
    (["--use_fsdp", "--fsdp_version", "2", "--fsdp_sharding_strategy", "SHARD_GRAD_OP"],
     "fsdp_sharding_strategy 'SHARD_GRAD_OP' is not planned"),
    (["--use_deepspeed", "--use_fsdp"], "DeepSpeed and FSDP cannot both launch the run"),
    (["--use_dora"], "use_dora True is not planned"),
    (["--foo_bar", "3"], "No such option '--foo_bar'"),
])
def test_what_trls_parser_would_refuse_or_the_plan_cannot_count_is_one_line(capsys, arguments, said):
    err = one_line_error(capsys, "check", "--gpu", "24GiB", "--model", "SmolLM2-135M", *arguments)
    assert said in err, err


def test_gpus_and_run_take_trls_arguments(capsys, tmp_path):
    code, cards = json_of(capsys, "gpus", "--model_name_or_path", "Qwen2.5-1.5B", "--use_peft", "--bf16", "true")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: Qwen2.5-1.5B\nuse_peft: true\nbf16: true\n")
    assert (code, cards) == json_of(capsys, "gpus", "--config", str(recipe))
    _, full = json_of(capsys, "gpus", "--model", "Qwen2.5-1.5B")
    assert [card["peak_bytes"] for card in cards] != [card["peak_bytes"] for card in full]
    out = tmp_path / "run"
    code, stdout, err = run(capsys, "run", "--model_name_or_path", "SmolLM2-135M", "--gpu", "24GiB", "--dataset",
                            "math-sample", "--num_generations", "4", "--per_device_train_batch_size", "4",
                            "--max_steps", "3", "--output_dir", str(out), "--learning_rate", "3e-6", "--dry-run")
    assert code == 0, err
    assert "max_steps=3" in stdout and f"output_dir={str(out)!r}" in stdout and "learning_rate=3e-06" in stdout
    err = one_line_error(capsys, "run", "--model", "SmolLM2-135M", "--gpu", "24GiB", "--dataset", "math-sample",
                         "--max_steps", "soon", "--dry-run")
    assert "--max_steps takes a whole number of steps" in err


TOKENS = st.one_of(st.sampled_from(["true", "no", "1", "0", "-1", "8", "0.5", "bfloat16", "q_proj", "{", "{}",
                                    '{"use_reentrant": false}', "None", "all-linear", "--x", "=", "zero3", "fsdp2",
                                    "cpu", "bf16"]),
                   st.text(max_size=6))
# (TrainingArguments' --debug is vram-plan's own: the traceback of an error); with the launcher's options that trl
# grpo hands to accelerate (vram_planner.launcher)
NAMES = st.sampled_from(sorted((BOOLEAN_ARGUMENTS | LIST_ARGUMENTS | SHARED_ARGUMENTS
                                | {"model_name_or_path", "use_peft", "deepspeed", "torch_compile", "learning_rate",
                                   "no_gradient_checkpointing", "generation_batch_size", "vllm_max_model_len",
                                   "num_processes", "accelerate_config", "config_file", "use_deepspeed", "zero_stage",
                                   "use_fsdp", "fsdp_version", "multi_gpu", "mixed_precision",
                                   "offload_optimizer_device", "fsdp_offload_params", "dynamo_backend"})
                               - {"debug"}))


@pytest.mark.slow
@settings(max_examples=250, deadline=None)
@given(arguments=st.lists(st.tuples(NAMES, st.lists(TOKENS, max_size=3), st.booleans()), min_size=1, max_size=5),
       command=st.sampled_from(["check", "plan"]))
def test_any_trl_command_line_gives_a_verdict_a_plan_or_one_clear_line(arguments, command):
    argv = []
    for name, values, dashes in arguments:
        argv += ["--" + (name.replace("_", "-") if dashes else name), *values]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([command, "--gpu", "24GiB", "--model", "SmolLM2-135M", *argv])
    if code == 2:
        assert out.getvalue() == "" and err.getvalue().count("\n") == 1 and err.getvalue().startswith("error: ")
        assert not CLASS_NAME.search(err.getvalue()), err.getvalue()
    else:
        assert code in (0, 1), err.getvalue()


def test_the_library_reads_a_pasted_command_as_the_command_line_does(capsys):
    from vram_planner import api

    text = "trl grpo " + shlex.join(PASTED)
    report = api.check(api.recipe(text, "rtx4090"))
    _, doc = json_of(capsys, "check", "--gpu", "rtx4090", *PASTED)
    assert {**report.to_dict(), "notes": []} == {**doc, "notes": []}
    planned = api.plan(api.recipe(text, "rtx4060-laptop"))
    assert api.recipe_edits(text, planned) == json_of(capsys, "plan", "--gpu", "rtx4060-laptop", *PASTED)[1][
        "recipe_edits"]


@pytest.mark.parametrize("command", ["plan", "check", "trace", "gpus", "run"])
def test_each_command_that_takes_them_says_so_in_its_help(capsys, command):
    code, out, _ = run(capsys, command, "--help")
    said = " ".join(out.split())
    assert code == 0 and "TRL's own arguments are read too" in said and "--accelerate_config zero3" in said
