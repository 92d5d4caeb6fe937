"""A TRL recipe (TrlParser's YAML) read as TRL runs it: `--config recipe.yaml` and api.recipe."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import CLASS_NAME, benchmark_module, json_of, one_line_error, run
from vram_planner import api
from vram_planner.cli import main
from vram_planner.errors import ConfigError, ProfileError
from vram_planner.recipe import MODEL_CONFIG_LORA, PEFT_DEFAULT_TARGETS, is_recipe, read_recipe
from vram_planner.request import request_fields
from vram_planner.trl_names import (LAST_RELEASE_WITH, LAUNCH_ARGUMENTS, MEMORY_NEUTRAL_ARGUMENTS, NOTED_ARGUMENTS,
                                    OLDER_NAMES, RUN_CARRIED_ARGUMENTS, TRL_NAMES, UNPLANNED_ARGUMENTS, same_value)

# open-r1's recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml as it is published (its system prompt shortened)
OPEN_R1_DEMO = """\
# Model arguments
model_name_or_path: Qwen/Qwen2.5-1.5B-Instruct
model_revision: main
torch_dtype: bfloat16
attn_implementation: flash_attention_2

# Data training arguments
dataset_name: open-r1/OpenR1-Math-220k
dataset_configs:
- default
system_prompt: "You are a helpful AI Assistant that provides well-reasoned and detailed responses."

# GRPO trainer config
bf16: true
use_vllm: true
vllm_device: auto
vllm_gpu_memory_utilization: 0.7
do_eval: false
gradient_accumulation_steps: 4
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
hub_model_id: Qwen2.5-1.5B-Open-R1-GRPO
hub_strategy: every_save
learning_rate: 2.0e-05
log_completions: true
log_level: info
logging_first_step: true
logging_steps: 1
logging_strategy: steps
lr_scheduler_type: cosine
max_prompt_length: 512
max_completion_length: 1024
max_steps: -1
num_generations: 16
num_train_epochs: 1
output_dir: data/Qwen2.5-1.5B-Open-R1-GRPO
overwrite_output_dir: true
per_device_eval_batch_size: 16
per_device_train_batch_size: 16
push_to_hub: true
report_to:
- wandb
reward_funcs:
- accuracy
- format
save_strategy: "epoch"
save_total_limit: 1
seed: 42
warmup_ratio: 0.1
"""
# what the recipe plans, as our flags spell it
OPEN_R1_DEMO_FLAGS = ["--model", "Qwen/Qwen2.5-1.5B-Instruct", "--dtype", "bfloat16", "--attn-implementation",
                      "flash_attention_2", "--mixed-precision", "bf16", "--use-vllm", "--vllm-gpu-memory-utilization",
                      "0.7", "--gradient-accumulation-steps", "4", "--gradient-checkpointing", "--no-use-reentrant",
                      "--max-prompt-length", "512", "--max-completion-length", "1024", "--num-generations", "16",
                      "--per-device-train-batch-size", "16"]


@pytest.mark.parametrize("release", [None, "0.16.0", "0.19.0"])
def test_open_r1s_recipe_is_judged_as_its_flags_are(capsys, tmp_path, release):
    recipe = tmp_path / "config_demo.yaml"
    recipe.write_text(OPEN_R1_DEMO)
    pinned = ["--trl-version", release] if release else []
    code, doc = json_of(capsys, "check", "--gpu", "h100-80gb", "--config", str(recipe), *pinned)
    older = ("vllm_device (TRL up to 0.17), torch_dtype (TRL up to 0.26) are fields of an older release than the TRL "
             "1.16.0 planned: --trl-version 0.17 plans the recipe as written; " if release is None else
             "vllm_device (TRL up to 0.17) is a field of an older release than the TRL 0.19.0 planned: --trl-version "
             "0.17 plans the recipe as written; " if release == "0.19.0" else "")
    assert doc["notes"][-1] == ("Read as a TRL recipe: 25 of its keys move no GPU memory here and are left out; "
                                f"{older}dataset_configs, system_prompt are the training script's own, not planned")
    flags_code, flags_doc = json_of(capsys, "check", "--gpu", "h100-80gb", *OPEN_R1_DEMO_FLAGS, *pinned)
    assert (code, {**doc, "notes": doc["notes"][:-1]}) == (flags_code, flags_doc)
    code, out, err = run(capsys, "check", "--gpu", "h100-80gb", "--config", str(recipe), *pinned)
    assert code in (0, 1) and err == "" and "Note: Read as a TRL recipe: 25 of its keys" in out


def test_a_recipe_that_leaves_the_model_to_the_command_line_takes_the_flags(capsys, tmp_path):
    recipe = tmp_path / "grpo.yaml"  # as `trl grpo --model_name_or_path M --config grpo.yaml` is run
    recipe.write_text("use_peft: true\nlearning_rate: 1.0e-6\nbf16: true\nper_device_train_batch_size: 8\n")
    _, doc = json_of(capsys, "check", "--gpu", "24GiB", "--model", "Llama-3.2-1B", "--config", str(recipe))
    assert doc["peft_config"] == {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05,
                                  "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"}
    assert doc["notes"][-1] == "Read as a TRL recipe: 1 of its keys moves no GPU memory here and is left out"
    assert "check needs --model" in one_line_error(capsys, "check", "--gpu", "24GiB", "--config", str(recipe))


def test_lora_is_on_only_with_use_peft_and_takes_model_configs_defaults_and_pefts_targets():
    full = read_recipe({"model_name_or_path": "Qwen2.5-0.5B", "lora_r": 64, "lora_alpha": 8})
    assert "lora_r" not in full.settings and full.unused_lora == ("lora_r", "lora_alpha")  # TRL: full fine-tuning
    assert full.summary() == ("Read as a TRL recipe; lora_r, lora_alpha are unused without use_peft: true, so TRL "
                              "trains the whole model, as planned")
    lora = read_recipe({"model_name_or_path": "Qwen2.5-0.5B", "use_peft": True, "lora_alpha": 8})
    assert lora.settings | {"lora_alpha": MODEL_CONFIG_LORA["lora_alpha"]} == {
        "model": "Qwen2.5-0.5B", **MODEL_CONFIG_LORA, "lora_target_modules": PEFT_DEFAULT_TARGETS["qwen2"]}
    assert lora.settings["lora_alpha"] == 8
    assert read_recipe({"model_name_or_path": "phi-2", "use_peft": True}).settings["lora_target_modules"] == [
        "q_proj", "v_proj", "fc1", "fc2"]
    undropped = read_recipe({"model_name_or_path": "Qwen2.5-0.5B", "use_peft": True, "disable_dropout": True})
    assert undropped.settings["lora_dropout"] == 0.0
    with pytest.raises(ConfigError, match="PEFT has no default LoRA targets for model_type 'phi3'"):
        read_recipe({"model_name_or_path": "Phi-3-mini-4k-instruct", "use_peft": True})
    named = read_recipe({"model_name_or_path": "Phi-3-mini-4k-instruct", "use_peft": True,
                         "lora_target_modules": "all-linear"})
    assert named.settings["lora_target_modules"] == "all-linear"


def test_pefts_default_targets_are_the_installed_pefts():
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as targets

    from vram_planner.model.architecture import FAMILIES, MODEL_TYPE_ALIASES

    for model_type in {*FAMILIES, *MODEL_TYPE_ALIASES}:
        assert PEFT_DEFAULT_TARGETS.get(model_type) == targets.get(model_type), model_type


def test_trls_names_become_the_requests_fields():
    recipe = read_recipe({"model_name_or_path": "Llama-3.2-1B", "dtype": "auto", "fp16": True, "bf16": False,
                          "generation_batch_size": 96, "per_device_train_batch_size": 8, "use_peft": True,
                          "load_in_4bit": True, "use_bnb_nested_quant": True, "vllm_max_model_len": 2048,
                          "activation_checkpointing": False, "adafactor": True,
                          "model_init_kwargs": {"attn_implementation": "eager"}})
    assert recipe.settings == {
        "model": "Llama-3.2-1B", "dtype": "bfloat16",  # auto: the checkpoint's config.json names bfloat16
        "mixed_precision": "fp16", "steps_per_generation": 12, "per_device_train_batch_size": 8,
        "load_in_4bit": True, "bnb_4bit_use_double_quant": True, "vllm_max_model_length": 2048,
        "gradient_checkpointing": False, "optim": "adafactor", "attn_implementation": "eager",
        **MODEL_CONFIG_LORA, "lora_target_modules": ["q_proj", "v_proj"]}
    assert read_recipe({"model_name_or_path": "Llama-3.2-1B", "bf16": False}).settings["mixed_precision"] == "no"
    # TRL's script lays model_init_kwargs over ModelConfig's dtype
    assert read_recipe({"model_name_or_path": "Llama-3.2-1B", "torch_dtype": "float32",
                        "model_init_kwargs": {"dtype": "bfloat16"}}).settings["dtype"] == "bfloat16"
    # the Hub's kernels, which transformers 5.25 turns on by default
    assert read_recipe({"model_name_or_path": "Llama-3.2-1B",
                        "model_init_kwargs": {"use_kernels": False}}).settings["use_kernels"] is False


@pytest.mark.parametrize("recipe,problem", [
    ({"torch_compile": True}, "torch_compile True is not planned (compiled graphs' own buffers); the plan assumes "
                              "False"),
    ({"resume_from_checkpoint": "out/checkpoint-50"}, "resume_from_checkpoint 'out/checkpoint-50' is not planned "
                                                      "(the checkpoint's optimizer states"),
    ({"deepspeed": "ds.json"}, "the DeepSpeed config ds.json is not a file here"),
    ({"fsdp": "full_shard auto_wrap"}, "plan FSDP2 as TRL launches it, --accelerate_config fsdp2"),
    ({"use_dora": True, "use_peft": True}, "use_dora True is not planned (DoRA's"),
    ({"gradient_checkpointing_kwargs": {"use_reentrant": False, "every_n_layers": 2}},
     "gradient_checkpointing_kwargs every_n_layers: 2 is not planned"),
    ({"generation_batch_size": 20, "per_device_train_batch_size": 8}, "must be a multiple of the global batch"),
    ({"generation_batch_size": 16, "steps_per_generation": 2}, "cannot both be set"),
    ({"bf16": True, "fp16": True}, "cannot both be true"),
    ({"model_init_kwargs": {"device_map": "auto"}}, "model_init_kwargs device_map: 'auto' is not planned"),
])
def test_what_moves_memory_unplanned_is_refused_with_what_it_would_change(capsys, tmp_path, recipe, problem):
    with pytest.raises(ConfigError, match="^.*" + problem.replace("(", r"\(").replace(")", r"\)")):
        read_recipe({"model_name_or_path": "Llama-3.2-1B", **recipe})
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps({"model_name_or_path": "Llama-3.2-1B", **recipe}))
    assert problem in one_line_error(capsys, "check", "--gpu", "24GiB", "--config", str(path))


def test_evaluation_is_named_as_not_planned_and_the_step_is_still_judged(capsys, tmp_path):
    # open-r1's Qwen2.5-Math-7B config_simple_rl.yaml evaluates every 100 steps
    recipe = tmp_path / "config_simple_rl.yaml"
    recipe.write_text("model_name_or_path: Qwen2.5-7B\ntorch_dtype: bfloat16\ndo_eval: true\neval_strategy: steps\n"
                      "eval_steps: 100\nper_device_eval_batch_size: 16\nlearning_rate: 1.5e-06\n")
    _, doc = json_of(capsys, "check", "--gpu", "h100-80gb", "--config", str(recipe))
    assert doc["notes"][-1] == (
        "Read as a TRL recipe: 3 of its keys move no GPU memory here and are left out; evaluation (do_eval True, "
        "eval_strategy 'steps') is not planned: it runs between optimizer steps, without gradients, from "
        "per_device_eval_batch_size; torch_dtype (TRL up to 0.26) is a field of an older release than the TRL 1.16.0 "
        "planned: --trl-version 0.26 plans the recipe as written")
    assert doc == json_of(capsys, "check", "--gpu", "h100-80gb", "--model", "Qwen2.5-7B", "--dtype", "bfloat16")[1] | {
        "notes": doc["notes"]}


def test_every_argument_of_trls_configs_is_read_left_out_or_refused_and_each_default_is_planned():
    # every field of the installed TRL's GRPOConfig (with TrainingArguments), ModelConfig, ScriptArguments and its
    # grpo script's arguments is the request's, one of TRL's names for it, memory-neutral, or unplanned with its
    # default among the values planned; every listed name is such a field, or one an older release had
    from trl import GRPOConfig, ModelConfig, ScriptArguments
    from trl.scripts.grpo import GRPOScriptArguments
    from trl.scripts.utils import DatasetMixtureConfig

    classes = (GRPOConfig, ModelConfig, ScriptArguments, GRPOScriptArguments, DatasetMixtureConfig)
    trl_fields = {f.name: f for config in classes for f in dataclasses.fields(config)}
    listed = set(TRL_NAMES) | MEMORY_NEUTRAL_ARGUMENTS | set(UNPLANNED_ARGUMENTS) | LAUNCH_ARGUMENTS
    assert set(trl_fields) - set(request_fields()) - listed == set()
    assert listed - set(trl_fields) == OLDER_NAMES
    assert not (MEMORY_NEUTRAL_ARGUMENTS | set(UNPLANNED_ARGUMENTS)) & set(request_fields())
    assert not MEMORY_NEUTRAL_ARGUMENTS & set(UNPLANNED_ARGUMENTS) and set(TRL_NAMES.values()) <= set(request_fields())
    assert NOTED_ARGUMENTS <= set(UNPLANNED_ARGUMENTS) and RUN_CARRIED_ARGUMENTS <= MEMORY_NEUTRAL_ARGUMENTS
    for name, (accepted, _) in UNPLANNED_ARGUMENTS.items():
        if name in trl_fields:
            field = trl_fields[name]
            default = field.default_factory() if field.default is dataclasses.MISSING else field.default
            assert same_value(default, accepted), (name, default)


NEUTRAL_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=False),
                           st.text(max_size=20), st.lists(st.text(max_size=8), max_size=3))


@settings(max_examples=150, deadline=None)
@given(neutral=st.dictionaries(st.sampled_from(sorted(MEMORY_NEUTRAL_ARGUMENTS)), NEUTRAL_VALUES, max_size=8),
       script=st.dictionaries(st.from_regex(r"\Azz_[a-z_]{1,12}\Z"), NEUTRAL_VALUES, max_size=3),
       knobs=st.fixed_dictionaries({}, optional={"per_device_train_batch_size": st.sampled_from([4, 8, 16]),
                                                 "use_peft": st.booleans(), "bf16": st.booleans(),
                                                 "torch_dtype": st.sampled_from(["bfloat16", "float32", "auto"]),
                                                 "gradient_checkpointing_kwargs": st.just({"use_reentrant": True}),
                                                 "max_completion_length": st.sampled_from([64, 1024])}))
def test_what_moves_no_memory_never_changes_the_request(neutral, script, knobs):
    base = read_recipe({"model_name_or_path": "SmolLM2-135M", **knobs})
    noisy = read_recipe({"model_name_or_path": "SmolLM2-135M", **neutral, **script, **knobs})
    assert noisy.settings == base.settings
    assert set(noisy.left_out) - set(base.left_out) == set(neutral) and set(noisy.script_keys) == set(script)
    assert is_recipe({**neutral, **script, **knobs}) == bool(set(neutral) | {"use_peft", "bf16", "torch_dtype",
                                                                            "gradient_checkpointing_kwargs"} & {
        *neutral, *knobs})


def test_the_generation_batch_is_read_for_the_micro_batch_and_gpus_given_beside_the_recipe(capsys, tmp_path):
    # open-r1's OpenR1-Zero-7B-Math config_v08.00.yaml: 512 completions a generation, micro-batches of 4, on 8 GPUs
    recipe = {"model_name_or_path": "Qwen2.5-0.5B", "generation_batch_size": 512, "per_device_train_batch_size": 4,
              "num_generations": 16, "gradient_accumulation_steps": 16}
    assert read_recipe(recipe).settings["steps_per_generation"] == 128
    assert read_recipe(recipe, {"num_gpus": 8}).settings["steps_per_generation"] == 16
    assert read_recipe(recipe, {"num_gpus": 8, "per_device_train_batch_size": 8}).settings[
        "steps_per_generation"] == 8
    path = tmp_path / "config_v08.00.yaml"
    path.write_text(json.dumps(recipe))
    _, doc = json_of(capsys, "check", "--gpu", "h100-80gb", "--config", str(path), "--num-gpus", "8",
                     "--zero-stage", "3")
    assert doc["config"]["steps_per_generation"] == 16
    assert api.recipe(recipe, "h100-80gb", num_gpus=8).steps_per_generation == 16


def test_the_libraries_recipe_is_the_command_lines(capsys, tmp_path):
    path = tmp_path / "config_demo.yaml"
    path.write_text(OPEN_R1_DEMO)
    request = api.recipe(path, "h100-80gb")
    assert (request.model, request.dtype, request.use_reentrant, request.num_generations) == (
        "Qwen/Qwen2.5-1.5B-Instruct", "bfloat16", False, 16)
    assert api.recipe(path, "h100-80gb", use_vllm=False).use_vllm is False
    spelled = api.check("Qwen/Qwen2.5-1.5B-Instruct", "h100-80gb", dtype="bfloat16",
                        attn_implementation="flash_attention_2", mixed_precision="bf16", use_vllm=True,
                        vllm_gpu_memory_utilization=0.7, gradient_accumulation_steps=4, gradient_checkpointing=True,
                        use_reentrant=False, max_prompt_length=512, max_completion_length=1024, num_generations=16,
                        per_device_train_batch_size=16).to_dict()
    # the recipe's report is those knobs' and says what reading the recipe left out, as `--config` does
    from_recipe = api.check(request).to_dict()
    summary = request.reading.summary()
    assert "evaluation" not in summary and summary.startswith("Read as a TRL recipe: ")
    assert from_recipe["notes"] == [*spelled["notes"], summary]
    assert {**from_recipe, "notes": spelled["notes"]} == spelled
    _, on_the_command_line = json_of(capsys, "check", "--gpu", "h100-80gb", "--config", str(path))
    assert from_recipe == on_the_command_line
    assert api.plan(request).notes[-1] == summary == api.plan(request.with_fields(beta=0.04)).notes[-1]
    with pytest.raises(ConfigError, match="a recipe is TrlParser's YAML"):
        api.recipe({"per_device_train_batch_size": 4})
    broken = tmp_path / "broken.yaml"
    broken.write_text("model_name_or_path: [\n")
    with pytest.raises(ProfileError, match=f"^{broken} is not valid YAML: "):
        api.recipe(broken)


def test_the_recipes_use_reentrant_decides_whether_old_trls_lora_checkpointing_fails(capsys, tmp_path):
    # TRL 0.15 left checkpointing reentrant (transformers 4's default) with nothing making the frozen embedding's
    # output require grad: LoRA fails at the first backward, unless the recipe turns use_reentrant off as open-r1's do
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: Qwen2.5-0.5B\nuse_peft: true\ngradient_checkpointing: true\n")
    assert "fails at the first backward" in one_line_error(capsys, "check", "--gpu", "24GiB", "--config", str(recipe),
                                                           "--trl-version", "0.15")
    recipe.write_text(recipe.read_text() + "gradient_checkpointing_kwargs:\n  use_reentrant: false\n")
    code, _, err = run(capsys, "check", "--gpu", "24GiB", "--config", str(recipe), "--trl-version", "0.15")
    assert code in (0, 1) and err == ""


def test_the_fields_of_older_releases_are_those_their_wheels_had():
    # benchmarks/trl_releases.py's facts: each release's GRPOConfig and ModelConfig fields, read from its wheel
    releases = benchmark_module("trl_releases").load_facts()["releases"]
    final = [r for r in releases if not r["prerelease"]]
    for name, last in LAST_RELEASE_WITH.items():
        having = [r["version"] for r in final if name in r["fields"]]
        assert having and ".".join(having[-1].split(".")[:2]) == last, (name, having[-1:])
    newest = set(final[-1]["fields"])
    every = set().union(*(r["fields"] for r in final))
    # every field a release had and the newest dropped is named where a recipe may still spell it
    assert {name for name in every - newest if name not in request_fields()} <= OLDER_NAMES
    assert {name for name in every if name in OLDER_NAMES} - set(request_fields()) <= set(LAST_RELEASE_WITH)


@pytest.mark.parametrize(("spelled", "transformers_version", "edited"), [
    ("gradient_checkpointing", "5.24.0", "gradient_checkpointing"),  # both names work until transformers 6.0
    ("activation_checkpointing", "5.24.0", "activation_checkpointing"),
    (None, "5.24.0", "activation_checkpointing"),  # the name of the release planned (5.23 on)
    (None, "5.22.0", "gradient_checkpointing"),
])
def test_the_edits_spell_checkpointing_as_the_recipe_does_else_as_the_release_does(spelled, transformers_version,
                                                                                   edited):
    from vram_planner.model.spec import TrainingConfig, with_changes
    from vram_planner.recipe import recipe_edits

    reading = read_recipe({"model_name_or_path": "Qwen2.5-0.5B", **({spelled: False} if spelled else {})})
    requested = TrainingConfig(transformers_version=transformers_version, gradient_checkpointing=False)
    chosen = with_changes(requested, gradient_checkpointing=True, use_reentrant=False)
    assert recipe_edits(reading, requested, chosen) == {edited: True, f"{edited}_kwargs": {"use_reentrant": False}}


@pytest.mark.parametrize("gpu", ["rtx4090", "rtx4060-laptop", "rtx3080-mobile"])
def test_the_plans_edits_to_the_recipe_make_the_recipe_of_the_plans_choice(capsys, tmp_path, gpu):
    # the lines `plan --config recipe.yaml` prints, laid over the recipe, are the config the plan chose
    recipe = tmp_path / "config_demo.yaml"
    recipe.write_text(OPEN_R1_DEMO.replace("Qwen/Qwen2.5-1.5B-Instruct", "Qwen2.5-1.5B"))
    code, out, _ = run(capsys, "plan", "--gpu", gpu, "--config", str(recipe))
    assert code in (0, 1)
    _, planned = json_of(capsys, "plan", "--gpu", gpu, "--config", str(recipe))
    block = out.split(f"In {recipe}, set (the rest as it is):\n")[1].strip().splitlines()
    assert block and all(": " in line and not line.startswith(" ") for line in block)
    # the JSON document and the library give the same edits
    assert {line.split(": ", 1)[0]: json.loads(line.split(": ", 1)[1]) for line in block} == planned["recipe_edits"]
    assert api.recipe_edits(recipe, api.plan(api.recipe(recipe, gpu))) == planned["recipe_edits"]
    edited = tmp_path / "edited.yaml"
    edited.write_text(recipe.read_text() + "\n".join(block) + "\n")  # YAML: a later key wins
    code, checked = json_of(capsys, "check", "--gpu", gpu, "--config", str(edited))
    assert (code == 0) == planned["fits"]
    same = ("config", "peft_config", "quantization_config", "peak_bytes")
    assert {key: checked[key] for key in same} == {key: planned[key] for key in same}


# Every argument a recipe may name, and values of every shape YAML gives
RECIPE_KEYS = sorted(set(TRL_NAMES) | MEMORY_NEUTRAL_ARGUMENTS | set(UNPLANNED_ARGUMENTS) | set(request_fields())
                     - {"model", "gpu", "calibration", "host_memory"})
ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-3, 5000), st.floats(-2, 1e4, allow_nan=False),
                      st.sampled_from(["auto", "bfloat16", "float16", "steps", "no", "all-linear", "cuda:1", "",
                                       "q_proj,v_proj", "0.17", "1.16"]),
                      st.text(max_size=12), st.lists(st.sampled_from(["q_proj", "v_proj", 3]), max_size=3),
                      st.dictionaries(st.sampled_from(["use_reentrant", "dtype", "every_n_layers", "device_map",
                                                       "attn_implementation"]),
                                      st.one_of(st.booleans(), st.integers(1, 3), st.just("bfloat16")), max_size=2))


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(recipe=st.dictionaries(st.sampled_from(RECIPE_KEYS), ANY_VALUE, max_size=6),
       command=st.sampled_from(["check", "plan"]))
def test_any_recipe_gives_a_verdict_a_plan_or_one_clear_line(tmp_path_factory, recipe, command):
    # through the command line as a user runs it: exit 0 or 1 with a report, or 2 with one line naming no class
    path = tmp_path_factory.mktemp("recipe") / "recipe.yaml"
    path.write_text(json.dumps({"model_name_or_path": "SmolLM2-135M", **recipe}))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([command, "--gpu", "24GiB", "--config", str(path)])
    if code == 2:
        assert out.getvalue() == "" and err.getvalue().count("\n") == 1 and err.getvalue().startswith("error: ")
        assert not CLASS_NAME.search(err.getvalue()), err.getvalue()
    else:
        assert code in (0, 1) and "Read as a TRL recipe" in out.getvalue(), err.getvalue()


def test_a_recipe_the_plan_keeps_has_no_edits_and_check_has_none_to_give(capsys, tmp_path):
    recipe = tmp_path / "small.yaml"
    recipe.write_text("model_name_or_path: SmolLM2-135M\nper_device_train_batch_size: 4\nnum_generations: 4\n"
                      "max_completion_length: 128\nbf16: true\n")
    code, out, _ = run(capsys, "plan", "--gpu", "h200", "--config", str(recipe))
    _, planned = json_of(capsys, "plan", "--gpu", "h200", "--config", str(recipe))
    assert code == 0 and planned["recipe_edits"] == {} and "set (the rest as it is)" not in out
    _, checked = json_of(capsys, "check", "--gpu", "h200", "--config", str(recipe))
    assert checked["recipe_edits"] is None
    _, plain = json_of(capsys, "plan", "--gpu", "rtx4090", "--model", "Qwen2.5-1.5B")
    assert plain["recipe_edits"] is None
    with pytest.raises(ConfigError, match="takes the report api.plan gave"):
        api.recipe_edits(recipe, api.check(api.recipe(recipe, "h200")))
