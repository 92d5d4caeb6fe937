"""The library API: one request in, one report out, and the report's `to_dict()` is exactly what the command line
prints with --json; errors name the fields in Python and the flags on the command line."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import run
from vram_planner import api
from vram_planner.errors import ConfigError, VramPlanError, flag
from vram_planner.model.spec import knob_names
from vram_planner.request import Request, knob_fields, request_fields
from vram_planner.units import GiB

MODELS = ["Llama-3.2-1B", "Qwen2.5-0.5B", "Qwen3-0.6B", "SmolLM2-135M", "gemma-2-2b", "Qwen2.5-7B"]
GPUS = ["t4", "rtx3080-mobile", "rtx4090", "a100-80gb", "12GiB"]
KNOBS = st.fixed_dictionaries({}, optional={
    "per_device_train_batch_size": st.sampled_from([1, 2, 4, 8, 16]),
    "num_generations": st.sampled_from([2, 3, 4, 8]),
    "gradient_accumulation_steps": st.sampled_from([1, 2, 4]),
    "max_completion_length": st.sampled_from([64, 256, 1024, 4096]),
    "max_prompt_length": st.sampled_from([128, 512]),
    "lora_r": st.sampled_from([8, 16, 64]),
    "dtype": st.sampled_from(["float32", "bfloat16", "float16"]),
    "optim": st.sampled_from(["adamw_torch_fused", "adamw_8bit", "adafactor"]),
    "gradient_checkpointing": st.booleans(),
    "load_in_4bit": st.booleans(),
    "beta": st.sampled_from([0.0, 0.04]),
    "use_vllm": st.booleans(),
})


def flags(knobs: dict) -> list[str]:
    args = []
    for name, value in knobs.items():
        if isinstance(value, bool):
            args.append(flag(name) if value else "--no-" + flag(name)[2:])
        else:
            args += [flag(name), str(value)]
    return args


def same_answer(capsys, command: str, model: str, gpu: str, knobs: dict) -> None:
    """The library's report is the command line's document; bad input is the same line, in fields or in flags."""
    code, out, err = run(capsys, command, "--model", model, "--gpu", gpu, *flags(knobs), "--json")
    ask = api.plan if command == "plan" else api.check
    try:
        report = ask(model, gpu, knobs)
    except VramPlanError as error:
        assert code == 2 and err == f"error: {error.worded(flag)}\n"
        named = [name for name in request_fields() if flag(name) in str(error)]
        assert not named, f"Python's words are the fields, not the flags of {named}: {error}"
        return
    assert code == (0 if report.fits else 1), err
    assert report.to_dict() == json.loads(out)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(["check", "plan"]), model=st.sampled_from(MODELS), gpu=st.sampled_from(GPUS),
       knobs=KNOBS)
def test_the_reports_are_the_command_lines_documents(capsys, command, model, gpu, knobs):
    same_answer(capsys, command, model, gpu, knobs)


def test_check_is_check_json_with_integer_bytes(capsys):
    same_answer(capsys, "check", "Llama-3.2-1B", "rtx3080-mobile", {"max_completion_length": 1024})
    report = api.check("Llama-3.2-1B", "rtx3080-mobile", max_completion_length=1024)
    document = report.to_dict()
    assert all(isinstance(document[k], int) for k in ("peak_bytes", "capacity_bytes", "spare_bytes"))
    assert all(isinstance(v, int) for phase in document["phases"] for v in phase["components"].values())
    assert json.loads(report.to_json()) == document


def test_a_request_and_keyword_arguments_are_the_same_question():
    request = Request(model="Qwen2.5-0.5B", gpu="t4", lora_r=16, dtype="float16")
    by_request = api.plan(request).to_dict()
    assert by_request == api.plan("Qwen2.5-0.5B", "t4", {"lora_r": 16}, dtype="float16").to_dict()
    assert by_request == api.plan(Request(model="Qwen2.5-0.5B"), "t4", lora_r=16, dtype="float16").to_dict()


def test_the_request_has_a_field_for_every_knob():
    assert set(knob_fields()) == set(knob_names()) - {"trl_version"}
    assert {"model", "gpu", "trl_version", "calibration", "safety_margin"} <= {f.name for f in fields(Request)}


def test_a_recipes_trl_names_point_at_the_setting_and_the_arguments_that_move_no_memory_are_one_problem():
    with pytest.raises(ConfigError) as refused:
        api.check("Llama-3.2-1B", "t4", model_name_or_path="meta-llama/Llama-3.2-1B", learning_rate=1e-6,
                  logging_steps=10, seed=42, output_dir="out", bf16=True)
    assert str(refused.value) == (
        "model_name_or_path is TRL's name: the setting here is model; bf16 is TRL's name: the setting here is "
        "mixed_precision; learning_rate, logging_steps, seed and 1 more change no GPU memory: leave them out")
    with pytest.raises(ConfigError, match="^learning_rate changes no GPU memory: leave it out$"):
        Request.of({"model": "Llama-3.2-1B", "learning_rate": 1e-6})
    with pytest.raises(ConfigError, match="^use_peft is TRL's name: the setting here is lora_r$"):
        Request(model="Llama-3.2-1B").with_fields(use_peft=True)


def test_an_unknown_field_names_the_closest_in_pythons_words(capsys):
    with pytest.raises(ConfigError) as refused:
        api.check("Llama-3.2-1B", "t4", max_completion_lenght=1024)
    assert str(refused.value) == "unknown setting max_completion_lenght (did you mean max_completion_length?)"
    with pytest.raises(ConfigError, match="^gpu is needed"):
        api.check("Llama-3.2-1B")
    with pytest.raises(ConfigError, match="^num_generations must be at least 2"):
        api.check("Llama-3.2-1B", "t4", num_generations=1)


@pytest.mark.parametrize(("key", "suggested"), [
    ("system_prompt", None), ("dataset_configs", None), ("code_language", None), ("cosine_max_len", None),
    ("kl_coef", None),
    ("lora_rank", "lora_r"), ("grad_accum_steps", "gradient_accumulation_steps"), ("num_generation", "num_generations"),
    ("per_device_batch_size", "per_device_train_batch_size"), ("gpu_name", "gpu"),
])
def test_an_unknown_setting_suggests_only_a_setting_it_resembles(key, suggested):
    # a recipe's script arguments share words with the settings (_prompt, _max_, _len): a suggestion below difflib's
    # own cutoff named an unrelated one (as TRL's do_eval -> model, save_strategy -> zero_stage, loss_type -> dtype
    # did before vram_planner.trl_names classified them)
    with pytest.raises(ConfigError) as refused:
        api.check("Llama-3.2-1B", "t4", **{key: 1})
    hint = f" (did you mean {suggested}?)" if suggested else ""
    assert str(refused.value) == f"unknown setting {key}{hint}"


def test_trls_arguments_given_as_settings_say_what_they_are():
    with pytest.raises(ConfigError, match=r"^do_eval is not planned \(evaluation's generation\): the plan assumes it "
                                          "is False; save_strategy changes no GPU memory: leave it out$"):
        api.check("Llama-3.2-1B", "t4", do_eval=True, save_strategy="epoch")


def test_maximize_fitting_gpus_and_the_catalogs_are_their_commands_documents(capsys):
    code, out, _ = run(capsys, "plan", "--gpu", "t4", "--model", "Qwen2.5-0.5B", "--maximize", "num_generations",
                       "--json")
    report = api.maximize("Qwen2.5-0.5B", "t4", "num_generations")
    assert report.to_dict() == json.loads(out) and report.maximized.value > 0
    code, out, _ = run(capsys, "gpus", "--model", "Qwen2.5-0.5B", "--lora-r", "16", "--json")
    cards = api.fitting_gpus("Qwen2.5-0.5B", lora_r=16)
    assert cards.to_dict() == json.loads(out) and cards.fits == (code == 0)
    for command, rows in (("gpus", api.gpus()), ("models", api.models())):
        _, out, _ = run(capsys, command, "--json")
        assert rows == json.loads(out)


def test_a_notebook_shows_a_short_table():
    report = api.plan("Llama-3.2-1B", "rtx3080-mobile")
    text, page = repr(report), report._repr_html_()
    assert text.startswith("<Report>") and len(text.splitlines()) < 20
    assert f"{report.peak_bytes / GiB:.2f} GiB" in text and "change optim" in text
    assert page.startswith("<table>") and page.count("<tr>") == len(text.splitlines()) - 1
    assert "peak" in page and "Llama-3.2-1B" in page


def test_a_config_as_a_dict_is_a_model(llama_1b_file):
    config = json.loads(llama_1b_file.read_text())
    from_dict = api.check(config, "t4").to_dict()
    from_file = api.check(str(llama_1b_file), "t4").to_dict()
    assert from_dict["model"] == "the given config.json"
    assert {**from_dict, "model": None} == {**from_file, "model": None}


def test_the_public_functions_say_what_they_take_and_return():
    for name in api.__all__:
        assert hasattr(api, name), name
    for function in (api.check, api.plan, api.maximize, api.fitting_gpus, api.trace, api.gpus, api.models,
                     api.resolve):
        assert "Returns:" in function.__doc__, function.__name__
        assert "Args:" in function.__doc__ or function in (api.gpus, api.models), function.__name__
