"""What TRL's own configs call the settings of a request, and what each of their other arguments does to GPU memory.

A recipe (TrlParser's YAML: TRL's ModelConfig and ScriptArguments, GRPOConfig and the transformers TrainingArguments
it extends, in any release from 0.14) names every argument of the run. vram_planner.recipe reads one as TRL runs it;
a request given TRL's names instead of ours is refused with a pointer (vram_planner.request). Pure data.
"""

from __future__ import annotations

from typing import Any

# TRL's name of a setting -> the request's field that plans it
TRL_NAMES = {
    "model_name_or_path": "model",  # ModelConfig
    "torch_dtype": "dtype",  # ModelConfig (and `dtype` from TRL 0.22)
    "bf16": "mixed_precision",  # TrainingArguments: bf16 or fp16 autocast
    "fp16": "mixed_precision",
    "use_peft": "lora_r",  # ModelConfig: LoRA with its lora_r
    "use_bnb_nested_quant": "bnb_4bit_use_double_quant",  # ModelConfig
    "generation_batch_size": "steps_per_generation",  # GRPOConfig: micro-batch x GPUs x steps_per_generation
    "vllm_max_model_len": "vllm_max_model_length",  # GRPOConfig before 0.18
    "per_gpu_train_batch_size": "per_device_train_batch_size",  # TrainingArguments' deprecated name (transformers 4)
    "gradient_checkpointing_kwargs": "use_reentrant",  # {"use_reentrant": ...}
    "activation_checkpointing": "gradient_checkpointing",  # TrainingArguments' name from transformers 5.2x
    "activation_checkpointing_kwargs": "use_reentrant",
    "adafactor": "optim",  # TrainingArguments (transformers 4): optim adafactor
    "disable_dropout": "lora_dropout",  # GRPOConfig: every dropout's p set to 0, LoRA's too
    "model_init_kwargs": "dtype",  # GRPOConfig: from_pretrained's dtype and attention, when the model is a name
}

# Training arguments whose value moves no GPU memory of the planned step on one GPU without evaluation: the
# optimizer's hyper-parameters (not its kind), the schedule, logging, saving and the hub, where the data comes from
# and how the host loads it (its prompts' length is max_prompt_length), the other processes' settings, and the loss's
# scalars (clipping ranges, scaling, the loss type: arithmetic over [sequences, tokens], never over the vocabulary).
# Evaluation's own arguments are here because evaluation itself is not planned (eval_strategy and do_eval are
# UNPLANNED_ARGUMENTS). torch_empty_cache_steps can only free cached memory.
MEMORY_NEUTRAL_ARGUMENTS = frozenset({
    # the optimizer's hyper-parameters and the schedule
    "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_ratio", "warmup_steps", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "num_train_epochs", "max_steps",
    # logging, reporting, where the run writes and what it is named
    "logging_steps", "logging_strategy", "logging_first_step", "logging_dir", "logging_nan_inf_filter", "log_level",
    "log_level_replica", "log_on_each_node", "log_completions", "log_completions_hub_repo", "log_multimodal",
    "log_unique_prompts", "wandb_log_unique_prompts", "num_completions_to_print", "output_dir", "overwrite_output_dir",
    "report_to", "run_name", "project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id",
    "disable_tqdm", "skip_memory_metrics", "include_num_input_tokens_seen", "include_tokens_per_second",
    # saving and the hub
    "save_strategy", "save_steps", "save_total_limit", "save_on_each_node", "save_only_model", "save_safetensors",
    "enable_jit_checkpoint", "restore_callback_states_from_checkpoint", "ignore_data_skip", "load_best_model_at_end",
    "metric_for_best_model", "greater_is_better", "push_to_hub", "hub_model_id", "hub_private_repo", "hub_strategy",
    "hub_token", "hub_revision", "hub_always_push", "push_to_hub_model_id", "push_to_hub_organization",
    "push_to_hub_token", "model_revision", "trust_remote_code",
    # the data and the host's loading of it
    "seed", "data_seed", "full_determinism", "dataset_name", "dataset_config", "dataset_train_split",
    "dataset_test_split", "dataset_streaming", "ignore_bias_buffers", "dataloader_drop_last", "dataloader_in_order",
    "dataloader_multiprocessing_context", "dataloader_num_workers", "dataloader_persistent_workers",
    "dataloader_pin_memory", "dataloader_prefetch_factor", "group_by_length", "length_column_name",
    "remove_unused_columns", "train_sampling_strategy", "shuffle_dataset", "chat_template_kwargs", "label_names",
    "datasets", "streaming", "test_split_size",  # TRL's scripts' DatasetMixtureConfig
    "reward_funcs",  # TRL's grpo script: reward functions by name or import path, run on the host
    # evaluation's own (evaluation is not planned)
    "per_device_eval_batch_size", "per_gpu_eval_batch_size", "num_generations_eval", "eval_steps", "eval_delay",
    "eval_accumulation_steps", "eval_do_concat_batches", "eval_use_gather_object", "batch_eval_metrics",
    "include_for_metrics", "include_inputs_for_metrics", "prediction_loss_only", "bf16_full_eval", "fp16_full_eval",
    "jit_mode_eval", "past_index", "do_train", "do_predict", "use_legacy_prediction_loop",
    # the other processes' (one GPU), and TPUs'
    "local_rank", "_n_gpu", "ddp_backend", "ddp_timeout", "ddp_broadcast_buffers", "ddp_find_unused_parameters",
    "ddp_static_graph", "average_tokens_across_devices", "split_batches", "dispatch_batches", "mp_parameters",
    "ray_scope", "tpu_num_cores", "tpu_metrics_debug", "use_ipex",
    # the loss's scalars and the rewards
    "epsilon", "epsilon_high", "delta", "scale_rewards", "reward_weights", "loss_type", "importance_sampling_level",
    "mask_truncated_completions", "multi_objective_aggregation", "off_policy_mask_threshold",
    "use_bias_correction_kl", "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos",
    "vespo_k_neg", "vespo_lambda_neg", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap", "router_aux_loss_coef",
    "label_smoothing_factor", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
    # precision flags that change kernels, not tensors, and the cache's release
    "tf32", "half_precision_backend", "fp16_backend", "fp16_opt_level", "torch_empty_cache_steps",
    # LoRA's scaling and task (not its size), vLLM's server address, prefix cache and decoding constraints
    "use_rslora", "lora_task_type", "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
    "vllm_server_timeout", "vllm_group_port", "vllm_enable_prefix_caching", "vllm_guided_decoding_regex",
    "vllm_structured_outputs_regex", "vllm_model_impl",
})

# Of those, what `vram-plan run --config recipe.yaml` carries into the GRPOConfig it starts: how the recipe trains
# (the optimizer's hyper-parameters, the schedule, seeds, the loss's scalars). Where the run writes, logs and saves is
# the run's own (its flags, and the checkpoints it resumes from); the rewards are its --reward's, whose count
# reward_weights would have to match.
RUN_CARRIED_ARGUMENTS = frozenset({
    "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_ratio", "warmup_steps", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "num_train_epochs", "seed", "data_seed",
    "full_determinism", "epsilon", "epsilon_high", "delta", "scale_rewards", "loss_type", "importance_sampling_level",
    "mask_truncated_completions", "multi_objective_aggregation", "off_policy_mask_threshold",
    "use_bias_correction_kl", "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos",
    "vespo_k_neg", "vespo_lambda_neg", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap", "sync_ref_model", "ref_model_mixup_alpha",
    "ref_model_sync_steps", "log_completions", "num_completions_to_print", "shuffle_dataset", "tf32",
    "torch_empty_cache_steps", "chat_template_kwargs", "router_aux_loss_coef",
})

# Arguments that move GPU memory in ways the plan does not count: the values under which the run is the planned one
# (each release's default among them) -> what another value adds or changes.
UNPLANNED_ARGUMENTS: dict[str, tuple[tuple[Any, ...], str]] = {
    "torch_compile": ((False,), "compiled graphs' own buffers"),
    "torch_compile_backend": ((None,), "compiled graphs' own buffers (it turns torch_compile on)"),
    "torch_compile_mode": ((None,), "compiled graphs' own buffers (it turns torch_compile on)"),
    "torchdynamo": ((None,), "compiled graphs' own buffers"),
    "fsdp_config": ((None, {}), "FSDP: plan it with fsdp and num_gpus"),
    "fsdp_min_num_params": ((0,), "FSDP: plan it with fsdp and num_gpus"),
    "fsdp_transformer_layer_cls_to_wrap": ((None,), "FSDP: plan it with fsdp and num_gpus"),
    "parallelism_config": ((None,), "tensor, context or sequence parallelism"),
    "tp_size": ((None, 0, 1), "tensor parallelism"),
    "accelerator_config": ((None, {}), "accelerate's batch splitting and dispatching"),
    "ddp_bucket_cap_mb": ((None,), "DDP's gradient buckets (planned at torch's 25 MB)"),
    "do_eval": ((False, None), "evaluation's generation"),
    "eval_strategy": (("no", None), "evaluation's generation"),
    "evaluation_strategy": (("no", None), "evaluation's generation"),
    "eval_on_start": ((False,), "evaluation's generation"),
    "auto_find_batch_size": ((False,), "a smaller micro-batch after each out-of-memory error"),
    "resume_from_checkpoint": ((None, False, ""), "the checkpoint's optimizer states loaded onto the GPU beside "
                               "the optimizer's own"),
    "use_cpu": ((False,), "training on the CPU"),
    "no_cuda": ((False,), "training on the CPU"),
    "use_mps_device": ((False,), "training on Apple's GPU"),
    "debug": ((None, "", []), "the overflow detector's hooks"),
    "neftune_noise_alpha": ((None,), "NEFTune's noisy embeddings"),
    "optim_args": ((None, ""), "the optimizer's own arguments"),
    "optim_target_modules": ((None, []), "GaLore's or APOLLO's projected states"),
    "liger_kernel_config": ((None, {}), "Liger's kernels as configured"),
    "use_liger_loss": ((False, None), "Liger's fused GRPO loss of its releases (use_liger_kernel is planned)"),
    "use_cache": ((False, None), "the KV cache the training forward would build"),
    "load_in_8bit": ((False,), "8-bit weights"),
    "bnb_4bit_quant_storage": ((None, "uint8"), "4-bit weights stored in another dtype"),
    "use_dora": ((False,), "DoRA's magnitudes and their activations"),
    "lora_modules_to_save": ((None, []), "full copies of the modules trained"),
    "lora_target_parameters": ((None, []), "LoRA on parameters (experts)"),
    "cache_implementation": ((None,), "another KV cache"),
    "generation_kwargs": ((None, {}), "generate()'s other arguments"),
    "use_transformers_paged": ((False,), "transformers' paged generation"),
    "use_transformers_continuous_batching": ((False,), "transformers' continuous batching and its paged cache"),
    "transformers_continuous_batching_config": ((None,), "transformers' continuous batching and its paged cache"),
    "pad_to_multiple_of": ((None, "auto"), "padded prompts and completions"),
    "max_tool_calling_iterations": ((None,), "tool calls' extra generation rounds"),
    "top_entropy_quantile": ((1.0,), "the entropies of every position"),
    "entropy_coef": ((0.0, None), "the entropy bonus"),
    "use_adaptive_entropy": ((False,), "the entropy bonus"),
    "vllm_device": (("auto", None), "vLLM on a card other than the next one"),
    "vllm_dtype": (("auto", None), "vLLM's weights in another dtype"),
    "reward_model_name_or_path": ((None,), "a reward model on the GPU"),  # TRL's grpo script
}
# Of those, the ones a recipe may keep: evaluation runs between optimizer steps, without gradients, from its own
# batch, so the training step's plan still holds for training; the note says evaluation is not in it.
NOTED_ARGUMENTS = frozenset({"do_eval", "eval_strategy", "evaluation_strategy", "eval_on_start"})

# Those of older releases, which recipes pinned to them still spell: ModelConfig's torch_dtype (dtype from TRL 0.22),
# GRPOConfig's fields that later releases renamed or removed, and TrainingArguments' fields that transformers 5 removed
OLDER_NAMES = frozenset({
    "torch_dtype", "use_liger_loss", "vllm_device", "vllm_dtype", "vllm_enable_prefix_caching",
    "vllm_guided_decoding_regex", "vllm_max_model_len", "wandb_log_unique_prompts", "_n_gpu", "adafactor",
    "dispatch_batches", "evaluation_strategy", "fp16_backend", "fp16_opt_level", "fsdp_min_num_params",
    "fsdp_transformer_layer_cls_to_wrap", "group_by_length", "half_precision_backend", "include_inputs_for_metrics",
    "include_tokens_per_second", "jit_mode_eval", "logging_dir", "mp_parameters", "no_cuda", "overwrite_output_dir",
    "past_index", "per_gpu_eval_batch_size", "per_gpu_train_batch_size", "push_to_hub_model_id",
    "push_to_hub_organization", "push_to_hub_token", "ray_scope", "save_safetensors", "split_batches", "torchdynamo",
    "tp_size", "tpu_metrics_debug", "tpu_num_cores", "use_ipex", "use_legacy_prediction_loop", "use_mps_device",
    "warmup_ratio",
})


# Fields an older recipe names that later releases dropped -> the last release with it (GRPOConfig, ModelConfig): a
# recipe that names one was written for that release or an earlier one, whose parser alone accepts it
LAST_RELEASE_WITH = {
    "vllm_device": "0.17", "vllm_dtype": "0.17", "vllm_max_model_len": "0.17", "vllm_enable_prefix_caching": "0.17",
    "torch_dtype": "0.26", "wandb_log_unique_prompts": "0.26", "use_liger_loss": "0.27",
    "vllm_guided_decoding_regex": "0.27",
}


# TrainingArguments' that say how the run is launched, read with the launcher's options (vram_planner.launcher): the
# DeepSpeed config (a path to its JSON, the JSON, or a mapping)
LAUNCH_ARGUMENTS = frozenset({"deepspeed"})

# TRL's arguments the tables above name (those TRL names as the request's fields do are SHARED_ARGUMENTS)
TRL_ARGUMENTS = frozenset(TRL_NAMES) | MEMORY_NEUTRAL_ARGUMENTS | frozenset(UNPLANNED_ARGUMENTS) | LAUNCH_ARGUMENTS

# TRL's arguments that are also the request's fields, by the same name: spelled as TRL's command line spells them
# (`--lora_r 16`), they mean what TRL makes of them (LoRA only with use_peft: vram_planner.cli.trl_arguments)
SHARED_ARGUMENTS = frozenset({
    "attn_implementation", "beta", "bnb_4bit_quant_type", "cast_lm_head_to_fp32", "ds3_gather_for_generation", "dtype",
    "fsdp", "gradient_accumulation_steps", "gradient_checkpointing", "load_in_4bit", "lora_alpha", "lora_dropout",
    "lora_r", "lora_target_modules", "max_completion_length", "max_prompt_length", "min_p", "num_generations",
    "num_iterations", "optim", "per_device_train_batch_size", "repetition_penalty", "steps_per_generation",
    "temperature", "top_k", "top_p", "use_liger_kernel", "use_vllm", "vllm_enable_sleep_mode",
    "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_mode", "vllm_tensor_parallel_size",
})

# How TRL's parser (transformers' HfArgumentParser, TRL's own copy from 1.x) reads a command line: these arguments are
# booleans (a bare flag is true; else yes/no, true/false, t/f, y/n or 1/0; `--no_X` where the default is true), these
# take one or more values (nargs "+"; report_to, typed str or a list, takes one), every other one value. Held to the
# installed TRL's parser by tests/cli/test_trl_arguments.py; the older releases' booleans are those of their
# TrainingArguments and GRPOConfig.
BOOLEAN_ARGUMENTS = frozenset({
    "activation_checkpointing", "auto_find_batch_size", "average_tokens_across_devices", "batch_eval_metrics", "bf16",
    "bf16_full_eval", "cast_lm_head_to_fp32", "dataloader_drop_last", "dataloader_in_order",
    "dataloader_persistent_workers", "dataloader_pin_memory", "dataset_streaming", "ddp_broadcast_buffers",
    "ddp_find_unused_parameters", "ddp_static_graph", "disable_dropout", "disable_tqdm", "do_eval", "do_predict",
    "do_train", "ds3_gather_for_generation", "enable_jit_checkpoint", "eval_do_concat_batches", "eval_on_start",
    "eval_use_gather_object", "fp16", "fp16_full_eval", "full_determinism", "gradient_checkpointing",
    "greater_is_better", "hub_always_push", "hub_private_repo", "ignore_bias_buffers", "ignore_data_skip",
    "include_num_input_tokens_seen", "load_best_model_at_end", "load_in_4bit", "load_in_8bit", "log_completions",
    "log_multimodal", "log_on_each_node", "log_unique_prompts", "logging_first_step", "logging_nan_inf_filter",
    "mask_truncated_completions", "prediction_loss_only", "push_to_hub", "remove_unused_columns",
    "restore_callback_states_from_checkpoint", "save_on_each_node", "save_only_model", "shuffle_dataset",
    "skip_memory_metrics", "streaming", "sync_ref_model", "tf32", "torch_compile", "trust_remote_code",
    "use_adaptive_entropy", "use_bias_correction_kl", "use_bnb_nested_quant", "use_cache", "use_cpu", "use_dora",
    "use_liger_kernel", "use_peft", "use_rslora", "use_transformers_continuous_batching", "use_transformers_paged",
    "use_vllm", "vllm_enable_sleep_mode", "vllm_importance_sampling_correction",
    # older releases'
    "adafactor", "dispatch_batches", "group_by_length", "include_inputs_for_metrics", "include_tokens_per_second",
    "jit_mode_eval", "no_cuda", "overwrite_output_dir", "save_safetensors", "split_batches", "tpu_metrics_debug",
    "use_ipex", "use_legacy_prediction_loop", "use_liger_loss", "use_mps_device", "vllm_enable_prefix_caching",
    "wandb_log_unique_prompts",
})
LIST_ARGUMENTS = frozenset({
    "datasets", "debug", "include_for_metrics", "label_names", "lora_modules_to_save", "lora_target_modules",
    "lora_target_parameters", "reward_funcs", "reward_weights",
})


def same_value(value: Any, accepted: tuple[Any, ...]) -> bool:
    """Whether a recipe's value is one of these, a boolean only a boolean (YAML's 0 is not false)."""
    return any(value is option or (_kind(value) == _kind(option) and value == option) for option in accepted)


def _kind(value: Any) -> type:
    return float if type(value) is int else type(value)  # 1 and 1.0 are one number; True is not
