"""vLLM's start-up budget as vLLM 0.22-0.31 works it out for what TRL passes (vram_planner/model/vllm.py), computed
by hand for a dense model, a GQA model, 4-bit weights and tensor parallelism, and what it decides: start or not."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vram_planner import engine
from vram_planner.errors import ConfigError
from vram_planner.model import vllm
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.calibration import Calibration
from vram_planner.model.phases import estimate
from vram_planner.model.spec import as_settings, training_config
from vram_planner.model.trl_releases import trl_release
from vram_planner.model.verdict import check_training
from vram_planner.units import GiB, MiB

CAPACITY = 80 * GiB
CONTEXT = 0.5 * GiB
# Llama-2-7B's shape: 32 layers of 4096, MLP 11008, 32 heads of 128, 32000 tokens, untied, 4096 positions.
SEVEN_B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
           "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
           "tie_word_embeddings": False, "max_position_embeddings": 4096}
DENSE = ModelArchitecture.from_config(SEVEN_B, name="dense-7b")
GQA = ModelArchitecture.from_config({**SEVEN_B, "num_key_value_heads": 8}, name="gqa-7b")

# Shared by the hand computations below (TRL 1.16 defaults: B=8, S=GA=1, prompt 256 + completion 512 = 768 tokens).
NON_TORCH = int(0.3 * GiB)
# Profile run, 4096 tokens of bf16: residual and hidden stream (2 x 4096) plus gate/up and the activation
# (3 x 11008) per token, larger than q/k/v and the attention output: 4096 x 2 x (8192 + 33024)
FORWARD_4096 = 337_641_472
# CUDA graphs for max_num_seqs 8: capture sizes 1, 2, 4, 8, 16 (up to 2 x 8) piecewise, 1, 2, 4, 8 full: 9 x 24 MiB
GRAPHS_8 = 9 * 24 * MiB


def colocated(arch, capacity=CAPACITY, **knobs):
    train = training_config({"use_vllm": True, "dtype": "bfloat16", **knobs})
    return vllm.colocated_budget(arch, train, capacity, CONTEXT, "test card")


def test_a_dense_model_budget_by_hand():
    b = colocated(DENSE)
    # 6,738,415,616 parameters (Llama-2-7B) in bf16, whatever dtype the trainer loads
    assert b.weights_bytes == 2 * 6_738_415_616
    # one token: 32 layers x keys and values x 32 heads x 128 x 2 bytes = 512 KiB; 768 tokens = 48 blocks of 16
    assert b.sequence_bytes == 768 * 512 * 1024
    assert b.max_num_seqs == 8 and b.batch_sequences == 8
    assert b.kv_cache_bytes == 8 * 768 * 512 * 1024
    # TRL 1.16 leaves max_model_len to vLLM, which takes the config's 4096 positions
    assert b.max_model_len == 4096 and b.one_sequence_bytes == 4096 * 512 * 1024
    assert b.activation_bytes == FORWARD_4096
    assert b.cuda_graph_bytes == GRAPHS_8 and b.non_torch_bytes == NON_TORCH
    requested = math.ceil(0.3 * CAPACITY)
    assert b.reservation_bytes == requested
    left = requested - (2 * 6_738_415_616 + FORWARD_4096 + GRAPHS_8 + NON_TORCH)
    assert b.kv_available_bytes == left
    assert b.kv_capacity_sequences == left // (768 * 512 * 1024) == 28
    assert b.problem is None


def test_gqa_shrinks_the_kv_cache_and_the_key_value_weights():
    b = colocated(GQA)
    # k and v project to 8 x 128: 4096 x 1024 each instead of 4096 x 4096
    assert b.weights_bytes == 2 * 5_933_109_248
    assert b.sequence_bytes == 768 * 128 * 1024  # 32 layers x 2 x 8 heads x 128 x 2 bytes per token
    assert b.kv_cache_bytes == 8 * 768 * 128 * 1024
    assert b.activation_bytes == FORWARD_4096  # the MLP, not attention, sets the profile's peak


def test_four_bit_weights_are_quantized_in_flight_except_embeddings_and_norms():
    b = colocated(GQA, lora_r=16, load_in_4bit=True)
    linear = 5_670_699_008  # decoder linears: 32 x (2 x 4096^2 + 2 x 4096 x 1024 + 3 x 4096 x 11008)
    nf4 = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4 bits, absmax per 64 in 8 bits, one fp32 per 256 absmax (double quant)
    assert b.weights_bytes == pytest.approx(linear * nf4 + (5_933_109_248 - linear) * 2, abs=1)


def test_tensor_parallel_splits_weights_kv_heads_and_the_mlp_and_widens_max_num_seqs():
    b = colocated(GQA, num_gpus=2, vllm_tensor_parallel_size=2)
    norms = (32 * 2 + 1) * 4096  # replicated on each rank
    assert b.weights_bytes == (5_933_109_248 - norms) * 2 / 2 + norms * 2
    assert b.sequence_bytes == 768 * 64 * 1024  # 4 KV heads per rank
    # TRL: max_num_seqs = B x vllm_tensor_parallel_size x steps_per_generation
    assert b.max_num_seqs == 16 and b.kv_cache_bytes == 16 * 768 * 64 * 1024
    # half the MLP per rank: 4096 x 2 x (8192 + 3 x 11008 / 2)
    assert b.activation_bytes == 4096 * 2 * (8192 + 16512)
    # capture sizes 1, 2, 4, 8, 16, 24, 32 piecewise and 1, 2, 4, 8, 16 full
    assert b.cuda_graph_bytes == 12 * 24 * MiB
    # vLLM's TP communicators are set up before its memory snapshot: outside this term (model/vllm_comm.py)
    assert b.non_torch_bytes == NON_TORCH


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    one_head = ModelArchitecture.from_config({**SEVEN_B, "num_key_value_heads": 1})
    assert vllm.kv_heads(one_head, 4) == 1 and vllm.kv_heads(GQA, 4) == 2


def test_the_sampler_sets_the_profile_peak_for_many_sequences_over_a_large_vocabulary():
    big_vocab = ModelArchitecture.from_config({**SEVEN_B, "vocab_size": 128256})
    rows = 512
    # the forward's 4096 tokens of hidden stream stay; each logit in bf16 plus four float32 copies
    sampler = 4096 * 4096 * 2 + 2 * rows * 4096 * 2 + rows * 128256 * (2 + 16)
    assert vllm.profile_activation_bytes(big_vocab, 4096, rows, 1, 2) == sampler > FORWARD_4096


def test_sliding_window_layers_keep_only_their_window_and_the_chunk():
    config = {**SEVEN_B, "model_type": "mistral", "num_hidden_layers": 4, "sliding_window": 100,
              "layer_types": ["sliding_attention", "full_attention"] * 2}
    arch = ModelArchitecture.from_config(config)
    assert arch.sliding_layers == 2
    page = 2 * 16 * 32 * 128 * 2
    # full layers: cdiv(5000, 16) = 313 blocks; sliding: cdiv(min(99 + 4096, 5000), 16) + 1 = 264
    assert vllm.request_kv_bytes(arch, 5000, 1, 2, 4096) == (2 * 313 + 2 * 264) * page


def test_too_small_a_share_cannot_start_and_the_reason_names_the_smallest_that_works():
    b = colocated(DENSE, vllm_gpu_memory_utilization=0.1)
    assert b.kv_available_bytes < 0
    smallest = b.min_gpu_memory_utilization
    # weights, profile, graphs and non-torch memory, then one sequence of 4096 tokens, as a share rounded up
    need = (b.non_kv_bytes + 4096 * 512 * 1024) / CAPACITY
    assert smallest == math.ceil(need * 100) / 100
    assert "--vllm-gpu-memory-utilization 0.1" in b.problem and f"smallest value that works is {smallest}" in b.problem
    assert colocated(DENSE, vllm_gpu_memory_utilization=smallest).problem is None
    short = colocated(DENSE, vllm_gpu_memory_utilization=round(smallest - 0.01, 2))
    assert "cannot hold one sequence of max_model_len 4096" in short.problem


def test_vllm_refuses_more_than_the_memory_free_when_it_starts():
    # the trainer's float32 weights (27 GiB; and the rotary embedding's two frequency buffers, a 512-byte block
    # each) and its CUDA context are on the card before vLLM starts
    b = colocated(DENSE, dtype="float32", vllm_gpu_memory_utilization=0.9)
    assert b.free_at_start_bytes == CAPACITY - CONTEXT - 4 * 6_738_415_616 - 2 * 512
    assert b.problem.startswith("vLLM refuses to start: --vllm-gpu-memory-utilization 0.9 asks for")
    assert b.recommended_gpu_memory_utilization is not None  # a smaller share still works


def test_the_recommendation_is_the_smallest_multiple_of_005_holding_the_round():
    b = colocated(DENSE, vllm_gpu_memory_utilization=0.9)
    recommended = b.recommended_gpu_memory_utilization
    assert round(recommended / 0.05, 9) == int(round(recommended / 0.05))
    enough = colocated(DENSE, vllm_gpu_memory_utilization=recommended)
    assert enough.problem is None and enough.kv_capacity_sequences >= enough.max_num_seqs
    less = colocated(DENSE, vllm_gpu_memory_utilization=round(recommended - 0.05, 2))
    assert less.problem is not None or less.kv_capacity_sequences < less.max_num_seqs


def test_fewer_sequences_than_a_round_is_a_warning_not_a_refusal():
    arch = ModelArchitecture.from_config({**SEVEN_B, "max_position_embeddings": 1024})
    train = training_config({"use_vllm": True, "dtype": "bfloat16", "vllm_gpu_memory_utilization": 0.2,
                             "per_device_train_batch_size": 64, "num_generations": 8})
    est = estimate(arch, train, trl_release("1.16.0"), Calibration(), CAPACITY)
    assert est.vllm.problem is None and est.vllm.kv_capacity_sequences < est.vllm.max_num_seqs == 64
    assert any(n.startswith("warning: vLLM's KV cache holds") and "queues the rest" in n for n in est.notes)


def test_the_training_gpu_carries_the_budget_and_sleep_mode_leaves_graphs_and_non_torch_memory():
    train = training_config({"use_vllm": True, "dtype": "bfloat16", "vllm_enable_sleep_mode": True})
    est = estimate(GQA, train, trl_release("1.16.0"), Calibration(), CAPACITY)
    awake = math.ceil(0.3 * CAPACITY)
    by_phase = {p.name: p.components["vllm_reservation"] for p in est.phases}
    assert by_phase.pop("generation") == awake  # woken whole: weights re-sent, KV cache re-created
    assert set(by_phase.values()) == {GRAPHS_8 + NON_TORCH}
    # level 2 (TRL 0.25 and later): only the model's buffers (the rotary cache) go to host RAM
    assert est.vllm.sleep_level == 2 and est.vllm.host_bytes == 4096 * 128 * 2
    assert any("sleep mode (level 2)" in n for n in est.notes)
    older = vllm.colocated_budget(GQA, training_config({**as_settings(train), "trl_version": "0.23.0"}), CAPACITY,
                                  CONTEXT)
    assert older.sleep_level == 1 and older.host_bytes == older.weights_bytes + 4096 * 128 * 2


def test_older_trl_releases_pass_what_they_passed():
    base = {"use_vllm": True, "vllm_mode": "colocate", "dtype": "bfloat16", "gradient_accumulation_steps": 2,
            "steps_per_generation": 4, "per_device_train_batch_size": 4, "num_generations": 4}
    # 0.18: max_num_seqs counted gradient_accumulation_steps, max_model_len was prompt + completion, and
    # max_num_batched_tokens was vLLM's LLM() default (16384 on a card of 70 GiB or more)
    b = vllm.colocated_budget(GQA, training_config({**base, "trl_version": "0.18.0"}), CAPACITY, CONTEXT, "H100")
    assert (b.max_num_seqs, b.max_model_len, b.max_num_batched_tokens) == (8, 768, 16384)
    b = vllm.colocated_budget(GQA, training_config({**base, "trl_version": "0.25.0"}), CAPACITY, CONTEXT)
    assert (b.max_num_seqs, b.max_model_len, b.max_num_batched_tokens) == (16, 768, 4096)
    # before 0.18 vLLM had a GPU of its own: the training card holds none of it
    train = training_config({"use_vllm": True, "trl_version": "0.17.0", "num_generations": 8})
    assert vllm.colocated_budget(GQA, train, CAPACITY, CONTEXT) is None
    assert "on a GPU of its own" in vllm.budget_notes(None, train)[0]


def test_server_mode_plans_the_servers_card_as_trl_vllm_serve_starts_it():
    train = training_config({"use_vllm": True, "vllm_mode": "server", "vllm_server_gpu": "h100-80gb",
                             "dtype": "bfloat16"})
    est = estimate(GQA, train, trl_release("1.16.0"), Calibration(), CAPACITY)
    assert all(p.components["vllm_reservation"] == 0 for p in est.phases)  # the training card holds no vLLM
    b = est.vllm
    assert b.mode == "server" and b.gpu_memory_utilization == 0.9
    # vllm serve's defaults on an H100: 1024 sequences, 8192 batched tokens; a round of 8 runs at once
    assert (b.max_num_seqs, b.max_num_batched_tokens, b.batch_sequences) == (1024, 8192, 8)
    assert b.problem is None
    small = training_config({**as_settings(train), "vllm_server_gpu": "rtx4060-ti-8gb"})
    assert "vLLM cannot start" in vllm.server_budget(GQA, small, CONTEXT).problem  # 11 GiB of weights on 8 GiB


def test_the_config_rules_of_the_vllm_knobs():
    def problems(**knobs):
        with pytest.raises(ConfigError) as caught:
            training_config(knobs)
        return str(caught.value)

    assert "vllm_tensor_parallel_size need" in problems(vllm_tensor_parallel_size=2)
    assert "must divide the number of processes" in problems(use_vllm=True, vllm_tensor_parallel_size=2)
    assert "not a GRPOConfig field in TRL 0.25.0" in problems(use_vllm=True, vllm_max_model_length=1024,
                                                              trl_version="0.25.0")
    assert "vllm_enable_sleep_mode is not a GRPOConfig field in TRL 0.22.0" in problems(
        use_vllm=True, vllm_enable_sleep_mode=True, trl_version="0.22.0")
    assert "it needs vllm_mode server" in problems(use_vllm=True, vllm_server_gpu="h100")
    assert "shorter than the longest prompt" in problems(use_vllm=True, vllm_max_model_length=100)
    train = training_config({"use_vllm": True, "num_gpus": 3, "vllm_tensor_parallel_size": 3})
    assert "attention heads (32) divisible" in vllm.vllm_config_problems(train, GQA)[0]
    long = training_config({"use_vllm": True, "vllm_max_model_length": 8192})
    assert "exceeds the model's context (4096 tokens)" in vllm.vllm_config_problems(long, GQA)[0]


def test_the_context_vllm_derives_follows_rope_scaling():
    def context(**extra):
        return ModelArchitecture.from_config({**SEVEN_B, **extra}).context_length

    assert context() == 4096
    assert context(rope_scaling={"rope_type": "llama3", "factor": 8.0}) == 4096  # already the scaled figure
    assert context(rope_scaling={"type": "linear", "factor": 2.0}) == 8192
    assert context(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}) == 8192
    assert context(rope_scaling={"type": "longrope", "long_factor": [1.0]}, original_max_position_embeddings=1024) \
        == 1024


def test_a_trainer_that_fills_the_card_alone_is_said_so_not_as_negative_free_memory():
    problem = engine.check("Qwen2.5-3B", "rtx2060", {"use_vllm": True}).estimate.vllm.problem
    assert "the trainer's CUDA context and weights already take" in problem
    assert not re.search(r"-\d+(\.\d+)? GiB", problem)


def test_a_larger_vllm_share_is_a_cost_not_a_negative_saving():
    # 8 GiB: vLLM's round needs 0.45 of the card, not TRL's 0.3; the trainer then has 0.15 x 8 GiB less
    plan = engine.plan("Llama-3.2-1B", "8GiB", {"use_vllm": True})
    assert plan.fits
    # with vLLM's context, prompt + completion, which alone saves nothing: the model's whole context would need more
    share = next(c for c in plan.changes if c.knob == "vllm_max_model_length + vllm_gpu_memory_utilization")
    assert (share.before, share.after) == ("None, 0.3", "768, 0.45")
    assert share.settings == {"vllm_max_model_length": 768, "vllm_gpu_memory_utilization": 0.45}
    assert share.saved_bytes == 0 and share.cost_bytes == math.ceil(0.45 * 8 * GiB) - math.ceil(0.3 * 8 * GiB)
    assert all(c.saved_bytes >= 0 and c.cost_bytes == 0 for c in plan.changes if c is not share)
    net = sum(c.saved_bytes - c.cost_bytes for c in plan.changes)
    assert plan.requested.estimate.peak_bytes - net == pytest.approx(plan.chosen.estimate.peak_bytes)


def test_prompt_and_completion_beyond_vllms_context_are_refused_with_vllms_reason():
    arch = engine.make_context("Llama-3.2-1B", "a40").arch

    def problems(**knobs):
        return vllm.vllm_config_problems(training_config({"use_vllm": True, **knobs}), arch)

    # 256 + 768 tokens is exactly vLLM's context of 1024: one token more is not
    assert problems(vllm_max_model_length=1024, max_completion_length=768) == []
    [colocated] = problems(vllm_max_model_length=1024, max_completion_length=769)
    assert colocated.startswith("--max-prompt-length 256 + --max-completion-length 769 = 1025 tokens exceed "
                                "--vllm-max-model-length 1024")
    assert "vLLM stops each sequence at 1024 tokens, so no completion reaches 769 tokens" in colocated
    assert colocated.endswith("use --vllm-max-model-length 1025 or more, or --max-completion-length 768 or less")
    [server] = problems(vllm_max_model_length=1024, max_completion_length=4714, vllm_mode="server")
    assert "vLLM's server refuses every such request (\"This model's maximum context length is 1024 tokens\"" in server
    [whole_prompt] = problems(vllm_max_model_length=256)  # the prompt leaves no room for one token
    assert "The decoder prompt (length 256) plus the number of requested output tokens (at least 1) is longer than " \
           "the maximum model length of 256" in whole_prompt and "--max-completion-length" not in whole_prompt.split(
               "; use ")[1]
    # beyond the model's own context no --vllm-max-model-length helps: only shorter lengths do
    [too_long] = problems(vllm_max_model_length=131072, max_prompt_length=1000, max_completion_length=130100)
    assert too_long.endswith("use --max-completion-length 130072 or less")
    assert problems(max_completion_length=4714) == []  # no --vllm-max-model-length: vLLM derives the model's context


@settings(deadline=None, derandomize=True, database=None, max_examples=60,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(model=st.sampled_from(["Llama-3.2-1B", "Qwen2.5-0.5B", "gemma-3-1b-it"]),
       card=st.sampled_from(["6GiB", "8GiB", "rtx4090", "a40"]), prompt=st.integers(1, 3000),
       completion=st.integers(1, 6000), slack=st.integers(-64, 4000), server=st.booleans())
def test_the_plan_never_proposes_what_vllms_context_cannot_hold(model, card, prompt, completion, slack, server):
    context = max(2, prompt + completion + slack)  # around the boundary, mostly within it
    knobs = {"use_vllm": True, "vllm_max_model_length": context, "max_prompt_length": prompt,
             "max_completion_length": completion, **({"vllm_mode": "server"} if server else {})}
    try:
        plan = engine.plan(model, card, knobs)
    except ConfigError as error:
        assume("exceed --vllm-max-model-length" not in str(error) and prompt + completion <= context)
        raise  # prompt + completion within vLLM's context: nothing else here is a reason to refuse
    assert prompt + completion <= context, "planned a config vLLM cannot generate"
    for verdict in (plan.chosen, plan.smallest):
        if verdict is not None:
            check_training(verdict.train, verdict.context)  # vLLM takes what the plan prints
            assert verdict.train.sequence_length <= context
