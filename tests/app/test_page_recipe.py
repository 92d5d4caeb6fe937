"""The page's fields filled from a pasted TRL recipe, or a pasted TRL command line: the request they then hold is the
one api.recipe reads from the same keys."""

from __future__ import annotations

import pytest

from test_recipe import OPEN_R1_DEMO
from vram_planner import api
from vram_planner.files import load_yaml
from vram_planner.request import DEFAULT_SAFETY_MARGIN


@pytest.fixture(autouse=True)
def no_default_accelerate_config(monkeypatch, tmp_path):
    # a pasted accelerate launch or trl grpo reads $HF_HOME/accelerate/default_config.yaml where no config is named
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


@pytest.fixture(scope="module")
def page_and_knobs():
    gr = pytest.importorskip("gradio")
    from vram_planner.app import page

    with gr.Blocks():
        knobs = page._knob_fields()
    return page, knobs


@pytest.mark.parametrize("recipe", [OPEN_R1_DEMO, "---\n" + OPEN_R1_DEMO,
                                    "model_name_or_path: Qwen2.5-0.5B\nuse_peft: true\nlora_r: 8\n"
                                    "generation_batch_size: 64\nper_device_train_batch_size: 8\n"
                                    "temperature: 0.7\nlearning_rate: 1.0e-6\n"])
def test_the_filled_fields_hold_the_recipes_request(page_and_knobs, recipe):
    page, knobs = page_and_knobs
    note, model, pasted, release, *values = page.recipe_fields(knobs, recipe)
    assert note.startswith("Read as a TRL recipe: ") and pasted == "" and release == page.UNSET
    request, _ = page.page_request(knobs, True, "h100-80gb", model["value"], pasted, release, DEFAULT_SAFETY_MARGIN,
                                   tuple(values))
    expected = api.recipe(load_yaml(recipe, "recipe"), "h100-80gb")
    # the same training config (a list of LoRA targets is the page's comma-separated text)
    assert api.resolve(request)[1] == api.resolve(expected)[1]
    assert request.model == expected.model


@pytest.mark.parametrize("text,said", [("a: [\n", "not valid YAML"), ("- a\n", "holds no mapping"),
                                       ("model_name_or_path: Qwen2.5-0.5B\ntorch_compile: true\n",
                                        "torch_compile True is not planned"),
                                       ("trl grpo --config r.yaml --bf16 true", "paste its YAML here"),
                                       ("trl grpo --model_name_or_path M --foo 3", "--foo is not one of TRL's"),
                                       ("trl grpo --use_peft maybe", "--use_peft takes yes/no"),
                                       ('trl grpo --run_name "a', "cannot be read as a shell line")])
def test_a_bad_recipe_is_one_line_and_leaves_the_fields(page_and_knobs, text, said):
    page, knobs = page_and_knobs
    note, *rest = page.recipe_fields(knobs, text)
    assert note.startswith("✘ error: ") and said in note and "\n" not in note
    assert all(update == {"__type__": "update"} for update in rest)


def test_a_pasted_trl_command_fills_the_fields_as_the_same_keys_do(page_and_knobs):
    page, knobs = page_and_knobs
    command = ("accelerate launch --num_processes 1 grpo.py \\\n  --model_name_or_path Qwen2.5-0.5B --use_peft "
               "--lora_r 8 \\\n  --per_device_train_batch_size 8 --generation_batch_size 64 --bf16 true "
               "--learning_rate 1e-6 --lora_target_modules q_proj v_proj")
    note, model, pasted, release, *values = page.recipe_fields(knobs, command)
    assert note.startswith("Read as TRL's arguments: 1 of them") and pasted == ""
    request, _ = page.page_request(knobs, True, "h100-80gb", model["value"], pasted, release, DEFAULT_SAFETY_MARGIN,
                                   tuple(values))
    expected = api.recipe({"model_name_or_path": "Qwen2.5-0.5B", "use_peft": True, "lora_r": 8,
                           "per_device_train_batch_size": 8, "generation_batch_size": 64, "bf16": True,
                           "learning_rate": 1e-6, "lora_target_modules": ["q_proj", "v_proj"]}, "h100-80gb")
    assert api.resolve(request)[1] == api.resolve(expected)[1] and request.model == expected.model


def test_a_pasted_multi_gpu_launch_fills_the_gpus_and_the_strategy(page_and_knobs):
    page, knobs = page_and_knobs
    command = ("accelerate launch --config_file examples/accelerate_configs/deepspeed_zero3.yaml --num_processes 4 "
               "grpo.py --model_name_or_path Qwen2.5-0.5B --bf16 true")
    note, model, pasted, release, *values = page.recipe_fields(knobs, command)
    assert "is not a file here: read as TRL's examples/accelerate_configs/deepspeed_zero3.yaml" in note
    request, _ = page.page_request(knobs, True, "h100-80gb", model["value"], pasted, release, DEFAULT_SAFETY_MARGIN,
                                   tuple(values))
    train = api.resolve(request)[1]
    assert (train.num_gpus, train.zero_stage) == (4, 3) and train == api.resolve(api.recipe(command, "h100-80gb"))[1]
