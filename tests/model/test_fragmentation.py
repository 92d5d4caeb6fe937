"""The allocation patterns of the analytic reserve, held to the caching allocator model that replays them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vram_planner.allocator import CachingAllocator
from vram_planner.allocator.sizes import K_LARGE_BUFFER, K_SMALL_SIZE, allocation_size
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.calibration import default_calibration
from vram_planner.model.fragmentation import (CACHE_IN_LOSS_SEGMENTS, CACHE_IN_MICRO_BATCH_SEGMENTS,
                                              CACHE_IN_PREFILL_SEGMENTS, EAGER_OVERFLOW, EAGER_SCORES,
                                              GENERATION_PATTERNS, LATE_GRADIENT, LATER_MICRO_BATCH, LAYER_GRADIENTS,
                                              PINNED_LAYER_INPUTS, PREFILL_STATES, SOFTCAPPED_SCORES,
                                              STATES_IN_DECODING_SEGMENTS, STATES_IN_HEAD_TILE,
                                              cache_in_loss_segment_bytes, cache_in_micro_batch_segment_bytes,
                                              cache_in_prefill_segment_bytes, eager_overflow_bytes,
                                              late_gradient_bytes, largest_request_bytes, pinned_layer_input_bytes,
                                              prefill_state_bytes, reserve_patterns, states_in_decoding_segment_bytes,
                                              states_in_head_tile_bytes, stranded_by_gradients,
                                              stranded_by_kept_inputs)
from vram_planner.model.lm_head import fused_tile_bytes
from vram_planner.model.spec import Optimizer, TrainingConfig
from vram_planner.profiles import model_config
from vram_planner.units import MiB


def checkpointed_forward(layers: int, input_bytes: int, projection_bytes: int) -> CachingAllocator:
    """A checkpointed forward as the allocator sees it: each layer's projections made and freed, then its output
    kept; the cache then emptied, as torch does before it gives up on a request."""
    allocator = CachingAllocator()
    for _ in range(layers):
        working = [allocator.malloc(projection_bytes) for _ in range(3)]  # gate, up, their product
        for address in working:
            allocator.free(address)
        allocator.malloc(input_bytes)
    allocator.empty_cache()
    return allocator


def sharing_blocks(kept_bytes: int, ratio: float, least_granules: int) -> tuple[int, int]:
    """A block `ratio` times `kept_bytes` in the allocator's 2 MiB granules, and how many kept tensors share one."""
    block_bytes = max(int(kept_bytes * ratio) // (2 * MiB), least_granules) * 2 * MiB
    return block_bytes, block_bytes // kept_bytes


@settings(max_examples=60, deadline=None)
@given(input_blocks=st.integers(2049, 800_000), ratio=st.floats(1.0, 8.0), segments=st.integers(1, 6))
def test_kept_inputs_strand_what_the_allocator_strands(input_blocks, ratio, segments):
    # sizes in the allocator's granules: inputs in 512-byte blocks above the small pool, projections in 2 MiB
    input_bytes = input_blocks * 512
    projection_bytes, sharing = sharing_blocks(input_bytes, ratio, least_granules=5)
    layers = sharing * segments  # every segment filled: the per-layer share is then exact
    allocator = checkpointed_forward(layers, input_bytes, projection_bytes)
    # beyond the inputs' bytes: a block the allocator does not split (a rest of 1 MiB or less) strands its rest too
    stranded = allocator.reserved_bytes - layers * input_bytes
    assert stranded_by_kept_inputs(layers, input_bytes, projection_bytes) == stranded


def test_a_partly_filled_last_segment_or_unaligned_sizes_strand_within_one_segment():
    for layers in range(1, 30):
        allocator = checkpointed_forward(layers, 100 * MiB + 1000, 543 * MiB)
        stranded = allocator.reserved_bytes - layers * (100 * MiB + 1024)
        assert abs(stranded_by_kept_inputs(layers, 100 * MiB + 1000, 543 * MiB) - stranded) < 544 * MiB


@settings(max_examples=200, deadline=None)
@given(layers=st.integers(1, 80), hidden=st.integers(64, 8192), intermediate=st.integers(64, 30000),
       tokens=st.integers(1, 2**20), more=st.integers(1, 2**16))
def test_what_the_inputs_strand_never_falls_as_the_tokens_grow(layers, hidden, intermediate, tokens, more):
    def stranded(n: int) -> float:
        return stranded_by_kept_inputs(layers, n * hidden * 2, n * intermediate * 2)

    assert stranded(tokens + more) >= stranded(tokens)


def test_inputs_larger_than_the_projection_or_in_the_small_pool_strand_nothing():
    assert stranded_by_kept_inputs(20, 200 * MiB, 150 * MiB) == 0
    assert stranded_by_kept_inputs(20, MiB // 2, 3 * MiB) == 0


def backward_with_gradients(layers: int, gradient_bytes: int, intermediate_bytes: int) -> CachingAllocator:
    """Full fine-tuning's backward as the allocator sees it: each layer's intermediate made and freed, then its
    weight gradient made and kept until the optimizer step; the cache then emptied."""
    allocator = CachingAllocator()
    for _ in range(layers):
        allocator.free(allocator.malloc(intermediate_bytes))
        allocator.malloc(gradient_bytes)
    allocator.empty_cache()
    return allocator


@settings(max_examples=60, deadline=None)
@given(gradient_mib=st.integers(11, 400), ratio=st.floats(0.3, 6.0), blocks=st.integers(1, 6))
def test_kept_gradients_strand_at_most_a_gradient_a_layer(gradient_mib, ratio, blocks):
    # above the 10 MiB from which a request gets a segment of its own size
    gradient_bytes = gradient_mib * 2 * MiB
    intermediate_bytes, sharing = sharing_blocks(gradient_bytes, ratio, least_granules=6)
    layers = max(sharing, 1) * blocks  # every block filled (one a layer where none fits)
    allocator = backward_with_gradients(layers, gradient_bytes, intermediate_bytes)
    stranded = allocator.reserved_bytes - layers * gradient_bytes
    if intermediate_bytes < gradient_bytes:
        assert stranded == 0 == stranded_by_gradients(layers, gradient_bytes, intermediate_bytes)
    else:  # the sawtooth the kept inputs make too, under its bound of a gradient a layer
        assert stranded == stranded_by_kept_inputs(layers, gradient_bytes, intermediate_bytes)
        assert stranded_by_gradients(layers, gradient_bytes, intermediate_bytes) >= stranded


def test_the_gradients_bound_is_reached_with_one_gradient_a_block():
    # Llama-3.2-1B in float32 at the boundary grid's tokens: 64 MiB gradients in 96 MiB blocks, 32 MiB left each;
    # as the block nears two gradients, what is left nears a gradient
    for intermediate_mib, left_mib in ((96, 32), (126, 62)):
        allocator = backward_with_gradients(16, 64 * MiB, intermediate_mib * MiB)
        assert allocator.reserved_bytes - 16 * 64 * MiB == 16 * left_mib * MiB
    assert stranded_by_gradients(16, 64 * MiB, 126 * MiB) - 16 * 62 * MiB == 16 * 2 * MiB


@settings(max_examples=200, deadline=None)
@given(layers=st.integers(1, 80), hidden=st.integers(64, 8192), intermediate=st.integers(64, 30000),
       tokens=st.integers(1, 2**20), more=st.integers(1, 2**16), trainable=st.sampled_from([2, 4]))
def test_what_the_gradients_strand_never_falls_as_the_tokens_grow(layers, hidden, intermediate, tokens, more,
                                                                  trainable):
    def stranded(n: int) -> float:
        return stranded_by_gradients(layers, hidden * intermediate * trainable, n * intermediate * 2)

    assert stranded(tokens + more) >= stranded(tokens)


def _arch(name: str) -> ModelArchitecture:
    return ModelArchitecture.from_config(model_config(name)[0])


def test_the_patterns_follow_the_knobs():
    arch = _arch("SmolLM2-135M")  # intermediate / hidden = 1536 / 576: two inputs per projection segment
    lora = TrainingConfig(dtype="bfloat16", lora_r=16, per_device_train_batch_size=16, num_generations=16,
                          max_completion_length=4096)
    assert pinned_layer_input_bytes(arch, lora) > 0 and late_gradient_bytes(arch, lora) == 0
    assert pinned_layer_input_bytes(arch, replace(lora, gradient_checkpointing=False)) == 0
    full = TrainingConfig(dtype="bfloat16")
    assert late_gradient_bytes(arch, full) == arch.vocab_size * arch.hidden_size * 2
    assert set(reserve_patterns(arch, lora, "generation")) == set(GENERATION_PATTERNS)
    assert reserve_patterns(arch, lora, "scoring") == reserve_patterns(arch, lora, "optimizer") == {}
    assert reserve_patterns(arch, replace(lora, allocator_conf="expandable_segments:True"),
                            "training") == {}
    assert set(reserve_patterns(arch, lora, "training")) >= {PINNED_LAYER_INPUTS, LATE_GRADIENT}


def test_a_later_micro_batch_and_full_fine_tunings_gradients_have_patterns_of_their_own():
    arch = _arch("Llama-3.2-1B")
    lora = TrainingConfig(dtype="bfloat16", lora_r=16, per_device_train_batch_size=8, num_generations=16,
                          max_prompt_length=512, max_completion_length=2048)
    assert reserve_patterns(arch, lora, "training")[LATER_MICRO_BATCH] == 0
    two = replace(lora, gradient_accumulation_steps=2)
    # LoRA on the MLP's output projection: its float32 input, 20480 tokens x 8192, is the block cut (640 MiB)
    assert reserve_patterns(arch, two, "training")[LATER_MICRO_BATCH] == largest_request_bytes(arch, two) == 640 * MiB
    assert reserve_patterns(arch, two, "training")[LAYER_GRADIENTS] == 0  # adapters' gradients are small
    full = TrainingConfig(max_completion_length=256)  # float32: 64 MiB gradients of the MLP, 16 layers
    assert reserve_patterns(arch, full, "training")[LAYER_GRADIENTS] == 16 * 64 * MiB
    short = replace(full, per_device_train_batch_size=1, num_generations=2, max_prompt_length=64,
                    max_completion_length=64)  # 128 tokens: a 2 MiB intermediate holds no gradient
    assert reserve_patterns(arch, short, "training")[LAYER_GRADIENTS] == 0


def test_whole_multiples_strand_nothing():
    arch = _arch("Llama-3.2-1B")  # intermediate / hidden = 8192 / 2048: four inputs fill a segment exactly
    train = TrainingConfig(dtype="bfloat16", lora_r=16, per_device_train_batch_size=16, num_generations=16,
                           max_completion_length=4096)
    assert pinned_layer_input_bytes(arch, train) == 0


def test_eager_attention_adds_its_score_blocks_and_softcapping_more_of_them():
    train = TrainingConfig(dtype="bfloat16", lora_r=16, per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=4096)
    eager = replace(train, attn_implementation="eager")
    for name in ("Llama-3.2-1B", "gemma-2-2b"):
        arch = _arch(name)
        assert reserve_patterns(arch, train, "training")[EAGER_SCORES] == 0
        scores = 4 * arch.num_attention_heads * eager.sequence_length ** 2 * 4  # [B, heads, L, L] in float32
        patterns = reserve_patterns(arch, eager, "training")
        assert patterns[EAGER_SCORES] == scores
        assert patterns[SOFTCAPPED_SCORES] == (scores if name == "gemma-2-2b" else 0)


def test_the_kv_caches_last_blocks_strand_the_rest_of_the_losss_segments():
    # Phi-3-mini's LoRA with 16 sequences of 512 + 2,048 tokens, 8 a micro-batch: every layer keeps a 2,047-token
    # window, keys and values in bfloat16, 32 heads of 96: blocks of 16 x 32 x 96 x 2,047 x 2 bytes (192 MiB). The
    # loss's largest block is the float32 input of the MLP's adapted output projection, 8 x 2,560 x 8,192 x 4 bytes
    # (640 MiB) a micro-batch: three blocks share one and leave 640 MiB - 3 blocks, a third of that per block, 64
    # blocks; counted for both micro-batches at once (1,280 MiB, six blocks) the same
    arch = _arch("Phi-3-mini-4k-instruct")
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
    assert cache_in_loss_segment_bytes(_arch("Qwen3-0.6B"), train) < 2 * MiB


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


def prefill_and_decoding(layers: int, mlp_bytes: int, live: int, row_bytes: int, prompt: int,
                         completion: int) -> tuple[CachingAllocator, set[int]]:
    """generate() as the allocator sees it: the prefill keeps each layer's prompt keys and values (`row_bytes` a
    token) and asks for `live` MLP tensors of `mlp_bytes` at once, freed before the next layer; each decoding step
    makes every layer's keys and values a token longer and frees the old ones. Returns the allocator after the last
    step and the addresses of the segments the prefill's MLP made."""
    allocator = CachingAllocator()
    cache = []
    for _ in range(layers):
        cache.append([allocator.malloc(row_bytes * prompt), allocator.malloc(row_bytes * prompt)])
        for block in [allocator.malloc(mlp_bytes) for _ in range(live)]:
            allocator.free(block)
    mlp_segment = allocation_size(mlp_bytes, K_LARGE_BUFFER)
    prefill = {segment[0][0] for segment in allocator.segment_blocks()
               if sum(size for _, size, _ in segment) == mlp_segment}
    for step in range(1, completion):
        for layer in cache:
            for kind, old in enumerate(layer):
                layer[kind] = allocator.malloc(row_bytes * (prompt + step))
                allocator.free(old)
    return allocator, prefill


@pytest.mark.parametrize("name, dtype, batch, prompt, completion", [
    ("SmolLM2-360M", "bfloat16", 64, 64, 256),  # 3 + 8 segments of 160 MiB, a 99.7 MiB block in each
    # 304 MiB segments with room for fifteen 20 MiB blocks: fewer blocks than places, the count bounded by the blocks
    ("Qwen2.5-0.5B", "bfloat16", 32, 128, 192),
    ("phi-2", "bfloat16", 16, 64, 128),  # a plain MLP: 2 + 16 segments of 160 MiB, a 119 MiB block in each
])
def test_the_caches_blocks_cut_from_the_prefills_segments_strand_what_the_allocator_strands(name, dtype, batch,
                                                                                          prompt, completion):
    # 8 steps per generation: the generation batch is 8 micro-batches
    train = TrainingConfig(dtype=dtype, per_device_train_batch_size=batch, num_generations=4,
                           gradient_accumulation_steps=4, steps_per_generation=8, max_prompt_length=prompt,
                           max_completion_length=completion)
    arch = _arch(name)
    sequences = train.local_generation_batch_size
    row = sequences * arch.num_kv_heads * arch.head_dim * 2
    allocator, prefill = prefill_and_decoding(arch.num_layers, sequences * prompt * arch.intermediate_size * 2,
                                              3 if arch.family.gated_mlp else 2, row, prompt, completion)
    # what no block of the last step fits in, in the prefill's segments that a block keeps (a wholly free one can be
    # released)
    block = row * (prompt + completion - 1)
    stranded = sum(size % block for segment in allocator.segment_blocks()
                   if segment[0][0] in prefill and any(allocated for _, _, allocated in segment)
                   for _, size, allocated in segment if not allocated)
    assert stranded > 0
    # the segments are counted from the prompts' cache, a part-filled one as a fraction, and the decoding leaves one
    # free in turn: within a segment
    segment = allocation_size(sequences * prompt * arch.intermediate_size * 2, K_LARGE_BUFFER)
    assert abs(cache_in_prefill_segment_bytes(arch, train) - stranded) <= segment
    assert reserve_patterns(arch, train, "generation")[CACHE_IN_PREFILL_SEGMENTS] == cache_in_prefill_segment_bytes(
        arch, train)


def test_the_prefills_segments_strand_nothing_without_a_prefill_here_or_with_blocks_past_them():
    train = TrainingConfig(dtype="bfloat16", per_device_train_batch_size=64, num_generations=4,
                           gradient_accumulation_steps=4, steps_per_generation=8, max_prompt_length=64,
                           max_completion_length=256)
    arch = _arch("SmolLM2-360M")
    assert cache_in_prefill_segment_bytes(arch, train) == pytest.approx((3 + 8) * 60.3125 * MiB, rel=1e-3)
    assert cache_in_prefill_segment_bytes(arch, replace(train, use_vllm=True)) == 0
    # 1,024 completion tokens: the last block (512 x 1,087 tokens x 640 bytes) outgrows the 160 MiB segment
    assert cache_in_prefill_segment_bytes(arch, replace(train, max_completion_length=1024)) == 0
    # 8 sequences of 64 prompt tokens: 2.5 MiB MLP tensors, served from the 20 MiB segments
    assert cache_in_prefill_segment_bytes(arch, replace(train, per_device_train_batch_size=1)) == 0


def test_the_first_steps_states_cut_from_the_decodings_segments_keep_the_next_generation_from_them():
    # SmolLM2-360M generating 512 sequences of 64 + 256 tokens: the last step's blocks, 512 x 319 tokens x 5 heads of
    # 64 in bfloat16 (99.7 MiB), each a 100 MiB segment; the first optimizer step's bfloat16 AdamW states of the
    # layers' linears above 1 MiB (the MLP's 4.7 MiB, attention's 1.8) are cut from them once generate() returns
    arch = _arch("SmolLM2-360M")
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
    arch = _arch("Mistral-7B-v0.3")
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


@pytest.mark.parametrize("pattern", [cache_in_micro_batch_segment_bytes, states_in_decoding_segment_bytes])
@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(["SmolLM2-135M", "Qwen3-0.6B", "gemma-2-2b", "phi-2", "Mistral-7B-v0.3"]),
       prompt=st.integers(1, 2048), completion=st.integers(1, 4096), more=st.integers(1, 2048),
       batch=st.integers(1, 64), steps=st.sampled_from([1, 2, 4, 8]), lora=st.booleans(),
       dtype=st.sampled_from(["float32", "bfloat16"]))
def test_generations_patterns_never_fall_as_the_tokens_or_the_batch_grow(pattern, name, prompt, completion, more,
                                                                         batch, steps, lora, dtype):
    arch = _arch(name)

    def stranded(**changes) -> float:
        knobs = dict(dtype=dtype, lora_r=16 if lora else None, num_generations=2, per_device_train_batch_size=2 * batch,
                     gradient_accumulation_steps=steps, max_prompt_length=prompt, max_completion_length=completion)
        return pattern(arch, TrainingConfig(**{**knobs, **changes}))

    assert stranded(max_prompt_length=prompt + more) >= stranded()
    assert stranded(max_completion_length=completion + more) >= stranded()
    # a larger micro-batch for the same generation batch: the loss's segments grow, the blocks stay
    if steps > 1:
        assert stranded(per_device_train_batch_size=4 * batch, gradient_accumulation_steps=steps // 2) >= stranded()


def eager_forward(layers: int, half_bytes: int, input_bytes: int) -> CachingAllocator:
    """A checkpointed forward with eager attention as the allocator sees it: each layer's two compute-dtype scores
    (q k^T, then masked), softmax's float32 input cast and output, the probabilities' compute-dtype copy, all freed;
    then its output kept; the cache then emptied."""
    allocator = CachingAllocator()
    for _ in range(layers):
        product = allocator.malloc(half_bytes)
        masked = allocator.malloc(half_bytes)
        allocator.free(product)
        cast = allocator.malloc(2 * half_bytes)
        allocator.free(masked)
        probabilities = allocator.malloc(2 * half_bytes)
        allocator.free(cast)
        copy = allocator.malloc(half_bytes)
        allocator.free(probabilities)
        allocator.free(copy)
        allocator.malloc(input_bytes)
    allocator.empty_cache()
    return allocator


def pinned_score_segments(allocator: CachingAllocator, half_bytes: int) -> int:
    return sum(1 for segment in allocator.segment_blocks() if sum(size for _, size, _ in segment) >= 2 * half_bytes)


@settings(max_examples=80, deadline=None)
@given(layers=st.integers(1, 40), half_mib=st.integers(6, 900), ratio=st.floats(1.0, 40.0))
def test_the_kept_inputs_overflow_into_a_score_segment_once_the_half_score_segments_are_full(layers, half_mib, ratio):
    half_bytes = half_mib * 2 * MiB
    input_bytes = max(int(half_bytes / ratio) // 512, 2049) * 512  # above the small pool, in whole blocks
    places = 2 * (half_bytes // input_bytes)  # two half-score segments, (S / 2) // input inputs each
    allocator = eager_forward(layers, half_bytes, input_bytes)
    assert (pinned_score_segments(allocator, half_bytes) > 0) == (layers > places)


def test_the_score_segment_an_overflow_pins_is_half_a_score_block_more_until_the_inputs_fit():
    # float32 models at the boundary grid's 8 x 1,280 tokens, scores [8, heads, 1280, 1280] in float32
    train = TrainingConfig(lora_r=16, attn_implementation="eager", max_completion_length=1024)
    for name, overflows in (("Qwen2.5-0.5B", True), ("Llama-3.2-1B", False)):
        arch = _arch(name)  # 24 layers, 2 x 10 places (350 MiB halves, 35 MiB inputs); 16 layers, 2 x 10
        half = 8 * arch.num_attention_heads * 1280 ** 2 * 4 // 2
        inputs = 8 * 1280 * arch.hidden_size * 4
        assert (pinned_score_segments(eager_forward(arch.num_layers, half, inputs), half) > 0) == overflows
        overflow = reserve_patterns(arch, train, "training")[EAGER_OVERFLOW]
        # Llama's inputs overflow below L* = 8 x 2048 x 4 / (2 x 32) = 1,024 tokens: the bytes of the scores there
        assert overflow == (half if overflows else 8 * arch.num_attention_heads * 1024 ** 2 * 4 / 2)
    assert eager_overflow_bytes(_arch("Qwen2.5-0.5B"), replace(train, attn_implementation="sdpa")) == 0
    assert eager_overflow_bytes(_arch("Qwen2.5-0.5B"), replace(train, gradient_checkpointing=False)) == 0


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(["SmolLM2-135M", "Qwen2.5-0.5B", "Llama-3.2-1B", "gemma-2-2b", "Mistral-7B-v0.3"]),
       completion=st.integers(1, 16384), more=st.integers(1, 4096), micro_batch=st.integers(1, 64),
       dtype=st.sampled_from(["float32", "bfloat16"]))
def test_the_overflow_never_falls_as_the_tokens_or_the_micro_batch_grow(name, completion, more, micro_batch, dtype):
    arch = _arch(name)

    def overflow(tokens: int, batch: int) -> float:
        return eager_overflow_bytes(arch, TrainingConfig(dtype=dtype, lora_r=16, attn_implementation="eager",
                                                      num_generations=2, per_device_train_batch_size=2 * batch,
                                                      max_completion_length=tokens))

    assert overflow(completion + more, micro_batch) >= overflow(completion, micro_batch)
    assert overflow(completion, micro_batch + 1) >= overflow(completion, micro_batch)


def tile_across_the_first_step(tile_bytes: int, state_bytes: int) -> tuple[CachingAllocator, int]:
    """The fused LM head's tile across the first optimizer step as the allocator sees it: the loss asks for the tile
    and frees it, the optimizer step makes the embedding's state, the next step's loss asks for the tile again.
    Returns the allocator and the bytes that last request had to reserve anew."""
    allocator = CachingAllocator()
    allocator.free(allocator.malloc(tile_bytes))
    allocator.malloc(state_bytes)
    before = allocator.reserved_bytes
    allocator.malloc(tile_bytes)
    return allocator, allocator.reserved_bytes - before


@settings(max_examples=80, deadline=None)
@given(tile_granules=st.integers(6, 600), share=st.floats(0.0, 1.5))
def test_a_state_cut_from_the_tiles_segment_strands_the_rest_of_it(tile_granules, share):
    tile = tile_granules * 2 * MiB  # a segment of its own: whole 2 MiB granules
    state = max(int(tile * share) // 512, 1) * 512
    allocator, anew = tile_across_the_first_step(tile, state)
    if state <= 1 * MiB or state > tile:  # the small pool's, or a segment of its own: the tile's is free again
        assert anew == 0
    else:  # cut from the tile's segment: the next tile takes a segment more
        assert anew == tile
        if tile - state > 1 * MiB:  # and the rest beside the state is cached, too short for it
            assert allocator.reserved_bytes - allocator.allocated_bytes == tile - state
        # (a rest of 1 MiB or less is not split off: the state's block is the whole segment)


def test_the_embeddings_state_in_the_tiles_segment_is_what_the_allocator_strands():
    defaults = TrainingConfig()  # TRL's: float32 weights, fused AdamW, 8 x 512 completions: 256 MiB bfloat16 tiles
    tile = int(fused_tile_bytes(defaults, defaults.release, defaults.micro_batch_completions))
    assert tile == 256 * MiB
    for name, optim, state in (("SmolLM2-135M", Optimizer.adamw_torch_fused, 49152 * 576 * 4),  # 108 MiB
                               ("SmolLM2-135M", Optimizer.adamw_8bit, 49152 * 576),  # 27 MiB
                               ("Llama-3.2-1B", Optimizer.adamw_8bit, 128256 * 2048),  # 250.5 MiB
                               ("Llama-3.2-1B", Optimizer.adamw_torch_fused, 128256 * 2048 * 4)):  # larger
        train = replace(defaults, optim=optim)
        allocator, anew = tile_across_the_first_step(tile, state)
        stranded = allocator.reserved_bytes - allocator.allocated_bytes if anew else 0
        assert states_in_head_tile_bytes(_arch(name), train) == stranded == max(tile - state, 0)
        assert reserve_patterns(_arch(name), train, "training")[STATES_IN_HEAD_TILE] == stranded
    arch = _arch("SmolLM2-135M")
    assert states_in_head_tile_bytes(arch, replace(defaults, lora_r=16)) == 0  # the adapters' states are small
    assert states_in_head_tile_bytes(arch, replace(defaults, optim=Optimizer.paged_adamw_8bit)) == 0
    assert states_in_head_tile_bytes(arch, replace(defaults, trl_version="1.10.0")) == 0  # no fused head
    tiny = _arch(str(Path(__file__).parents[1] / "fixtures" / "tiny-llama-headdim.json"))
    assert states_in_head_tile_bytes(tiny, defaults) == 0  # a state of 1,000 x 64 floats: the small pool


def states_across_the_prefill(segment_bytes: int, state_bytes: int, layers: int) -> CachingAllocator:
    """Generation's prefill and the first optimizer step as the allocator sees them: the prefill asks for a block of
    `segment_bytes` per layer (a segment each, as its layers' tensors overlap) and frees them; the first optimizer step
    then makes one state of `state_bytes` per layer and keeps it."""
    allocator = CachingAllocator()
    for block in [allocator.malloc(segment_bytes) for _ in range(layers)]:
        allocator.free(block)
    for _ in range(layers):
        allocator.malloc(state_bytes)
    return allocator


@settings(max_examples=80, deadline=None)
@given(segment_granules=st.integers(6, 300), share=st.floats(0.5, 1.0), layers=st.integers(1, 40))
def test_a_state_filling_a_prefill_segment_past_half_strands_the_rest_of_it(segment_granules, share, layers):
    segment = segment_granules * 2 * MiB  # a segment of its own: whole 2 MiB granules
    state = min(max(int(segment * share) // 512 + 1, 1) * 512, segment)  # past half: one state to a segment
    allocator = states_across_the_prefill(segment, state, layers)
    assert allocator.reserved_bytes == layers * segment  # every state cut from a prefill segment, none anew
    if segment - state > 1 * MiB:  # the rest beside each state is cached, too short for the next state
        assert allocator.reserved_bytes - allocator.allocated_bytes == layers * (segment - state)


def test_the_first_steps_states_in_the_prefills_segments_are_what_the_allocator_strands():
    defaults = TrainingConfig()  # TRL's: float32 weights, fused AdamW, 8 prompts of 256 tokens generated at once
    phi = _arch("phi-2")  # the prefill's fc1 output: 2,048 x 10,240 bfloat16, 40 MiB; attention states 25 MiB
    segment, state = 2048 * 10240 * 2, 2560 * 2560 * 4
    allocator = states_across_the_prefill(segment, state, phi.num_layers)
    stranded = allocator.reserved_bytes - allocator.allocated_bytes
    assert stranded == phi.num_layers * 15 * MiB
    assert prefill_state_bytes(phi, defaults) == stranded
    assert reserve_patterns(phi, defaults, "training")[PREFILL_STATES] == stranded
    # 8-bit states of 6.25 MiB are served by the 20 MiB segments' smaller blocks; the MLP's 25 MiB fill past half
    assert prefill_state_bytes(phi, replace(defaults, optim=Optimizer.adamw_8bit)) == phi.num_layers * 15 * MiB
    # Mistral-7B's 8-bit states: the 16 MiB attention ones share a 56 MiB segment, three beside 8 MiB (counted 16)
    mistral = _arch("Mistral-7B-v0.3")
    assert prefill_state_bytes(mistral, replace(defaults, optim=Optimizer.adamw_8bit)) == mistral.num_layers * 16 * MiB
    for no_prefill_states in (replace(defaults, lora_r=16), replace(defaults, optim=Optimizer.paged_adamw_8bit),
                              replace(defaults, optim=Optimizer.sgd), replace(defaults, use_vllm=True)):
        assert prefill_state_bytes(phi, no_prefill_states) == 0


@pytest.mark.parametrize("pattern, tokens_knob", [(states_in_head_tile_bytes, "max_completion_length"),
                                                 (prefill_state_bytes, "max_prompt_length")])
@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(["SmolLM2-135M", "Qwen2.5-0.5B", "Llama-3.2-1B", "gemma-3-1b-it", "phi-2",
                             "Mistral-7B-v0.3"]),
       tokens=st.integers(1, 8192), more=st.integers(1, 4096), batch=st.integers(1, 64),
       dtype=st.sampled_from(["float32", "bfloat16"]), optim=st.sampled_from(list(Optimizer)))
def test_what_the_first_steps_states_strand_never_falls_as_the_tokens_or_the_batch_grow(pattern, tokens_knob, name,
                                                                                        tokens, more, batch, dtype,
                                                                                        optim):
    # the LM head's tile grows with the scored tokens, the prefill's segments with the prompts' tokens
    arch = _arch(name)

    def stranded(length: int, sequences: int) -> float:
        return pattern(arch, TrainingConfig(dtype=dtype, optim=optim, num_generations=2,
                                            per_device_train_batch_size=2 * sequences, **{tokens_knob: length}))

    assert stranded(tokens + more, batch) >= stranded(tokens, batch)
    assert stranded(tokens, batch + 1) >= stranded(tokens, batch)


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
    stranded = cache_in_prefill_segment_bytes(_arch("SmolLM2-360M"), TrainingConfig(**many))
    weight = default_calibration().allocator_reserve["default"]["generation"][CACHE_IN_PREFILL_SEGMENTS]
    assert decoding.moment.startswith("last decoding step") and stranded > 0 and weight > 0
    assert decoding.components["allocator_overhead"] > weight * stranded
