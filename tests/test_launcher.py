"""How a run is launched, read as accelerate reads it: accelerate launch's options (and those `trl grpo` hands it),
TRL's accelerate configs and a DeepSpeed config, as the plan's GPUs and strategy."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import CLASS_NAME, json_of, one_line_error
from vram_planner import api
from vram_planner.errors import VramPlanError
from vram_planner.files import MAX_NESTING
from vram_planner.launcher import (DEEPSPEED_ZERO_DEFAULTS, EARLIER_RELEASES_OPTIONS, LAUNCH_FLAGS, LAUNCH_OPTIONS,
                                   NEUTRAL_OPTIONS, PREFIXED_WITH_THEIR_SWITCH, READ_OPTIONS, TORCHRUN_OPTIONS,
                                   TORCHRUN_SWITCHES, UNPLANNED_OPTIONS, launch_settings, read_deepspeed_config)
from vram_planner.model.accelerate_config import TRL_CONFIGS, TRL_EXAMPLE_CONFIGS
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.zero import overlaps_reduction
from vram_planner.recipe import read_recipe
from vram_planner.request import request_fields
from vram_planner.trl_arguments import command_line_arguments

MODEL = ["--model_name_or_path", "Qwen2.5-0.5B"]
# what each of TRL's shipped configs launches (num_processes 8 in every file), as vram-plan's own options say it
TRL_CONFIG_PLANS = {"zero1": ["--zero-stage", "1", "--num-gpus", "8"],
                    "zero2": ["--zero-stage", "2", "--num-gpus", "8"],
                    "zero3": ["--zero-stage", "3", "--num-gpus", "8"], "fsdp2": ["--fsdp", "--num-gpus", "8"],
                    "multi_gpu": ["--num-gpus", "8"], "single_gpu": []}
COMPARED = ("peak_bytes", "config", "assumptions", "fits")


@pytest.fixture(autouse=True)
def no_default_accelerate_config(monkeypatch, tmp_path):
    # accelerate launch reads $HF_HOME/accelerate/default_config.yaml where no config is named: none here
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


def _accelerate_options():
    from accelerate.commands.launch import launch_command_parser

    names = {spelled[2:].replace("-", "_"): action for action in launch_command_parser()._actions
             for spelled in action.option_strings if spelled.startswith("--") and spelled != "--help"}
    return names, {name for name, action in names.items() if action.nargs == 0}


def test_every_option_of_accelerate_launch_is_read_neutral_or_refused_and_its_switches_take_no_value():
    names, switches = _accelerate_options()
    own = {name for name in names if not name.startswith(PREFIXED_WITH_THEIR_SWITCH)}
    # the installed release's options, and those of the releases before it that it dropped
    assert own - LAUNCH_OPTIONS == set() and LAUNCH_OPTIONS - own - EARLIER_RELEASES_OPTIONS == {"accelerate_config"}
    assert EARLIER_RELEASES_OPTIONS <= NEUTRAL_OPTIONS
    assert LAUNCH_FLAGS == switches
    assert not READ_OPTIONS & set(UNPLANNED_OPTIONS) and not (READ_OPTIONS | set(UNPLANNED_OPTIONS)) & (
        NEUTRAL_OPTIONS - LAUNCH_FLAGS)
    for name, (accepted, _) in UNPLANNED_OPTIONS.items():  # accelerate's own default is a value planned
        default = names[name].default
        assert default is None or default is False or str(default).lower() in {str(a).lower() for a in accepted}, name


def test_the_deepspeed_defaults_the_plan_counts_are_deepspeeds():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = {field.alias or name: field.default for name, field in DeepSpeedZeroConfig.model_fields.items()}
    assert {key: fields[key] for key in DEEPSPEED_ZERO_DEFAULTS} == DEEPSPEED_ZERO_DEFAULTS
    for stage in range(4):
        assert DeepSpeedZeroConfig(stage=stage).overlap_comm == overlaps_reduction(TrainingConfig(zero_stage=stage))


@pytest.mark.parametrize("name", sorted(TRL_CONFIG_PLANS))
def test_each_config_trl_ships_plans_what_vram_plans_own_options_say(capsys, name):
    code, launched = json_of(capsys, "check", "--gpu", "h100", *MODEL, "--accelerate_config", name)
    expected_code, expected = json_of(capsys, "check", "--gpu", "h100", "--model", "Qwen2.5-0.5B",
                                      *TRL_CONFIG_PLANS[name])
    assert code == expected_code and {k: launched[k] for k in COMPARED} == {k: expected[k] for k in COMPARED}


def test_fsdp1_is_refused_in_one_line(capsys):
    err = one_line_error(capsys, "check", "--gpu", "h100", *MODEL, "--accelerate_config", "fsdp1")
    assert "fsdp_version 1 is not planned" in err and "as TRL's fsdp2 config" in err


@pytest.mark.parametrize("launch, ours", [
    (["--accelerate_config", "zero3", "--num_processes", "4"], ["--zero-stage", "3", "--num-gpus", "4"]),
    (["--use_deepspeed", "--num-processes=2"], ["--zero-stage", "2", "--num-gpus", "2"]),
    (["--use_deepspeed", "--zero_stage", "3", "--num_processes", "4", "--offload_optimizer_device", "cpu",
      "--offload_param_device", "cpu"],
     ["--zero-stage", "3", "--num-gpus", "4", "--offload-optimizer", "cpu", "--offload-param", "cpu"]),
    (["--use_fsdp", "--fsdp_version", "2", "--fsdp_offload_params", "true", "--num_processes", "2"],
     ["--fsdp", "--num-gpus", "2", "--offload-param", "cpu"]),
    (["--multi_gpu", "--num_processes", "2"], ["--num-gpus", "2"]),
    (["--num_processes", "2"], ["--num-gpus", "2"]),  # accelerate turns multi-GPU on where it finds several
    (["--accelerate_config", "zero2", "--num_processes", "2", "--zero_stage", "1"], ["--zero-stage", "1",
                                                                                      "--num-gpus", "2"]),
    # vram-plan's own options win over the launcher's
    (["--accelerate_config", "zero3", "--num-gpus", "2"], ["--zero-stage", "3", "--num-gpus", "2"]),
])
def test_accelerate_launchs_options_plan_what_vram_plans_own_options_say(capsys, launch, ours):
    code, launched = json_of(capsys, "check", "--gpu", "h100", *MODEL, *launch)
    expected_code, expected = json_of(capsys, "check", "--gpu", "h100", "--model", "Qwen2.5-0.5B", *ours)
    assert code == expected_code and {k: launched[k] for k in COMPARED} == {k: expected[k] for k in COMPARED}


def test_an_accelerate_config_file_and_a_deepspeed_config_are_read_where_they_are(capsys, tmp_path):
    config = tmp_path / "my_zero3.yaml"
    config.write_text(yaml.safe_dump({**TRL_CONFIGS["zero3"], "num_processes": 4}))
    _, from_file = json_of(capsys, "check", "--gpu", "h100", *MODEL, "--config_file", str(config))
    deepspeed = tmp_path / "ds_config.json"
    deepspeed.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
                                                           "offload_optimizer": {"device": "cpu"}},
                                     "train_micro_batch_size_per_gpu": "auto"}))
    _, from_json = json_of(capsys, "check", "--gpu", "h100", *MODEL, "--deepspeed", str(deepspeed),
                           "--num_processes", "4")
    _, ours = json_of(capsys, "check", "--gpu", "h100", "--model", "Qwen2.5-0.5B", "--zero-stage", "3",
                      "--num-gpus", "4")
    _, offloaded = json_of(capsys, "check", "--gpu", "h100", "--model", "Qwen2.5-0.5B", "--zero-stage", "3",
                           "--num-gpus", "4", "--offload-optimizer", "cpu", "--stage3-prefetch-bucket-size", "auto")
    assert {k: from_file[k] for k in COMPARED} == {k: ours[k] for k in COMPARED}
    assert {k: from_json[k] for k in COMPARED} == {k: offloaded[k] for k in COMPARED}
    assert "an upper bound" not in " ".join(from_json["notes"])
    # the launcher's options win over the file's
    _, two = json_of(capsys, "check", "--gpu", "h100", *MODEL, "--config_file", str(config), "--num_processes", "2")
    _, ours_two = json_of(capsys, "check", "--gpu", "h100", "--model", "Qwen2.5-0.5B", "--zero-stage", "3",
                          "--num-gpus", "2")
    assert {k: two[k] for k in COMPARED} == {k: ours_two[k] for k in COMPARED} != {k: ours[k] for k in COMPARED}


def test_a_trl_example_config_that_is_no_file_here_is_read_as_trls_and_said_so(capsys):
    path = "examples/accelerate_configs/deepspeed_zero2.yaml"
    _, launched = json_of(capsys, "check", "--gpu", "h100", *MODEL, "--config_file", path, "--num_processes", "2")
    _, ours = json_of(capsys, "check", "--gpu", "h100", "--model", "Qwen2.5-0.5B", "--zero-stage", "2",
                      "--num-gpus", "2")
    assert {k: launched[k] for k in COMPARED} == {k: ours[k] for k in COMPARED}
    assert any(f"{path} is not a file here: read as TRL's" in note for note in launched["notes"])
    assert set(TRL_EXAMPLE_CONFIGS.values()) <= set(TRL_CONFIGS)
    err = one_line_error(capsys, "check", "--gpu", "h100", *MODEL, "--config_file", "configs/mine.yaml")
    assert "the accelerate config configs/mine.yaml is not a file here" in err


@pytest.mark.parametrize("zero, said", [
    ({"stage": 1, "overlap_comm": True}, "--overlap-comm on under ZeRO-1 is not planned"),
    ({"stage": 2, "reduce_scatter": False}, "the DeepSpeed config's reduce_scatter False is not planned: the plan "
                                            "counts DeepSpeed's defaults (reduce_scatter True), as --zero-stage 2 plans "
                                            "it"),
    ({"stage": 2, "reduce_bucket_size": "lots"}, "reduce-bucket-size should be a number of elements such as 2e8"),
    ({"stage": 3, "stage3_max_live_parameters": 2e9}, "stage3_max_live_parameters 2000000000.0 is not planned"),
    ({"stage": 3, "offload_param": {"device": "nvme"}}, "offload_param_device 'nvme' is not planned"),
])
def test_a_deepspeed_config_the_plan_does_not_count_is_refused_with_what_it_counts(capsys, tmp_path, zero, said):
    deepspeed = tmp_path / "ds.json"
    deepspeed.write_text(json.dumps({"zero_optimization": zero}))
    err = one_line_error(capsys, "check", "--gpu", "h100", *MODEL, "--deepspeed", str(deepspeed), "--num_processes",
                         "2")
    assert said in err


def test_transformers_example_zero2_config_is_planned_with_its_buckets(capsys, tmp_path):
    # transformers' example ds_config_zero2.json: 2e8 buckets, overlap_comm, the optimizer offloaded
    deepspeed = tmp_path / "ds_config_zero2.json"
    deepspeed.write_text(json.dumps({"zero_optimization": {
        "stage": 2, "allgather_bucket_size": 2e8, "overlap_comm": True, "reduce_scatter": True,
        "reduce_bucket_size": 2e8, "contiguous_gradients": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": True}}, "train_micro_batch_size_per_gpu": "auto"}))
    code, launched = json_of(capsys, "check", "--gpu", "h100", *MODEL, "--deepspeed", str(deepspeed),
                             "--num_processes", "2")
    expected_code, ours = json_of(capsys, "check", "--gpu", "h100", "--model", "Qwen2.5-0.5B", "--zero-stage", "2",
                                  "--num-gpus", "2", "--offload-optimizer", "cpu", "--reduce-bucket-size", "2e8",
                                  "--overlap-comm")
    _, defaults = json_of(capsys, "check", "--gpu", "h100", "--model", "Qwen2.5-0.5B", "--zero-stage", "2",
                          "--num-gpus", "2", "--offload-optimizer", "cpu")
    assert code == expected_code and {k: launched[k] for k in COMPARED} == {k: ours[k] for k in COMPARED}
    assert ours["peak_bytes"] != defaults["peak_bytes"]  # the two 2e8 buckets are not one of 5e8


def test_deepspeeds_defaults_and_stage_3s_overlap_are_planned_as_they_are():
    for zero in ({"stage": 3, "overlap_comm": True, **DEEPSPEED_ZERO_DEFAULTS}, {"stage": 1, "overlap_comm": False}):
        launch = launch_settings({"deepspeed_config_file": {"zero_optimization": zero}, "num_processes": 2})
        planned = {key: zero[key] for key in ("reduce_bucket_size", "overlap_comm", "stage3_prefetch_bucket_size",
                                              "stage3_param_persistence_threshold") if key in zero}
        assert not launch.problems and launch.settings == {"num_gpus": 2, "zero_stage": zero["stage"], **planned}
    # transformers' example ds_config_zero3.json plans as vram-plan's ZeRO-3 with both offloads, its "auto" sizes
    hf_zero3 = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                "stage3_gather_16bit_weights_on_model_save": True}
    launch = launch_settings({"deepspeed_config_file": {"zero_optimization": hf_zero3, "bf16": {"enabled": "auto"}},
                              "num_processes": 2})
    assert not launch.problems and launch.settings == {"num_gpus": 2, "zero_stage": 3, "offload_optimizer": "cpu",
                                                       "offload_param": "cpu", "reduce_bucket_size": "auto",
                                                       "overlap_comm": True, "stage3_prefetch_bucket_size": "auto",
                                                       "stage3_param_persistence_threshold": "auto"}
    assert not launch.notes
    # no prefetch: planned as the default's rounds, an upper bound, said; below stage 3 DeepSpeed reads none of them
    launch = launch_settings({"deepspeed_config_file": {"zero_optimization": {
        "stage": 3, "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0}}, "num_processes": 2})
    assert launch.settings == {"num_gpus": 2, "zero_stage": 3, "stage3_param_persistence_threshold": 0}
    assert "stage3_prefetch_bucket_size 0" in launch.notes[0] and "an upper bound" in launch.notes[0]
    launch = launch_settings({"deepspeed_config_file": {"zero_optimization": {
        "stage": 2, "stage3_prefetch_bucket_size": "auto", "stage3_max_live_parameters": 1e8}}, "num_processes": 2})
    assert not launch.problems and not launch.notes and launch.settings == {"num_gpus": 2, "zero_stage": 2}
    # DeepSpeed offloads parameters at ZeRO-3 only
    launch = launch_settings({"use_deepspeed": True, "zero_stage": 2, "offload_param_device": "cpu",
                              "num_processes": 2})
    assert launch.settings == {"num_gpus": 2, "zero_stage": 2} and "at ZeRO-3 only" in launch.notes[0]
    launch = launch_settings({"deepspeed_config_file": json.dumps({"zero_optimization": {"stage": 2},
                                                                   "optimizer": {"type": "Lamb"}})})
    assert launch.problems == ["the DeepSpeed config's optimizer 'Lamb' is not planned; leave the optimizer to the "
                               "Trainer's optim"]


@pytest.mark.parametrize("recipe, precision", [
    ({"mixed_precision": "no"}, "bf16"),  # TRL 1.16 makes bf16 true: accelerate's is left out
    ({"mixed_precision": "no", "bf16": False}, "no"),  # neither flag true: accelerate's is TrainingArguments'
    ({"mixed_precision": "fp16", "bf16": False}, "fp16"),
    ({"mixed_precision": "fp16", "bf16": True}, "bf16"),
    ({"mixed_precision": "bf16", "trl_version": "0.14.0"}, "bf16"),  # 0.14's bf16 defaults to false
    ({"mixed_precision": "fp16", "trl_version": "0.14.0"}, "fp16"),
    ({"trl_version": "0.14.0"}, None),
])
def test_accelerates_mixed_precision_counts_where_trls_bf16_and_fp16_leave_it(recipe, precision):
    read = read_recipe({"model_name_or_path": "SmolLM2-135M", "use_peft": True, **recipe})
    assert read.settings.get("mixed_precision", "bf16" if "trl_version" not in recipe else None) == precision


def test_a_pasted_launch_command_reads_the_launchers_options_and_trls():
    assert command_line_arguments(
        "accelerate launch --config_file examples/accelerate_configs/deepspeed_zero3.yaml --num_processes 8 \\\n"
        "  grpo.py --model_name_or_path Qwen/Qwen2.5-7B --bf16 true --gradient_accumulation_steps 4") == {
        "config_file": "examples/accelerate_configs/deepspeed_zero3.yaml", "num_processes": 8,
        "model_name_or_path": "Qwen/Qwen2.5-7B", "bf16": True, "gradient_accumulation_steps": 4}
    # accelerate's own gradient_accumulation_steps before the script is not TRL's (the Trainer's is)
    assert "gradient_accumulation_steps" not in command_line_arguments(
        "accelerate launch --use_deepspeed --gradient_accumulation_steps 8 grpo.py --model_name_or_path m")
    # trl grpo hands the options its parser does not know to accelerate launch; it has no script
    assert command_line_arguments("trl grpo --model_name_or_path m --accelerate_config zero3 --num_processes 2 "
                                  "--reward_funcs my_rewards.py") == {
        "model_name_or_path": "m", "accelerate_config": "zero3", "num_processes": 2, "reward_funcs": ["my_rewards.py"]}
    assert command_line_arguments("python -u grpo.py --model_name_or_path m") == {"model_name_or_path": "m"}
    # torchrun's processes per node times its nodes; a count it takes from the machine is --num-gpus's
    for command, read in (("torchrun --nproc_per_node 8 grpo.py", {"num_processes": 8}),
                          ("python -m torch.distributed.run --nproc-per-node=4 --nnodes 2 --standalone grpo.py",
                           {"num_processes": 8}),
                          ("torchrun --nproc_per_node gpu --rdzv_backend c10d grpo.py", {"multi_gpu": True}),
                          ("torchrun --nnodes 1:4 --nproc_per_node 8 grpo.py", {"multi_gpu": True})):
        assert command_line_arguments(command + " --model_name_or_path m") == {**read, "model_name_or_path": "m"}
    for command, said in (("deepspeed --num_gpus 8 grpo.py", "deepspeed's options (--num_gpus 8) are not read here"),
                          ("python -m foo grpo.py", "python's options (-m foo) are not read here"),
                          ("torchrun --foo 1 grpo.py", "--foo is not one of torchrun's options"),
                          ("torchrun --nproc_per_node", "--nproc_per_node takes one value"),
                          ("accelerate launch --foo 2 grpo.py", "--foo is not one of accelerate launch's options")):
        with pytest.raises(VramPlanError, match=re.escape(said)):
            command_line_arguments(command.replace("grpo.py", "grpo.py --model_name_or_path m")
                                   if "grpo.py" in command else command + " grpo.py --model_name_or_path m")


def test_torchruns_options_are_those_of_the_installed_torch():
    from torch.distributed.run import get_args_parser

    names = {spelled.lstrip("-").replace("-", "_"): action for action in get_args_parser()._actions
             for spelled in action.option_strings if spelled.startswith("--") and spelled != "--help"}
    assert set(names) == TORCHRUN_OPTIONS
    assert {name for name, action in names.items() if action.nargs == 0} == TORCHRUN_SWITCHES


def test_a_torchrun_command_with_a_deepspeed_config_plans_what_vram_plans_own_options_say(capsys, tmp_path):
    deepspeed = tmp_path / "ds_config.json"
    deepspeed.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    pasted = f"torchrun --nproc_per_node 4 grpo.py --model_name_or_path Qwen2.5-0.5B --deepspeed {deepspeed}"
    report = api.check(api.recipe(pasted, "h100"))
    _, cli = json_of(capsys, "check", "--gpu", "h100", "--model", "Qwen2.5-0.5B", "--zero-stage", "2",
                     "--num-gpus", "4")
    assert {k: json.loads(report.to_json())[k] for k in COMPARED} == {k: cli[k] for k in COMPARED}


def test_the_library_reads_a_pasted_launch_command_as_the_cli_reads_its_options(capsys):
    pasted = "accelerate launch --config_file examples/accelerate_configs/deepspeed_zero3.yaml grpo.py " \
             "--model_name_or_path Qwen2.5-0.5B --num_generations 8"
    request = api.recipe(pasted, "h100")
    assert request.num_gpus == 8 and request.zero_stage == 3
    report = api.check(request)
    _, cli = json_of(capsys, "check", "--gpu", "h100", "--model", "Qwen2.5-0.5B", "--zero-stage", "3",
                     "--num-gpus", "8", "--num-generations", "8")
    assert json.loads(report.to_json())["peak_bytes"] == cli["peak_bytes"]


LAUNCH_VALUES = {
    "accelerate_config": st.sampled_from(sorted(TRL_CONFIGS) + ["zero4", "nope.yaml"]),
    "num_processes": st.one_of(st.integers(-1, 9), st.sampled_from(["2", "x"])),
    "multi_gpu": st.booleans(), "use_deepspeed": st.booleans(), "use_fsdp": st.booleans(),
    "zero_stage": st.one_of(st.integers(-1, 4), st.just("3")),
    "offload_optimizer_device": st.sampled_from(["none", "cpu", "nvme", "disk"]),
    "offload_param_device": st.sampled_from(["none", "cpu", "nvme"]),
    "fsdp_version": st.sampled_from(["1", "2", 2]), "fsdp_offload_params": st.sampled_from(["true", "false", True]),
    "mixed_precision": st.sampled_from(["no", "bf16", "fp16", "fp8", "int4"]),
    "dynamo_backend": st.sampled_from(["no", "inductor"]), "cpu": st.booleans(), "gpu_ids": st.just("0,1"),
    "fsdp_sharding_strategy": st.sampled_from(["FULL_SHARD", "HYBRID_SHARD"]),
}


@settings(max_examples=300, deadline=None)
@given(options=st.fixed_dictionaries({}, optional=LAUNCH_VALUES), precision=st.sampled_from([None, "bf16", "fp16"]))
def test_any_launch_reads_as_the_requests_fields_or_one_line_problems(options, precision):
    launch = launch_settings(options, precision)
    assert all(isinstance(problem, str) and "\n" not in problem and not CLASS_NAME.search(problem)
               for problem in launch.problems + launch.notes)
    assert set(launch.settings) <= set(request_fields())
    if not launch.problems:
        assert launch.settings.get("num_gpus", 1) >= 1 and launch.settings.get("zero_stage", 0) in (0, 1, 2, 3)
        assert not ("zero_stage" in launch.settings and launch.settings.get("fsdp"))


def test_read_deepspeed_config_takes_a_mapping_json_text_or_a_path(tmp_path):
    config = {"zero_optimization": {"stage": 1}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    from vram_planner.launcher import Launch

    for source in (config, json.dumps(config), str(path)):
        launch = Launch()
        assert read_deepspeed_config(source, launch) == {"use_deepspeed": True, "zero_stage": 1}
        assert not launch.problems
    launch = Launch()
    read_deepspeed_config("{not json", launch)
    assert launch.problems and launch.problems[0].startswith("the DeepSpeed config is not JSON")
    launch = Launch()  # deeper than any config: one line, not json's recursion
    read_deepspeed_config('{"a": ' * 100_000, launch)
    assert launch.problems == [f"the DeepSpeed config is nested more than {MAX_NESTING} levels deep; no file "
                               "vram-plan reads is"]


def test_accelerates_default_config_is_read_where_the_command_names_none(capsys, tmp_path):
    default = tmp_path / "hf_home" / "accelerate" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text(yaml.safe_dump({**TRL_CONFIGS["zero2"], "num_processes": 2}))
    _, ours = json_of(capsys, "check", "--gpu", "h100", "--model", "Qwen2.5-0.5B", "--zero-stage", "2",
                      "--num-gpus", "2")
    for pasted in ("accelerate launch grpo.py --model_name_or_path Qwen2.5-0.5B",
                   "trl grpo --model_name_or_path Qwen2.5-0.5B"):
        request = api.recipe(pasted, "h100")
        assert (request.num_gpus, request.zero_stage) == (2, 2)
        report = json.loads(api.check(request).to_json())
        assert {k: report[k] for k in COMPARED} == {k: ours[k] for k in COMPARED}
        read = read_recipe(command_line_arguments(pasted), command_line=True)
        assert f"accelerate's default config {default} is read" in read.summary()
    # a config named, --cpu, or a launcher other than accelerate's leaves it unread
    assert api.recipe("accelerate launch --config_file examples/accelerate_configs/deepspeed_zero3.yaml grpo.py "
                      "--model_name_or_path Qwen2.5-0.5B", "h100").zero_stage == 3
    assert api.recipe("python grpo.py --model_name_or_path Qwen2.5-0.5B", "h100").num_gpus in (None, 1)
    assert api.recipe("trl grpo --model_name_or_path Qwen2.5-0.5B --accelerate_config zero3", "h100").zero_stage == 3


def test_the_analytic_model_holds_what_deepspeeds_engine_holds_with_each_configs_buckets():
    # benchmarks/deepspeed_configs.py traced each config with DeepSpeed's own engine on one rank: the analytic model,
    # as the launcher reads the config, is never below it and within 2% in every phase; the need within the band
    from pathlib import Path

    from vram_planner import engine
    from vram_planner.model.components import zero_rank_excess_bytes
    from vram_planner.model.verdict import need_above_estimate

    results = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "deepspeed_configs.json")
                         .read_text())
    for row in results["rows"]:
        zero = {"stage": row["settings"]["zero_stage"], "reduce_bucket_size": row["settings"].get(
            "reduce_bucket_size", 500_000_000), **{key: row["settings"][key] for key in (
                "overlap_comm", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
                if key in row["settings"]}}
        launch = launch_settings({"deepspeed_config_file": {"zero_optimization": zero},
                                  "num_processes": row["settings"]["num_gpus"]})
        assert not launch.problems
        rest = {k: v for k, v in row["settings"].items() if k not in launch.settings}
        # as the transformers release the table was traced under runs the step (5.25's kernelized norms keep less)
        traced_under = {"transformers_version": results["versions"]["transformers"]}
        verdict = engine.check(row["model"], "h100", {**row.get("base", results["base"]), **launch.settings, **rest,
                                                      **traced_under})
        for phase in verdict.estimate.phases:
            analytic = phase.tensor_bytes - zero_rank_excess_bytes(verdict.context.arch, verdict.train, phase.name,
                                                                   row["rank"])
            traced = row["traced_bytes"][phase.name]
            # at TRL's own batch one known miss: Qwen2.5-7B on 4, whose loss reduces a bucket beside its first layer's
            # backward 82 MiB (0.19%) above the estimate's moment; and prefetch rounds smaller than the MLP's
            # matrices (transformers' "auto" bucket on Qwen2.5-0.5B with LoRA), whose rounds the trace holds up to
            # 1.7 MiB (0.14%) larger than the forward's order counts them
            auto_prefetch = row["settings"].get("stage3_prefetch_bucket_size") == "auto"
            small_rounds = auto_prefetch and row["model"] == "Qwen2.5-0.5B"
            below = 0.997 if "base" in row else 0.998 if small_rounds else 0.999
            # what ZeRO-3's later micro-batch holds past max_live_parameters is counted at its bound, two of the
            # largest parameters (a round's last one, the module fetched beyond the limit); Llama-3.2-1B's LoRA on 8
            # with transformers' "auto" sizes holds 28 MiB of it in its backward (+2.3%)
            past_max_live = auto_prefetch and row["model"] == "Llama-3.2-1B"
            above = 1.025 if past_max_live else 1.02
            assert traced * below <= analytic <= traced * above, (row["model"], row["settings"], phase.name)
        # the need, bisected through the allocator model, within the band near_boundary reads for the strategy
        peak = verdict.estimate.peak_bytes
        assert row["need_bytes"] <= peak * (1 + need_above_estimate(verdict.train)), row
        if verdict.train.zero_stage in (1, 2, 3) and verdict.estimate.peak_phase.name == "optimizer":
            # ZeRO's optimizer step: what DeepSpeed's buffers strand counted (model/zero_replay.py), so the estimate is
            # never more than 1% below the need, nor more than 6% above it (ZeRO-3's full fine-tuning of
            # Llama-3.2-1B on 2 with DeepSpeed's 5e8 bucket 5.1% below it before its step was replayed)
            assert row["need_bytes"] * 0.99 <= peak <= row["need_bytes"] * 1.06, row


LAUNCHERS = st.sampled_from(["accelerate launch", "trl grpo", "torchrun", "python -m torch.distributed.run",
                             "python", "deepspeed", "uv run"])
LAUNCH_WORDS = st.lists(st.sampled_from(
    ["--num_processes", "--num-processes=4", "2", "8", "--multi_gpu", "--use_deepspeed", "--zero_stage", "3",
     "--accelerate_config", "zero3", "fsdp2", "--config_file", "examples/accelerate_configs/fsdp2.yaml",
     "--nproc_per_node", "gpu", "--nnodes", "1:2", "--standalone", "--mixed_precision", "bf16", "--use_fsdp",
     "--fsdp_version", "--offload_optimizer_device", "cpu", "--debug", "-m", "--foo", "x"]), max_size=6)


@settings(max_examples=300, deadline=None)
@given(launcher=LAUNCHERS, before=LAUNCH_WORDS, after=LAUNCH_WORDS)
def test_any_pasted_launch_command_reads_or_is_one_line(launcher, before, after):
    script = "" if launcher.startswith("trl") else " grpo.py"
    text = f"{launcher} {' '.join(before)}{script} --model_name_or_path SmolLM2-135M {' '.join(after)}"
    try:
        read = read_recipe(command_line_arguments(text), command_line=True)
    except VramPlanError as error:
        said = str(error)
        assert "\n" not in said.strip() and not CLASS_NAME.search(said), said
        return
    assert set(read.settings) <= set(request_fields()) and read.settings["model"] == "SmolLM2-135M"
    assert read.settings.get("num_gpus", 1) >= 1
