"""What TRL's own configs call the settings of a request, for a refusal that points a recipe's keys (TrlParser's YAML:
TRL's ModelConfig and ScriptArguments, GRPOConfig and the transformers TrainingArguments it extends) at vram-plan's."""

from __future__ import annotations

# TRL's name of a setting -> the request's field that plans it
TRL_NAMES = {
    "model_name_or_path": "model",  # ModelConfig
    "torch_dtype": "dtype",  # ModelConfig (and `dtype` from TRL 0.22)
    "bf16": "mixed_precision",  # TrainingArguments: bf16 or fp16 autocast
    "fp16": "mixed_precision",
    "use_peft": "lora_r",  # ModelConfig: LoRA with its lora_r
    "use_bnb_nested_quant": "bnb_4bit_use_double_quant",  # ModelConfig
    "generation_batch_size": "steps_per_generation",  # GRPOConfig: micro-batch x GPUs x steps_per_generation
}

# Training arguments whose value moves no GPU memory of the planned step: the optimizer's hyper-parameters (not its
# kind), the schedule's length and shape, logging, where the run writes and what it is named, the rewards' scaling and
# the loss's clipping, and where the data comes from (its prompts' length is max_prompt_length). Not here, as they
# do move memory: gradient clipping's norms, saving (ZeRO-3 gathers the 16-bit weights to save), the evaluation's
# batch (sampling's knobs, which add logits-sized tensors to each decoding step, are settings).
MEMORY_NEUTRAL_ARGUMENTS = frozenset({
    "learning_rate", "lr_scheduler_type", "warmup_ratio", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2",
    "adam_epsilon", "num_train_epochs", "max_steps", "logging_steps", "logging_strategy", "logging_first_step",
    "logging_dir", "log_level", "log_completions", "num_completions_to_print", "output_dir", "overwrite_output_dir",
    "seed", "data_seed", "report_to", "run_name", "hub_model_id", "hub_private_repo", "scale_rewards", "reward_weights",
    "epsilon", "epsilon_high", "model_revision", "dataset_name", "dataset_config", "dataset_train_split",
    "dataset_test_split",
})
# Those of older releases, which recipes pinned to them still spell: ModelConfig's torch_dtype (dtype from TRL 0.22),
# and TrainingArguments' fields that transformers 5 removed
OLDER_NAMES = frozenset({"torch_dtype", "warmup_ratio", "logging_dir", "overwrite_output_dir"})
