"""The command line in-process: exit codes, one-line errors, JSON contract, files."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import LLAMA_1B, one_line_error, run, unwritable_targets
from vram_planner.cli import main

JSON_FIELDS = {"fits", "peak_bytes", "capacity_bytes", "params", "trainable_params", "phases", "config",
               "grpo_config_valid", "calibration"}


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


def test_the_smallest_fitting_card_is_judged_with_its_own_calibration(capsys, _private_home):
    # A probe's calibration measures one card (its CUDA context above all): the card asked about keeps its own, and
    # each larger card is judged with the calibration plan would pick for it.
    from vram_planner.model.calibration import default_calibration
    from vram_planner.validation import to_json

    def smallest_fitting() -> str:
        doc = json.loads(run(capsys, "--gpu", "rtx2060", "--model", "Qwen2.5-7B-Instruct", "--json")[1])
        assert not doc["fits"]
        return doc["smallest_fitting_gpu"]

    def probe_calibration(gpu: str, context_gib: float) -> None:
        cal = replace(default_calibration(), **{"name": "probe", "gpu": gpu,
                                                        "cuda_context_bytes": int(context_gib * 2**30)})
        (_private_home / "calibrations").mkdir(exist_ok=True)
        (_private_home / "calibrations" / f"{gpu}.json").write_text(to_json(cal))

    answer = smallest_fitting()
    probe_calibration("rtx2060", 40.0)  # the small card's context must not weigh on the larger ones
    assert smallest_fitting() == answer
    probe_calibration(answer, 40.0)  # the larger card's own calibration decides for it
    assert smallest_fitting() not in (answer, None)


@pytest.mark.parametrize("args,expected", [
    (["--num-generations", "1"], "--num-generations must be at least 2"),
    (["--per-device-train-batch-size", "3"], "must be evenly divisible by the number of generations per prompt (8)"),
    (["--per-device-train-batch-size", "3"], "change --per-device-train-batch-size 3, --gradient-accumulation-steps 1 "
                                             "or --num-generations 8"),
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
    assert "not valid JSON" in one_line_error(capsys, "--gpu", "16GiB", "--model", str(broken))
    folder = tmp_path / "empty-model"
    folder.mkdir()
    assert "has no config.json" in one_line_error(capsys, "--gpu", "16GiB", "--model", str(folder))
    not_decoder = tmp_path / "config.json"
    not_decoder.write_text(json.dumps({"model_type": "bert"}))
    assert "not one vram-plan knows" in one_line_error(capsys, "--gpu", "16GiB", "--model", str(not_decoder))


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
                                           ("- a\n- b\n", "must hold a mapping"), ("a: [\n", "not valid YAML"),
                                           # YAML reads these as {None: None} and {1: 4}: no setting's name
                                           ("?\n", "None is not a setting's name"), ("1: 4\n", "1 is not a setting"),
                                           # a typo'd key left empty is still a typo
                                           ("per_device_train_batch:\n", "did you mean --per-device-train")])
def test_bad_config_files(capsys, tmp_path, llama_1b_file, text, expected):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    assert expected in one_line_error(capsys, "--gpu", "16GiB", "--model", str(llama_1b_file), "--config", str(cfg))


@pytest.mark.parametrize("text,key", [
    ("optim: [a]\n", "optim"), ("model: {a: b}\n", "model"), ("gpu: [1]\n", "gpu"), ("gpu: 24\n", "gpu"),
    ("lora_r: 8\nlora_target_modules: {a: 1}\n", "lora_target_modules"),
    ("per_device_train_batch_size: [1]\n", "per_device_train_batch_size"), ("dtype: {a: 1}\n", "dtype"),
    ("beta: [0.1, 0.2]\n", "beta"), ("lora_r: 8\nlora_target_modules: [q_proj, [v_proj]]\n", "lora_target_modules"),
])
@pytest.mark.parametrize("flags", [[], ["--gpu", "16GiB", "--model", "Llama-3.2-1B"]])
def test_a_config_file_value_of_the_wrong_shape_is_one_line_naming_the_key(capsys, tmp_path, text, key, flags):
    cfg = tmp_path / "run.yaml"
    others = {"model": "model: Llama-3.2-1B\n", "gpu": "gpu: 16GiB\n"}
    cfg.write_text(text + "".join(line for name, line in others.items() if name != key))
    err = one_line_error(capsys, "check", "--config", str(cfg), *flags)
    assert key in err and str(cfg) in err


def test_a_config_file_may_list_the_lora_targets(capsys, tmp_path):
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"model": "Llama-3.2-1B", "gpu": "80GiB", "lora_r": 8,
                               "lora_target_modules": ["q_proj", "v_proj"]}))
    code, out, _ = run(capsys, "check", "--config", str(cfg), "--json")
    assert code == 0 and json.loads(out)["peft_config"]["target_modules"] == ["q_proj", "v_proj"]


def test_plot_writes_a_png(capsys, tmp_path, llama_1b_file):
    target = tmp_path / "plots" / "plan.png"
    code, _, _ = run(capsys, "--gpu", "15.73GiB", "--model", str(llama_1b_file), "--plot", str(target))
    assert code == 0 and target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(target.parent.iterdir()) == [target]  # no temporary file left behind


def forbid_planning(monkeypatch) -> None:
    from vram_planner import engine

    def no_work(*args, **kwargs):
        raise AssertionError("the model and the card were resolved before the output target was checked")

    monkeypatch.setattr(engine, "make_context", no_work)


@pytest.mark.parametrize("where", ["below a file", "deeper below a file", "a folder", "a folder with a slash",
                                   "in /proc", "below /proc"])
@pytest.mark.parametrize("command", ["plan", "check"])
def test_an_unwritable_plot_is_refused_before_any_work(capsys, monkeypatch, tmp_path, llama_1b_file, where, command):
    forbid_planning(monkeypatch)
    target = unwritable_targets(tmp_path)[where]
    err = one_line_error(capsys, command, "--gpu", "16GiB", "--model", str(llama_1b_file), "--plot", target)
    assert "--plot" in err and target.rstrip("/") in err and ".tmp" not in err
    assert not list(Path("/proc").glob(".plan.png*"))


def test_a_plot_with_an_unknown_suffix_is_refused_before_any_work(capsys, monkeypatch, tmp_path, llama_1b_file):
    forbid_planning(monkeypatch)
    err = one_line_error(capsys, "--gpu", "16GiB", "--model", str(llama_1b_file), "--plot", str(tmp_path / "p.jpg"))
    assert "write .png, .svg or .pdf" in err


def test_debug_shows_the_traceback(llama_1b_file):
    with pytest.raises(Exception):
        main(["--debug", "--gpu", "16GiB", "--model", str(llama_1b_file), "--num-generations", "1"])


@pytest.mark.parametrize("bug", [KeyError("gate_proj"), ValueError("first line\nsecond line"), RuntimeError()])
def test_a_bug_is_one_line_without_the_exceptions_class_name(capsys, monkeypatch, llama_1b_file, bug):
    # The last resort: what no input should reach. A bug in the planner stands in for one.
    from vram_planner import engine

    def broken(*args, **kwargs):
        raise bug

    monkeypatch.setattr(engine, "best_plan", broken)
    err = one_line_error(capsys, "--gpu", "16GiB", "--model", str(llama_1b_file))
    assert err.startswith("error: internal error") and "--debug" in err
    assert type(bug).__name__ not in err and "Error:" not in err and "Exception" not in err
    assert (str(bug).splitlines() or [""])[0] in err
    with pytest.raises(type(bug)):
        main(["--debug", "--gpu", "16GiB", "--model", str(llama_1b_file)])


def test_plan_and_check_never_import_torch_transformers_or_trl(llama_1b_file):
    code = ("import sys, contextlib, io\n"
            "from vram_planner.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    main(['--gpu', '16GiB', '--model', {str(llama_1b_file)!r}])\n"
            f"    main(['check', '--gpu', '16GiB', '--model', {str(llama_1b_file)!r}, '--json'])\n"
            "heavy = [m for m in ('torch', 'transformers', 'trl', 'peft') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plan_loads_only_what_it_uses(tmp_path):
    # Start-up (issue 10): the other commands' modules, the maximize search, vLLM's model, difflib (only refusals
    # suggest names) and rich's emoji table are not loaded by the README's command; once the profiles are cached
    # neither are the TOML parser, pydantic (the catalogs were validated when cached, and no knob was given) nor
    # importlib.metadata (the installed TRL's version is remembered). Cold and warm, the answer is the same.
    code = ("import sys, contextlib, io\n"
            "from vram_planner.cli import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
            "    main(['--gpu', 'rtx3080-mobile', '--model', 'Llama-3.2-1B'])\n"
            "print(' '.join(sorted(sys.modules)))\n"
            "print(out.getvalue())\n")
    env = {**os.environ, "VRAM_PLAN_CACHE": str(tmp_path / "cache"), "COLUMNS": "120"}
    answers = []
    for warm in (False, True):
        modules, answer = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                         env=env).stdout.split("\n", 1)
        loaded = set(modules.split())
        unused = {"vram_planner.cli.run", "vram_planner.cli.advise", "vram_planner.cli.replay",
                  "vram_planner.model.maximize", "vram_planner.model.vllm", "difflib", "rich._emoji_codes"}
        if warm:
            unused |= {"tomllib", "pydantic", "pydantic_core", "importlib.metadata", "email"}
        assert "vram_planner.cli.plan" in loaded and not loaded & unused, loaded & unused
        answers.append(answer)
    assert answers[0] == answers[1] and "GRPOConfig" in answers[0]


def test_an_unknown_command_is_compared_with_every_command(capsys):
    err = one_line_error(capsys, "replai", "x")
    assert err.startswith("error: unknown command 'replai'; did you mean 'replay'") and "--help lists them" in err
    err = one_line_error(capsys, "advice", "x")
    assert "did you mean 'advise'" in err


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


ANSI = re.compile(r"\x1b\[[0-9;]*m")
SNIPPET_CONFIGS = [
    ("plan", "rtx3080-mobile", "Llama-3.2-1B", []),
    ("check", "t4", "Llama-3.2-1B", ["--lora-r", "16", "--load-in-4bit", "--lora-target-modules", "q_proj,v_proj"]),
    ("plan", "h100", "Qwen2.5-1.5B-Instruct", ["--use-vllm", "--num-iterations", "2", "--beta", "0.04"]),
    ("check", "80GiB", "LONG", ["--lora-r", "8", "--dtype", "bfloat16", "--max-prompt-length", "4321"]),
    ("plan", "24GiB", "LONG", ["--attn-implementation", "eager", "--steps-per-generation", "4"]),
    ("plan", "24GiB", "QUOTED", []),
]
LOCAL_MODELS = {"LONG": ("a-very-long-folder-name-for-a-fine-tuned-model-" * 3) + "/Llama-3.2-1B-with-a-long-name",
                "QUOTED": "it's a \"quoted\" \\ model"}


def printed_snippet(out: str) -> str:
    """The printed code: from its first `from `/`import ` line to `trainer.train()`."""
    lines = ANSI.sub("", out).splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(("from ", "import ")))
    last = next(i for i, line in enumerate(lines) if line.startswith("trainer.train()"))
    return "\n".join(lines[first:last + 1])


@pytest.mark.parametrize("terminal", ["0", "1"])
@pytest.mark.parametrize("command,gpu,model,flags", SNIPPET_CONFIGS)
def test_the_printed_snippet_is_valid_python_at_any_width(capsys, monkeypatch, tmp_path, terminal, command, gpu,
                                                         model, flags):
    if model in LOCAL_MODELS:  # a local folder: the model id and the output_dir come from its path
        folder = tmp_path / LOCAL_MODELS[model]
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(LLAMA_1B))
        model = str(folder)
    monkeypatch.setenv("TTY_COMPATIBLE", terminal)  # "1": rendered as for a terminal, "0": as when piped
    for width in [40, 41, 57, 64, 79, 80, 81, 100, 120, 160, 200]:
        monkeypatch.setenv("COLUMNS", str(width))
        code, out, err = run(capsys, command, "--gpu", gpu, "--model", model, *flags)
        assert code == 0, err
        tree = ast.parse(printed_snippet(out))  # a SyntaxError here is what a paste would give
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert {"GRPOConfig", "GRPOTrainer"} <= calls


def trainer_model(out: str) -> str:
    """The `model=` GRPOTrainer gets in the printed code."""
    tree = ast.parse(printed_snippet(out))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "GRPOTrainer")
    return ast.literal_eval(next(k.value for k in call.keywords if k.arg == "model"))


def test_the_printed_trainer_loads_a_model_folder_not_its_config_file(capsys, tmp_path):
    # GRPOTrainer(model=...) calls from_pretrained, which takes a hub id or a folder: given a config.json, the code
    # names its folder; a JSON file of another name is named as given (no folder would load it)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_1B))
    (tmp_path / "llama.json").write_text(json.dumps(LLAMA_1B))
    for given, loaded in ((tmp_path / "config.json", tmp_path), (tmp_path, tmp_path),
                          (tmp_path / "llama.json", tmp_path / "llama.json")):
        code, out, _ = run(capsys, "--gpu", "24GiB", "--model", str(given))
        assert code == 0 and trainer_model(out) == str(loaded)


def test_a_verdict_near_the_boundary_says_so_and_names_exact(capsys):
    """Steps have needed up to NEED_ABOVE_ESTIMATE more than the estimate and NEED_BELOW_ESTIMATE less. With the
    default 5% margin a "fits" is flagged only where the band reaches past the margin; a card more than the band above
    the peak is not; without a margin, a card 1% above the peak fits by the estimate but could be short. A card 5% below the peak does not fit by it, but a need NEED_BELOW_ESTIMATE below could; an 80 GiB
    card is far from both."""
    from vram_planner import engine
    from vram_planner.model.verdict import NEED_ABOVE_ESTIMATE, NEED_BELOW_ESTIMATE

    model = ["--model", "Qwen2.5-0.5B"]
    peak = engine.check("Qwen2.5-0.5B", "80GiB", {}).estimate.peak_bytes
    above = NEED_ABOVE_ESTIMATE
    code, out, _ = run(capsys, "check", "--gpu", f"{peak / 0.95 / 2**30 + 0.01:.3f}GiB", *model, "--json")
    assert json.loads(out)["fits"] is True and json.loads(out)["near_boundary"] is (above > 0.05 / 0.95)
    # beyond the band and the margin both: fits, and not near the boundary
    clear = max(peak * (1 + above), peak / 0.95)
    code, out, _ = run(capsys, "check", "--gpu", f"{clear / 2**30 + 0.01:.3f}GiB", *model, "--json")
    assert json.loads(out)["fits"] is True and json.loads(out)["near_boundary"] is False
    card = f"{peak * 1.01 / 2**30:.3f}GiB"
    code, out, _ = run(capsys, "check", "--gpu", card, *model, "--safety-margin", "0", "--json")
    near = json.loads(out)
    assert near["fits"] is True and near["near_boundary"] is True
    for command in ("check", "plan"):
        code, out, _ = run(capsys, command, "--gpu", card, *model, "--safety-margin", "0")
        said = " ".join(out.split())
        assert (f"Near the boundary: steps have needed up to {NEED_ABOVE_ESTIMATE:.0%} more than the "
                "estimate (the most measured), and this card would not hold that; "
                f"`vram-plan {command} --exact` with the same flags traces the step and decides") in said, said
    code, out, _ = run(capsys, "check", "--gpu", f"{peak * 0.95 / 2**30:.3f}GiB", *model, "--json")
    short = json.loads(out)
    assert short["fits"] is False and short["near_boundary"] is True and NEED_BELOW_ESTIMATE > 0.05
    code, out, _ = run(capsys, "check", "--gpu", "80GiB", *model, "--json")
    assert json.loads(out)["near_boundary"] is False


def test_a_step_whose_kept_tensors_meet_the_decodings_segments_is_flagged_within_its_own_band(capsys):
    """Without gradient checkpointing, after a generation of several micro-batches at once under torch's default
    allocator, needs have been measured further above the estimate than elsewhere: a "fits" past the other steps'
    band but within that one is flagged, and the line says which steps needed how much more; with one micro-batch per
    generation, or expandable segments, the same card is clear of the other steps' band."""
    from vram_planner import engine
    from vram_planner.model.verdict import NEED_ABOVE_ESTIMATE, need_above_estimate

    knobs = {"gradient_checkpointing": False, "gradient_accumulation_steps": 4}
    flags = ["--model", "Qwen2.5-0.5B", "--no-gradient-checkpointing", "--gradient-accumulation-steps", "4"]
    verdict = engine.check("Qwen2.5-0.5B", "80GiB", knobs)
    peak, above = verdict.estimate.peak_bytes, need_above_estimate(verdict.train)
    assert above > NEED_ABOVE_ESTIMATE > 0.05 / 0.95
    between = (NEED_ABOVE_ESTIMATE + above) / 2  # past the margin and the other steps' band, inside this one
    card = f"{peak * (1 + between) / 2**30:.3f}GiB"
    code, out, _ = run(capsys, "check", "--gpu", card, *flags, "--json")
    checked = json.loads(out)
    assert code == 0 and checked["fits"] is True and checked["near_boundary"] is True
    assert checked["need_above_estimate"] == above
    code, out, _ = run(capsys, "check", "--gpu", card, *flags)
    said = " ".join(out.split())
    assert (f"Near the boundary: steps without gradient checkpointing that generate for several micro-batches at once "
            f"have needed up to {above:.0%} more than the estimate") in said, said
    for other, other_flags in (({"gradient_checkpointing": False}, flags[:3]),
                               ({**knobs, "allocator_conf": "expandable_segments:True"},
                                [*flags, "--allocator-conf", "expandable_segments:True"])):
        other_peak = engine.check("Qwen2.5-0.5B", "80GiB", other).estimate.peak_bytes
        code, out, _ = run(capsys, "check", "--gpu", f"{other_peak * (1 + between) / 2**30:.3f}GiB", *other_flags,
                           "--json")
        assert json.loads(out)["fits"] is True and json.loads(out)["near_boundary"] is False, other_flags


def test_a_generation_under_expandable_segments_is_flagged_within_what_its_growing_cache_can_strand(capsys):
    """Under expandable segments the decoding's growing keys and values strand up to a page a layer beyond the
    estimate (benchmarks/results/decoding_holes.txt): held-out QLoRA seed 1's SmolLM2-360M, 10.2% under its need, is
    flagged on a card past the share band of its peak but short of its generation plus that, and the line says why;
    under torch's default allocator (whose decoding segments the estimate counts) the same card is not flagged."""
    from vram_planner import engine
    from vram_planner.model.verdict import need_above_estimate

    knobs = {"dtype": "bfloat16", "lora_r": 64, "load_in_4bit": True, "per_device_train_batch_size": 8,
             "num_generations": 16, "gradient_accumulation_steps": 4, "steps_per_generation": 8,
             "max_prompt_length": 64, "max_completion_length": 384, "beta": 0.01, "attn_implementation": "eager",
             "allocator_conf": "expandable_segments:True"}
    flags = ["--model", "SmolLM2-360M", "--dtype", "bfloat16", "--lora-r", "64", "--load-in-4bit",
             "--per-device-train-batch-size", "8", "--num-generations", "16", "--gradient-accumulation-steps", "4",
             "--steps-per-generation", "8", "--max-prompt-length", "64", "--max-completion-length", "384",
             "--beta", "0.01", "--attn-implementation", "eager"]
    verdict = engine.check("SmolLM2-360M", "80GiB", knobs)
    peak, holes = verdict.estimate.peak_bytes, verdict.decoding_holes_bytes
    assert verdict.estimate.peak_phase.name == "generation" and holes == 32 * 64 * 447 * 640
    card = f"{peak * (1 + need_above_estimate(verdict.train)) + holes / 2:.0f}"  # past the share band, short of this
    code, out, _ = run(capsys, "check", "--gpu", f"{int(card) / 2**30:.4f}GiB", *flags, "--allocator-conf",
                       "expandable_segments:True", "--json")
    checked = json.loads(out)
    assert code == 0 and checked["fits"] is True and checked["near_boundary"] is True, checked["peak_bytes"]
    assert checked["decoding_holes_bytes"] == holes
    code, out, _ = run(capsys, "check", "--gpu", f"{int(card) / 2**30:.4f}GiB", *flags, "--allocator-conf",
                       "expandable_segments:True")
    said = " ".join(out.split())
    assert ("Near the boundary: generation's growing keys and values under expandable segments can leave up to "
            f"{holes / 2**30:.2f} GiB mapped beyond the estimate") in said, said
    code, out, _ = run(capsys, "check", "--gpu", f"{int(card) / 2**30:.4f}GiB", *flags, "--json")
    default = json.loads(out)
    assert default["decoding_holes_bytes"] is None
    assert default["near_boundary"] == (default["peak_bytes"] * (1 + default["need_above_estimate"])
                                        > default["capacity_bytes"])


def test_a_step_of_a_release_that_makes_the_whole_logits_is_flagged_within_its_band(capsys):
    """TRL 0.15 to 1.14 make the whole logits, and under LoRA with checkpointing the logits block their LM head's
    backward may find stranded is not counted (benchmarks/results/boundary-trl-1.0.0.txt): a "fits" past the other
    steps' band but within theirs is flagged, and the line names those steps; the same release's step without
    checkpointing (the block counted) and TRL 1.16's step on the same card are not flagged. TRL 0.14 has its own."""
    from vram_planner import engine
    from vram_planner.model.verdict import (NEED_ABOVE_ESTIMATE, NEED_ABOVE_ESTIMATE_HEAD_BLOCK_UNCOUNTED,
                                            NEED_ABOVE_ESTIMATE_KERNEL_HEAD_BLOCK_UNCOUNTED,
                                            NEED_ABOVE_ESTIMATE_MERGED_LOSS, need_above_band,
                                            need_above_estimate)

    settings = {"dtype": "bfloat16", "lora_r": 16, "gradient_checkpointing": True}
    flags = ["--model", "Qwen2.5-0.5B", "--dtype", "bfloat16", "--lora-r", "16", "--gradient-checkpointing"]
    verdict = engine.check("Qwen2.5-0.5B", "80GiB", settings, trl_version="1.0.0")
    band = NEED_ABOVE_ESTIMATE_HEAD_BLOCK_UNCOUNTED
    assert need_above_estimate(verdict.train) == band > NEED_ABOVE_ESTIMATE
    between = (NEED_ABOVE_ESTIMATE + band) / 2
    card = f"{verdict.estimate.peak_bytes * (1 + between) / 2**30:.3f}GiB"
    code, out, _ = run(capsys, "check", "--gpu", card, *flags, "--trl-version", "1.0.0", "--json")
    checked = json.loads(out)
    assert code == 0 and checked["fits"] is True and checked["near_boundary"] is True
    assert checked["need_above_estimate"] == band
    code, out, _ = run(capsys, "check", "--gpu", card, *flags, "--trl-version", "1.0.0")
    said = " ".join(out.split())
    assert ("Near the boundary: LoRA steps with gradient checkpointing of the TRL releases that make the whole logits "
            f"(0.15 to 1.13) have needed up to {band:.0%} more than the estimate") in said, said
    # TRL 1.14's kernel asks for blocks of the whole logits: a band of its own
    kernel = engine.check("Qwen2.5-0.5B", "80GiB", settings, trl_version="1.14.0")
    assert need_above_estimate(kernel.train) == NEED_ABOVE_ESTIMATE_KERNEL_HEAD_BLOCK_UNCOUNTED > band
    assert need_above_band(kernel.train)[1] == ("LoRA steps with gradient checkpointing of TRL 1.14 (its log-prob "
                                                "kernel's backward asks for blocks of the whole logits)")
    for other, trl_version in (({**settings, "gradient_checkpointing": False}, "1.0.0"), (settings, "1.16.0")):
        assert need_above_estimate(engine.check("Qwen2.5-0.5B", "80GiB", other, trl_version=trl_version).train) < band
    newest = engine.check("Qwen2.5-0.5B", "80GiB", settings).estimate.peak_bytes
    code, out, _ = run(capsys, "check", "--gpu", f"{newest * (1 + between) / 2**30:.3f}GiB", *flags, "--json")
    assert json.loads(out)["fits"] is True and json.loads(out)["near_boundary"] is False
    merged = engine.check("Qwen2.5-0.5B", "80GiB", {"dtype": "bfloat16"}, trl_version="0.14.0")
    assert need_above_estimate(merged.train) == NEED_ABOVE_ESTIMATE_MERGED_LOSS
