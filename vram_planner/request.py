"""What a caller asks about: the model, the card and the knobs, named as GRPOConfig's fields plus ours.

A `Request` is typed, so an editor completes the knob names; a knob left at None takes the TRL release's default
(and the defaults the card makes necessary). The CLI builds one from its flags, the web app from a query string or its
form, a notebook from keyword arguments; errors name the fields, and each face words them for its reader.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from vram_planner.errors import SETTING_CUTOFF, ConfigError, closest_names, field_name
from vram_planner.trl_names import MEMORY_NEUTRAL_ARGUMENTS, TRL_NAMES, UNPLANNED_ARGUMENTS

__all__ = ["Request", "DEFAULT_SAFETY_MARGIN", "CONTEXT_FIELDS", "request_fields", "knob_fields"]

# Share of the card a plan leaves free: the analytic model's error before calibration is several percent
# (fitcheck-llm's mean 5.5% total error on T4, ../shared/design/grpo-memory.md), so "fits" keeps 5% spare.
DEFAULT_SAFETY_MARGIN = 0.05


@dataclass(frozen=True, kw_only=True)
class Request:
    """One configuration to judge: what it runs on, and its knobs (None: not given).

    The knobs' values are checked when the request is judged (vram_planner.model.spec.TrainingConfig holds their
    rules), all problems at once; `Request.of` checks the names and, for text from a query string, the types.
    """

    __pydantic_config__ = {"extra": "forbid", "allow_inf_nan": False}

    model: str | dict[str, Any] | None = None  # catalog name, config.json, model folder, hub id, or a config's dict
    gpu: str | None = None  # catalog name, "auto" (the local card) or a size like "24GiB"
    trl_version: str | None = None  # plan for this TRL release (default: the installed one)
    calibration: str | Path | None = None  # a calibration profile's path (default: the one probe wrote for the card)
    safety_margin: float = DEFAULT_SAFETY_MARGIN  # share of the card kept free
    # GRPOConfig's fields
    per_device_train_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    steps_per_generation: int | None = None
    num_generations: int | None = None
    max_prompt_length: int | None = None  # the longest prompt of the dataset, in tokens
    max_completion_length: int | None = None
    beta: float | None = None
    num_iterations: int | None = None
    temperature: float | None = None  # generate()'s sampling (without vLLM, each filter is logits-sized)
    top_p: float | None = None
    top_k: int | None = None  # 0: no top-k filter
    min_p: float | None = None
    repetition_penalty: float | None = None
    optim: str | None = None  # transformers optimizer name: adamw_torch_fused, adamw_8bit, ...
    gradient_checkpointing: bool | None = None
    use_reentrant: bool | None = None  # gradient_checkpointing_kwargs' (default: as the release runs it)
    use_liger_kernel: bool | None = None
    use_kernels: bool | None = None  # from_pretrained's (model_init_kwargs): the Hub's kernels (default from 5.25)
    cast_lm_head_to_fp32: bool | None = None  # the LM head of the policy and reference in float32 (TRL 0.25+)
    use_vllm: bool | None = None
    vllm_mode: str | None = None  # colocate or server
    vllm_gpu_memory_utilization: float | None = None
    vllm_enable_sleep_mode: bool | None = None
    vllm_max_model_length: int | None = None
    vllm_tensor_parallel_size: int | None = None
    # ours: the model's loading, LoRA and 4-bit weights, several GPUs, the releases and the allocator
    dtype: str | None = None  # weights' dtype: float32 (TRL's default), bfloat16, float16
    mixed_precision: str | None = None  # bf16, fp16 or no
    attn_implementation: str | None = None  # sdpa, eager or flash_attention_2
    vllm_server_gpu: str | None = None  # server mode: the card `trl vllm-serve` runs on
    lora_r: int | None = None
    lora_alpha: int | None = None
    lora_dropout: float | None = None
    lora_target_modules: str | list[str] | None = None  # "q_proj,v_proj" or all-linear
    load_in_4bit: bool | None = None
    bnb_4bit_quant_type: str | None = None  # nf4 or fp4
    bnb_4bit_use_double_quant: bool | None = None
    num_gpus: int | str | None = None  # a count, or "auto": the fewest that fit, with the strategy
    zero_stage: int | None = None
    fsdp: bool | None = None
    ds3_gather_for_generation: bool | None = None  # ZeRO-3: gather the whole model to generate (TRL's default)
    reduce_bucket_size: int | str | None = None  # ZeRO: DeepSpeed's reduction bucket in elements, or "auto"
    overlap_comm: bool | None = None  # ZeRO: reduce beside the backward (DeepSpeed's default: at stage 3 only)
    stage3_prefetch_bucket_size: int | str | None = None  # ZeRO-3: elements a prefetch round gathers, or "auto"
    stage3_param_persistence_threshold: int | str | None = None  # ZeRO-3: largest parameter kept gathered, or "auto"
    offload_optimizer: str | None = None  # cpu: ZeRO-Offload's optimizer on the host (zero_stage 2 or 3)
    offload_param: str | None = None  # cpu: ZeRO-3's parameters on the host, or FSDP2's CPU offload
    host_memory: str | None = None  # RAM of one node for offloaded states, like "512GiB" (default: this machine's)
    transformers_version: str | None = None
    allocator_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF of the run (default: that environment variable)

    @classmethod
    def of(cls, values: Mapping[str, Any], *, from_text: bool = False) -> Request:
        """A request from a mapping of field names to values (a config file, keyword arguments, a query string's
        parameters with `from_text`: their text is read as the fields' types). ConfigError names every unknown field
        with the closest known names, and with `from_text` every value that is not of its field's type."""
        names = request_fields()
        unknown = [str(key) for key in values if key not in names]
        if unknown:
            raise ConfigError(unknown_setting_problems(unknown))
        if not from_text:
            return cls(**values)
        from pydantic import ValidationError

        from vram_planner.validation import validate

        try:
            return validate(cls, {k: v for k, v in values.items() if v is not None})
        except ValidationError as exc:
            raise ConfigError([_type_problem(error) for error in exc.errors()]) from exc

    def with_fields(self, **changes: Any) -> Request:
        """The same request with some fields changed (unknown names refused as `of` refuses them)."""
        names = request_fields()
        unknown = [key for key in changes if key not in names]
        if unknown:
            raise ConfigError(unknown_setting_problems(unknown))
        return replace(self, **changes)

    @property
    def knobs(self) -> dict[str, Any]:
        """The knobs given (not None), for the training config."""
        return {name: value for name in knob_fields() if (value := getattr(self, name)) is not None}


CONTEXT_FIELDS = ("model", "gpu", "trl_version", "calibration", "safety_margin")


def request_fields() -> tuple[str, ...]:
    return tuple(f.name for f in fields(Request))


def knob_fields() -> tuple[str, ...]:
    """The knobs: every field but what names the model, the card, the release, the calibration and the margin."""
    return tuple(name for name in request_fields() if name not in CONTEXT_FIELDS)


def unknown_setting_problems(keys: list[str]) -> list[str]:
    """One problem per key that names no setting, but the training arguments that move no memory (a recipe has
    dozens): one for all of them, naming the first few."""
    names = request_fields()
    neutral = [key for key in keys if key in MEMORY_NEUTRAL_ARGUMENTS]
    problems = [_unknown(key, names) for key in keys if key not in MEMORY_NEUTRAL_ARGUMENTS]
    if neutral:
        shown = ", ".join(field_name(key) for key in neutral[:3])
        more = f" and {len(neutral) - 3} more" if len(neutral) > 3 else ""
        one = len(neutral) == 1
        problems.append(f"{shown}{more} {'changes' if one else 'change'} no GPU memory: leave {'it' if one else 'them'} "
                        "out")
    return problems


def _unknown(key: str, names: tuple[str, ...]) -> str:
    if key in TRL_NAMES:
        return f"{field_name(key)} is TRL's name: the setting here is {field_name(TRL_NAMES[key])}"
    if key in UNPLANNED_ARGUMENTS:
        accepted, effect = UNPLANNED_ARGUMENTS[key]
        return f"{field_name(key)} is not planned ({effect}): the plan assumes it is {accepted[0]!r}"
    near = closest_names(key, names, cutoff=SETTING_CUTOFF)
    return f"unknown setting {field_name(key)}" + (f" (did you mean {field_name(near[0])}?)" if near else "")


def _type_problem(error: dict[str, Any]) -> str:
    from vram_planner.errors import short_repr
    from vram_planner.validation import error_message

    name = str(error["loc"][0]) if error["loc"] else "request"
    message = error_message(error).removeprefix("Input should be ")
    return f"{field_name(name)} should be {message} (got {short_repr(error.get('input'))})"
