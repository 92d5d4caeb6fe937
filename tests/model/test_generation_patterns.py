"""Generation's allocation patterns, held to the caching allocator model that replays them."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from helpers import catalog_architecture
from vram_planner import engine
from vram_planner.allocator import CachingAllocator
from vram_planner.allocator.sizes import K_LARGE_BUFFER, K_ROUND_LARGE, K_SMALL_SIZE, allocation_size
from vram_planner.model.calibration import default_calibration
from vram_planner.model.components import kv_cache_bytes
from vram_planner.model.fragmentation import largest_request_bytes, reserve_patterns
from vram_planner.model.generation_patterns import (CACHE_IN_LOSS_SEGMENTS, CACHE_IN_MICRO_BATCH_SEGMENTS,
                                                    CACHE_IN_PREFILL_SEGMENTS, DECODING_REPEATED_KV,
                                                    PREFILL_LARGEST_REQUEST, PREFILL_PATTERNS,
                                                    STATES_IN_DECODING_SEGMENTS, cache_in_loss_segment_bytes,
                                                    cache_in_micro_batch_segment_bytes, cache_in_prefill_segment_bytes,
                                                    decoding_repeated_kv_request_bytes, heaviest_prompt_length,
                                                    prefill_largest_request_bytes, states_in_decoding_segment_bytes)
from vram_planner.model.spec import Optimizer, TrainingConfig
from vram_planner.model.stranding import stranded_by_kept_inputs
from vram_planner.units import MiB



def test_the_kv_caches_last_blocks_strand_the_rest_of_the_losss_segments():
    # Phi-3-mini's LoRA with 16 sequences of 512 + 2,048 tokens, 8 a micro-batch: every layer keeps a 2,047-token
    # window, keys and values in bfloat16, 32 heads of 96: blocks of 16 x 32 x 96 x 2,047 x 2 bytes (192 MiB). The
    # loss's largest block is the float32 input of the MLP's adapted output projection, 8 x 2,560 x 8,192 x 4 bytes
    # (640 MiB) a micro-batch: three blocks share one and leave 640 MiB - 3 blocks, a third of that per block, 64
    # blocks; counted for both micro-batches at once (1,280 MiB, six blocks) the same
    arch = catalog_architecture("Phi-3-mini-4k-instruct")
    train = TrainingConfig(dtype="bfloat16", lora_r=16, num_generations=16, per_device_train_batch_size=8,
                           gradient_accumulation_steps=2, max_prompt_length=512, max_completion_length=2048)
    block, segment = 16 * 32 * 96 * 2047 * 2, 8 * 2560 * 8192 * 4
    assert largest_request_bytes(arch, train) == segment
    expected = 64 * (segment - 3 * block) / 3
    assert reserve_patterns(arch, train, "generation")[CACHE_IN_LOSS_SEGMENTS] == pytest.approx(expected)
    assert 1300 * MiB < expected < 1400 * MiB
    # the same blocks whatever the micro-batch: the reserve neither rises as it falls nor falls as it grows
    for micro_batch in (1, 2, 4, 16):
        same = replace(train, per_device_train_batch_size=micro_batch, gradient_accumulation_steps=16 // micro_batch)
        assert cache_in_loss_segment_bytes(arch, same) == pytest.approx(expected)
    # without the window the blocks hold all 2,559 tokens: five share the 1,280 MiB of both micro-batches
    whole = replace(arch, sliding_window=None, sliding_layers=0)
    block = 16 * 32 * 96 * 2559 * 2
    assert cache_in_loss_segment_bytes(whole, train) == pytest.approx(64 * (2 * segment - 5 * block) / 5)
    # vLLM keeps its cache in its own reservation; expandable segments map pages to fit
    assert cache_in_loss_segment_bytes(arch, replace(train, use_vllm=True)) == 0
    assert reserve_patterns(arch, replace(train, allocator_conf="expandable_segments:True"), "generation") == {}
    # blocks that fill the segment strand next to nothing: Qwen3-0.6B's 8 heads of 128 at 2,559 tokens (80 MiB),
    # six to its 3,072-wide float32 block of 40,960 tokens (480 MiB), 0.2 MiB beside them
    assert cache_in_loss_segment_bytes(catalog_architecture("Qwen3-0.6B"), train) < 2 * MiB


def test_the_caches_blocks_cut_from_cached_segments_strand_what_the_allocator_strands():
    # the previous step's loss leaves its segments cached; the cache's blocks are cut from them by best fit
    segment, block, segments = 640 * MiB, 16 * 32 * 96 * 2047 * 2, 7
    allocator = CachingAllocator()
    for address in [allocator.malloc(segment) for _ in range(segments)]:
        allocator.free(address)
    blocks = [allocator.malloc(block) for _ in range(3 * segments)]
    assert allocator.reserved_bytes == segments * segment  # no segment of their own
    stranded = allocator.reserved_bytes - len(blocks) * block
    assert stranded == pytest.approx(stranded_by_kept_inputs(len(blocks), block, segment))


def prefill_and_decoding(layers: int, largest_bytes: int, live: int, row_bytes: int, prompt: int,
                         completion: int) -> tuple[CachingAllocator, set[int]]:
    """generate() as the allocator sees it: the prefill keeps each layer's prompt keys and values (`row_bytes` a
    token) and asks for `live` tensors of its largest size, `largest_bytes` (the MLP's, or eager attention's float32
    scores), at once, freed before the next layer; each decoding step makes every layer's keys and values a token
    longer and frees the old ones. Returns the allocator after the last step and the addresses of the segments the
    prefill's largest tensors made."""
    allocator = CachingAllocator()
    cache = []
    for _ in range(layers):
        cache.append([allocator.malloc(row_bytes * prompt), allocator.malloc(row_bytes * prompt)])
        for block in [allocator.malloc(largest_bytes) for _ in range(live)]:
            allocator.free(block)
    largest_segment = allocation_size(largest_bytes, K_LARGE_BUFFER)
    prefill = {segment[0][0] for segment in allocator.segment_blocks()
               if sum(size for _, size, _ in segment) == largest_segment}
    for step in range(1, completion):
        for layer in cache:
            for kind, old in enumerate(layer):
                layer[kind] = allocator.malloc(row_bytes * (prompt + step))
                allocator.free(old)
    return allocator, prefill


@pytest.mark.parametrize("name, dtype, batch, prompt, completion, attention", [
    ("SmolLM2-360M", "bfloat16", 64, 64, 256, "sdpa"),  # 3 + 8 segments of 160 MiB, a 99.7 MiB block in each
    # 304 MiB segments with room for fifteen 20 MiB blocks: fewer blocks than places, the count bounded by the blocks
    ("Qwen2.5-0.5B", "bfloat16", 32, 128, 192, "sdpa"),
    ("phi-2", "bfloat16", 16, 64, 128, "sdpa"),  # a plain MLP: 2 + 16 segments of 160 MiB, a 119 MiB block in each
    # eager attention's float32 scores (2 GiB) outgrow the MLP's tensors (768 MiB): their segments
    ("Qwen3-0.6B", "bfloat16", 64, 256, 128, "eager"),
    # scores shorter than the MLP's tensors (20 MiB against 160): the MLP's segments, as without eager attention
    ("SmolLM2-360M", "bfloat16", 64, 64, 256, "eager"),
])
def test_the_caches_blocks_cut_from_the_prefills_segments_strand_what_the_allocator_strands(name, dtype, batch,
                                                                                          prompt, completion,
                                                                                          attention):
    # 8 steps per generation: the generation batch is 8 micro-batches
    train = TrainingConfig(dtype=dtype, per_device_train_batch_size=batch, num_generations=4,
                           gradient_accumulation_steps=4, steps_per_generation=8, max_prompt_length=prompt,
                           max_completion_length=completion, attn_implementation=attention)
    arch = catalog_architecture(name)
    sequences = train.local_generation_batch_size
    row = sequences * arch.num_kv_heads * arch.head_dim * 2
    mlp = sequences * prompt * arch.intermediate_size * 2
    scores = sequences * arch.num_attention_heads * prompt * prompt * 4 if attention == "eager" else 0
    largest, live = (scores, 1) if scores > mlp else (mlp, 3 if arch.family.gated_mlp else 2)
    allocator, prefill = prefill_and_decoding(arch.num_layers, largest, live, row, prompt, completion)
    # what no block of the last step fits in, in the prefill's segments that a block keeps (a wholly free one can be
    # released)
    block = row * (prompt + completion - 1)
    stranded = sum(size % block for segment in allocator.segment_blocks()
                   if segment[0][0] in prefill and any(allocated for _, _, allocated in segment)
                   for _, size, allocated in segment if not allocated)
    assert stranded > 0
    # the segments are counted from the prompts' cache, a part-filled one as a fraction, and the decoding leaves one
    # free in turn: within a segment
    segment = allocation_size(largest, K_LARGE_BUFFER)
    assert abs(cache_in_prefill_segment_bytes(arch, train, shorter_prompts=False) - stranded) <= segment
    assert reserve_patterns(arch, train, "generation")[CACHE_IN_PREFILL_SEGMENTS] == cache_in_prefill_segment_bytes(
        arch, train) >= cache_in_prefill_segment_bytes(arch, train, shorter_prompts=False)


def test_eager_attentions_scores_make_the_prefills_segments_where_they_outgrow_the_mlps_tensors():
    # 512 prompts of 256 tokens: float32 scores of 16 heads, 2 GiB a layer, against the MLP's 768 MiB; the prompts'
    # cache (28 layers' keys and values, 256 MiB each) fills 7 segments of them beside the one softmax's output
    # holds, and each takes five of the last step's 383 MiB blocks beside 133 MiB
    train = TrainingConfig(dtype="bfloat16", lora_r=16, per_device_train_batch_size=8, num_generations=8,
                           steps_per_generation=64, max_prompt_length=256, max_completion_length=128,
                           attn_implementation="eager")
    arch = catalog_architecture("Qwen3-0.6B")
    assert cache_in_prefill_segment_bytes(arch, train, shorter_prompts=False) == (1 + 7) * (2048 - 5 * 383) * MiB
    allocator, prefill = prefill_and_decoding(arch.num_layers, 2048 * MiB, 1, 512 * 8 * 128 * 2, 256, 128)
    stranded = sum(size % (383 * MiB) for segment in allocator.segment_blocks()
                   if segment[0][0] in prefill for _, size, allocated in segment if not allocated)
    assert len(prefill) == 8 and 0 <= stranded - cache_in_prefill_segment_bytes(arch, train,
                                                                               shorter_prompts=False) <= 383 * MiB
    # SDPA keeps no scores: the MLP's 768 MiB segments, two blocks in each beside 2 MiB
    sdpa = cache_in_prefill_segment_bytes(arch, replace(train, attn_implementation="sdpa"), shorter_prompts=False)
    assert 0 < sdpa < 28 * 2 * MiB


def test_eager_attentions_copies_of_grouped_keys_and_values_find_no_rest_the_cache_left():
    # the grid's Qwen3-0.6B eager LoRA point: 16 query heads on 8 key-value heads copy each 383 MiB block to 766 MiB
    train = TrainingConfig(dtype="bfloat16", lora_r=16, per_device_train_batch_size=8, num_generations=8,
                           steps_per_generation=64, max_prompt_length=256, max_completion_length=128,
                           attn_implementation="eager")
    arch = catalog_architecture("Qwen3-0.6B")
    copy = decoding_repeated_kv_request_bytes(arch, train)
    assert copy == 2 * 383 * MiB
    assert reserve_patterns(arch, train, "generation")[DECODING_REPEATED_KV] == copy
    # the cache's blocks fill the prefill's score segments five to one beside 133 MiB: the copy takes a segment more
    allocator, _ = prefill_and_decoding(arch.num_layers, 2048 * MiB, 1, 512 * 8 * 128 * 2, 256, 128)
    reserved = allocator.reserved_bytes
    allocator.malloc(int(copy))
    assert allocator.reserved_bytes == reserved + copy
    # SDPA's decoding copies nothing from transformers 5.23 on (it packs the grouped queries); before, its masked
    # decoding copied as eager attention does
    sdpa = replace(train, attn_implementation="sdpa")
    assert decoding_repeated_kv_request_bytes(arch, sdpa) == 0
    assert decoding_repeated_kv_request_bytes(arch, replace(sdpa, transformers_version="5.22.0")) == copy
    # nor do ungrouped heads copy, nor vLLM's generation here
    assert decoding_repeated_kv_request_bytes(catalog_architecture("phi-2"), train) == 0  # 32 heads, 32 key-value heads
    assert decoding_repeated_kv_request_bytes(arch, replace(train, use_vllm=True)) == 0
    # a copy that shares the 20 MiB segments: 8 sequences of 64 + 32 tokens, 3 MiB
    assert decoding_repeated_kv_request_bytes(arch, replace(train, steps_per_generation=1, max_prompt_length=64,
                                                    max_completion_length=32)) == 0


def test_the_prefills_segments_strand_nothing_without_a_prefill_here_or_with_blocks_past_them():
    train = TrainingConfig(dtype="bfloat16", per_device_train_batch_size=64, num_generations=4,
                           gradient_accumulation_steps=4, steps_per_generation=8, max_prompt_length=64,
                           max_completion_length=256)
    arch = catalog_architecture("SmolLM2-360M")
    assert cache_in_prefill_segment_bytes(arch, train) == pytest.approx((3 + 8) * 60.3125 * MiB, rel=1e-3)
    assert cache_in_prefill_segment_bytes(arch, replace(train, use_vllm=True)) == 0
    # 1,024 completion tokens: the last block (512 x 1,087 tokens x 640 bytes) outgrows the 160 MiB segment
    assert cache_in_prefill_segment_bytes(arch, replace(train, max_completion_length=1024)) == 0
    # 8 sequences of 64 prompt tokens: 2.5 MiB MLP tensors, served from the 20 MiB segments
    assert cache_in_prefill_segment_bytes(arch, replace(train, per_device_train_batch_size=1)) == 0


@settings(max_examples=120, deadline=None)
@given(name=st.sampled_from(["SmolLM2-360M", "Qwen3-0.6B", "gemma-2-2b", "gemma-3-1b-it", "phi-2", "Llama-3.1-8B"]),
       sequences=st.sampled_from([2, 8, 64, 512, 2048]), prompt=st.integers(1, 1200),
       completion=st.integers(1, 3000), dtype=st.sampled_from(["float32", "bfloat16"]), lora=st.booleans(),
       attention=st.sampled_from(["sdpa", "eager"]))
# Found by this sweep in a CI run (2026-11-30): one block fewer fits at every odd prompt length from 47 to 55, nine
# segment sizes below where four fit unrounded (_PrefillSegments.flickering_segments); 2 MiB counted, 104 MiB stranded
@example(name="gemma-2-2b", sequences=64, prompt=62, completion=9, dtype="float32", lora=False, attention="sdpa")
# the ROUNDING_STEPS segments below the last length with a block fewer, whatever the flicker: a 128-token prompt
# strands the most here
@example(name="SmolLM2-360M", sequences=8, prompt=130, completion=143, dtype="float32", lora=True, attention="sdpa")
def test_the_prefills_segments_are_counted_at_the_prompt_length_up_to_the_longest_that_strands_the_most(
        name, sequences, prompt, completion, dtype, lora, attention):
    # a batch's prompts are as long as its longest: a run meets every prompt length up to max_prompt_length, each
    # with its own layout of blocks in the prefill's segments and a shorter cache. Every length, a token at a time:
    arch = catalog_architecture(name)
    train = TrainingConfig(dtype=dtype, lora_r=16 if lora else None, num_generations=2,
                           per_device_train_batch_size=sequences, max_prompt_length=prompt,
                           max_completion_length=completion, attn_implementation=attention)

    def at(length: int) -> TrainingConfig:
        return replace(train, max_prompt_length=length)

    def cache(length: int) -> float:  # the last decoding step's keys and values
        return kv_cache_bytes(arch, train, sequences, length + completion - 1)

    counted = cache_in_prefill_segment_bytes(arch, train)
    shorter = max(cache_in_prefill_segment_bytes(arch, at(length), shorter_prompts=False) - (cache(prompt) - cache(
        length)) for length in range(1, prompt + 1))
    assert counted >= shorter - K_ROUND_LARGE  # a step's 2 MiB rounding aside, none strands more, cache and all
    assert counted <= shorter + 1  # and what is counted is what some prompt length strands


def test_a_shorter_prompt_that_strands_more_is_what_the_run_needs():
    # Qwen3-0.6B LoRA with eager attention generating 512 sequences of p + 128 tokens: the exact engine (check
    # --exact) needs 30.89 GiB at p = 243, where four of the last step's blocks leave nearly a fifth in each of the
    # prefill's 2 GiB scores segments, and 28.46 GiB at p = 256, where five fit
    knobs = {"dtype": "bfloat16", "lora_r": 16, "per_device_train_batch_size": 8, "num_generations": 8,
             "gradient_accumulation_steps": 4, "steps_per_generation": 64, "max_prompt_length": 256,
             "max_completion_length": 128, "attn_implementation": "eager"}
    arch, train = catalog_architecture("Qwen3-0.6B"), TrainingConfig(**knobs)
    shorter = replace(train, max_prompt_length=243)
    assert heaviest_prompt_length(arch, train) == 243
    assert cache_in_prefill_segment_bytes(arch, shorter, shorter_prompts=False) > 2.5 * cache_in_prefill_segment_bytes(
        arch, train, shorter_prompts=False)
    assert cache_in_prefill_segment_bytes(arch, train) > cache_in_prefill_segment_bytes(arch, train,
                                                                                        shorter_prompts=False)
    # the estimate follows: the step at 256 needs what the one at 243 does, and more
    peak = engine.check("Qwen3-0.6B", "b200", knobs).estimate.peak_bytes
    assert peak >= engine.check("Qwen3-0.6B", "b200", {**knobs, "max_prompt_length": 243}).estimate.peak_bytes
    # at 127 tokens more still is stranded (3.8 GiB), but the cache is 7.6 GB shorter: it needs 18.2 GiB, and counts
    # for nothing at 256
    longest = replace(train, max_prompt_length=127)
    assert cache_in_prefill_segment_bytes(arch, longest, shorter_prompts=False) > cache_in_prefill_segment_bytes(
        arch, shorter, shorter_prompts=False)
    assert heaviest_prompt_length(arch, train) != 127


def test_the_first_steps_states_cut_from_the_decodings_segments_keep_the_next_generation_from_them():
    # SmolLM2-360M generating 512 sequences of 64 + 256 tokens: the last step's blocks, 512 x 319 tokens x 5 heads of
    # 64 in bfloat16 (99.7 MiB), each a 100 MiB segment; the first optimizer step's bfloat16 AdamW states of the
    # layers' linears above 1 MiB (the MLP's 4.7 MiB, attention's 1.8) are cut from them once generate() returns
    arch = catalog_architecture("SmolLM2-360M")
    train = TrainingConfig(dtype="bfloat16", per_device_train_batch_size=64, num_generations=4,
                           gradient_accumulation_steps=4, steps_per_generation=8, max_prompt_length=64,
                           max_completion_length=256)
    block = 512 * 5 * 64 * 319 * 2
    states = [linear.in_features * linear.out_features * 2 for linear in arch.layer_linears()] * 2  # exp_avg, _sq
    states = [state for state in states if state > K_SMALL_SIZE]  # the 0.6 MiB ones the small pool serves
    allocator = CachingAllocator()
    for address in [allocator.malloc(block) for _ in range(2 * arch.num_layers)]:
        allocator.free(address)
    reserved = allocator.reserved_bytes
    for _ in range(arch.num_layers):
        for state in states:
            allocator.malloc(state)
    assert allocator.reserved_bytes == reserved  # every state cut from the decoding's segments, none anew
    pinned = sum(1 for segment in allocator.segment_blocks() if any(allocated for _, _, allocated in segment))
    # the next generation's last blocks find the segments that hold a state too short: as many segments anew
    for _ in range(2 * arch.num_layers):
        allocator.malloc(block)
    assert allocator.reserved_bytes == reserved + pinned * allocation_size(block, K_LARGE_BUFFER)
    stranded = pinned * allocation_size(block, K_LARGE_BUFFER) - arch.num_layers * sum(states)
    # packed densely here, less than a segment beside them; the step's own frees spread them over more (530 MiB at
    # the traced need): the states' bytes bound it, for the fit to weigh
    assert 0 <= stranded < allocation_size(block, K_LARGE_BUFFER)
    assert states_in_decoding_segment_bytes(arch, train) == arch.num_layers * sum(states)
    assert reserve_patterns(arch, train, "generation")[STATES_IN_DECODING_SEGMENTS] == arch.num_layers * sum(states)
    # 8 sequences: 1.6 MiB blocks share the 20 MiB segments, and the next generation's fit beside the states
    assert states_in_decoding_segment_bytes(arch, replace(train, per_device_train_batch_size=1)) == 0
    for no_states in (replace(train, lora_r=16), replace(train, use_vllm=True),
                      replace(train, optim=Optimizer.paged_adamw_8bit), replace(train, optim=Optimizer.sgd)):
        assert states_in_decoding_segment_bytes(arch, no_states) == 0


def test_a_micro_batchs_loss_segment_strands_less_than_a_block_beside_the_caches_blocks():
    # Mistral-7B-v0.3 LoRA generating 256 sequences of 64 + 384 tokens, 32 a micro-batch: 221.5 MiB blocks (8 heads
    # of 128, 447 tokens, bfloat16); the loss's largest request is the adapted down projection's float32 input, 32 x
    # 448 x 14,336 x 4 bytes (784 MiB): three blocks to a segment beside 119.5 MiB
    arch = catalog_architecture("Mistral-7B-v0.3")
    train = TrainingConfig(dtype="bfloat16", lora_r=16, per_device_train_batch_size=32, num_generations=8,
                           gradient_accumulation_steps=4, steps_per_generation=8, max_prompt_length=64,
                           max_completion_length=384)
    block, segment = 256 * 8 * 128 * 447 * 2, 32 * 448 * 14336 * 4
    assert largest_request_bytes(arch, train) == segment
    allocator = CachingAllocator()
    for address in [allocator.malloc(segment) for _ in range(3)]:
        allocator.free(address)
    for _ in range(9):
        allocator.malloc(block)
    rests = [sum(size for _, size, allocated in s if not allocated) for s in allocator.segment_blocks()]
    assert rests == [segment - 3 * block] * 3 and 0 < segment - 3 * block < block
    assert cache_in_micro_batch_segment_bytes(arch, train) == block  # the envelope of the rest: a block
    assert reserve_patterns(arch, train, "generation")[CACHE_IN_MICRO_BATCH_SEGMENTS] == block
    # a micro-batch of 8: 196 MiB segments, shorter than a block: nothing cut from them
    assert cache_in_micro_batch_segment_bytes(arch, replace(train, per_device_train_batch_size=8,
                                                            gradient_accumulation_steps=16,
                                                            steps_per_generation=32)) == 0
    assert cache_in_micro_batch_segment_bytes(arch, replace(train, use_vllm=True)) == 0


@pytest.mark.parametrize("pattern", [cache_in_micro_batch_segment_bytes, states_in_decoding_segment_bytes,
                                     decoding_repeated_kv_request_bytes, prefill_largest_request_bytes])
@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(["SmolLM2-135M", "Qwen3-0.6B", "gemma-2-2b", "phi-2", "Mistral-7B-v0.3"]),
       prompt=st.integers(1, 2048), completion=st.integers(1, 4096), more=st.integers(1, 2048),
       batch=st.integers(1, 64), steps=st.sampled_from([1, 2, 4, 8]), lora=st.booleans(),
       dtype=st.sampled_from(["float32", "bfloat16"]), attention=st.sampled_from(["sdpa", "eager"]))
def test_generations_patterns_never_fall_as_the_tokens_or_the_batch_grow(pattern, name, prompt, completion, more,
                                                                         batch, steps, lora, dtype, attention):
    arch = catalog_architecture(name)

    def stranded(**changes) -> float:
        knobs = dict(dtype=dtype, lora_r=16 if lora else None, num_generations=2, per_device_train_batch_size=2 * batch,
                     gradient_accumulation_steps=steps, max_prompt_length=prompt, max_completion_length=completion,
                     attn_implementation=attention)
        return pattern(arch, TrainingConfig(**{**knobs, **changes}))

    assert stranded(max_prompt_length=prompt + more) >= stranded()
    assert stranded(max_completion_length=completion + more) >= stranded()
    # a larger micro-batch for the same generation batch: the loss's segments grow, the blocks stay
    if steps > 1:
        assert stranded(per_device_train_batch_size=4 * batch, gradient_accumulation_steps=steps // 2) >= stranded()


def test_generations_patterns_weigh_on_its_decoding_not_on_its_prefill():
    """Generation's patterns are the decoding's last blocks beside the segments they were cut from: at the prefill
    they do not exist yet. Counted at the prefill too, where it outweighs the decoding (Phi-3-mini's LoRA, 2
    sequences of 256 prompt tokens and a few completion tokens), the blocks' rest, which falls as they grow, made the
    phase need less for a longer completion; at the decoding the cache grows by more than the rest falls. Where the
    decoding is the heaviest moment (SmolLM2-360M generating 512 sequences) they weigh on it."""
    from vram_planner import engine

    def generation(model: str, card: str, settings: dict, **context):
        verdict = engine.check(model, card, settings, **context)
        return next(p for p in verdict.estimate.phases if p.name == "generation")

    short = {"num_generations": 2, "per_device_train_batch_size": 2, "lora_r": 4}
    phases = [generation("Phi-3-mini-4k-instruct", "rtx2060", {**short, "max_completion_length": c},
                         trl_version="1.15.0") for c in range(1, 9)]
    totals = [p.total_bytes for p in phases]
    assert totals == sorted(totals)
    many = {"dtype": "bfloat16", "per_device_train_batch_size": 64, "num_generations": 4,
            "gradient_accumulation_steps": 4, "steps_per_generation": 8, "max_prompt_length": 64,
            "max_completion_length": 256}
    decoding = generation("SmolLM2-360M", "h100-80gb", many)
    stranded = cache_in_prefill_segment_bytes(catalog_architecture("SmolLM2-360M"), TrainingConfig(**many))
    weight = default_calibration().allocator_reserve["default"]["generation"][CACHE_IN_PREFILL_SEGMENTS]
    assert decoding.moment.startswith("last decoding step") and stranded > 0 and weight > 0
    assert decoding.components["allocator_overhead"] > weight * stranded


def prefill_layers(layers: int, kept_bytes: int, working_bytes: int, largest_bytes: int) -> list[int]:
    """generate()'s prefill as the allocator sees it, layer by layer: blocks kept for the decoding (the prompts' keys
    and values, `kept_bytes` each), a working tensor that lives through the layer, then the layer's largest request,
    each freed before the next layer. Returns the bytes reserved when each layer's largest request is met."""
    allocator, reserved = CachingAllocator(), []
    for _ in range(layers):
        for _ in range(2):
            allocator.malloc(kept_bytes)
        working = allocator.malloc(working_bytes)
        largest = allocator.malloc(largest_bytes)
        reserved.append(allocator.reserved_bytes)
        allocator.free(largest)
        allocator.free(working)
    return reserved


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(3, 30), kept_mib=st.integers(11, 200), working_ratio=st.floats(1.2, 8.0),
       largest_ratio=st.floats(1.5, 8.0))
def test_the_prefills_largest_request_takes_a_segment_beside_the_one_a_smaller_tensor_pins(layers, kept_mib,
                                                                                           working_ratio,
                                                                                           largest_ratio):
    """From the second layer on, the kept blocks fill the working tensor's segment, the working tensor is cut from
    the largest request's freed segment, and the request takes a segment of its own beside it: the allocator holds a
    largest request's segment more than the live tensors and their own segments."""
    kept = kept_mib * MiB
    working = int(kept * working_ratio) // 512 * 512
    largest = int(working * largest_ratio) // 512 * 512
    reserved = prefill_layers(layers, kept, working, largest)
    segment = allocation_size(largest, K_LARGE_BUFFER)
    # the second layer: its working tensor sits in the first layer's largest segment, beside what a request of that
    # size cannot use
    assert reserved[1] - reserved[0] >= segment
    # the pattern counts the request: at most what the allocator took beyond one segment of it, a layer later
    assert reserved[-1] >= reserved[0] + segment


def test_the_prefills_largest_request_is_the_mlps_as_its_projection_reads_it_or_eager_attentions_scores():
    arch = catalog_architecture("Qwen2.5-0.5B")
    knobs = {"dtype": "bfloat16", "per_device_train_batch_size": 8, "num_generations": 8,
             "gradient_accumulation_steps": 4, "steps_per_generation": 64, "max_prompt_length": 512,
             "max_completion_length": 128}
    tokens = 512 * 512
    # a LoRA adapter on the down projection reads its input in float32 (the 4,864 MiB request of the boundary point)
    assert prefill_largest_request_bytes(arch, TrainingConfig(**knobs, lora_r=16)) == tokens * 4864 * 4 == 4864 * MiB
    assert prefill_largest_request_bytes(arch, TrainingConfig(**knobs)) == tokens * 4864 * 2
    # eager attention's float32 scores, 14 heads x 512 x 512 a sequence, outgrow the bfloat16 intermediate
    eager = TrainingConfig(**knobs, attn_implementation="eager")
    assert prefill_largest_request_bytes(arch, eager) == 512 * 14 * 512 * 512 * 4
    assert prefill_largest_request_bytes(arch, TrainingConfig(**knobs, use_vllm=True)) == 0  # no prefill here
    # a prompt so short its request shares the 20 MiB segments
    assert prefill_largest_request_bytes(arch, TrainingConfig(**{**knobs, "steps_per_generation": 1,
                                                                 "max_prompt_length": 1})) == 0


def test_the_prefills_pattern_weighs_on_its_moments_and_the_decodings_on_theirs():
    """What each moment of generation holds beyond its tensors and their shares: the prefill's largest request at the
    prefill, the decoding's blocks at the decoding, never both."""
    from vram_planner.model.phases import PREFILL_MOMENTS, generation_moments, persistent_bytes, with_overheads
    from vram_planner.model.stranding import loaded_weight_segment_bytes

    arch = catalog_architecture("Qwen2.5-0.5B")
    train = TrainingConfig(dtype="bfloat16", lora_r=16, per_device_train_batch_size=8, num_generations=8,
                           gradient_accumulation_steps=4, steps_per_generation=64, max_prompt_length=512,
                           max_completion_length=128)
    cal = default_calibration()
    weights = cal.allocator_reserve["default"]["generation"]
    patterns = reserve_patterns(arch, train, "generation")
    assert patterns[PREFILL_LARGEST_REQUEST] > 0 and weights[PREFILL_LARGEST_REQUEST] > 0
    for moment in generation_moments(arch, train, cal, persistent_bytes(arch, train)):
        with_patterns = with_overheads(moment, cal, 0.0, train, arch=arch).components["allocator_overhead"]
        without = with_overheads(moment, cal, 0.0, train).components["allocator_overhead"]
        prefilling = moment.moment in PREFILL_MOMENTS
        weighed = sum(weights.get(name, 0.0) * value for name, value in patterns.items()
                      if (name in PREFILL_PATTERNS) == prefilling)
        # the loaded weights' rests are counted at every moment, as they are (the embedding's 0.34 MiB here)
        assert with_patterns - without == pytest.approx(weighed + loaded_weight_segment_bytes(arch, train))
