"""profiles/trl.toml against what every TRL release's wheel says (benchmarks/trl_releases.py's committed facts).

The facts were read from the released wheels with `ast` and committed in benchmarks/results/trl_releases.json, so
this needs no network: `python benchmarks/trl_releases.py` refreshes them, `--check` prints the same comparison.
"""

from __future__ import annotations

import pytest
from packaging.version import Version

from helpers import benchmark_module


def _script():
    """The benchmark script as a module: the comparison lives there, once."""
    return benchmark_module("trl_releases")


script = _script()
FACTS = script.load_facts()


def test_facts_cover_every_release_pypi_listed():
    listed = [v for v in FACTS["pypi_releases"] if script.OLDEST <= Version(v) <= script.NEWEST]
    assert [r["version"] for r in FACTS["releases"]] == listed
    assert listed[0] == "0.14.0" and listed[-1] == "1.16.0" and len(listed) >= 50


# Read by hand in the wheels' trl/trainer/grpo_config.py, grpo_trainer.py and transformers' training_args.py.
@pytest.mark.parametrize("version,column,value", [
    ("0.14.0", "default_per_device_train_batch_size", 1), ("0.14.0", "default_gradient_accumulation_steps", 8),
    ("0.14.0", "default_beta", 0.04), ("0.14.0", "batch_counts", "prompts"),
    ("0.14.0", "step_structure", "loss_merged"), ("0.16.0", "default_vllm_gpu_memory_utilization", None),
    ("0.26.0", "default_max_prompt_length", None), ("0.26.0", "accepts_max_prompt_length", True),
    ("0.28.0", "accepts_max_prompt_length", False), ("0.24.0", "liger", "layer_kernels"),
    ("0.15.0", "num_generations_rule", "global_batch"), ("0.17.0", "num_generations_rule", "effective_batch"),
    ("0.17.0", "generation_batch", "accumulation"), ("0.16.1", "generation_batch", "micro_batch"),
    ("0.18.0", "num_generations_rule", "generation_batch"), ("0.19.0", "default_mixed_precision", "bf16"),
    ("0.18.2", "default_mixed_precision", "no"), ("0.22.0", "default_gradient_checkpointing", True),
    ("0.21.0", "default_gradient_checkpointing", False), ("0.19.1", "default_optim", "adamw_torch"),
    ("0.20.0", "default_optim", "adamw_torch_fused"), ("0.29.1", "default_vllm_mode", "server"),
    ("1.0.0", "default_vllm_mode", "colocate"), ("1.9.2", "default_max_completion_length", 256),
    ("1.10.0", "default_max_completion_length", 512), ("0.27.1", "transformers_major", 4),
    ("0.27.2", "transformers_major", 5), ("1.13.0", "liger", "fused_loss"), ("1.14.0", "liger", "chunked_logprobs"),
    ("1.15.0", "lm_head", "fused_chunked"), ("1.14.2", "lm_head", "full_logits"),
    # the log-prob method's own lines: per-row log_softmax (0.14), `logits / self.temperature` (0.16),
    # `logits.div_(self.temperature)` (1.0), the same division while `outputs` keeps the model's output (1.10), the
    # kernel that takes the temperature (1.14)
    ("0.14.0", "full_logits_log_probs", "rows"), ("0.15.2", "full_logits_log_probs", "rows"),
    ("0.16.0", "full_logits_log_probs", "scaled_copy"), ("0.29.1", "full_logits_log_probs", "scaled_copy"),
    ("1.0.0", "full_logits_log_probs", "scaled_in_place"), ("1.9.2", "full_logits_log_probs", "scaled_in_place"),
    ("1.10.0", "full_logits_log_probs", "scaled_copy_beside_output"), ("1.14.0", "full_logits_log_probs", "kernel"),
    ("0.14.0", "logits_to_keep_argument", "num_logits_to_keep"), ("0.15.0", "logits_to_keep_argument",
                                                                   "logits_to_keep"),
    # model_inputs["use_cache"] = False  # only used in generation; set False to suppress warnings (0.22.0 on)
    ("0.21.0", "log_prob_forward_cache", "model_default"), ("0.22.0", "log_prob_forward_cache", "off"),
    # 0.14.0: model(input_ids, num_logits_to_keep=num_logits_to_keep + 1); 0.15.0: model(input_ids=...,
    # attention_mask=attention_mask, ...)
    ("0.14.0", "log_prob_attention_mask", "none"), ("0.15.0", "log_prob_attention_mask", "passed"),
    ("1.16.0", "log_prob_attention_mask", "passed"),
    # utils.py entropy_from_logits: `for logits_chunk in logits.split(chunk_size, dim=0)` (0.20), `flat_logits =
    # logits.reshape(-1, num_classes)` (0.23); the trainer calls it no more once 1.14's kernel computes entropies
    ("0.19.1", "training_entropy", "none"), ("0.20.0", "training_entropy", "per_sequence"),
    ("0.22.2", "training_entropy", "per_sequence"), ("0.23.0", "training_entropy", "flat_rows"),
    ("1.13.0", "training_entropy", "flat_rows"), ("1.14.0", "training_entropy", "none"),
    # trl/models/utils.py add_hooks: `coordinator._invalidate_trace()` from 1.5.0; 0.14.0 has add_hooks without it
    ("0.14.0", "zero3_trace_kept_across_generation", True), ("1.4.0", "zero3_trace_kept_across_generation", True),
    ("1.5.0", "zero3_trace_kept_across_generation", False), ("1.16.0", "zero3_trace_kept_across_generation", False),
    # LoRA + checkpointing: `model.enable_input_require_grads()` in _enable_gradient_checkpointing (0.16.0), through
    # prepare_peft_model (0.22.0), in __init__ (0.26.0); GRPOConfig.__post_init__'s setdefault("use_reentrant", False)
    # (0.27.0); `args.gradient_checkpointing_kwargs["use_reentrant"] = True` for PEFT + ZeRO-3 (1.9.0)
    ("0.15.2", "checkpointing_input_grads", False), ("0.16.0", "checkpointing_input_grads", True),
    ("0.22.0", "checkpointing_input_grads", True), ("0.26.0", "checkpointing_input_grads", True),
    ("0.26.2", "checkpointing_reentrant", True), ("0.27.0", "checkpointing_reentrant", False),
    ("1.16.0", "checkpointing_reentrant", False), ("1.8.0", "peft_zero3_reentrant", False),
    ("1.9.0", "peft_zero3_reentrant", True), ("1.16.0", "peft_zero3_reentrant", True),
    # generate()'s sampling: 0.14 passes temperature=0.9 alone, so transformers 4.48's GenerationConfig keeps
    # `kwargs.pop("top_k", 50)`; GRPOConfig's top_k 50 (0.16), None (0.18), 0 (0.27)
    ("0.14.0", "default_temperature", 0.9), ("0.14.0", "default_top_k", 50),
    ("0.15.2", "accepts_sampling_filters", False), ("0.16.0", "accepts_sampling_filters", True),
    ("0.17.0", "default_top_k", 50), ("0.17.0", "default_temperature", 0.9),
    ("0.18.0", "default_temperature", 1.0), ("0.18.0", "default_top_k", 0), ("0.27.0", "default_top_k", 0),
])
def test_extracted_facts_hold_what_the_source_says(version, column, value):
    facts = next(r for r in FACTS["releases"] if r["version"] == version)
    assert script.COLUMNS[column](facts) == value


@pytest.mark.parametrize("facts", FACTS["releases"], ids=lambda facts: facts["version"])
def test_table_row_agrees_with_the_release(facts):
    assert script.disagreements({"releases": [facts]}) == []


def test_the_fused_head_releases_have_no_full_logits_to_compare():
    fused = [r for r in FACTS["releases"] if r["behaviour"]["lm_head"] == "fused_chunked"]
    assert fused and all(script.COLUMNS["full_logits_log_probs"](r) is script.SKIP for r in fused)
