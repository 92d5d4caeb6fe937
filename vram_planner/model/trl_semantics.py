"""What a TRL release makes of the knobs: its defaults for the ones left unset, and, in words, what the plan
assumed where the release gave them another meaning than the newest one (profiles/trl.toml)."""

from __future__ import annotations

from typing import Any

from vram_planner.model.spec import TrainingConfig
from vram_planner.model.trl_releases import TrlRelease


def release_defaults(release: TrlRelease, use_vllm: bool = False) -> dict[str, Any]:
    """The knobs a user did not set, as this release's GRPOConfig (and the TrainingArguments of its time) sets them."""
    defaults: dict[str, Any] = {
        "per_device_train_batch_size": release.default_per_device_train_batch_size,
        "gradient_accumulation_steps": release.default_gradient_accumulation_steps,
        "gradient_checkpointing": release.default_gradient_checkpointing,
        "mixed_precision": release.default_mixed_precision,
        "beta": release.default_beta,
        "max_completion_length": release.default_max_completion_length,
        "optim": release.default_optim,
        "dtype": release.default_model_dtype,
    }
    if release.default_vllm_gpu_memory_utilization is not None:
        defaults["vllm_gpu_memory_utilization"] = release.default_vllm_gpu_memory_utilization
    if release.default_max_prompt_length is not None:
        defaults["max_prompt_length"] = release.default_max_prompt_length
    if use_vllm:  # the mode means nothing without vLLM, and spec refuses it alone
        defaults["vllm_mode"] = release.default_vllm_mode
    return defaults


def release_assumptions(train: TrainingConfig) -> list[str]:
    """How the knobs were read where this release meant something else than the newest one."""
    release, notes = train.release, []
    name = f"TRL {release.version}"
    b, g = train.per_device_train_batch_size, train.num_generations
    if release.batch_counts == "prompts":
        notes.append(f"{name}: per_device_train_batch_size counts prompts: {b} prompt{'s' * (b != 1)} x {g} "
                     f"generations = {train.micro_batch_completions} completions per micro-batch")
    if release.generation_batch == "micro_batch":
        notes.append(f"{name}: each micro-batch generates its own {train.micro_batch_completions} completions "
                     "(generation does not span gradient accumulation)")
    if release.step_structure == "loss_merged":
        notes.append(f"{name}: generation, the policy's log-probs and the reference's run inside compute_loss, so "
                     "their memory meets in one moment")
    if train.transformers.attention_mask == "shared":
        notes.append(f"transformers {train.transformers.version} builds one attention mask for all layers")
    if release.reference_when == "always" and train.beta == 0:
        notes.append(f"{name}: the reference model is loaded and scores even with beta 0")
    return notes
