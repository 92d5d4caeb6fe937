"""How a GRPO run is launched, read as the launcher reads it: `accelerate launch`'s options (and those `trl grpo` hands
to it, TRL's `--accelerate_config zero3` among them), an accelerate config file, and a DeepSpeed config (accelerate's
`deepspeed_config_file`, TrainingArguments' `--deepspeed`), as the request's fields: num_gpus, zero_stage, fsdp,
offload_optimizer, offload_param and the mixed precision. Pure Python; the files named are read where they are.

accelerate 1.15's and 1.16's rules (accelerate/commands/launch.py): the launch options win over the config file's
values, which fill the rest (`_validate_launch_command`: `fsdp_config`'s keys as `fsdp_*`, `deepspeed_config`'s as
they are); the config's `distributed_type` decides the launcher (NO: one process, whatever num_processes says);
without a config file, num_processes above 1 turns multi-GPU training on, and without num_processes accelerate
starts one process per visible GPU, which only the machine knows. `--use_deepspeed` without a stage is ZeRO-2
(DeepSpeedPlugin's default, accelerate/utils/dataclasses.py). A DeepSpeed config's stage and offload devices win
over accelerate's (`DeepSpeedPlugin.__post_init__` fills the plugin from the file).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vram_planner.model.spec import (DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD, DEEPSPEED_PREFETCH_BUCKET_SIZE,
                                     DEEPSPEED_REDUCE_BUCKET_SIZE)

# accelerate launch's options that take no value (store_true; --no_tpu_cluster stores a constant)
LAUNCH_FLAGS = frozenset({
    "quiet", "cpu", "multi_gpu", "tpu", "enable_cpu_affinity", "dynamo_use_fullgraph", "dynamo_use_dynamic",
    "dynamo_use_regional_compilation", "use_deepspeed", "use_fsdp", "use_parallelism_config", "use_megatron_lm",
    "same_network", "module", "no_python", "tpu_cluster", "no_tpu_cluster", "tpu_use_sudo", "downcast_bf16",
    "fp8_use_autocast_during_eval", "debug"})
# The options read into the plan (TRL's --accelerate_config becomes accelerate's --config_file:
# trl/cli/accelerate_config.py)
READ_OPTIONS = frozenset({
    "accelerate_config", "config_file", "num_processes", "multi_gpu", "use_deepspeed", "zero_stage",
    "offload_optimizer_device", "offload_param_device", "deepspeed_config_file", "use_fsdp", "fsdp_version",
    "fsdp_offload_params", "mixed_precision"})
# Options whose other values change memory in ways the plan does not count: the values it plans, and what they do
UNPLANNED_OPTIONS: dict[str, tuple[tuple[Any, ...], str]] = {
    "cpu": ((False,), "training on the CPU"),
    "tpu": ((False,), "training on TPUs"),
    "use_megatron_lm": ((False,), "Megatron-LM's tensor and pipeline parallelism"),
    "use_parallelism_config": ((False,), "accelerate's tensor, context and sequence parallelism"),
    "dynamo_backend": ((None, "no", "NO"), "torch.compile"),
    "fp8_backend": ((None, "no", "NO"), "FP8 training"),
    "deepspeed_moe_layer_cls_names": ((None,), "DeepSpeed's mixture-of-experts layers"),
    "fsdp_sharding_strategy": ((None, "FULL_SHARD", "1"),
                               "FSDP's sharding: the plan shards fully, as TRL's fsdp2 does"),
    "fsdp_reshard_after_forward": ((None, True, "true", "FULL_SHARD"),
                                   "FSDP2 keeping the gathered layers after the forward"),
    "fsdp_activation_checkpointing": ((None, False, "false"),
                                      "FSDP's own activation checkpointing (TRL's gradient_checkpointing is planned)"),
    "fsdp_activation_checkpointing_offload": ((None, False, "false"), "activations offloaded to the CPU"),
    "fsdp_forward_prefetch": ((None, False, "false"), "FSDP gathering the next layer during the forward"),
    "fsdp_auto_wrap_policy": ((None, "TRANSFORMER_BASED_WRAP"), "FSDP wrapping other than per decoder layer"),
}
# The rest of accelerate launch's options: where the processes run, what they log, how they meet (num_machines too:
# num_processes counts every machine's)
NEUTRAL_OPTIONS = frozenset({
    "num_machines", "quiet", "num_cpu_threads_per_process", "enable_cpu_affinity", "dynamo_mode",
    "dynamo_use_fullgraph", "dynamo_use_dynamic", "dynamo_use_regional_compilation", "gpu_ids", "same_network",
    "machine_rank", "main_process_ip", "main_process_port", "tee", "log_dir", "role", "rdzv_backend", "rdzv_conf",
    "max_restarts", "monitor_interval", "module", "no_python", "tpu_cluster", "no_tpu_cluster", "tpu_use_sudo",
    "vm", "env", "main_training_function", "downcast_bf16", "offload_optimizer_nvme_path",
    "offload_param_nvme_path", "gradient_accumulation_steps", "gradient_clipping", "zero3_init_flag",
    "zero3_save_16bit_model", "deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter",
    "deepspeed_multinode_launcher", "fsdp_min_num_params", "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_backward_prefetch", "fsdp_state_dict_type", "fsdp_use_orig_params", "fsdp_cpu_ram_efficient_loading",
    "fsdp_sync_module_states", "aws_access_key_id", "aws_secret_access_key", "debug", "mpirun_hostfile",
    "fp8_use_autocast_during_eval", "fp8_margin", "fp8_interval", "fp8_format", "fp8_amax_history_len",
    "fp8_amax_compute_algo", "fp8_override_linear_precision", "fp8_opt_level", "fp8_enable_fsdp_float8_all_gather",
    "fp8_pad_inner_dim"})
# Options of earlier accelerate releases that later ones dropped, still read as those releases read them: MS-AMP's
# --fp8_opt_level went with MS-AMP in 1.16
EARLIER_RELEASES_OPTIONS = frozenset({"fp8_opt_level"})
# Megatron-LM's and the parallelism config's options: used only with use_megatron_lm / use_parallelism_config
PREFIXED_WITH_THEIR_SWITCH = ("megatron_lm_", "parallelism_config_")
LAUNCH_OPTIONS = READ_OPTIONS | frozenset(UNPLANNED_OPTIONS) | NEUTRAL_OPTIONS | LAUNCH_FLAGS

# accelerate's distributed types, as the launcher's switch each amounts to
DISTRIBUTED_FLAGS = {"DEEPSPEED": "use_deepspeed", "FSDP": "use_fsdp", "MULTI_GPU": "multi_gpu",
                     "MEGATRON_LM": "use_megatron_lm", "XLA": "tpu", "TPU": "tpu", "MULTI_CPU": "cpu"}
# accelerate's distributed types that run on GPUs other than NVIDIA's (Intel, Ascend, ...): not planned
OTHER_DEVICES = ("MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_HPU", "MULTI_NEURON")
# DeepSpeed's default zero_optimization values (deepspeed/runtime/zero/config.py DeepSpeedZeroConfig, 0.19.8), which
# the plan counts; a config's other values are refused, as some need more than the defaults
# (benchmarks/results/deepspeed_configs.txt), but for those the plan models (PLANNED_ZERO_KEYS) and those that move no
# memory (NEUTRAL_ZERO_KEYS)
DEEPSPEED_ZERO_DEFAULTS: dict[str, Any] = {
    "reduce_bucket_size": DEEPSPEED_REDUCE_BUCKET_SIZE, "allgather_bucket_size": 500_000_000,
    "contiguous_gradients": True,
    "reduce_scatter": True, "allgather_partitions": True, "use_multi_rank_bucket_allreduce": True,
    "sub_group_size": 1_000_000_000, "stage3_prefetch_bucket_size": DEEPSPEED_PREFETCH_BUCKET_SIZE,
    "stage3_param_persistence_threshold": DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000, "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False, "zero_quantized_gradients": False, "round_robin_gradients": False,
    "memory_efficient_linear": True, "stage3_module_granularity_threshold": 0, "zenflow": None}
# The zero_optimization values the plan counts as the config gives them (TrainingConfig's fields of the same names;
# "auto" as transformers fills it, model/zero.py reduce_bucket_elements), overlap_comm among them; ZeRO-3's
# coordinator's at stage 3 (below it DeepSpeed reads none of them)
PLANNED_ZERO_KEYS = ("reduce_bucket_size", "overlap_comm")
PLANNED_ZERO3_KEYS = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
# ZeRO-1/2 all-gather the updated partitions in place, in shards of allgather_bucket_size (`all_gather_dp_groups`,
# deepspeed/runtime/utils.py:1019-1054, or all_gather_into_tensor without shards where the backend has it)
NEUTRAL_ZERO_KEYS = ("allgather_bucket_size",)
# DeepSpeed config sections that change memory in ways the plan does not count
UNPLANNED_DEEPSPEED_SECTIONS = ("data_types", "communication_data_type", "compression_training", "sparse_attention",
                                "pipeline", "amp", "fp8")
# DeepSpeed's own optimizer in place of the Trainer's: Adam and AdamW keep the same two float32 states per element
DEEPSPEED_ADAM = ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam")


# torchrun's options (torch/distributed/run.py get_args_parser, torch 2.13): its switches, and those read (how many
# processes per node, how many nodes); the rest say where and how the processes meet and log
TORCHRUN_SWITCHES = frozenset({"standalone", "module", "no_python", "run_path", "virtual_local_rank"})
TORCHRUN_OPTIONS = TORCHRUN_SWITCHES | frozenset({
    "nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "max_restarts",
    "monitor_interval", "start_method", "event_log_handler", "role", "log_dir", "redirects", "tee",
    "local_ranks_filter", "duplicate_stdout_filters", "duplicate_stderr_filters", "node_rank", "master_addr",
    "master_port", "local_addr", "logs_specs", "numa_binding", "signals_to_handle", "shutdown_timeout"})
# torchrun's short spellings
TORCHRUN_SHORT = {"-m": "module", "-r": "redirects", "-t": "tee"}


@dataclass
class Launch:
    """What the launch reads as, for a recipe's reading: the request's fields, the notes for the person, the problems
    (each one line)."""

    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def is_launch_option(name: str) -> bool:
    """Whether an option name (underscored) is accelerate launch's or TRL's --accelerate_config."""
    return name in LAUNCH_OPTIONS or name.startswith(PREFIXED_WITH_THEIR_SWITCH)


def launch_settings(options: Mapping[str, Any], trl_precision: str | None = "bf16", gpus_given: bool = False) -> Launch:
    """The request's fields a launch's options set (underscored names as accelerate launch's, with TRL's
    accelerate_config; a later spelling already won). `trl_precision`: the mixed precision TRL's bf16 or fp16 set
    (given, or the planned release's default), which TrainingArguments prefers to the launcher's; None where neither
    is true. `gpus_given`: vram-plan's num_gpus is given beside, and counts where num_processes is not."""
    launch = Launch()
    options = dict(options)
    config = _config_file(options, launch)
    if config is not None:
        options = {**config, **options}  # the launch's own options win over the file's
    options.pop("config_file", None)
    options.pop("accelerate_config", None)
    deepspeed_file = options.get("deepspeed_config_file")
    if deepspeed_file not in (None, "none"):
        options.update(read_deepspeed_config(deepspeed_file, launch))
    fsdp2 = bool(options.get("use_fsdp")) and str(options.get("fsdp_version") or "1") == "2"
    # Megatron-LM's and the parallelism config's own options count only under their switch, which is refused
    for name, value in options.items():
        if name.startswith("fsdp_") and not fsdp2:  # FSDP1's own, or unused without FSDP
            continue
        if name in UNPLANNED_OPTIONS:
            accepted, effect = UNPLANNED_OPTIONS[name]
            if not _accepted(value, accepted):
                planned = next(a for a in accepted if a is not None)
                launch.problems.append(f"{name} {value!r} is not planned ({effect}); the plan assumes {planned!r}")
    _strategy(options, launch, config is not None, gpus_given)
    _mixed_precision(options.get("mixed_precision"), trl_precision, launch)
    return launch


def _accepted(value: Any, accepted: tuple[Any, ...]) -> bool:
    if isinstance(value, str) and any(isinstance(a, str) for a in accepted):
        return value.lower() in {str(a).lower() for a in accepted if a is not None}
    return value in accepted


def _whole(value: Any) -> bool:
    # a whole number as accelerate's int options take it (YAML's true is no count)
    return isinstance(value, int) and not isinstance(value, bool)


def _truth(value: Any) -> bool:
    # accelerate's string booleans ("true"/"false" in the fsdp_* options), YAML's booleans
    return value is True or (isinstance(value, str) and value.lower() in ("true", "yes", "1"))


def _strategy(options: dict[str, Any], launch: Launch, from_file: bool, gpus_given: bool) -> None:
    processes = options.get("num_processes")
    if processes is not None and (not _whole(processes) or processes < 1):
        launch.problems.append(f"num_processes {processes!r} is not a number of processes (1 or more)")
        return
    deepspeed = bool(options.get("use_deepspeed")) or (not from_file and options.get("zero_stage") is not None)
    fsdp = bool(options.get("use_fsdp"))
    several = deepspeed or fsdp or bool(options.get("multi_gpu")) or (not from_file and (processes or 1) > 1)
    if deepspeed and fsdp:
        launch.problems.append("DeepSpeed and FSDP cannot both launch the run (accelerate refuses it)")
        return
    if not several:
        if from_file:
            launch.settings["num_gpus"] = 1  # distributed_type NO: one process, whatever num_processes says
        return
    if processes is None and not gpus_given:
        launch.notes.append("num_processes is not given: the launcher starts one process per GPU it sees, which "
                            "only your machine knows; planned for --num-gpus (1 unless given)")
    elif processes is not None:
        launch.settings["num_gpus"] = processes
    if deepspeed:
        stage = options.get("zero_stage")
        stage = 2 if stage is None else stage
        if not _whole(stage) or stage not in (0, 1, 2, 3):
            launch.problems.append(f"zero_stage {stage!r} is not a ZeRO stage (0, 1, 2 or 3)")
            return
        launch.settings["zero_stage"] = stage
        launch.settings.update({key: options[key] for key in (*PLANNED_ZERO_KEYS, *PLANNED_ZERO3_KEYS)
                                if key in options})
        for name, field_name in (("offload_optimizer_device", "offload_optimizer"),
                                 ("offload_param_device", "offload_param")):
            device = str(options.get(name) or "none").lower()
            if device == "nvme":
                launch.problems.append(f"{name} 'nvme' is not planned (offload to NVMe); the plan offloads to the "
                                       "CPU or not at all")
            elif device not in ("none", "cpu"):
                launch.problems.append(f"{name} {device!r} is not a device DeepSpeed offloads to (none, cpu, nvme)")
            elif device == "cpu" and field_name == "offload_param" and stage != 3:
                launch.notes.append(f"{name} 'cpu' is left out: DeepSpeed offloads parameters at ZeRO-3 only")
            elif device == "cpu":
                launch.settings[field_name] = "cpu"
    if fsdp:
        version = str(options.get("fsdp_version") or "1")  # accelerate launch's default
        if version != "2":
            launch.problems.append(f"fsdp_version {version} is not planned (FSDP1's flat parameters); the plan runs "
                                   "FSDP2, as TRL's fsdp2 config (fsdp_version: 2)")
            return
        launch.settings["fsdp"] = True
        if _truth(options.get("fsdp_offload_params")):
            launch.settings["offload_param"] = "cpu"


def _mixed_precision(value: Any, trl_precision: str | None, launch: Launch) -> None:
    """accelerate's mixed precision reaches TrainingArguments only where neither bf16 nor fp16 is true (transformers'
    TrainingArguments.__post_init__ reads ACCELERATE_MIXED_PRECISION first, then the flags)."""
    if value is None:
        return
    spelled = str(value).lower()
    if spelled not in ("no", "fp16", "bf16", "fp8"):
        launch.problems.append(f"mixed_precision {value!r} is not one of accelerate's (no, fp16, bf16, fp8)")
    elif spelled == "fp8":
        launch.problems.append("mixed_precision 'fp8' is not planned (FP8 training); the plan assumes 'bf16'")
    elif trl_precision is None:
        launch.settings["mixed_precision"] = spelled
    elif spelled != trl_precision:
        launch.notes.append(f"accelerate's mixed_precision {spelled!r} is left out: TRL's bf16/fp16 make it "
                            f"{trl_precision!r}")


def _config_file(options: dict[str, Any], launch: Launch) -> dict[str, Any] | None:
    """The options an accelerate config file gives (TRL's --accelerate_config: a path, or the name of a config TRL
    ships), flattened as accelerate flattens it; None where none is named or it cannot be read (a problem then)."""
    from vram_planner.errors import closest_names
    from vram_planner.model.accelerate_config import TRL_CONFIGS

    named, path = options.get("accelerate_config"), options.get("config_file")
    if named is not None and path is None:
        if Path(str(named)).is_file():
            path = named
        elif str(named) in TRL_CONFIGS:
            return accelerate_config_options(TRL_CONFIGS[str(named)], launch)
        else:
            near = closest_names(str(named), TRL_CONFIGS)
            launch.problems.append(f"accelerate_config {named!r} is neither a file here nor one of the configs TRL "
                                   f"ships ({', '.join(sorted(TRL_CONFIGS))})"
                                   + (f"; did you mean {' or '.join(near)}?" if near else ""))
            return None
    if path is None:
        return None
    if Path(str(path)) == default_accelerate_config_path():
        launch.notes.append(f"accelerate's default config {path} is read, as accelerate launch reads it where no "
                            "--config_file is given")
    example = _trl_example(str(path))
    if example is not None:
        launch.notes.append(f"{path} is not a file here: read as TRL's examples/accelerate_configs/"
                            f"{Path(str(path)).name}")
        return accelerate_config_options(TRL_CONFIGS[example], launch)
    mapping = _read_mapping(str(path), "accelerate config", launch, yaml=True)
    return None if mapping is None else accelerate_config_options(mapping, launch)


def _trl_example(path: str) -> str | None:
    """The TRL config a path names where it is no file here but TRL's repository's examples/accelerate_configs/ one
    (the same files TRL ships: model/accelerate_config.py), as TRL's docs launch with it."""
    from vram_planner.model.accelerate_config import TRL_EXAMPLE_CONFIGS

    spelled = Path(path)
    if spelled.is_file() or spelled.parent.parts[-2:] != ("examples", "accelerate_configs"):
        return None
    return TRL_EXAMPLE_CONFIGS.get(spelled.stem) if spelled.suffix == ".yaml" else None


def accelerate_config_options(config: Mapping[str, Any], launch: Launch) -> dict[str, Any]:
    """An accelerate config's values as launch options, as `_validate_launch_command` copies them: the sections'
    keys (fsdp_config's as fsdp_*, dynamo_config's as dynamo_*, fp8_config's as fp8_*), the distributed type as the
    launcher's switch, use_cpu as --cpu."""
    options: dict[str, Any] = {}
    for name, value in config.items():
        if isinstance(value, Mapping):
            prefix = {"fsdp_config": "fsdp_", "dynamo_config": "dynamo_", "fp8_config": "fp8_"}.get(name, "")
            options.update({(key if key.startswith(prefix) else prefix + key): item for key, item in value.items()})
        elif name == "distributed_type":
            kind = str(value).upper()
            if kind in DISTRIBUTED_FLAGS:
                options[DISTRIBUTED_FLAGS[kind]] = True
            elif kind in OTHER_DEVICES:
                launch.problems.append(f"distributed_type {value} is not planned (accelerators other than NVIDIA "
                                       "GPUs)")
            elif kind != "NO":
                launch.problems.append(f"distributed_type {value!r} is not one of accelerate's")
        elif name == "use_cpu":
            options["cpu"] = bool(value)
        elif name not in ("compute_environment",):
            options[name] = value
    return options


def read_deepspeed_config(source: Any, launch: Launch) -> dict[str, Any]:
    """A DeepSpeed config's stage and offload devices as launch options (a path to its JSON, the JSON itself, or a
    mapping, as TrainingArguments' `deepspeed` takes it); the zero_optimization values the plan does not count are
    problems, transformers' "auto" a note."""
    config = source if isinstance(source, Mapping) else (
        _json_mapping(source, launch) if str(source).lstrip().startswith("{")
        else _read_mapping(str(source), "DeepSpeed config", launch, yaml=False))
    if config is None:
        return {}
    zero = config.get("zero_optimization")
    if not isinstance(zero, Mapping):
        launch.problems.append("the DeepSpeed config has no zero_optimization section (accelerate refuses it)")
        return {}
    stage = zero.get("stage", 0)
    options: dict[str, Any] = {"use_deepspeed": True, "zero_stage": stage}
    for section, name in (("offload_optimizer", "offload_optimizer_device"), ("offload_param", "offload_param_device")):
        device = (zero.get(section) or {}).get("device") if isinstance(zero.get(section) or {}, Mapping) else None
        if device is not None:
            options[name] = device
    options.update({key: zero[key] for key in PLANNED_ZERO_KEYS if zero.get(key) is not None})
    zero3_keys = PLANNED_ZERO3_KEYS if stage == 3 else ()
    options.update({key: zero[key] for key in zero3_keys if zero.get(key) is not None})
    if stage == 3 and zero.get("stage3_prefetch_bucket_size") in (0, 0.0):
        # no prefetch round, but the coordinator keeps what it gathers for reuse (`__params_to_release`): between
        # nothing prefetched and the default's rounds (sharded traces: 4-7% under the latter), so planned as those
        del options["stage3_prefetch_bucket_size"]
        launch.notes.append("the DeepSpeed config's stage3_prefetch_bucket_size 0 is planned at DeepSpeed's default "
                            "(5e7): with no prefetch the coordinator still keeps what it gathers, a few percent less; "
                            "the per-GPU figures are an upper bound there")
    unplanned = []
    for key, default in DEEPSPEED_ZERO_DEFAULTS.items():
        value = zero.get(key, default)
        moves_nothing = key.startswith("stage3_") and stage != 3
        if value != default and key not in (*PLANNED_ZERO_KEYS, *zero3_keys, *NEUTRAL_ZERO_KEYS) and not moves_nothing:
            unplanned.append((key, value, default))
    if unplanned:
        launch.problems.append(
            f"the DeepSpeed config's {', '.join(f'{key} {value!r}' for key, value, _ in unplanned)} "
            f"{'is' if len(unplanned) == 1 else 'are'} not planned: the plan counts DeepSpeed's defaults "
            f"({', '.join(f'{key} {default!r}' for key, _, default in unplanned)}), as --zero-stage "
            f"{stage} plans it")
    optimizer = config.get("optimizer")
    if isinstance(optimizer, Mapping):
        kind = str(optimizer.get("type", "")).lower()
        if kind in DEEPSPEED_ADAM:
            launch.notes.append(f"DeepSpeed's own {optimizer.get('type')} optimizer keeps the two float32 states per "
                                "element the planned optim does")
        else:
            launch.problems.append(f"the DeepSpeed config's optimizer {optimizer.get('type')!r} is not planned; "
                                   "leave the optimizer to the Trainer's optim")
    for section in UNPLANNED_DEEPSPEED_SECTIONS:
        if config.get(section) not in (None, {}, False) and not (
                isinstance(config.get(section), Mapping) and config[section].get("enabled") is False):
            launch.problems.append(f"the DeepSpeed config's {section} section is not planned")
    return options


def _read_mapping(path: str, what: str, launch: Launch, yaml: bool) -> dict[str, Any] | None:
    from vram_planner.errors import VramPlanError
    from vram_planner.files import MAX_SETTINGS_BYTES, load_yaml, read_text

    if not Path(path).is_file():
        launch.problems.append(f"the {what} {path} is not a file here (paste the command where it is, or give its "
                               "settings as vram-plan's --num-gpus, --zero-stage, --fsdp)")
        return None
    try:
        text = read_text(path, MAX_SETTINGS_BYTES, f"the {what}", kind="a YAML file" if yaml else "a JSON file")
        value = load_yaml(text, path) if yaml else _json_mapping(text, launch, path)
    except VramPlanError as exc:
        launch.problems.append(str(exc))
        return None
    if value is not None and not isinstance(value, Mapping):
        launch.problems.append(f"the {what} {path} is not a mapping of settings")
        return None
    return None if value is None else dict(value)


def _json_mapping(text: str, launch: Launch, label: str = "the DeepSpeed config") -> dict[str, Any] | None:
    from vram_planner.errors import VramPlanError
    from vram_planner.files import load_json

    try:
        value = load_json(text, label)  # refuses nesting deeper than any config, which json.loads recurses into
    except json.JSONDecodeError as exc:
        launch.problems.append(f"{label} is not JSON: {exc.msg} (line {exc.lineno})")
        return None
    except VramPlanError as exc:
        launch.problems.append(str(exc))
        return None
    if not isinstance(value, dict):
        launch.problems.append(f"{label} is not a JSON mapping")
        return None
    return value


def default_accelerate_config() -> Path | None:
    """The config `accelerate config` wrote, which accelerate launch (and trl grpo through it) reads where no
    --config_file is given; None where there is none."""
    path = default_accelerate_config_path()
    return path if path.is_file() else None


def default_accelerate_config_path() -> Path:
    """Where `accelerate config` writes its default: $HF_HOME/accelerate/default_config.yaml
    (accelerate/commands/config/config_args.py)."""
    import os

    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expanduser(home)) / "accelerate" / "default_config.yaml"


def torchrun_options(words: list[str]) -> dict[str, Any]:
    """torchrun's options before the script (`torchrun --nproc_per_node 8`, `python -m torch.distributed.run ...`)
    as the launch options they amount to: nproc_per_node x nnodes processes, each a rank of the Trainer's data
    parallelism (DDP, or DeepSpeed where TrainingArguments' --deepspeed names a config); VramPlanError for an option
    torchrun does not have. A count torchrun takes from the machine ("gpu", "auto") or an elastic range of nodes is
    left to --num-gpus, with a note."""
    from vram_planner.errors import VramPlanError

    found: dict[str, str] = {}
    i = 0
    while i < len(words):
        spelled, has_value, inline = words[i].partition("=")
        name = TORCHRUN_SHORT.get(spelled) or spelled.lstrip("-").replace("-", "_")
        if not spelled.startswith("-") or name not in TORCHRUN_OPTIONS:
            raise VramPlanError(f"{spelled} is not one of torchrun's options")
        if name in TORCHRUN_SWITCHES:
            i += 1
            continue
        if not has_value:
            i += 1
            if i >= len(words):
                raise VramPlanError(f"{spelled} takes one value, as torchrun does")
            inline = words[i]
        found[name] = inline
        i += 1
    per_node, nodes = found.get("nproc_per_node", "1"), found.get("nnodes", "1")
    if per_node.isdigit() and nodes.isdigit() and int(per_node) >= 1:
        return {"num_processes": int(per_node) * int(nodes)}
    return {"multi_gpu": True}  # as many processes as the machine shows: --num-gpus decides
