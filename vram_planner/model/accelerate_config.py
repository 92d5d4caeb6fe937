"""Several GPUs as the plan runs them: the strategy's name, TRL's accelerate config for it and the launch line.

Pure: no accelerate, no TRL. The configs are TRL's own, as TRL 1.16 ships them in `trl/accelerate_configs/` (the
files `trl grpo --accelerate_config zero3` reads; the same blobs as `examples/accelerate_configs/deepspeed_zero1.yaml`,
`deepspeed_zero2.yaml`, `deepspeed_zero3.yaml`, `fsdp2.yaml` and `multi_gpu.yaml` in TRL's repository), with the
plan's number of processes, mixed precision and (where the file names it) gradient accumulation. A test holds these
copies to the installed TRL's files and loads what `plan` prints with accelerate's own config classes.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from vram_planner.model.spec import (DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD, DEEPSPEED_PREFETCH_BUCKET_SIZE,
                                     DEEPSPEED_REDUCE_BUCKET_SIZE, TrainingConfig)

# ZeRO-3's coordinator's sizes as DeepSpeed's defaults have them: a config file names them only where the plan differs
ZERO3_COORDINATOR_DEFAULTS = {"stage3_prefetch_bucket_size": DEEPSPEED_PREFETCH_BUCKET_SIZE,
                              "stage3_param_persistence_threshold": DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD}

CONFIG_FILE = "accelerate_config.yaml"  # the name the launch line gives the printed config
DEEPSPEED_FILE = "ds_config.json"  # the DeepSpeed config the printed accelerate config names, where it needs one
SCRIPT_FILE = "train_grpo.py"  # the name the launch line gives the printed GRPOConfig code

_COMMON: dict[str, Any] = {
    "compute_environment": "LOCAL_MACHINE", "debug": False, "downcast_bf16": "no", "machine_rank": 0,
    "main_training_function": "main", "mixed_precision": "bf16", "num_machines": 1, "num_processes": 8,
    "rdzv_backend": "static", "same_network": True, "tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False,
    "use_cpu": False,
}
# trl/accelerate_configs/<name>.yaml of TRL 1.16.0, key for key
TRL_CONFIGS: dict[str, dict[str, Any]] = {
    "multi_gpu": {**_COMMON, "distributed_type": "MULTI_GPU", "gpu_ids": "all"},
    "zero1": {**_COMMON, "distributed_type": "DEEPSPEED", "deepspeed_config": {
        "deepspeed_multinode_launcher": "standard", "gradient_accumulation_steps": 1, "zero3_init_flag": False,
        "zero_stage": 1}},
    "zero2": {**_COMMON, "distributed_type": "DEEPSPEED", "deepspeed_config": {
        "deepspeed_multinode_launcher": "standard", "offload_optimizer_device": "none",
        "offload_param_device": "none", "zero3_init_flag": False, "zero_stage": 2}},
    "zero3": {**_COMMON, "distributed_type": "DEEPSPEED", "deepspeed_config": {
        "deepspeed_multinode_launcher": "standard", "offload_optimizer_device": "none",
        "offload_param_device": "none", "zero3_init_flag": True, "zero3_save_16bit_model": True, "zero_stage": 3}},
    "fsdp2": {**_COMMON, "distributed_type": "FSDP", "enable_cpu_affinity": False, "fsdp_config": {
        "fsdp_activation_checkpointing": False, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_cpu_ram_efficient_loading": True, "fsdp_offload_params": False, "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_version": 2}},
    # the two the plan never prints, read where a launch names them (vram_planner.launcher)
    "fsdp1": {**_COMMON, "distributed_type": "FSDP", "enable_cpu_affinity": False, "fsdp_config": {
        "fsdp_activation_checkpointing": False, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_forward_prefetch": True, "fsdp_offload_params": False, "fsdp_reshard_after_forward": "FULL_SHARD",
        "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_sync_module_states": True, "fsdp_use_orig_params": True,
        "fsdp_version": 1}},
    "single_gpu": {**_COMMON, "distributed_type": "NO", "gpu_ids": "all"},
}
# TRL's repository keeps the same files as examples/accelerate_configs/<name>.yaml, the paths its docs launch with
TRL_EXAMPLE_CONFIGS = {"deepspeed_zero1": "zero1", "deepspeed_zero2": "zero2", "deepspeed_zero3": "zero3",
                       "fsdp1": "fsdp1", "fsdp2": "fsdp2", "multi_gpu": "multi_gpu", "single_gpu": "single_gpu"}
# The file TRL ships for each strategy of the plan (TrainingConfig.distributed); ZeRO stage 0 has none of its own and
# takes zero1's with stage 0.
TRL_CONFIG_NAMES = {"ddp": "multi_gpu", "zero0": "zero1", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3",
                    "fsdp": "fsdp2"}
STRATEGY_NAMES = {"ddp": "DDP", "zero0": "ZeRO-0", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
                  "fsdp": "FSDP2"}


def strategy(train: TrainingConfig) -> str:
    """The plan's distribution strategy: single, ddp, zero0-zero3 or fsdp."""
    return train.distributed


def offload_label(train: TrainingConfig) -> str:
    """' + offload: optimizer' after the strategy's name where states are offloaded to the CPU; '' where none is."""
    if train.fsdp and train.offload_param == "cpu":
        return " + CPU offload"
    offloaded = [what for what, device in (("optimizer", train.offload_optimizer), ("parameters", train.offload_param))
                 if device == "cpu"]
    return f" + offload: {', '.join(offloaded)}" if offloaded else ""


def strategy_label(train: TrainingConfig) -> str | None:
    """'2 x ZeRO-3' (None on one GPU without DeepSpeed or FSDP): what the per-GPU numbers are for."""
    name = STRATEGY_NAMES.get(strategy(train))
    return None if name is None else f"{train.num_gpus} x {name}{offload_label(train)}"


def per_gpu_label(train: TrainingConfig) -> str:
    """', per GPU, 2 x ZeRO-3' to follow the card's name in a headline; '' on one plain GPU."""
    label = strategy_label(train)
    return "" if label is None else f", per GPU, {label}"


def trl_config_name(train: TrainingConfig) -> str | None:
    return TRL_CONFIG_NAMES.get(strategy(train))


def accelerate_config(train: TrainingConfig, deepspeed_file: str = DEEPSPEED_FILE) -> dict[str, Any] | None:
    """TRL's accelerate config for the plan's strategy with its processes and mixed precision (None on one GPU).
    Where the plan's DeepSpeed buckets are not DeepSpeed's defaults, which accelerate's config cannot say, its
    DeepSpeed section names the DeepSpeed config (`deepspeed_config`) at `deepspeed_file` instead, as accelerate asks:
    the stage, offload devices and mixed precision then live in that file alone."""
    name = trl_config_name(train)
    if name is None:
        return None
    config = copy.deepcopy(TRL_CONFIGS[name])
    config.update(num_processes=train.num_gpus, mixed_precision=train.mixed_precision)
    deepspeed = config.get("deepspeed_config")
    if deepspeed is not None and deepspeed_config(train) is not None:
        # accelerate refuses a mixed precision beside a DeepSpeed config file (DeepSpeedPlugin's
        # `_deepspeed_config_checks`): the file's "auto" takes GRPOConfig's bf16/fp16
        del config["mixed_precision"]
        config["deepspeed_config"] = {"deepspeed_config_file": deepspeed_file,
                                      "deepspeed_multinode_launcher": deepspeed["deepspeed_multinode_launcher"],
                                      "zero3_init_flag": deepspeed["zero3_init_flag"]}
    elif deepspeed is not None:
        deepspeed["zero_stage"] = train.zero_stage
        if "gradient_accumulation_steps" in deepspeed:
            # transformers refuses a DeepSpeed value other than GRPOConfig's (HfTrainerDeepSpeedConfig.fill_match)
            deepspeed["gradient_accumulation_steps"] = train.gradient_accumulation_steps
        if train.offloaded:  # the keys TRL's zero2/zero3 files spell out, set as accelerate config --offload asks
            deepspeed.update(offload_optimizer_device=train.offload_optimizer, offload_param_device=train.offload_param)
    fsdp = config.get("fsdp_config")
    if fsdp is not None:
        fsdp["fsdp_offload_params"] = train.offload_param == "cpu"
    return config


def deepspeed_config(train: TrainingConfig) -> dict[str, Any] | None:
    """The DeepSpeed config of the plan's ZeRO run where its buckets or ZeRO-3's prefetch and persistence sizes are
    not DeepSpeed's defaults (None otherwise): the stage, offload devices and those sizes planned; "auto" where
    transformers fills the value from GRPOConfig (integrations/deepspeed.py `trainer_config_process`) or from the
    model (the sizes)."""
    coordinator = {key: getattr(train, key) for key, default in ZERO3_COORDINATOR_DEFAULTS.items()
                   if getattr(train, key) != default}
    if train.zero_stage is None or (train.reduce_bucket_size == DEEPSPEED_REDUCE_BUCKET_SIZE
                                    and train.overlap_comm is None and not coordinator):
        return None
    zero: dict[str, Any] = {"stage": train.zero_stage, "reduce_bucket_size": train.reduce_bucket_size}
    if train.overlap_comm is not None:
        zero["overlap_comm"] = train.overlap_comm
    zero.update(coordinator)
    for section, device in (("offload_optimizer", train.offload_optimizer), ("offload_param", train.offload_param)):
        if device != "none":
            zero[section] = {"device": device}
    if train.zero_stage == 3:  # as TRL's zero3.yaml saves the model (zero3_save_16bit_model)
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    precision = {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    return {**precision, "zero_optimization": zero, "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}


def deepspeed_config_json(train: TrainingConfig) -> str | None:
    """The DeepSpeed config file's text (None where the accelerate config needs none)."""
    config = deepspeed_config(train)
    return None if config is None else json.dumps(config, indent=2) + "\n"


def accelerate_config_yaml(train: TrainingConfig, deepspeed_file: str = DEEPSPEED_FILE) -> str | None:
    """The accelerate config file as text, with a first comment line that says where it comes from."""
    config = accelerate_config(train, deepspeed_file)
    if config is None:
        return None
    import yaml

    offloaded = ", and its CPU offload" if train.offloaded else ""
    if deepspeed_config(train) is not None:
        offloaded = f", its DeepSpeed settings in {deepspeed_file}"
    origin = (f"# TRL's accelerate_configs/{trl_config_name(train)}.yaml with the plan's {train.num_gpus} processes "
              f"and mixed precision{offloaded}\n")
    return origin + yaml.safe_dump(config, sort_keys=True)


def launch_line(train: TrainingConfig) -> str | None:
    """The command that starts the printed code on every GPU with the printed config (None on one GPU)."""
    if trl_config_name(train) is None:
        return None
    return f"accelerate launch --config_file {CONFIG_FILE} {SCRIPT_FILE}"
