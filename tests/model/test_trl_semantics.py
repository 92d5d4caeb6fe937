"""Each semantic difference between TRL releases, computed by hand from the release's source (profiles/trl.toml;
benchmarks/results/trl_releases.json holds what the wheels say)."""

from __future__ import annotations

import json

import pytest

from helpers import CURRENT, LLAMA_1B, one_line_error, run
from vram_planner import engine
from vram_planner.errors import ConfigError
from vram_planner.model.grpo_config import grpo_config_kwargs, python_snippet
from vram_planner.model.spec import TrainingConfig, training_config

V = LLAMA_1B["vocab_size"]
# The seeds' laptop run (TRL 0.14): one prompt per micro-batch, four generations each.
SEEDS = dict(per_device_train_batch_size=1, gradient_accumulation_steps=4, num_generations=4, max_prompt_length=256,
             max_completion_length=786, dtype="bfloat16")
SEEDS_FLAGS = ["--per-device-train-batch-size", "1", "--gradient-accumulation-steps", "4", "--num-generations", "4",
               "--max-prompt-length", "256", "--max-completion-length", "786", "--dtype", "bfloat16"]


def check(llama_1b_file, settings, version, gpu="rtx4090"):
    return engine.check(str(llama_1b_file), gpu, settings, trl_version=version)


def test_0_14_batch_counts_prompts(llama_1b_file):
    old = check(llama_1b_file, SEEDS, "0.14.0")
    assert old.train.micro_batch_completions == 1 * 4 and old.train.local_generation_batch_size == 4
    # 0.15 counts completions: the same 4 completions per micro-batch are asked for with B = 4
    new = check(llama_1b_file, {**SEEDS, "per_device_train_batch_size": 4}, "0.15.0")
    assert new.train.micro_batch_completions == 4
    assert old.estimate.phases[0].components["kv_cache"] == new.estimate.phases[0].components["kv_cache"]
    assert ("TRL 0.14.0: per_device_train_batch_size counts prompts: 1 prompt x 4 generations = 4 completions per "
            "micro-batch") in old.estimate.notes


@pytest.mark.parametrize(("transformers", "positions"), [
    ("4.48.2", 787),  # honours num_logits_to_keep: the completion's 786 positions + 1
    ("4.51.3", 787),  # renames it to logits_to_keep (@deprecate_kwarg)
    ("4.52.0", 256 + 786),  # drops it into **kwargs: every position of prompt + completion
    ("4.57.1", 256 + 786),
])
def test_0_14_merges_both_log_prob_passes_into_the_loss(llama_1b_file, transformers, positions):
    verdict = check(llama_1b_file, {**SEEDS, "mixed_precision": "bf16", "transformers_version": transformers},
                    "0.14.0")
    assert [p.name for p in verdict.estimate.phases] == ["generation", "training", "optimizer"]  # no scoring phase
    training = verdict.estimate.phases[1]
    assert training.moment == "reference log-probs while the policy's graph is alive"
    # 4 completions: every row's fp32 log_softmax is kept for backward (4 x (positions - 1) x V x 4 B); the
    # reference's bf16 logits and accelerate's fp32 copy (6 B each), and the KV cache its output holds (0.14 leaves
    # use_cache on without checkpointing): bf16 keys and values of 4 x (256 + 786) tokens in every layer. One row's
    # log_softmax comes after the output is gone, beside the fp32 copy alone (4 B a logit), which is less.
    rows, converting = 4 * (positions - 1) * V * 4, 4 * positions * V * (2 + 4)
    assert training.components["lm_head_buffers"] == rows + converting
    kv = 4 * (256 + 786) * LLAMA_1B["num_hidden_layers"] * 2 * LLAMA_1B["num_key_value_heads"] * 64 * 2
    # from 4.56 the policy's forward keeps its keys and values for backward in its own cache's copies (SDPA reads
    # them), which the KV cache counts beside the reference's (phases._policy_cache_saved_bytes)
    assert training.components["kv_cache"] == kv * (2 if transformers == "4.57.1" else 1)
    assert 4 * positions * V * 4 + (positions - 1) * V * 4 < converting + kv
    # the reference's weights are loaded whatever beta (until 0.16) and stay beside the policy's graph
    assert training.components["reference_weights"] > 0
    dropped = [n for n in verdict.estimate.notes if "ignores the num_logits_to_keep" in n]
    assert bool(dropped) is (positions == 256 + 786)


def test_0_15_passes_logits_to_keep_which_transformers_4_48_drops(llama_1b_file):
    """TRL 0.15 asks with logits_to_keep, which 4.48 has no argument for: its logits cover the whole sequence (and
    TRL slices them afterwards); 4.49 on honours it."""
    knobs = {**SEEDS, "per_device_train_batch_size": 4, "mixed_precision": "bf16"}
    heads = {}
    for transformers in ("4.48.2", "4.49.0", "4.52.0"):
        training = check(llama_1b_file, {**knobs, "transformers_version": transformers}, "0.15.0").estimate.phases
        heads[transformers] = next(p for p in training if p.name == "training")
    from vram_planner.model.lm_head import full_logits_bytes
    from vram_planner.model.spec import TrainingConfig

    train = TrainingConfig(**knobs, trl_version="0.15.0")
    forward_bytes = full_logits_bytes(train, train.release)[0]
    assert forward_bytes == 2 + 4  # the bf16 logits and accelerate's fp32 copy of them

    forward = {t: p.components["lm_head_buffers"] for t, p in heads.items()
               if p.moment == "forward: LM head"}
    assert heads["4.49.0"].components == heads["4.52.0"].components
    assert heads["4.48.2"].total_bytes > heads["4.49.0"].total_bytes
    for transformers, buffers in forward.items():
        positions = 256 + 786 if transformers == "4.48.2" else 787
        assert buffers == 4 * positions * V * forward_bytes


def test_without_autocast_the_logits_keep_the_weights_dtype(llama_1b_file):
    # 0.14's default: bf16=False, so bf16 weights compute in bf16; 4.48 honours num_logits_to_keep
    verdict = check(llama_1b_file, {**SEEDS, "transformers_version": "4.48"}, "0.14.0")
    training = verdict.estimate.phases[1]
    rows, logits, one_row = 4 * 786 * V * 2, 4 * 787 * V * 2, 786 * V * 2
    # the loop's variable keeps the previous row's log_softmax while the next one is made
    assert training.components["lm_head_buffers"] == rows + logits + 2 * one_row


@pytest.mark.parametrize("version,knobs,accepted", [
    ("0.14.0", {"per_device_train_batch_size": 3, "num_generations": 4}, True),  # 3 prompts x 4 completions
    ("0.15.0", {"per_device_train_batch_size": 4, "num_generations": 4}, True),
    ("0.15.0", {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "num_generations": 4}, False),
    ("0.16.1", {"per_device_train_batch_size": 6, "num_generations": 4}, False),
    ("0.17.0", {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "num_generations": 4}, True),
    ("0.17.0", {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "num_generations": 4}, False),
    ("0.18.0", {"per_device_train_batch_size": 2, "steps_per_generation": 2, "num_generations": 4}, True),
    ("0.18.0", {"per_device_train_batch_size": 2, "steps_per_generation": 3, "num_generations": 4}, False),
])
def test_each_release_applies_its_own_num_generations_rule(version, knobs, accepted):
    if accepted:
        training_config({**knobs, "trl_version": version})
        return
    with pytest.raises(ConfigError) as caught:
        training_config({**knobs, "trl_version": version})
    b, ga, s = knobs["per_device_train_batch_size"], knobs.get("gradient_accumulation_steps", 1), \
        knobs.get("steps_per_generation")
    expected = {"0.15.0": f"global train batch size (1 x {b})", "0.16.1": f"global train batch size (1 x {b})",
                "0.17.0": f"effective train batch size (1 x {b} x {ga})",
                "0.18.0": f"generation batch size (1 x {b} x {s})"}[version]
    (problem,) = caught.value.problems
    assert problem.startswith(f"TRL {version} refuses it: the {expected} must be evenly divisible by the number of "
                              "generations per prompt (4)")


def test_steps_per_generation_does_not_exist_before_0_18():
    with pytest.raises(ConfigError, match="steps_per_generation is not a GRPOConfig field in TRL 0.17.0"):
        training_config({"steps_per_generation": 2, "num_generations": 2, "trl_version": "0.17.0"})


def test_the_generation_batch_spans_accumulation_from_0_17(llama_1b_file):
    knobs = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4, "num_generations": 4}
    per_micro_batch, spanning = check(llama_1b_file, knobs, "0.16.1"), check(llama_1b_file, knobs, "0.17.0")
    assert per_micro_batch.train.local_generation_batch_size == 4 and spanning.train.local_generation_batch_size == 16
    before, after = per_micro_batch.estimate.phases[0], spanning.estimate.phases[0]
    assert before.moment == after.moment and after.components["kv_cache"] == 4 * before.components["kv_cache"]
    # 0.16 generates inside every micro-batch, from the second on next to the accumulated gradients (as the trace
    # finds: benchmarks/trl_matrix.py); 0.17 generates once, before any micro-batch's backward
    optimizer = next(p for p in per_micro_batch.estimate.phases if p.name == "optimizer")
    assert before.components["gradients"] == optimizer.components["gradients"] > 0
    assert after.components["gradients"] == 0


@pytest.mark.parametrize("version,knobs,old_logps", [
    ("0.15.2", {"num_iterations": 2}, False),  # no old log-probs before 0.16
    ("0.16.0", {"num_iterations": 2}, True),
    ("0.16.0", {}, False),
    ("0.18.0", {"steps_per_generation": 8, "gradient_accumulation_steps": 4}, True),  # S > GA
    ("0.20.0", {"steps_per_generation": 8, "gradient_accumulation_steps": 4}, True),  # 4 % 8 != 0
    ("0.20.0", {"steps_per_generation": 2, "gradient_accumulation_steps": 4}, False),
    ("0.19.1", {"steps_per_generation": 2, "gradient_accumulation_steps": 4, "num_iterations": 1}, False),
    ("0.22.2", {"use_vllm": True}, False),  # importance sampling for vLLM came in 0.23
    ("0.23.0", {"use_vllm": True}, True),
])
def test_old_log_probs_follow_each_release(version, knobs, old_logps):
    train = training_config({"per_device_train_batch_size": 4, "num_generations": 4, **knobs, "trl_version": version})
    assert train.computes_old_logps is old_logps


@pytest.mark.parametrize("version,reference", [("0.14.0", True), ("0.15.2", True), ("0.16.0", False)])
def test_the_reference_model_is_loaded_with_beta_0_until_0_16(llama_1b_file, version, reference):
    verdict = check(llama_1b_file, {"beta": 0.0, "per_device_train_batch_size": 4, "num_generations": 4}, version)
    assert (verdict.estimate.phases[-1].components["reference_weights"] > 0) is reference


@pytest.mark.parametrize("version,expected", [
    ("0.14.0", dict(per_device_train_batch_size=1, gradient_accumulation_steps=8, gradient_checkpointing=False,
                    mixed_precision="no", beta=0.04, max_prompt_length=512, max_completion_length=256,
                    optim="adamw_torch")),
    ("0.15.2", dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, mixed_precision="no", beta=0.04)),
    ("0.19.0", dict(mixed_precision="bf16", beta=0.0, gradient_checkpointing=False, optim="adamw_torch")),
    ("0.20.0", dict(optim="adamw_torch_fused", gradient_checkpointing=False)),
    ("0.22.0", dict(gradient_checkpointing=True, max_prompt_length=512)),
    ("0.26.0", dict(max_prompt_length=256)),  # deprecated, read by nothing: the longest prompt, our own default
    ("1.9.2", dict(max_completion_length=256)),
    ("1.10.0", dict(max_completion_length=512)),
])
def test_unset_knobs_take_the_release_defaults(llama_1b_file, version, expected):
    train = check(llama_1b_file, {"num_generations": 8}, version).train
    actual = {key: getattr(train, key) for key in expected}
    assert {key: getattr(value, "value", value) for key, value in actual.items()} == expected


def test_the_printed_config_is_one_the_release_accepts():
    old = TrainingConfig(trl_version="0.25.1", num_generations=8)
    kwargs = grpo_config_kwargs(old)
    assert kwargs["max_prompt_length"] == 256 and kwargs["model_init_kwargs"] == {"torch_dtype": "float32"}
    assert "steps_per_generation" not in kwargs
    assert "(longer ones are truncated)" in python_snippet(old, "meta-llama/Llama-3.2-1B")
    new = grpo_config_kwargs(TrainingConfig(trl_version="0.28.0", num_generations=8))
    assert "max_prompt_length" not in new and new["model_init_kwargs"] == {"dtype": "float32"}
    # vllm_mode came in 0.18; before it vLLM ran on a GPU of its own
    vllm = dict(use_vllm=True, vllm_mode="server", num_generations=8)
    assert "vllm_mode" not in grpo_config_kwargs(TrainingConfig(trl_version="0.17.0", **vllm))
    assert grpo_config_kwargs(TrainingConfig(trl_version="0.18.0", **vllm))["vllm_mode"] == "server"


def test_transformers_before_4_53_builds_one_mask_for_all_layers(llama_1b_file):
    # The same TRL release on transformers 4.52 (its model's own _update_causal_mask: one shared float mask) and 4.53
    # (masking_utils' boolean mask, of which SDPA makes a float copy in each layer)
    knobs = {"gradient_checkpointing": False, "per_device_train_batch_size": 8, "max_prompt_length": 256,
             "max_completion_length": 256}
    tf4, tf5 = (check(llama_1b_file, {**knobs, "transformers_version": v}, "0.19.1") for v in ("4.52.4", "4.53.0"))
    length, layers = 512, LLAMA_1B["num_hidden_layers"]
    per_layer_rows = 8 * length * length * 2 * layers  # 4.53 on: each layer's bf16 mask [8, 1, 512, 512]
    shared = 8 * length * length * 4  # before 4.53: one mask in the float32 embeddings' dtype
    assert tf5.estimate.phases[-1].components == tf4.estimate.phases[-1].components  # the optimizer step: no masks
    first = {p.name: p for p in tf4.estimate.phases}["training"]
    assert first.moment == {p.name: p for p in tf5.estimate.phases}["training"].moment
    difference = ({p.name: p for p in tf5.estimate.phases}["training"].components["activations"]
                  - first.components["activations"])
    assert difference == per_layer_rows - shared


def test_a_config_file_names_the_release_and_the_flag_wins(capsys, llama_1b_file, tmp_path):
    settings = tmp_path / "run.yaml"
    settings.write_text("trl_version: 0.14.0\nper_device_train_batch_size: 1\nnum_generations: 4\n")
    code, out, _ = run(capsys, "check", "--gpu", "rtx4090", "--model", str(llama_1b_file), "--config", str(settings),
                       "--json")
    assert json.loads(out)["trl_version"] == "0.14.0"
    code, out, _ = run(capsys, "check", "--gpu", "rtx4090", "--model", str(llama_1b_file), "--config", str(settings),
                       "--trl-version", "0.15.0", "--per-device-train-batch-size", "4", "--json")
    assert json.loads(out)["trl_version"] == "0.15.0" and json.loads(out)["config"]["per_device_train_batch_size"] == 4


@pytest.mark.parametrize("mixed_precision", [[], ["--mixed-precision", "bf16"]])
def test_advise_names_the_0_14_logits_and_no_fix_saves_negative_memory(capsys, llama_1b_file, tmp_path,
                                                                        mixed_precision):
    # 1.90 GiB: float32 logits of 4 completions over Llama's vocabulary. Without autocast (0.14's default bf16=False)
    # bfloat16 weights give bfloat16 logits, so a float32 match says the run had mixed precision on.
    log = tmp_path / "crash.log"
    log.write_text(CURRENT + "\n")
    code, out, _ = run(capsys, "advise", str(log), "--gpu", "rtx3080-mobile", "--model", str(llama_1b_file),
                       *SEEDS_FLAGS, *mixed_precision, "--trl-version", "0.14.0", "--json")
    advice = json.loads(out)
    # transformers 4.56 (the newest 4.x planned) ignores num_logits_to_keep: the float32 copy spans prompt + completion
    assert code == 0 and advice["culprit"].startswith("accelerate's float32 copy of the policy's logits over the whole "
                                                      "prompt + completion")
    assert advice["culprit"].endswith(f"4 completions x 994 positions x {V} vocabulary entries x 4 B")
    assert ("most likely had bf16=True" in advice["culprit"]) is not mixed_precision
    assert advice["fixes"] and all(fix["saves_bytes"] is None or fix["saves_bytes"] > 0 for fix in advice["fixes"])
    # over the whole sequence the logits cost more than the fused head of the newer TRL in any case
    assert any(fix["change"].startswith("pip install 'trl>=") for fix in advice["fixes"])
    code, out, _ = run(capsys, "advise", str(log), "--gpu", "rtx3080-mobile", "--model", str(llama_1b_file),
                       *SEEDS_FLAGS, *mixed_precision, "--trl-version", "0.14.0", "--transformers-version", "4.48.2",
                       "--json")
    upgrade = [fix for fix in json.loads(out)["fixes"] if fix["change"].startswith("pip install 'trl>=")]
    # over the completion only (4.48 honours num_logits_to_keep): with autocast the newer TRL's fused head saves the
    # float32 logits; without it, its float32 head gradients cost less than the bfloat16 logits and the two rows
    # 0.14's reference loop holds at once (its variable keeps the previous row's log_softmax)
    assert upgrade and all(fix["saves_bytes"] > 0 for fix in upgrade)


def test_trace_refuses_another_release_in_one_line(capsys, llama_1b_file):
    err = one_line_error(capsys, "trace", "--model", str(llama_1b_file), "--gpu", "rtx4090", "--trl-version", "0.14.0",
                         "--per-device-train-batch-size", "1", "--num-generations", "2")
    assert "runs the installed TRL 1.16.0, not --trl-version 0.14.0" in err
    # and how to trace it: that release with a transformers the engine runs it with
    assert "install it with a transformers it runs with: transformers 4.48.0 to 4.x" in err


@pytest.mark.parametrize(("version", "cached"), [("0.15.0", True), ("0.22.0", False)])
def test_before_0_22_a_scoring_pass_keeps_its_chunks_kv_cache_unless_checkpointing_turned_it_off(llama_1b_file,
                                                                                              version, cached):
    # 0.15's log-prob forward keeps the model's use_cache, which TRL turns off only under gradient checkpointing; its
    # peak is the chunk's logits and their float32 copy, made while the forward's output holds the cache. 0.22 passes
    # use_cache=False. Gradient checkpointing changes nothing else in a no-grad pass.
    knobs = {"per_device_train_batch_size": 4, "num_generations": 4, "max_prompt_length": 256,
             "max_completion_length": 256, "beta": 0.04, "transformers_version": "4.56.2", "dtype": "bfloat16",
             "mixed_precision": "bf16"}
    on, off = ({p.name: p for p in check(llama_1b_file, {**knobs, "gradient_checkpointing": g}, version)
                .estimate.phases}["scoring"] for g in (False, True))
    kv = 4 * 512 * LLAMA_1B["num_hidden_layers"] * 2 * LLAMA_1B["num_key_value_heads"] * 64 * 2  # bf16 k and v
    assert on.components.get("kv_cache", 0) == (kv if cached else 0)
    assert off.components.get("kv_cache", 0) == 0
    assert on.tensor_bytes - off.tensor_bytes == (kv if cached else 0)
