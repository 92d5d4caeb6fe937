"""The training configuration: knobs spelled like GRPOConfig fields, validated in one step."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from enum import Enum
from functools import lru_cache
from typing import Annotated, Any, Literal, get_args

from vram_planner.errors import SETTING_CUTOFF, ConfigError, VramPlanError, closest_names, field_name, short_repr
from vram_planner.errors import flag as cli_flag
from vram_planner.model import trl_releases
from vram_planner.model.divisors import divisors
from vram_planner.model.transformers_releases import (TransformersRelease, known_transformers_version,
                                                     transformers_release)
from vram_planner.model.trl_releases import TrlRelease, version_tuple
from vram_planner.validation import After, Before, Rules, error_message, field_names, to_jsonable, validate

Dtype = Literal["float32", "bfloat16", "float16"]
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
# Upper bound of every count (sequences, tokens, steps, ranks, GPUs): no GPU holds 2**40 of anything, and products
# of a few such counts stay finite as floats, so bytes never overflow.
MAX_COUNT = 2**40
COUNT = Rules(gt=0, le=MAX_COUNT)
# DeepSpeed's default reduce_bucket_size, in elements (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig)
DEEPSPEED_REDUCE_BUCKET_SIZE = 500_000_000
# ZeRO-3's coordinator's prefetch bucket and persistence threshold, in elements (zero/config.py:222, :228)
DEEPSPEED_PREFETCH_BUCKET_SIZE = 50_000_000
DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD = 100_000


class Optimizer(str, Enum):
    """The transformers `optim` names the memory model knows."""

    adamw_torch_fused = "adamw_torch_fused"
    adamw_torch = "adamw_torch"
    adamw_8bit = "adamw_8bit"
    adamw_bnb_8bit = "adamw_bnb_8bit"
    paged_adamw_8bit = "paged_adamw_8bit"
    paged_adamw_32bit = "paged_adamw_32bit"
    lion_8bit = "lion_8bit"
    paged_lion_8bit = "paged_lion_8bit"
    lion_32bit = "lion_32bit"
    adafactor = "adafactor"
    sgd = "sgd"
    rmsprop = "rmsprop"
    adagrad = "adagrad"

    @property
    def is_8bit(self) -> bool:
        return "8bit" in self.value

    @property
    def needs_bitsandbytes(self) -> bool:
        return "8bit" in self.value or self.value.startswith(("paged_", "lion_"))

    @property
    def is_paged(self) -> bool:
        """bitsandbytes' paged optimizers keep their states in CUDA managed memory, which pages out to the host."""
        return self.value.startswith("paged_")

    @property
    def state_tensors(self) -> int:
        """The states it keeps per parameter as tensors of the parameter's shape: AdamW's two moments, Lion's,
        RMSprop's and Adagrad's one (8-bit or not); none for SGD, nor for Adafactor, whose states are factored."""
        if self in (Optimizer.sgd, Optimizer.adafactor):
            return 0
        return 1 if "lion" in self.value or self in (Optimizer.rmsprop, Optimizer.adagrad) else 2


def _allocator_settings(value: str) -> str:
    if value:
        from vram_planner.allocator import parse_allocator_conf  # only when one is given: start-up stays lean

        try:
            parse_allocator_conf(value, "allocator_conf")
        except ConfigError as exc:
            # the knob's message shows the value itself: the parser's echo of it goes
            reason = str(exc).removeprefix("allocator_conf").removeprefix(":").strip()
            reason = reason.replace(f"{value!r}: ", "").replace(f"{value!r} ", "the text ")
            raise ValueError(f"a PYTORCH_CUDA_ALLOC_CONF text torch accepts; {reason}") from exc
    return value.strip()


def _host_memory(value: str | None) -> str | None:
    if value is None:
        return None
    from vram_planner.units import parse_size_bytes

    try:
        parse_size_bytes(value)
    except VramPlanError as exc:
        raise ValueError(f"a memory size such as 512GiB ({exc})") from exc
    return value.strip()


def _bucket_elements(value: Any) -> int | str:
    # DeepSpeed configs write sizes as JSON numbers such as 2e8 (a float), the command line as text ("2e8")
    return _elements(value, least=1)


def _zero3_elements(value: Any) -> int | str:
    # as _bucket_elements, and 0 as DeepSpeed takes it (zero/config.py: ge=0): no parameter kept gathered
    return _elements(value, least=0)


def _elements(value: Any, least: int) -> int | str:
    if value == "auto" and isinstance(value, str):
        return value
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        number = None
    elif isinstance(number, float):
        number = int(number) if math.isfinite(number) and number.is_integer() else None
    if number is not None and least <= number <= MAX_COUNT:
        return number
    raise ValueError(f"a number of elements such as 2e8 ({least} to 2^40), or auto")


def _known_release(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return trl_releases.trl_release(value).version
    except ConfigError as exc:
        raise ValueError(exc.problems[0].removeprefix(field_name("trl_version") + " ")) from exc


def _known_transformers(value: str | None) -> str | None:
    return None if value is None else known_transformers_version(value)


def _split_module_names(value: Any) -> Any:
    """'q_proj,v_proj' from a flag or a config file is a list of module names."""
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    if isinstance(value, (list, tuple)):  # a config file's list: its items stripped, as the flag's are
        return [name.strip() if isinstance(name, str) else name for name in value]
    return value


def _some_module_names(value: list[str] | None) -> list[str] | None:
    if value is not None and (not value or not all(value)):
        raise ValueError("a comma-separated list of module names such as q_proj,v_proj, or all-linear")
    if value is not None and "all-linear" in value and len(value) > 1:
        raise ValueError("all-linear alone (it already targets every linear layer)")
    return value


@dataclass(frozen=True)
class TrainingConfig:
    """Everything about the run except the model and the GPU. Defaults are TRL 1.16's GRPOConfig defaults.

    The knobs mean what they meant in TRL `trl_version` (None: the newest release vram-plan knows): in 0.14
    per_device_train_batch_size counted prompts, before 0.17 each micro-batch generated its own completions, and so
    on (profiles/trl.toml). The properties below translate them into completions and generation rounds.

    `training_config(values)` validates (pydantic, with the rules annotated here, then `cross_field_problems`);
    constructing one directly takes the values as given, as pydantic's model_construct does.
    """

    __pydantic_config__ = {"extra": "forbid", "allow_inf_nan": False}

    per_device_train_batch_size: Annotated[int, COUNT] = 8
    gradient_accumulation_steps: Annotated[int, COUNT] = 1
    steps_per_generation: Annotated[int | None, COUNT] = None
    num_generations: Annotated[int, Rules(le=MAX_COUNT)] = 8
    # TRL >= 0.28 no longer truncates prompts: this is the longest prompt of the dataset, in tokens.
    max_prompt_length: Annotated[int, COUNT] = 256
    max_completion_length: Annotated[int, COUNT] = 512
    beta: Annotated[float, Rules(ge=0)] = 0.0
    num_iterations: Annotated[int, COUNT] = 1
    # generate()'s sampling: each filter adds tensors of the step's logits' size (model/sampling.py); vLLM samples
    # inside its own budget. temperature and top_k None: the release's (`sampling_temperature`, `sampling_top_k`);
    # top_k 0 and min_p None filter nothing
    temperature: Annotated[float | None, Rules(gt=0)] = None
    top_p: Annotated[float, Rules(gt=0, le=1)] = 1.0
    top_k: Annotated[int | None, Rules(ge=0, le=MAX_COUNT)] = None
    min_p: Annotated[float | None, Rules(ge=0, le=1)] = None
    repetition_penalty: Annotated[float, Rules(gt=0)] = 1.0
    optim: Optimizer = Optimizer.adamw_torch_fused
    gradient_checkpointing: bool = True
    # gradient_checkpointing_kwargs={'use_reentrant': ...} (no effect without checkpointing, as in TRL); None: as the
    # release sets it up
    use_reentrant: bool | None = None
    dtype: Dtype = "float32"
    mixed_precision: Literal["bf16", "fp16", "no"] = "bf16"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    use_liger_kernel: bool = False
    # from_pretrained's use_kernels (model_init_kwargs): None, the transformers release's default (true from 5.25)
    use_kernels: bool | None = None
    cast_lm_head_to_fp32: bool = False
    use_vllm: bool = False
    vllm_mode: Literal["colocate", "server"] = "colocate"
    vllm_gpu_memory_utilization: Annotated[float, Rules(gt=0, lt=1)] = 0.3
    vllm_enable_sleep_mode: bool = False
    vllm_max_model_length: Annotated[int | None, COUNT] = None
    vllm_tensor_parallel_size: Annotated[int, COUNT] = 1
    vllm_server_gpu: str | None = None  # server mode: the card trl vllm-serve runs on (not a GRPOConfig field)
    lora_r: Annotated[int | None, COUNT] = None
    lora_alpha: Annotated[int | None, COUNT] = None
    lora_dropout: Annotated[float, Rules(ge=0, lt=1)] = 0.0
    lora_target_modules: Annotated[list[str] | None, Before(_split_module_names), After(_some_module_names)] = None
    load_in_4bit: bool = False
    bnb_4bit_quant_type: Literal["nf4", "fp4"] | None = None
    bnb_4bit_use_double_quant: bool | None = None
    num_gpus: Annotated[int, COUNT] = 1
    zero_stage: Annotated[int | None, Rules(ge=0, le=3)] = None
    fsdp: bool = False
    # ZeRO-3 generation gathers the whole model (TRL's default) or lets each layer gather itself (False)
    ds3_gather_for_generation: bool = True
    # DeepSpeed's gradient reduction bucket, in elements (zero_optimization.reduce_bucket_size; "auto": transformers
    # fills it with hidden_size^2), and whether its reduction overlaps the backward (None: DeepSpeed's default, on at
    # stage 3 only); vram_planner/model/zero.py counts them
    reduce_bucket_size: Annotated[int | Literal["auto"], Before(_bucket_elements)] = (
        DEEPSPEED_REDUCE_BUCKET_SIZE)
    overlap_comm: bool | None = None
    # ZeRO-3's coordinator: how many elements a prefetch round gathers ahead of the module fetched, and the largest
    # parameter kept gathered after the optimizer step ("auto": transformers fills 0.9 x hidden_size^2 and
    # 10 x hidden_size); vram_planner/model/zero.py counts them
    stage3_prefetch_bucket_size: Annotated[int | Literal["auto"], Before(_bucket_elements)] = (
        DEEPSPEED_PREFETCH_BUCKET_SIZE)
    stage3_param_persistence_threshold: Annotated[int | Literal["auto"], Before(_zero3_elements)] = (
        DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD)
    # ZeRO-Offload (DeepSpeed's offload_optimizer / offload_param devices) and FSDP2's CPUOffloadPolicy (--offload-param
    # under --fsdp): which model states live in the host's RAM (vram_planner/model/offload.py)
    offload_optimizer: Literal["none", "cpu"] = "none"
    offload_param: Literal["none", "cpu"] = "none"
    # The RAM of one node, as a size ("512GiB"; None: this machine's), that offloaded states are judged against
    host_memory: Annotated[str | None, After(_host_memory)] = None
    trl_version: Annotated[str | None, After(_known_release)] = None
    # None: the installed transformers when it is of the TRL release's time, else the newest of that time we know
    transformers_version: Annotated[str | None, After(_known_transformers)] = None
    # PYTORCH_CUDA_ALLOC_CONF of the run ("" for torch's defaults): expandable segments change the allocator's reserve
    allocator_conf: Annotated[str, After(_allocator_settings)] = ""

    def __post_init__(self) -> None:
        if not isinstance(self.optim, Optimizer):  # a name, as settings files and records hold it
            object.__setattr__(self, "optim", Optimizer(self.optim))

    # Derived quantities, named as TRL names them.
    @property
    def expandable_segments(self) -> bool:
        """Whether the caching allocator grows segments in place (PYTORCH_CUDA_ALLOC_CONF expandable_segments:True)."""
        return bool(self.allocator_conf) and _expandable(self.allocator_conf)

    @property
    def sampling_temperature(self) -> float:
        """The temperature generate() samples at: the knob, else the release's GRPOConfig default."""
        return self.release.default_temperature if self.temperature is None else self.temperature

    @property
    def sampling_top_k(self) -> int:
        """The top-k filter generate() applies (0: none): the knob, else the release's (GRPOConfig's, or before it
        had the field, transformers 4's GenerationConfig's 50)."""
        return self.release.default_top_k if self.top_k is None else self.top_k

    @property
    def release(self) -> TrlRelease:
        """The TRL release whose meaning the knobs have."""
        return trl_releases.trl_release(self.trl_version or trl_releases.NEWEST_KNOWN)

    @property
    def transformers(self) -> TransformersRelease:
        """The transformers release the run's model code comes from."""
        return transformers_release(self.transformers_version, self.release.transformers_major)

    @property
    def hub_kernel_layers(self) -> tuple[str, ...]:
        """What the Hub's kernels replace in training on CUDA: kernelized by use_kernels or the release's default
        (profiles/transformers.toml hub_kernels, hub_training_kernels). With use_liger_kernel, Liger's own layer
        kernels are counted instead (the calibration's coefficients, `activations.liger_layer_saved_bytes`): its
        RMSNorm is the same kernel the Hub builds."""
        row = self.transformers
        kernelized = row.hub_kernels if self.use_kernels is None else self.use_kernels
        return tuple(row.hub_training_kernels) if kernelized and not self.use_liger_kernel else ()

    @property
    def steps_per_generation_resolved(self) -> int:
        """Micro-batches one generation round serves (1 where each micro-batch generated its own, TRL < 0.17)."""
        if self.release.generation_batch == "micro_batch":
            return 1
        return self.steps_per_generation or self.gradient_accumulation_steps

    @property
    def micro_batch_completions(self) -> int:
        """Completions in one micro-batch: B, or B prompts x num_generations where B counted prompts (TRL 0.14)."""
        if self.release.batch_counts == "prompts":
            return self.per_device_train_batch_size * self.num_generations
        return self.per_device_train_batch_size

    @property
    def generation_batch_size(self) -> int:
        """Global completions per generation round (TRL's generation_batch_size)."""
        return self.micro_batch_completions * self.num_gpus * self.steps_per_generation_resolved

    @property
    def local_generation_batch_size(self) -> int:
        """Completions each GPU generates at once."""
        return self.micro_batch_completions * self.steps_per_generation_resolved

    @property
    def sequence_length(self) -> int:
        return self.max_prompt_length + self.max_completion_length

    @property
    def uses_lora(self) -> bool:
        return self.lora_r is not None

    @property
    def computes_old_logps(self) -> bool:
        """Whether TRL scores the generation batch with the old policy (its condition in the release's
        _generate_and_score_completions; importance sampling with vLLM is on by default where it exists)."""
        rule, iterations = self.release.old_logps_when, self.num_iterations
        if rule == "never":
            return False
        if rule == "num_iterations":
            return iterations > 1
        if rule == "num_iterations_or_more_steps":
            return iterations > 1 or self.steps_per_generation_resolved > self.gradient_accumulation_steps
        off_policy = self.gradient_accumulation_steps % (self.steps_per_generation_resolved * iterations) != 0
        return off_policy or (rule == "off_policy_or_vllm" and self.use_vllm)

    @property
    def computes_ref_logps(self) -> bool:
        """Whether a reference model scores the completions (before TRL 0.16 always, even with beta 0)."""
        return self.beta != 0.0 or self.release.reference_when == "always"

    @property
    def reentrant_checkpointing(self) -> bool:
        """Whether gradient checkpointing runs reentrant (torch.utils.checkpoint's use_reentrant=True): as the run's
        gradient_checkpointing_kwargs say, else as the release sets it up (profiles/trl.toml checkpointing_reentrant);
        TRL forces it under ZeRO-3 with LoRA whatever they say (peft_zero3_reentrant)."""
        release = self.release
        forced = release.peft_zero3_reentrant and self.uses_lora and self.zero_stage == 3
        chosen = release.checkpointing_reentrant if self.use_reentrant is None else self.use_reentrant
        return self.gradient_checkpointing and (chosen or forced)

    @property
    def first_layer_input_needs_grad(self) -> bool:
        """Whether the first decoder layer's input needs a gradient: with full fine-tuning (the embedding trains), or
        with LoRA where TRL makes the embedding's output require grad under checkpointing
        (checkpointing_input_grads)."""
        return not self.uses_lora or (self.gradient_checkpointing and self.release.checkpointing_input_grads)

    @property
    def distributed(self) -> Literal["single", "ddp", "zero0", "zero1", "zero2", "zero3", "fsdp"]:
        if self.fsdp:
            return "fsdp"
        if self.zero_stage is not None:  # stage 0 too: DeepSpeed's engine, not torch's DDP
            return f"zero{self.zero_stage}"  # type: ignore[return-value]
        return "ddp" if self.num_gpus > 1 else "single"

    @property
    def offloaded(self) -> bool:
        """Whether any model state lives in the host's RAM."""
        return "cpu" in (self.offload_optimizer, self.offload_param)

    @property
    def optimizer_offloaded(self) -> bool:
        """Whether the optimizer steps on the CPU: ZeRO-Offload's optimizer, or FSDP2's CPU offload (which moves the
        shards, their gradients and so the step to the host)."""
        return self.offload_optimizer == "cpu" or (self.fsdp and self.offload_param == "cpu")

    @property
    def lora_targets(self) -> list[str] | None:
        """None means every linear layer of the decoder (PEFT's 'all-linear')."""
        if self.lora_target_modules in (None, ["all-linear"]):
            return None
        return self.lora_target_modules


def plain_value(value: Any) -> Any:
    """A knob's value as people and files write it: an enum's (the optimizer's name), anything else as it is."""
    return value.value if isinstance(value, Enum) else value


def command_line_flags(settings: dict[str, Any]) -> str:
    """Settings as the flags that set them: `--lora-r 16 --load-in-4bit --no-gradient-checkpointing`."""
    words = []
    for name, value in settings.items():
        if isinstance(value, bool):
            words.append(cli_flag(name) if value else "--no-" + cli_flag(name)[2:])
        elif value is not None:
            value = plain_value(value)
            words.append(f"{cli_flag(name)} {','.join(value) if isinstance(value, list) else value}")
    return " ".join(words)


def cross_field_problems(c: TrainingConfig) -> list[str]:
    """Every rule that involves several fields, each naming the flags to change."""
    problems = []
    if c.num_generations < 2:
        problems.append(f"{field_name('num_generations')} must be at least 2 (got {c.num_generations}): "
                        "GRPO compares completions within a group")
    if c.steps_per_generation is not None and not c.release.accepts_steps_per_generation:
        problems.append(f"{field_name('steps_per_generation')} is not a GRPOConfig field in TRL {c.release.version} "
                        f"(it came in 0.18; before it one generation served "
                        f"{field_name('gradient_accumulation_steps')} micro-batches, or one)")
    elif c.num_generations >= 2:
        problems.extend(generation_batch_problems(c))
    if c.load_in_4bit and not c.uses_lora:
        problems.append(f"{field_name('load_in_4bit')} needs LoRA ({field_name('lora_r')}): 4-bit weights cannot be "
                        "trained directly")
    if not c.load_in_4bit and (c.bnb_4bit_quant_type is not None or c.bnb_4bit_use_double_quant is not None):
        problems.append(f"{field_name('bnb_4bit_quant_type')} / {field_name('bnb_4bit_use_double_quant')} need "
                        f"{field_name('load_in_4bit')}")
    if not c.uses_lora and (c.lora_alpha is not None or c.lora_target_modules is not None or c.lora_dropout):
        problems.append(f"{field_name('lora_alpha')} / {field_name('lora_target_modules')} / "
                        f"{field_name('lora_dropout')} need {field_name('lora_r')}")
    if c.zero_stage is not None and c.fsdp:
        problems.append(f"choose one of {field_name('zero_stage')} and {field_name('fsdp')}")
    if (c.reduce_bucket_size != DEEPSPEED_REDUCE_BUCKET_SIZE or c.overlap_comm is not None) and c.zero_stage not in (
            1, 2, 3):
        problems.append(f"{field_name('reduce_bucket_size')} / {field_name('overlap_comm')} need "
                        f"{field_name('zero_stage')} 1, 2 or 3 (DeepSpeed's ZeRO reduces gradients in buckets)")
    elif c.overlap_comm and c.zero_stage == 1:
        problems.append(f"{field_name('overlap_comm')} on under ZeRO-1 is not planned (it then reduces inside the "
                        f"backward of an accumulation's last micro-batch, keeping other ranks' gradients larger than "
                        f"the bucket whole); plan it with {field_name('zero_stage')} 2, or turn "
                        f"{field_name('overlap_comm')} off")
    if (c.stage3_prefetch_bucket_size != DEEPSPEED_PREFETCH_BUCKET_SIZE
            or c.stage3_param_persistence_threshold != DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD) and c.zero_stage != 3:
        problems.append(f"{field_name('stage3_prefetch_bucket_size')} / "
                        f"{field_name('stage3_param_persistence_threshold')} need {field_name('zero_stage')} 3 "
                        "(ZeRO-3's parameter coordinator)")
    if not c.ds3_gather_for_generation and c.zero_stage != 3:
        problems.append(f"{field_name('ds3_gather_for_generation')} off needs {field_name('zero_stage')} 3 (only "
                        "ZeRO-3 gathers for generation)")
    problems.extend(offload_problems(c))
    if c.dtype == "float16" and c.mixed_precision == "fp16" and not c.uses_lora:
        problems.append("full fine-tuning of float16 weights with fp16 mixed precision fails in the grad scaler "
                        f"('Attempting to unscale FP16 gradients'); load float32 ({field_name('dtype')} float32) or "
                        "use LoRA")
    if c.reentrant_checkpointing and not c.first_layer_input_needs_grad:
        problems.append(f"LoRA with {field_name('gradient_checkpointing')} fails at the first backward in TRL "
                        f"{c.release.version} ('element 0 of tensors does not require grad'): its checkpointing is "
                        "reentrant (transformers 4's default) and nothing makes the frozen embedding's output require "
                        "grad (TRL 0.16 calls enable_input_require_grads); turn checkpointing off or use TRL 0.16 on")
    if c.vllm_mode == "server" and not c.use_vllm:
        problems.append(f"{field_name('vllm_mode')} needs {field_name('use_vllm')}")
    problems.extend(vllm_problems(c))
    problems.extend(cast_lm_head_problems(c))
    problems.extend(sampling_problems(c))
    if c.use_kernels and not c.transformers.hub_training_kernels:
        problems.append(f"{field_name('use_kernels')} is planned from transformers 5.24 on, whose Hub kernels vram-plan "
                        f"has read, not for transformers {c.transformers.version}: leave it unset, or plan for 5.24 or "
                        f"later ({field_name('transformers_version')})")
    return problems


SAMPLING_KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_knobs_given(c: TrainingConfig) -> list[str]:
    """The sampling knobs away from their unset values (TrainingConfig's defaults: the release's sampling)."""
    unset = {field.name: field.default for field in fields(TrainingConfig)}
    return [name for name in SAMPLING_KNOBS if getattr(c, name) != unset[name]]


def sampling_problems(c: TrainingConfig) -> list[str]:
    """Before TRL 0.16 GRPOConfig has temperature alone; generate() then filters with GenerationConfig's top_k."""
    if c.release.accepts_sampling_filters:
        return []
    return [_not_a_field_yet(c, name, (0, 16, 0)) for name in sampling_knobs_given(c) if name != "temperature"]


def cast_lm_head_problems(c: TrainingConfig) -> list[str]:
    """Where cast_lm_head_to_fp32 is planned: a GRPOConfig field from TRL 0.25, planned on one GPU or DDP. TRL 0.25-1.14
    compute full logits through it under autocast, which with float32 weights (their default) is what they do without
    it; with 16-bit weights that path is not modelled."""
    if not c.cast_lm_head_to_fp32:
        return []
    flag = field_name("cast_lm_head_to_fp32")
    since = (0, 25, 0)
    if version_tuple(c.release.version) < since:
        return [_not_a_field_yet(c, "cast_lm_head_to_fp32", since)]
    problems = []
    if c.zero_stage is not None or c.fsdp:
        problems.append(f"{flag} is planned on one GPU or DDP only: vram-plan does not yet model the float32 head "
                        f"under {field_name('zero_stage')} or {field_name('fsdp')}, whose engines hold the model in "
                        "their own dtype")
    if c.release.lm_head != "fused_chunked" and c.dtype != "float32":
        problems.append(f"{flag} with {field_name('dtype')} {c.dtype} is planned from TRL 1.15 on (its fused LM head); "
                        f"vram-plan does not model TRL {c.release.version}'s float32 head over 16-bit weights: load "
                        "float32, or plan for TRL 1.15+")
    return problems


def _not_a_field_yet(c: TrainingConfig, field: str, since: tuple[int, int, int]) -> str:
    return (f"{field_name(field)} is not a GRPOConfig field in TRL {c.release.version} (it came in "
            f"{'.'.join(map(str, since[:2]))})")


def offload_problems(c: TrainingConfig) -> list[str]:
    """What each offload needs: ZeRO-Offload's optimizer under stage 2 or 3 (the TRL configs that carry the key),
    its parameters under stage 3 beside the optimizer; FSDP2 offloads parameters, gradients and the step at once."""
    problems = []
    if c.offload_optimizer == "cpu" and c.fsdp:
        problems.append(f"{field_name('offload_optimizer')} cpu: FSDP2 offloads parameters, gradients and the optimizer step "
                        f"together; use {field_name('offload_param')} cpu")
    elif c.offload_optimizer == "cpu" and c.zero_stage not in (2, 3):
        problems.append(f"{field_name('offload_optimizer')} cpu needs {field_name('zero_stage')} 2 or 3 (ZeRO-Offload), or "
                        f"{field_name('fsdp')} with {field_name('offload_param')} cpu")
    if c.offload_param == "cpu" and not c.fsdp and c.zero_stage != 3:
        problems.append(f"{field_name('offload_param')} cpu needs {field_name('zero_stage')} 3 (with "
                        f"{field_name('offload_optimizer')} cpu) or {field_name('fsdp')}")
    elif c.offload_param == "cpu" and c.zero_stage == 3 and c.offload_optimizer != "cpu":
        problems.append(f"{field_name('offload_param')} cpu under ZeRO-3 goes with {field_name('offload_optimizer')} cpu "
                        "(vram-plan plans ZeRO-3's parameter offload as DeepSpeed's estimator and TRL's examples pair them)")
    if c.load_in_4bit and "cpu" in (c.offload_optimizer, c.offload_param):
        problems.append(f"{field_name('offload_optimizer')} / {field_name('offload_param')} with {field_name('load_in_4bit')}: "
                        "bitsandbytes' 4-bit weights are not planned off the GPU; choose one")
    return problems


def vllm_problems(c: TrainingConfig) -> list[str]:
    """The vLLM knobs' rules: what needs vLLM (or its server mode), and what the TRL release has (GRPOConfig fields
    of trl/trainer/grpo_config.py; VLLMGeneration's check that the tensor parallel size divides the processes)."""
    given = [field_name(f) for f in ("vllm_max_model_length", "vllm_server_gpu") if getattr(c, f) is not None]
    given += [field_name("vllm_tensor_parallel_size")] if c.vllm_tensor_parallel_size != 1 else []
    if not c.use_vllm:
        return [f"{' / '.join(given)} need{'s' * (len(given) == 1)} {field_name('use_vllm')}"] if given else []
    problems, release = [], version_tuple(c.release.version)
    for field, since, unset in (("vllm_max_model_length", (0, 26, 0), None),
                                ("vllm_enable_sleep_mode", (0, 23, 0), False),
                                ("vllm_tensor_parallel_size", (0, 18, 0), 1)):
        if release < since and getattr(c, field) != unset:
            problems.append(_not_a_field_yet(c, field, since))
    if c.vllm_server_gpu is not None and c.vllm_mode != "server":
        problems.append(f"{field_name('vllm_server_gpu')} plans the card of vLLM's server: it needs "
                        f"{field_name('vllm_mode')} server")
    if c.vllm_mode == "colocate" and c.num_gpus % c.vllm_tensor_parallel_size:
        problems.append(f"TRL refuses it: {field_name('vllm_tensor_parallel_size')} ({c.vllm_tensor_parallel_size}) "
                        "must divide the "
                        f"number of processes ({field_name('num_gpus')} {c.num_gpus}) evenly in colocate mode")
    if c.vllm_max_model_length is not None and c.vllm_max_model_length < c.max_prompt_length:
        problems.append(f"{field_name('vllm_max_model_length')} {c.vllm_max_model_length} is shorter than the "
                        "longest prompt "
                        f"({field_name('max_prompt_length')} {c.max_prompt_length}): vLLM refuses longer prompts")
    return problems


def generation_batch_problems(c: TrainingConfig) -> list[str]:
    """The release's own rule on what num_generations must divide, in TRL's words, then the flags to change."""
    rule = c.release.num_generations_rule
    b, gpus, g = c.per_device_train_batch_size, c.num_gpus, c.num_generations
    if rule == "none":
        return []
    batch_flags = [("per_device_train_batch_size", b)]
    if rule == "global_batch":
        factors, batch, name = f"{gpus} x {b}", b * gpus, "global train batch size"
    elif rule == "effective_batch":
        factors, batch, name = f"{gpus} x {b} x {c.gradient_accumulation_steps}", c.generation_batch_size, \
            "effective train batch size"
        batch_flags.append(("gradient_accumulation_steps", c.gradient_accumulation_steps))
    else:
        factors, batch, name = f"{gpus} x {b} x {c.steps_per_generation_resolved}", c.generation_batch_size, \
            "generation batch size"
        batch_flags.append(("steps_per_generation" if c.steps_per_generation else "gradient_accumulation_steps",
                            c.steps_per_generation_resolved))
    flags = ", ".join(f"{field_name(f)} {v}" for f, v in batch_flags) + f" or {field_name('num_generations')} {g}"
    if batch % g == 0:
        return []
    valid = sorted(d for d in divisors(batch, at_most=10**6) if d >= 2)
    shown = ", ".join(map(str, valid[:12])) + (", ..." if len(valid) > 12 else "")
    return [f"TRL {c.release.version} refuses it: the {name} ({factors}) must be evenly divisible by the number of "
            f"generations per prompt ({g}); the valid values for the number of generations are [{shown}] "
            f"(change {flags})"]


@lru_cache(maxsize=1)
def knob_names() -> tuple[str, ...]:
    return field_names(TrainingConfig)


@lru_cache(maxsize=1)
def knob_types() -> dict[str, Any]:
    """Each knob's type, without its rules (`int | None`, `Literal['sdpa', 'eager', 'flash_attention_2']`, ...)."""
    from typing import get_type_hints

    return get_type_hints(TrainingConfig)


def training_config(values: dict[str, Any]) -> TrainingConfig:
    """Validate user values (from flags or a config file); every problem in one ConfigError."""
    names = knob_names()
    problems = []
    for key in (str(k) for k in values if k not in names):
        near = closest_names(key, names, cutoff=SETTING_CUTOFF)
        problems.append(f"unknown setting {field_name(key)}"
                        + (f" (did you mean {field_name(near[0])}?)" if near else ""))
    known = {k: v for k, v in values.items() if k in names and v is not None}
    from pydantic import ValidationError

    try:
        config = validate(TrainingConfig, known)
    except ValidationError as exc:
        problems.extend(_describe(exc))
        raise ConfigError(problems) from exc
    problems.extend(cross_field_problems(config))
    if problems:
        raise ConfigError(problems)
    return config


def release_config(values: dict[str, Any]) -> TrainingConfig:
    """A TRL release's defaults (trl_semantics.release_defaults) with nothing of the user's but the environment's
    allocator setting: `training_config` without pydantic, which `plan` with no knobs then never loads.

    The defaults keep the field rules by construction (tests/model/test_release_config.py holds every release row to
    training_config's answer); the allocator text and the cross-field rules are checked here, and anything they find
    is left to training_config to put in its words.
    """
    try:
        config = TrainingConfig(**{name: value for name, value in values.items() if value is not None})
        config = replace(config, allocator_conf=_allocator_settings(config.allocator_conf))
    except (TypeError, ValueError):
        return training_config(values)
    return training_config(values) if cross_field_problems(config) else config


def _describe(exc: Any) -> list[str]:  # pydantic's ValidationError
    out = []
    for err in exc.errors():
        if not err["loc"]:
            out.append(err["msg"].removeprefix("Value error, "))
            continue
        field = str(err["loc"][0])
        value = err.get("input")
        allowed = _allowed_values(field)
        if allowed and err["type"] in ("enum", "literal_error"):
            near = closest_names(str(value), allowed)
            hint = f"did you mean {near[0]!r}? " if near else ""
            out.append(f"{field_name(field)} {value!r} is not known; {hint}choose from {', '.join(allowed)}")
            continue
        message = error_message(err).removeprefix("Input should be ").removeprefix("Value error, ")
        out.append(f"{field_name(field)} should be {message} (got {short_repr(value)})")
    return out


def _allowed_values(field: str) -> list[str]:
    annotation = knob_types()[field]
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return [member.value for member in annotation]
    return [str(a) for a in get_args(annotation) if isinstance(a, str)] or [
        str(x) for a in get_args(annotation) for x in get_args(a) if isinstance(x, str)]


def with_changes(train: TrainingConfig, **changes: Any) -> TrainingConfig:
    """A config derived from a valid one, checked again; ConfigError with every problem.

    The planner derives thousands of configs per plan. Without pydantic, each changed value goes through its field's
    own validators and is held to its field's rules, and the cross-field rules run again; a value those checks do
    not admit goes through training_config, whose words the error then has.
    """
    names, metadata = knob_names(), _knob_rules()
    unknown = [name for name in changes if name not in names]
    if unknown:
        raise ConfigError([f"unknown setting {field_name(name)}" for name in unknown])
    try:
        checked = {name: _checked(metadata.get(name), value) for name, value in changes.items()}
    except (ValueError, OverflowError):
        return training_config({**as_settings(train), **changes})
    changed = replace(train, **checked)
    problems = cross_field_problems(changed)
    if problems:
        raise ConfigError(problems)
    return changed


def _checked(annotated: Any, value: Any) -> Any:
    """The value after its field's validators, as the field's number type; ValueError where they, the type or the
    rules do not admit it."""
    if annotated is None:
        return value
    numbers = [t for t in (*get_args(annotated.__origin__), annotated.__origin__) if t in (int, float)]
    if value is not None and numbers:
        if float in numbers and type(value) in (int, float):
            value = float(value)
        elif type(value) is not int:
            raise ValueError(f"{value!r} is not an int")
    for item in annotated.__metadata__:
        if isinstance(item, (Before, After)):
            value = item.function(value)
        elif value is not None and not item.admits(value):
            raise ValueError(f"{value!r} is outside {item!r}")
    return value


@lru_cache(maxsize=1)
def _knob_rules() -> dict[str, Any]:
    """Each annotated knob's annotation (`Annotated[int, Rules(...)]`); the knobs without rules are left out."""
    from typing import get_type_hints

    hints = get_type_hints(TrainingConfig, include_extras=True)
    return {name: hint for name, hint in hints.items() if hasattr(hint, "__metadata__")}


def as_settings(train: TrainingConfig) -> dict[str, Any]:
    """Every knob's value (lists copied), as training_config takes them."""
    return asdict(train)


def changed_settings(train: TrainingConfig) -> dict[str, Any]:
    """The knobs not at TrainingConfig's defaults, as JSON values (what a probe record keeps of a config)."""
    defaults = to_jsonable(TrainingConfig())
    return {name: value for name, value in to_jsonable(train).items() if value != defaults[name]}


@lru_cache(maxsize=64)
def _parsed_allocator_conf(allocator_conf: str) -> Any:
    from vram_planner.allocator import parse_allocator_conf

    return parse_allocator_conf(allocator_conf)


def allocator_conf_notes(allocator_conf: str) -> list[str]:
    """What a reader of these allocator settings should know about how they act (AllocatorConf.notes)."""
    return _parsed_allocator_conf(allocator_conf).notes()


def _expandable(allocator_conf: str) -> bool:
    return _parsed_allocator_conf(allocator_conf).expandable_segments
