"""The plan as TRL wants it: GRPOConfig keyword arguments, the LoRA and 4-bit configs, a ready snippet.

Nothing here imports TRL; `grpo_config_problems` mirrors GRPOConfig.__post_init__ of TRL 1.16 and the tests hold
it to the real class.
"""

from __future__ import annotations

import json
from typing import Any

from vram_planner.model.spec import TrainingConfig, sampling_knobs_given
from vram_planner.model.trl_releases import TrlRelease


def grpo_config_kwargs(train: TrainingConfig) -> dict[str, Any]:
    """Keyword arguments for trl.GRPOConfig (besides output_dir) that reproduce this plan."""
    release = train.release
    # transformers 4 named the load dtype torch_dtype
    model_init: dict[str, Any] = {"dtype" if release.transformers_major >= 5 else "torch_dtype": train.dtype}
    if train.attn_implementation != "sdpa":
        model_init["attn_implementation"] = train.attn_implementation
    if train.use_kernels is not None:
        model_init["use_kernels"] = train.use_kernels
    kwargs: dict[str, Any] = {
        "per_device_train_batch_size": train.per_device_train_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "num_generations": train.num_generations,
        **({"max_prompt_length": train.max_prompt_length} if release.truncates_prompts else {}),
        "max_completion_length": train.max_completion_length,
        "beta": train.beta,
        "optim": train.optim.value,
        train.transformers.checkpointing_argument: train.gradient_checkpointing,
        "bf16": train.mixed_precision == "bf16",
        "fp16": train.mixed_precision == "fp16",
        "model_init_kwargs": model_init,
    }
    if train.gradient_checkpointing and train.use_reentrant is not None:
        kwargs[f"{train.transformers.checkpointing_argument}_kwargs"] = {"use_reentrant": train.use_reentrant}
    if train.steps_per_generation is not None:
        kwargs["steps_per_generation"] = train.steps_per_generation
    if train.num_iterations != 1:
        kwargs["num_iterations"] = train.num_iterations
    if train.use_liger_kernel:
        kwargs["use_liger_kernel"] = True
    if train.cast_lm_head_to_fp32:  # a GRPOConfig field from TRL 0.25 (spec refuses it before)
        kwargs["cast_lm_head_to_fp32"] = True
    kwargs.update(sampling_kwargs(train))
    if train.zero_stage == 3 and not train.ds3_gather_for_generation:
        kwargs["ds3_gather_for_generation"] = False
    if train.use_vllm:
        kwargs["use_vllm"] = True
        if release.accepts_vllm_mode:  # before 0.18 vLLM always ran on a GPU of its own
            kwargs["vllm_mode"] = train.vllm_mode
        if train.vllm_mode == "colocate" and release.accepts_vllm_mode:
            kwargs["vllm_gpu_memory_utilization"] = train.vllm_gpu_memory_utilization
            if train.vllm_enable_sleep_mode:  # a GRPOConfig field from TRL 0.23 (spec refuses it before)
                kwargs["vllm_enable_sleep_mode"] = True
            if train.vllm_tensor_parallel_size != 1:
                kwargs["vllm_tensor_parallel_size"] = train.vllm_tensor_parallel_size
            if train.vllm_max_model_length is not None:  # server mode: trl vllm-serve's --max_model_len instead
                kwargs["vllm_max_model_length"] = train.vllm_max_model_length
    return kwargs


# TrainingArguments' two spellings of the same arguments (profiles/transformers.toml checkpointing_argument): a
# recipe's edits keep the recipe's
CHECKPOINTING_SPELLINGS = {"gradient_checkpointing": "activation_checkpointing",
                           "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs"}
CHECKPOINTING_SPELLINGS.update({new: old for old, new in CHECKPOINTING_SPELLINGS.items()})


def sampling_kwargs(train: TrainingConfig) -> dict[str, Any]:
    """The sampling knobs given, or changed from what generate() does when they are unset."""
    return {name: getattr(train, name) for name in sampling_knobs_given(train)}


def lora_config_kwargs(train: TrainingConfig) -> dict[str, Any] | None:
    """Keyword arguments for peft.LoraConfig, or None for full fine-tuning."""
    if not train.uses_lora:
        return None
    targets: str | list[str] = train.lora_targets or "all-linear"
    return {"r": train.lora_r, "lora_alpha": train.lora_alpha or 2 * (train.lora_r or 0),
            "lora_dropout": train.lora_dropout, "target_modules": targets, "task_type": "CAUSAL_LM"}


def quantization_config_kwargs(train: TrainingConfig) -> dict[str, Any] | None:
    """Keyword arguments for transformers.BitsAndBytesConfig, or None without 4-bit loading."""
    if not train.load_in_4bit:
        return None
    return {"load_in_4bit": True, "bnb_4bit_quant_type": train.bnb_4bit_quant_type or "nf4",
            "bnb_4bit_use_double_quant": train.bnb_4bit_use_double_quant is not False,
            "bnb_4bit_compute_dtype": "bfloat16" if train.mixed_precision != "fp16" else "float16"}


def grpo_config_problems(kwargs: dict[str, Any], num_processes: int = 1, release: TrlRelease | None = None) -> list[str]:
    """The checks of GRPOConfig.__post_init__ (TRL 1.16) that these kwargs would fail; for an older `release`, the
    checks it shares with 1.16 (its own batch rules are the spec's, see spec.generation_batch_problems)."""
    problems = []
    if release is None or release.num_generations_rule == "generation_batch":
        problems += _generation_batch_problems(kwargs, num_processes)
    if kwargs.get("bf16") and kwargs.get("fp16"):
        problems.append("bf16 and fp16 cannot both be set")
    if "max_prompt_length" in kwargs and (release is None or not release.accepts_max_prompt_length):
        problems.append("max_prompt_length is not a GRPOConfig field since TRL 0.28")
    return problems


def _generation_batch_problems(kwargs: dict[str, Any], num_processes: int) -> list[str]:
    """TRL 1.16's rules on generation_batch_size, steps_per_generation and num_generations."""
    problems = []
    b = kwargs.get("per_device_train_batch_size", 8)
    ga = kwargs.get("gradient_accumulation_steps", 1)
    s = kwargs.get("steps_per_generation")
    generation_batch = kwargs.get("generation_batch_size")
    if generation_batch is not None and s is not None:
        problems.append("'generation_batch_size' and 'steps_per_generation' can not be both configured")
    elif generation_batch is not None and generation_batch % (b * num_processes):
        problems.append(f"generation_batch_size ({generation_batch}) must be divisible by the global batch size "
                        f"({b * num_processes})")
    if generation_batch is None:
        generation_batch = b * num_processes * (s if s is not None else ga)
    g = kwargs.get("num_generations", 8)
    if generation_batch % g:
        problems.append(f"generation_batch_size ({generation_batch}) must be divisible by num_generations ({g})")
    if g < 2:
        problems.append(f"num_generations ({g}) must be at least 2")
    return problems


def python_snippet(train: TrainingConfig, model_id: str) -> str:
    """Paste-ready Python that starts this run with TRL."""
    kwargs = grpo_config_kwargs(train)
    lines = ["from trl import GRPOConfig, GRPOTrainer"]
    lora, quant = lora_config_kwargs(train), quantization_config_kwargs(train)
    if lora:
        lines.insert(0, "from peft import LoraConfig")
    if quant:
        lines.insert(0, "from transformers import BitsAndBytesConfig")
    lines += ["", "args = GRPOConfig(", f"    output_dir={json.dumps(output_dir_name(model_id))},"]
    lines += [f"    {key}={_py(value)}," for key, value in kwargs.items()]
    lines += [")", "trainer = GRPOTrainer(", f"    model={model_id!r},",
              "    reward_funcs=[...],  # your reward functions", "    args=args,",
              "    train_dataset=dataset,  # prompts; vram-plan assumed the longest is "
              f"{train.max_prompt_length} tokens"
              + (" (longer ones are truncated)" if train.release.truncates_prompts else "")]
    if lora:
        lines.append(f"    peft_config=LoraConfig({call_args(lora)}),")
    if quant:
        lines.append(f"    quantization_config=BitsAndBytesConfig({call_args(quant)}),")
    lines += [")", "trainer.train()"]
    if train.allocator_conf:  # torch reads it at the first CUDA allocation: set before anything touches the GPU
        lines[:0] = ["import os", "", f"os.environ[\"PYTORCH_CUDA_ALLOC_CONF\"] = {train.allocator_conf!r}", ""]
    return "\n".join(lines)


def output_dir_name(model_id: str) -> str:
    """`grpo-<model>`: the last part of a hub id or of a local folder (a config.json's folder)."""
    parts = [part for part in model_id.replace("\\", "/").split("/") if part]
    if len(parts) > 1 and parts[-1].lower().endswith(".json"):
        parts.pop()
    return f"grpo-{parts[-1] if parts else 'model'}"


def _py(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value).replace("true", "True").replace("false", "False").replace("null", "None")
    return repr(value)


def call_args(kwargs: dict[str, Any]) -> str:
    """Keyword arguments as Python source: `a=1, b={"c": True}`."""
    return ", ".join(f"{k}={_py(v)}" for k, v in kwargs.items())
