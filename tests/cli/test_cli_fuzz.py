"""Fuzz the command line: every subcommand, fed bad numbers, names, files of random bytes, empty files, unreadable
and unwritable paths, devices, oversized files and JSON or YAML nested 100,000 deep, answers with exit code 2 and
exactly one line on stderr that names no exception class, within seconds (devices within one). Its output reads on a
console that is not UTF-8, and a closed pipe is exit 141. In-process through `vram_planner.cli.main`, as
tests/cli/test_cli.py does."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from helpers import CLASS_NAME, CURRENT, FIXTURES, LLAMA_1B, unwritable_targets
from vram_planner import files, profiles
from vram_planner.cli import main

TINY = FIXTURES / "tiny-llama-headdim.json"
SHORT = ["--per-device-train-batch-size", "2", "--num-generations", "2", "--max-prompt-length", "16",
         "--max-completion-length", "16"]
# What each command needs besides the input under test; the tiny model keeps a trace that runs to seconds.
BASE = {
    "plan": ["plan", "--gpu", "24GiB", "--model", "Llama-3.2-1B"],
    "check": ["check", "--gpu", "24GiB", "--model", "Llama-3.2-1B"],
    "trace": ["trace", "--gpu", "24GiB", "--model", str(TINY), *SHORT],
}
TRAINING_COMMANDS = list(BASE)
SECONDS = 10.0  # "within seconds"; the analytic commands answer in milliseconds
OOM_LOG = CURRENT + "\n"  # an OOM to advise on, so that what is under test is the other input


@pytest.fixture(autouse=True, scope="module")
def _training_stack_imported():
    """trace, probe and run import torch, transformers, TRL and datasets first (seconds, once per process): the time
    bound is on what each command does with its input. Imported here, outside a test's capsys, the libraries' log
    handlers hold a stream that stays open."""
    import datasets  # noqa: F401
    import trl  # noqa: F401


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """No hub: an unknown id must fail fast and in one line, as on a machine without network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi: `--gpu auto` and `probe` find no card


def refused(capsys, args: list[str], seconds: float = SECONDS) -> str:
    """Run the command; assert exit 2, one `error:` line on stderr naming no exception class, within `seconds`."""
    start = time.perf_counter()
    code = main([str(a) for a in args])
    elapsed = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert code == 2, f"{args}: exit {code}\nstdout: {out[-800:]}\nstderr: {err[-800:]}"
    assert err.count("\n") == 1 and err.startswith("error: "), f"{args}: stderr is not one line:\n{err[-2000:]}"
    assert not CLASS_NAME.search(err), f"{args}: {err}"
    assert out == "", f"{args}: wrote to stdout before refusing:\n{out[-800:]}"
    assert elapsed < seconds, f"{args}: {elapsed:.1f} s"
    return err


def answered(capsys, args: list[str], seconds: float = SECONDS) -> int:
    """Extreme but meaningful input: a verdict (0 fits, 1 does not) or a one-line refusal, within `seconds`."""
    start = time.perf_counter()
    code = main([str(a) for a in args])
    elapsed = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert code in (0, 1, 2), f"{args}: exit {code}"
    if code == 2:
        assert err.count("\n") == 1 and err.startswith("error: ") and not CLASS_NAME.search(err), f"{args}: {err}"
    assert elapsed < seconds, f"{args}: {elapsed:.1f} s"
    return code


# Flags and values that are wrong whatever else is given (issue 10's list, and their neighbours).
BAD_KNOBS = [
    *(["--per-device-train-batch-size", v] for v in ["0", "-1", "nan", "inf", "1.5", ""]),
    *(["--gradient-accumulation-steps", v] for v in ["0", "-3", "nan"]),
    *(["--steps-per-generation", v] for v in ["0", "-1"]),
    *(["--num-generations", v] for v in ["0", "1", "-2"]),
    *(["--max-prompt-length", v] for v in ["0", "-1", "inf"]),
    *(["--max-completion-length", v] for v in ["0", "-5", "nan"]),
    *(["--beta", v] for v in ["nan", "inf", "-inf"]),
    *(["--num-iterations", v] for v in ["0", "-1"]),
    *(["--use-vllm", "--vllm-gpu-memory-utilization", v] for v in ["nan", "inf", "0", "-0.5", "1.5"]),
    *(["--lora-r", v] for v in ["0", "-8", "nan"]),
    *(["--lora-r", "8", "--lora-dropout", v] for v in ["nan", "inf", "-0.1", "1.5"]),
    *(["--num-gpus", v] for v in ["0", "-1"]),
    *(["--num-gpus", "2", "--zero-stage", v] for v in ["4", "-1"]),
    *(["--safety-margin", v] for v in ["nan", "inf", "-0.1", "0.9"]),
    *(["--trl-version", v] for v in ["2.0", "-1", "abc", "", "99.1"]),
    *(["--transformers-version", v] for v in ["7.0", "3.9", "-1", "abc", "", "latest"]),
    ["--model", "gemma-2-2b", "--attn-implementation", "sdpa"],
    *(["--lora-r", "8", "--lora-target-modules", v] for v in ["qproj", ",,,", ""]),
    ["--gpu", "rtx9999"], ["--gpu", ""], ["--gpu", "0GiB"], ["--gpu", "-3GiB"], ["--gpu", "nanGiB"],
    ["--gpu", "infGiB"], ["--gpu", "1e400GiB"], ["--gpu", "auto"],
    ["--model", "not-a-catalog-model"], ["--model", ""], ["--model", "someone/not-a-real-model-xyz"],
    ["--optim", "adamw9"], ["--dtype", "float8"], ["--dtype", "bf16"], ["--mixed-precision", "bf8"],
    ["--attn-implementation", "flash3"], ["--use-vllm", "--vllm-mode", "remote"],
    ["--lora-r", "8", "--load-in-4bit", "--bnb-4bit-quant-type", "nf5"], ["--load-in-4bit"],
    ["--no-such-flag"], ["--lora-alpha", "16"], ["--zero-stage", "2", "--fsdp", "--num-gpus", "2"],
    ["--gpu", "t4", "--dtype", "float16", "--mixed-precision", "fp16"],
    ["--gpu", "v100", "--attn-implementation", "flash_attention_2"],
]
# Far beyond any card, still well-formed: a verdict or a refusal, never minutes.
EXTREME_KNOBS = [
    ["--per-device-train-batch-size", "1073741824"], ["--per-device-train-batch-size", "1000000000000",
                                                       "--num-generations", "2"],
    ["--max-completion-length", "100000000"], ["--max-prompt-length", "1000000000"],
    ["--num-generations", "2147483648", "--per-device-train-batch-size", "2147483648"],
    ["--gradient-accumulation-steps", "1000000000"], ["--num-gpus", "1000000"], ["--lora-r", "1000000000"],
    ["--trl-version", "0.14"], ["--beta", "1e308"], ["--gpu", "1e30GiB"],
]


def _flag_id(flags: list[str]) -> str:
    return " ".join(flags) or "''"


@pytest.mark.parametrize("flags", BAD_KNOBS, ids=_flag_id)
@pytest.mark.parametrize("command", TRAINING_COMMANDS)
def test_bad_knobs(capsys, command, flags):
    refused(capsys, BASE[command] + flags)


@pytest.mark.parametrize("flags", BAD_KNOBS, ids=_flag_id)
def test_bad_knobs_with_advise(capsys, tmp_path, flags):
    refused(capsys, ["advise", oom_log(tmp_path), "--gpu", "24GiB", "--model", "Llama-3.2-1B", *flags])


@pytest.mark.parametrize("flags", EXTREME_KNOBS, ids=_flag_id)
@pytest.mark.parametrize("command", ["plan", "check"])
def test_extreme_knobs_are_answered_within_seconds(capsys, command, flags):
    answered(capsys, BASE[command] + flags)


@pytest.fixture(scope="module")
def traced_once():
    """The first trace in a process imports the model's code and warms torch up (seconds, once)."""
    assert main(BASE["trace"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("flags", [f for f in EXTREME_KNOBS if "--num-gpus" not in f], ids=_flag_id)
def test_extreme_knobs_are_traced_or_refused_within_seconds(capsys, traced_once, flags):
    answered(capsys, BASE["trace"] + flags, seconds=30)  # a trace builds the model: seconds, not milliseconds


@pytest.mark.parametrize("model", [*(entry.name for entry in profiles.models()),
                                   *(str(path) for path in sorted(FIXTURES.glob("tiny-*.json")))])
@pytest.mark.parametrize("command", ["plan", "check", "advise"])
def test_every_model_gets_an_answer(capsys, tmp_path, command, model):
    # Not bad input at all: the phi3 family's fused gate_up_proj once crashed all of them.
    code = answered(capsys, with_model(command, tmp_path, model))
    assert code in (0, 1) if command != "advise" else code == 0


def test_a_phi3_model_is_traced(capsys):
    code = answered(capsys, [*BASE["trace"], "--model", FIXTURES / "tiny-phi3.json"], seconds=30)
    assert code in (0, 1)


# config.json files that are not a decoder language model's, or whose sizes are nonsense.
BAD_MODEL_CONFIGS = {
    "negative hidden size": LLAMA_1B | {"hidden_size": -2048},
    "zero layers": LLAMA_1B | {"num_hidden_layers": 0},
    "zero heads": LLAMA_1B | {"num_attention_heads": 0},
    "negative vocabulary": LLAMA_1B | {"vocab_size": -1},
    "zero intermediate size": LLAMA_1B | {"intermediate_size": 0},
    "a size as a string": LLAMA_1B | {"hidden_size": "2048"},
    "a size as a float": LLAMA_1B | {"hidden_size": 2048.5},
    "a size as a boolean": LLAMA_1B | {"num_hidden_layers": True},
    "a size beyond any model": LLAMA_1B | {"vocab_size": 2**70},
    "heads that do not divide": LLAMA_1B | {"num_key_value_heads": 7},
    "no sizes": {"model_type": "llama"},
    "BERT": {"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 30522, "hidden_size": 768,
             "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
    "T5": {"model_type": "t5", "is_encoder_decoder": True, "architectures": ["T5ForConditionalGeneration"],
           "vocab_size": 32128, "d_model": 512, "num_layers": 6, "num_heads": 8},
    "gemma3 text_config a list": {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                                  "text_config": [1, 2]},
    "gemma3 text_config a string": {"model_type": "gemma3", "text_config": "gemma3_text"},
    "model_type a list": LLAMA_1B | {"model_type": ["llama"]},
    "architectures a string": LLAMA_1B | {"model_type": "x", "architectures": "LlamaForCausalLM"},
    "tie_word_embeddings a string": LLAMA_1B | {"tie_word_embeddings": "yes"},
    "a JSON list": [LLAMA_1B],
    "a JSON string": "llama",
    "JSON null": None,
}


@pytest.mark.parametrize("name", list(BAD_MODEL_CONFIGS))
@pytest.mark.parametrize("command", TRAINING_COMMANDS + ["advise"])
def test_bad_model_configs(capsys, tmp_path, command, name):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(BAD_MODEL_CONFIGS[name]))
    refused(capsys, with_model(command, tmp_path, config))


def with_model(command: str, tmp_path: Path, model: Path | str) -> list:
    """The command with `model` for --model (advise: with an OOM log, so the model is what gets read)."""
    if command == "advise":
        return ["advise", oom_log(tmp_path), "--gpu", "24GiB", "--model", model]
    return [*BASE[command], "--model", model]


# Calibration files of the wrong shape.
BAD_CALIBRATIONS = {
    "a list": [1, 2], "a string": "default", "a number": 3, "null": None,
    "an unknown key": {"cuda_context_byte": 1},
    "a negative context": {"cuda_context_bytes": -1},
    "a string for a number": {"allocator_overhead_fraction": "a lot"},
    "an overhead of 2": {"allocator_overhead_fraction": 2},
    "a mapping for a number": {"inference_hidden_bytes": {"a": 1}},
    "nan": {"backward_mlp_bytes": float("nan")},
    "measured a list": {"measured": [1]},
}


@pytest.mark.parametrize("name", list(BAD_CALIBRATIONS))
@pytest.mark.parametrize("command", TRAINING_COMMANDS)
def test_bad_calibrations(capsys, tmp_path, command, name):
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps(BAD_CALIBRATIONS[name]))
    refused(capsys, [*BASE[command], "--calibration", calibration])


# --config files with a value of the wrong type or shape, or no settings.
BAD_SETTINGS_FILES = {
    "optim a list": "optim: [a]\n", "model a mapping": "model: {a: b}\n", "gpu a list": "gpu: [1]\n",
    "gpu a number": "gpu: 24\n", "targets a mapping": "lora_r: 8\nlora_target_modules: {a: 1}\n",
    "batch a list": "per_device_train_batch_size: [1]\n", "batch a string": "per_device_train_batch_size: many\n",
    "beta nan": "beta: .nan\n", "a date": "max_completion_length: 2024-01-01\n", "unknown key": "batch: 4\n",
    "a list": "- a\n- b\n", "a scalar": "42\n", "broken YAML": "a: [\n", "a binary value": "optim: !!binary aGk=\n",
    "only comments": "# nothing here\n",
}


@pytest.mark.parametrize("name", list(BAD_SETTINGS_FILES))
@pytest.mark.parametrize("command", TRAINING_COMMANDS)
def test_bad_settings_files(capsys, tmp_path, command, name):
    settings_file = tmp_path / "run.yaml"
    settings_file.write_text(BAD_SETTINGS_FILES[name])
    base = [command, "--gpu", "24GiB", "--model", TINY]  # no flags over the file's values
    refused(capsys, [*base, "--config", settings_file])


@pytest.mark.parametrize("name", list(BAD_SETTINGS_FILES))
def test_bad_settings_files_with_advise(capsys, tmp_path, name):
    settings_file = tmp_path / "run.yaml"
    settings_file.write_text(BAD_SETTINGS_FILES[name])
    refused(capsys, ["advise", oom_log(tmp_path), "--gpu", "24GiB", "--model", "Llama-3.2-1B", "--config",
                     settings_file])


# Every file argument: where it goes on the command line (given the file and a folder for what else it needs).
FILE_ARGUMENTS = {
    **{f"{command} --{flag}": (lambda path, folder, command=command, flag=flag: [*BASE[command], f"--{flag}", path])
       for command in TRAINING_COMMANDS for flag in ("model", "config", "calibration")},
    "advise --model": lambda path, folder: ["advise", oom_log(folder), "--gpu", "24GiB", "--model", path],
    "advise --config": lambda path, folder: ["advise", oom_log(folder), "--gpu", "24GiB", "--model", "Llama-3.2-1B",
                                             "--config", path],
    "advise LOG": lambda path, folder: ["advise", path],
    "advise LOG with a model": lambda path, folder: ["advise", path, "--gpu", "24GiB", "--model", "Llama-3.2-1B"],
    "replay SNAPSHOT": lambda path, folder: ["replay", path],
}
FILE_NAMES = {"--model": "config.json", "--config": "run.yaml", "--calibration": "calibration.json",
              "LOG": "crash.log", "SNAPSHOT": "memory.pickle"}


def oom_log(folder: Path) -> Path:
    log = folder / "oom.log"
    log.write_text(OOM_LOG)
    return log


def file_name(argument: str) -> str:
    return next(name for flag, name in FILE_NAMES.items() if flag in argument)


def _is_json_object(data: bytes) -> bool:
    try:
        return isinstance(json.loads(data), dict)
    except ValueError:
        return False




@pytest.fixture(scope="module")
def random_files(tmp_path_factory) -> Path:
    """One folder for the files hypothesis rewrites on every example (a function-scoped tmp_path would not be)."""
    return tmp_path_factory.mktemp("random-files")

RANDOM_BYTES = st.one_of(st.binary(max_size=4096), st.text(max_size=400).map(str.encode))


@pytest.mark.parametrize("argument", list(FILE_ARGUMENTS))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=RANDOM_BYTES)
def test_random_bytes_as_every_file_argument(capsys, random_files, argument, data):
    # "{}" is a calibration of defaults: valid, not random
    assume(not ("--calibration" in argument and _is_json_object(data)))
    path = random_files / file_name(argument)
    path.write_bytes(data)
    refused(capsys, FILE_ARGUMENTS[argument](path, random_files))


@pytest.mark.parametrize("argument", list(FILE_ARGUMENTS))
@pytest.mark.parametrize("kind", ["empty", "missing", "a folder", "below a file"])
def test_empty_and_unreadable_paths_as_every_file_argument(capsys, tmp_path, argument, kind):
    path = tmp_path / file_name(argument)
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "a folder":
        path.mkdir()
    elif kind == "below a file":
        (tmp_path / "a-file").write_text("")
        path = tmp_path / "a-file" / path.name
    refused(capsys, FILE_ARGUMENTS[argument](path, tmp_path))


# Files no reader may take whole (issue 28): nesting past any parser's recursion, devices that never end, and a file
# larger than every cap (sparse: it takes no disk, and a reader that read it would take seconds).
HOSTILE_FILES = {
    "JSON arrays 100,000 deep": lambda path: path.write_text("[" * 100_000 + "]" * 100_000),
    "JSON objects 100,000 deep": lambda path: path.write_text('{"a":' * 100_000 + "1" + "}" * 100_000),
    "YAML 100,000 deep": lambda path: path.write_text("- " * 100_000 + "a\n"),
    "/dev/zero": lambda path: Path("/dev/zero"),
    "/dev/urandom": lambda path: Path("/dev/urandom"),
    "a link to /dev/zero": lambda path: path.symlink_to("/dev/zero"),
    "2 GiB and a byte": lambda path: sparse(path, files.MAX_SNAPSHOT_BYTES + 1),
}


def sparse(path: Path, size: int) -> None:
    path.touch()
    os.truncate(path, size)


@pytest.mark.parametrize("argument", list(FILE_ARGUMENTS))
@pytest.mark.parametrize("hostile", list(HOSTILE_FILES))
def test_hostile_files_as_every_file_argument_are_refused_within_a_second(capsys, tmp_path, argument, hostile):
    path = tmp_path / file_name(argument)
    made = HOSTILE_FILES[hostile](path)
    refused(capsys, FILE_ARGUMENTS[argument](made if isinstance(made, Path) else path, tmp_path), seconds=1.0)


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_advise_refuses_a_device_on_stdin(capsys, monkeypatch, device):
    with open(device, "rb") as stream:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(stream))
        err = refused(capsys, ["advise", "-"], seconds=1.0)
    assert "stdin: it is a device" in err


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(65, 5000), kinds=st.sampled_from(["[", '{"a":', '[{"a":']),
       argument=st.sampled_from(["check --model", "check --calibration", "check --config", "trace --model"]))
def test_json_nested_past_the_cap(capsys, random_files, depth, kinds, argument):
    """Between the cap and the parsers' recursion limit too: whatever walks the value after parsing is safe."""
    closing = {"[": "]", '{"a":': "}", '[{"a":': "}]"}[kinds]
    path = random_files / "deep.json"
    path.write_text(kinds * depth + "1" + closing * depth)
    err = refused(capsys, FILE_ARGUMENTS[argument](path, random_files), seconds=1.0)
    assert f"nested more than {files.MAX_NESTING} levels deep" in err


@pytest.mark.parametrize("where", ["below a file", "deeper below a file", "a folder", "in /proc", "below /proc"])
@pytest.mark.parametrize("command", TRAINING_COMMANDS)
def test_unwritable_plots(capsys, tmp_path, command, where):
    refused(capsys, [*BASE[command], "--plot", unwritable_targets(tmp_path)[where]])


@pytest.mark.parametrize("command", TRAINING_COMMANDS)
def test_an_immutable_plot_is_refused_before_the_work(capsys, immutable_file, command):
    err = refused(capsys, [*BASE[command], "--plot", immutable_file])
    assert "read-only or immutable" in err


@pytest.mark.parametrize("flag", ["--plot", "--out"])
def test_a_device_as_a_target_is_refused(capsys, tmp_path, flag):
    """A name that ends in .png but links to /dev/full: renaming the plot over it would replace the device."""
    link = tmp_path / "plan.png"
    link.symlink_to("/dev/full")
    args = ["probe", "--simulate", "--gpu", "h100", "--quick", "--out"] if flag == "--out" else [*BASE["plan"], flag]
    assert "it is a device, not a file" in refused(capsys, [*args, link])
    assert Path("/dev/full").is_char_device()


@pytest.mark.parametrize("where", ["below a file", "deeper below a file", "a folder", "in /proc", "below /proc"])
def test_unwritable_probe_outputs(capsys, tmp_path, where):
    refused(capsys, ["probe", "--simulate", "--gpu", "h100", "--quick", "--out", unwritable_targets(tmp_path)[where]])


@pytest.mark.parametrize("args", [
    ["probe"], ["probe", "--simulate"], ["probe", "--simulate", "--gpu", "rtx9999"], ["probe", "--gpu", "h100"],
    ["probe", "--simulate", "--gpu", ""], ["probe", "--bogus"], ["probe", "--simulate", "--gpu", "h100", "--out", ""],
], ids=_flag_id)
def test_bad_probes(capsys, args):
    refused(capsys, args)


def test_a_probe_whose_data_home_is_unwritable(capsys, tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("VRAM_PLAN_HOME", str(tmp_path / "a-file" / "home"))
    refused(capsys, ["probe", "--simulate", "--gpu", "h100", "--quick"])


@pytest.mark.parametrize("args", [["gpus", "--bogus"], ["models", "extra"], ["gpus", "--json", "x"],
                                  ["nosuchcommand"], ["--gpu"], ["plan", "--gpu"]], ids=_flag_id)
def test_bad_catalog_and_command_names(capsys, args):
    refused(capsys, args)


@pytest.mark.parametrize("catalog", ["gpus.toml", "models.toml"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=2048), st.just(b"gpu = 3\n"), st.just(b"[[gpu]]\nname = 1\n"),
                      st.just(b"[[model]]\nname = 'x'\nconfig = '/nonexistent.json'\n")))
@example(data=b"gpu = " + b"[" * 100_000 + b"]" * 100_000 + b"\n")  # tomllib recurses into arrays
def test_random_bytes_as_a_users_catalog(capsys, monkeypatch, random_files, catalog, data):
    folder = random_files / "profiles"
    folder.mkdir(exist_ok=True)
    (folder / catalog).write_bytes(data)
    monkeypatch.setenv("VRAM_PLAN_PROFILES", str(folder))
    profiles.gpu_catalog.cache_clear()
    profiles.model_catalog.cache_clear()
    try:
        command = catalog.removesuffix(".toml")
        start = time.perf_counter()
        code = main([command])
        out, err = capsys.readouterr()
        # bytes that parse as a catalog of no entries leave the shipped one
        assert code == 0 or (code == 2 and err.count("\n") == 1 and not CLASS_NAME.search(err)), err
        assert time.perf_counter() - start < SECONDS
    finally:
        (folder / catalog).unlink()
        profiles.gpu_catalog.cache_clear()
        profiles.model_catalog.cache_clear()


# What people read, on consoles that are not UTF-8 and into pipes that close: each command's human output and JSON.
READABLE = {
    "plan": BASE["plan"], "check": BASE["check"],
    "plan --maximize": [*BASE["plan"], "--maximize", "max_completion_length"],
    "check that does not fit": [*BASE["check"], "--gpu", "t4", "--per-device-train-batch-size", "64"],
    "gpus": ["gpus"], "models": ["models"], "gpus --model": ["gpus", "--model", "Llama-3.2-1B"],
    "replay": ["replay", FIXTURES / "snapshots" / "kv_cache_growth.pickle"], "--help": ["--help"],
    "plan --help": ["plan", "--help"],
}
JSON = {"check --json": [*BASE["check"], "--json"], "gpus --json": ["gpus", "--json"],
        "models --json": ["models", "--json"],
        "replay --json": ["replay", FIXTURES / "snapshots" / "kv_cache_growth.pickle", "--json"]}


def output_on(monkeypatch, stream, args: list) -> int:
    """The exit code of `args` with `stream` as stdout."""
    monkeypatch.setattr("sys.stdout", stream)
    try:
        return main([str(a) for a in args])
    finally:
        monkeypatch.undo()


def console_text(monkeypatch, args: list, encoding: str) -> tuple[int, str]:
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding=encoding, newline="\n")
    code = output_on(monkeypatch, stream, args)
    stream.flush()
    return code, raw.getvalue().decode(encoding)


@pytest.mark.parametrize("args", [*READABLE.values(), ["advise", "LOG", "--gpu", "24GiB", "--model", "Llama-3.2-1B"]],
                         ids=[*READABLE, "advise"])
def test_a_console_that_is_not_utf8_gets_a_readable_answer(capsys, monkeypatch, tmp_path, args):
    """A legacy Windows console is cp1252: no check mark, no blocks, no box drawing. The same answer as on UTF-8,
    with ASCII stand-ins (nothing falls back to '?') and the tables and bars still aligned."""
    args = [oom_log(tmp_path) if a == "LOG" else a for a in args]
    code, utf8 = console_text(monkeypatch, args, "utf-8")
    assert code in (0, 1), capsys.readouterr().err
    code_cp1252, cp1252 = console_text(monkeypatch, args, "cp1252")
    assert (code_cp1252, capsys.readouterr().err) == (code, "")
    assert cp1252.count("?") == utf8.count("?") and len(cp1252.splitlines()) == len(utf8.splitlines()) > 0
    aligned = [(a, b) for a, b in zip(utf8.splitlines(), cp1252.splitlines(), strict=True)
               if "\u2502" in a or "\u2588" in a]  # table rows and bars
    assert all(len(a) == len(b) for a, b in aligned), "\n".join(b for a, b in aligned)
    for symbol, stand_in in [("\u2714 fits", "+ fits"), ("\u2718 does not fit", "x does not fit"), ("\u2588", "#"),
                             ("\u2192", "->")]:
        assert (symbol in utf8) == (stand_in in cp1252), symbol


def test_the_issue_s_cp1252_console():
    """`PYTHONIOENCODING=cp1252 vram-plan plan --gpu t4 --model Llama-3.2-1B` answered 'internal error'."""
    import subprocess
    import sys

    code = "import sys\nfrom vram_planner.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    done = subprocess.run([sys.executable, "-c", code, "plan", "--gpu", "t4", "--model", "Llama-3.2-1B"],
                          capture_output=True, env={**os.environ, "PYTHONIOENCODING": "cp1252"}, timeout=60)
    assert (done.returncode, done.stderr) == (0, b"")
    text = done.stdout.decode("cp1252")
    assert "+ fits: peak" in text and "##" in text and "?" not in text


def test_every_symbol_we_print_has_an_ascii_stand_in():
    """Any character in a string of the package (help texts included) that cp1252 lacks has an ASCII stand-in,
    so a new symbol cannot turn into '?' on a legacy console."""
    import tokenize

    from vram_planner.cli.console import ASCII_FALLBACKS

    package = Path(main.__code__.co_filename).parents[1]
    lacking = set()
    for source in package.rglob("*.py"):
        if "app" in source.relative_to(package).parts:  # the web page is HTML, in UTF-8
            continue
        with source.open("rb") as fh:
            strings = [t.string for t in tokenize.tokenize(fh.readline) if t.type == tokenize.STRING]
        lacking |= {c for text in strings for c in text if c not in ASCII_FALLBACKS and not _encodes(c, "cp1252")}
    assert not lacking
    assert "\u2714" in ASCII_FALLBACKS and all(v.isascii() for v in ASCII_FALLBACKS.values())


def _encodes(character: str, encoding: str) -> bool:
    try:
        character.encode(encoding)
    except UnicodeEncodeError:
        return False
    return True


class ClosedPipe(io.RawIOBase):
    """stdout whose reader went away (`| head`): every write is EPIPE, until the test is over."""

    broken = True

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.broken:
            raise BrokenPipeError(32, "Broken pipe")
        return len(data)


@pytest.mark.parametrize("args", [*READABLE.values(), *JSON.values()], ids=[*READABLE, *JSON])
def test_a_closed_pipe_is_its_own_exit_code(capsys, monkeypatch, args):
    """141 (128 + SIGPIPE), never 1 ("does not fit") or 2, and nothing on stderr."""
    pipe = ClosedPipe()
    stream = io.TextIOWrapper(pipe, encoding="utf-8")
    try:
        assert output_on(monkeypatch, stream, args) == 141
    finally:
        pipe.broken = False
        stream.close()
    assert capsys.readouterr().err == ""


def test_a_refusal_into_a_closed_pipe(monkeypatch):
    """`vram-plan check --gpu bad ... 2>&1 | head -0`: the error line meets the closed pipe too; 141, not a traceback
    and exit 1."""
    pipe = ClosedPipe()
    stream = io.TextIOWrapper(pipe, encoding="utf-8", line_buffering=True)
    monkeypatch.setattr("sys.stderr", stream)
    try:
        assert output_on(monkeypatch, stream, [*BASE["check"], "--gpu", "rtx9999"]) == 141
    finally:
        pipe.broken = False
        stream.close()


@pytest.mark.parametrize("args", [READABLE["replay"], JSON["gpus --json"]], ids=["replay", "gpus --json"])
def test_a_real_pipe_closed_by_its_reader(args):
    """`vram-plan replay ... | head`, with a reader that is gone before the first write: exit 141, no traceback."""
    import subprocess
    import sys

    code = "import sys\nfrom vram_planner.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    process = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()
    _, err = process.communicate(timeout=60)
    assert (process.returncode, err) == (141, b"")


# `run`: the same checks before anything starts. --dry-run keeps a case that is wrongly let through from training.
RUN_SMALL = ["--gpu", "24GiB", "--per-device-train-batch-size", "2", "--num-generations", "2",
             "--max-completion-length", "8", "--max-prompt-length", "128", "--dry-run"]


@pytest.fixture(scope="module")
def run_base(tiny_model_folder, tmp_path_factory):
    """The arguments of a dry run that succeeds, into an output folder that does not exist yet."""
    out = tmp_path_factory.mktemp("run") / "out"
    return ["run", "--model", tiny_model_folder, "--dataset", "math-sample", "--output-dir", out, *RUN_SMALL]


def test_the_run_base_is_good(capsys, run_base):
    code = main([str(a) for a in run_base])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("flags", BAD_KNOBS, ids=_flag_id)
def test_bad_knobs_with_run(capsys, run_base, flags):
    refused(capsys, run_base + flags)


@pytest.mark.parametrize("flags", [
    ["--max-steps", "0"], ["--max-steps", "-5"], ["--save-steps", "0"], ["--save-steps", "-1"],
    ["--reward", "bogus"], ["--reward", "no_such_module_xyz:f"], ["--reward", "os:no_such_function"],
    ["--reward", ""], ["--dataset", "not-a-dataset"], ["--dataset", ""], ["--json"], ["--plot", "plan.png"],
], ids=_flag_id)
def test_bad_run_options(capsys, run_base, flags):
    refused(capsys, run_base + flags)


def test_a_hub_dataset_offline(capsys, run_base, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    refused(capsys, run_base + ["--dataset", "gsm8k"])


@pytest.mark.parametrize("where", ["below a file", "deeper below a file", "in /proc", "below /proc"])
def test_unwritable_run_output_folders(capsys, run_base, tmp_path, where):
    target = unwritable_targets(tmp_path)[where].removesuffix("plan.png") + "run"
    refused(capsys, run_base + ["--output-dir", target])


BAD_DATASETS = {
    "empty.jsonl": b"", "blank.jsonl": b"\n\n", "no-prompt.jsonl": b'{"question": "1 + 1?"}\n',
    "empty-prompt.jsonl": b'{"prompt": ""}\n', "number-prompt.jsonl": b'{"prompt": 5}\n',
    "null-prompt.jsonl": b'{"prompt": null}\n', "list.jsonl": b"[1, 2]\n", "broken.jsonl": b'{"prompt": "a"\n',
    "random.parquet": b"PAR1 not parquet", "data.csv": b"prompt\nhello\n", "data.txt": b"hello\n",
}


@pytest.mark.parametrize("name", list(BAD_DATASETS))
def test_bad_run_datasets(capsys, run_base, tmp_path, name):
    dataset = tmp_path / name
    dataset.write_bytes(BAD_DATASETS[name])
    refused(capsys, run_base + ["--dataset", dataset])


@pytest.mark.parametrize("kind", ["missing", "a folder that is no dataset", "below a file", "a link to /dev/zero",
                                  "nested 100,000 deep", "nested 100,000 deep, a bracket a line"])
def test_unreadable_run_datasets(capsys, run_base, tmp_path, kind):
    dataset = tmp_path / "data.jsonl"
    if kind == "a link to /dev/zero":
        dataset.symlink_to("/dev/zero")
    elif kind == "nested 100,000 deep":  # the datasets library's reader (pyarrow's) crashed the process
        dataset.write_text('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    elif kind == "nested 100,000 deep, a bracket a line":
        dataset = tmp_path / "data.json"
        dataset.write_text('{"prompt":\n' + "[\n" * 100_000 + "]\n" * 100_000 + "}\n")
    elif kind == "a folder that is no dataset":
        dataset = tmp_path / "folder"
        dataset.mkdir()
        (dataset / "notes.txt").write_text("hello")
    elif kind == "below a file":
        (tmp_path / "a-file").write_text("")
        dataset = tmp_path / "a-file" / "data.jsonl"
    refused(capsys, run_base + ["--dataset", dataset])


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=RANDOM_BYTES)
def test_random_bytes_as_the_run_dataset(capsys, run_base, random_files, data):
    dataset = random_files / "random.jsonl"
    dataset.write_bytes(data)
    refused(capsys, run_base + ["--dataset", dataset])


@pytest.mark.parametrize("kind", ["config only", "random config"])
def test_bad_run_model_folders(capsys, run_base, tmp_path, kind):
    folder = tmp_path / "model"
    folder.mkdir()
    config = TINY.read_bytes() if kind == "config only" else b"\x00\xff not json"
    (folder / "config.json").write_bytes(config)
    refused(capsys, run_base + ["--model", folder])


@pytest.mark.parametrize("when", ["on a sample batch", "on import"])
def test_a_reward_that_calls_sys_exit(capsys, run_base, tmp_path, when):
    """A dry run calls the reward on a sample batch; its sys.exit(3) would have been the command's exit code."""
    reward = tmp_path / "my_reward.py"
    body = "    sys.exit(3)\n" if when == "on a sample batch" else "    return [1.0] * len(completions)\nsys.exit(3)\n"
    reward.write_text(f"import sys\n\n\ndef score(completions, **kwargs):\n{body}")
    err = refused(capsys, run_base + ["--reward", f"{reward}:score"])
    assert "sys.exit(3)" in err


@pytest.mark.parametrize("command", ["plan", "check"])
def test_a_target_that_fails_after_the_check_is_one_line(capsys, tmp_path, monkeypatch, command):
    """Checked writable before the work, the plot's file is made read-only (or its disk fills) meanwhile: the system's
    word for it in one line, not an internal error."""
    import errno

    from vram_planner.report import plot

    target = tmp_path / "plan.png"

    def fails(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(target))

    monkeypatch.setattr(plot, "plot_phases", fails)
    err = refused(capsys, [*BASE[command], "--plot", target])
    assert err == f"error: cannot use {target}: Permission denied\n"
