"""TRL's accelerate configs as the plan prints them: TRL's own files, read by accelerate's own launcher."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from unittest import mock

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import launched
from vram_planner.errors import ConfigError
from vram_planner.model import accelerate_config as launcher
from vram_planner.model.spec import training_config

STRATEGIES = st.sampled_from([{}, {"zero_stage": 0}, {"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3},
                              {"fsdp": True}, {"zero_stage": 2, "offload_optimizer": "cpu"},
                              {"zero_stage": 3, "offload_optimizer": "cpu"},
                              {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
                              {"fsdp": True, "offload_param": "cpu"}])


def installed_trl_configs() -> Path:
    spec = importlib.util.find_spec("trl")  # located, not imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("TRL is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "accelerate_configs"


@pytest.mark.parametrize("name", sorted(launcher.TRL_CONFIGS))
def test_the_configs_are_trls_own_files(name):
    assert launcher.TRL_CONFIGS[name] == yaml.safe_load((installed_trl_configs() / f"{name}.yaml").read_text())


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(strategy=STRATEGIES, gpus=st.integers(1, 16), accumulation=st.integers(1, 8),
       precision=st.sampled_from(["bf16", "fp16", "no"]))
def test_accelerate_launches_the_printed_config_as_planned(tmp_path_factory, strategy, gpus, accumulation, precision):
    try:
        train = training_config({**strategy, "num_gpus": gpus, "gradient_accumulation_steps": accumulation,
                                 "per_device_train_batch_size": 2, "num_generations": 2,
                                 "mixed_precision": precision, "dtype": "bfloat16"})
    except ConfigError:
        return  # a combination TRL refuses
    text = launcher.accelerate_config_yaml(train)
    if launcher.strategy(train) == "single":
        assert text is None and launcher.launch_line(train) is None and launcher.per_gpu_label(train) == ""
        return
    assert text is not None and yaml.safe_load(text) == launcher.accelerate_config(train)
    args = launched(text, tmp_path_factory.mktemp("launch"))
    assert args.num_processes == gpus and args.mixed_precision == precision
    assert bool(args.use_deepspeed) == (train.zero_stage is not None)
    assert bool(args.use_fsdp) == train.fsdp
    if train.zero_stage is not None:
        assert args.zero_stage == train.zero_stage
        if train.zero_stage in (0, 1):  # zero1.yaml names it; transformers refuses a value other than GRPOConfig's
            assert args.gradient_accumulation_steps == accumulation
        if train.zero_stage in (2, 3):  # the offload devices, as TRL's zero2/zero3 files name them
            assert (args.offload_optimizer_device, args.offload_param_device) == (train.offload_optimizer,
                                                                                   train.offload_param)
    if train.fsdp:
        assert str(args.fsdp_version) == "2"
        assert str(args.fsdp_offload_params).lower() == str(train.offload_param == "cpu").lower()
    name = {"ddp": "DDP", "fsdp": "FSDP2"}.get(launcher.strategy(train), f"ZeRO-{train.zero_stage}")
    assert launcher.per_gpu_label(train) == f", per GPU, {gpus} x {name}{launcher.offload_label(train)}"
    assert ("offload" in launcher.per_gpu_label(train)) == train.offloaded
    assert launcher.launch_line(train) == (f"accelerate launch --config_file {launcher.CONFIG_FILE} "
                                           f"{launcher.SCRIPT_FILE}")


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(stage=st.sampled_from([1, 2, 3]), bucket=st.sampled_from(["auto", 200_000_000, 500_000_000, 12_345]),
       overlap=st.sampled_from([None, True, False]), offload=st.sampled_from([{}, {"offload_optimizer": "cpu"}]),
       coordinator=st.sampled_from([{}, {"stage3_prefetch_bucket_size": "auto"},
                                    {"stage3_prefetch_bucket_size": 10**7, "stage3_param_persistence_threshold": 0}]))
def test_a_plan_with_its_own_buckets_names_a_deepspeed_config_accelerate_and_our_launcher_read_as_planned(
        tmp_path_factory, stage, bucket, overlap, offload, coordinator):
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    from vram_planner.launcher import launch_settings

    try:
        train = training_config({"zero_stage": stage, "num_gpus": 4, "reduce_bucket_size": bucket,
                                 "overlap_comm": overlap, "dtype": "bfloat16", **offload, **coordinator})
    except ConfigError:
        return  # ZeRO-1 with overlap_comm, ZeRO-1 with offload, ZeRO-3's sizes below stage 3: refused
    folder = tmp_path_factory.mktemp("launch")
    deepspeed = folder / launcher.DEEPSPEED_FILE
    text = launcher.accelerate_config_yaml(train, str(deepspeed))
    assert (launcher.deepspeed_config(train) is None) == (bucket == 500_000_000 and overlap is None
                                                         and not coordinator)
    if launcher.deepspeed_config(train) is None:
        assert "deepspeed_config_file" not in text
        return
    deepspeed.write_text(launcher.deepspeed_config_json(train))
    args = launched(text, folder)
    # accelerate's launcher hands the ranks the file (and the fields its config gave, which its plugin checks
    # against the file, commands/launch.py launch_command), and its plugin reads the planned values from it
    config = yaml.safe_load(text)
    fields = [*config["deepspeed_config"], *(["mixed_precision"] if "mixed_precision" in config else [])]
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = prepare_deepspeed_cmd_env(args)
    with mock.patch.dict(os.environ, {k: v for k, v in env.items() if k.startswith("ACCELERATE_")}):
        zero = DeepSpeedPlugin().deepspeed_config["zero_optimization"]
    assert (zero["stage"], zero["reduce_bucket_size"], zero.get("overlap_comm")) == (stage, bucket, overlap)
    assert all(zero[key] == value for key, value in coordinator.items())
    # and the file, pasted back into vram-plan as a launch, is the same plan
    config = folder / launcher.CONFIG_FILE
    config.write_text(text)
    read = launch_settings({"config_file": str(config)}, "bf16")
    assert not read.problems
    assert training_config({**read.settings, "dtype": "bfloat16"}) == train
