"""The smoke step's inputs: the longest prompts, completions forced to full length under every TRL release, and
the memory it leaves freed before the run starts."""

from __future__ import annotations

from typing import Any

from vram_planner.model.spec import TrainingConfig


def longest_first(dataset: Any, rows: int) -> Any:
    """The `rows` longest prompts (by characters, a close stand-in for tokens), longest first."""
    lengths = [len(str(prompt)) for prompt in dataset["prompt"]]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:rows]
    return dataset.select(order)


def release_memory() -> None:
    """Free what a finished or failed trainer left before the next one starts: its model and optimizer sit in
    reference cycles (collected here), and the caching allocator keeps their blocks reserved until told (on CUDA),
    so the next run would start on their fragments (issue 29: 4.457 GiB reserved after the smoke step, 4.225 GiB in
    a fresh process, the same config)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def full_length_completions(train: TrainingConfig) -> dict[str, int]:
    """GRPOConfig.generation_kwargs that force every completion to max_completion_length: EOS is never sampled, so
    TRL's completion mask (which cuts each completion at its first EOS before the loss passes) keeps it whole. vLLM's
    SamplingParams name it min_tokens (its start-up budget is the GRPOConfig's vllm_gpu_memory_utilization, as
    planned), transformers' GenerationConfig min_new_tokens. Its logits processor holds one more float32 [sequences,
    vocabulary] copy of the scores than sampling alone at each decoding step: the smoke step's generation can be that
    much heavier than the run's."""
    return {"min_tokens" if train.use_vllm else "min_new_tokens": train.max_completion_length}


def generation_kwargs_field() -> bool:
    """Whether the installed TRL's GRPOConfig takes generation_kwargs (0.19 on)."""
    from dataclasses import fields

    from trl import GRPOConfig

    return any(field.name == "generation_kwargs" for field in fields(GRPOConfig))


def force_full_length(trainer: Any, train: TrainingConfig) -> None:
    """What full_length_completions asks, set on the trainer of a TRL release without GRPOConfig.generation_kwargs
    (0.14-0.18 build `generation_config`, or vLLM's `sampling_params`, in their trainer)."""
    for name, value in full_length_completions(train).items():
        target = getattr(trainer, "sampling_params" if train.use_vllm else "generation_config")
        setattr(target, name, value)
