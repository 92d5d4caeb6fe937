"""The allocation patterns of the analytic reserve, held to the caching allocator model that replays them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import catalog_architecture
from vram_planner.allocator import CachingAllocator
from vram_planner.model.fragmentation import (EAGER_OVERFLOW, EAGER_SCORES, LATE_GRADIENT, LATER_MICRO_BATCH,
                                              LAYER_GRADIENTS, PINNED_LAYER_INPUTS, PREFILL_STATES, SOFTCAPPED_SCORES,
                                              STATES_IN_HEAD_TILE, eager_overflow_bytes, late_gradient_bytes,
                                              largest_request_bytes, layer_gradient_bytes, pinned_layer_input_bytes,
                                              prefill_state_bytes,
                                              reserve_patterns, states_in_head_tile_bytes, stranded_by_gradients)
from vram_planner.model.generation_patterns import GENERATION_PATTERNS
from vram_planner.model.lm_head import fused_tile_bytes, logit_positions
from vram_planner.model.spec import Optimizer, TrainingConfig
from vram_planner.model.stranding import reference_logits_stranded_bytes, stranded_by_kept_inputs
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


def test_the_patterns_follow_the_knobs():
    arch = catalog_architecture("SmolLM2-135M")  # intermediate / hidden = 1536 / 576: two inputs per projection segment
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


@pytest.mark.parametrize("knobs, whole", [
    ({}, True),
    ({"num_gpus": 2, "zero_stage": 1}, True),  # reduces copies of the gradients, keeps them whole to the step
    ({"num_gpus": 2, "zero_stage": 2}, False),  # keeps its partition
    ({"num_gpus": 2, "zero_stage": 3}, False),
    ({"num_gpus": 2, "fsdp": True}, False),
    ({"lora_r": 16}, False),
], ids=str)
def test_the_gradients_patterns_weigh_a_backward_that_keeps_every_gradient_whole(knobs, whole):
    arch = catalog_architecture("Llama-3.2-1B")
    train = TrainingConfig(dtype="bfloat16", per_device_train_batch_size=8, num_generations=8, **knobs)
    counted = (late_gradient_bytes(arch, train), layer_gradient_bytes(arch, train))
    assert (min(counted) > 0) if whole else counted == (0, 0)


def test_a_later_micro_batch_and_full_fine_tunings_gradients_have_patterns_of_their_own():
    arch = catalog_architecture("Llama-3.2-1B")
    lora = TrainingConfig(dtype="bfloat16", lora_r=16, per_device_train_batch_size=8, num_generations=16,
                          max_prompt_length=512, max_completion_length=2048)
    assert reserve_patterns(arch, lora, "training")[LATER_MICRO_BATCH] == 0
    two = replace(lora, gradient_accumulation_steps=2)
    # LoRA on the MLP's output projection: its float32 input, 20480 tokens x 8192, is the block cut (640 MiB)
    assert reserve_patterns(arch, two, "training")[LATER_MICRO_BATCH] == largest_request_bytes(arch, two) == 640 * MiB
    assert reserve_patterns(arch, two, "training")[LAYER_GRADIENTS] == 0  # adapters' gradients are small
    # one generation for two optimizer steps, or used twice: the next step's forward finds the backward's cache
    for later in (replace(lora, steps_per_generation=2), replace(lora, num_iterations=2)):
        assert reserve_patterns(arch, later, "training")[LATER_MICRO_BATCH] == 640 * MiB
    full = TrainingConfig(max_completion_length=256)  # float32: 64 MiB gradients of the MLP, 16 layers
    assert reserve_patterns(arch, full, "training")[LAYER_GRADIENTS] == 16 * 64 * MiB
    short = replace(full, per_device_train_batch_size=1, num_generations=2, max_prompt_length=64,
                    max_completion_length=64)  # 128 tokens: a 2 MiB intermediate holds no gradient
    assert reserve_patterns(arch, short, "training")[LAYER_GRADIENTS] == 0


def test_whole_multiples_strand_nothing():
    arch = catalog_architecture("Llama-3.2-1B")  # intermediate / hidden = 8192 / 2048: four inputs fill a segment exactly
    train = TrainingConfig(dtype="bfloat16", lora_r=16, per_device_train_batch_size=16, num_generations=16,
                           max_completion_length=4096)
    assert pinned_layer_input_bytes(arch, train) == 0


def test_eager_attention_adds_its_score_blocks_and_softcapping_more_of_them():
    train = TrainingConfig(dtype="bfloat16", lora_r=16, per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=4096)
    eager = replace(train, attn_implementation="eager")
    for name in ("Llama-3.2-1B", "gemma-2-2b"):
        arch = catalog_architecture(name)
        assert reserve_patterns(arch, train, "training")[EAGER_SCORES] == 0
        scores = 4 * arch.num_attention_heads * eager.sequence_length ** 2 * 4  # [B, heads, L, L] in float32
        patterns = reserve_patterns(arch, eager, "training")
        assert patterns[EAGER_SCORES] == scores
        assert patterns[SOFTCAPPED_SCORES] == (scores if name == "gemma-2-2b" else 0)


def eager_forward(layers: int, half_bytes: int, input_bytes: int, left_by_backward: int = 0) -> CachingAllocator:
    """A checkpointed forward with eager attention as the allocator sees it: each layer's two compute-dtype scores
    (q k^T, then masked), softmax's float32 input cast and output, the probabilities' compute-dtype copy, all freed;
    then its output kept; the cache then emptied. `left_by_backward`: float32 score blocks a previous backward freed
    into the cache before the forward begins."""
    allocator = CachingAllocator()
    for block in [allocator.malloc(2 * half_bytes) for _ in range(left_by_backward)]:
        allocator.free(block)
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


@settings(max_examples=80, deadline=None)
@given(layers=st.integers(1, 40), half_mib=st.integers(6, 900), ratio=st.floats(1.0, 40.0), left=st.integers(1, 3))
def test_a_forward_in_the_cache_a_backward_left_pins_a_score_segment_whatever_the_places(layers, half_mib, ratio,
                                                                                          left):
    half_bytes = half_mib * 2 * MiB
    input_bytes = max(int(half_bytes / ratio) // 512, 2049) * 512
    places = 2 * (half_bytes // input_bytes)
    pinned = pinned_score_segments(eager_forward(layers, half_bytes, input_bytes, left_by_backward=left), half_bytes)
    # one where the half-score segments have places for every input (a first forward pins none there), more where not
    assert pinned == 1 if layers <= places else pinned >= 1


def test_a_forward_after_a_backward_counts_the_overflow_at_every_length():
    # Qwen2.5-1.5B LoRA in bfloat16, eager, 16 x (512 + 5,056) tokens: L* is 1,792 tokens
    arch = catalog_architecture("Qwen2.5-1.5B")
    first = TrainingConfig(dtype="bfloat16", lora_r=8, attn_implementation="eager", per_device_train_batch_size=16,
                           num_generations=8, max_prompt_length=512, max_completion_length=5056)
    scores_at = {length: 16 * arch.num_attention_heads * length ** 2 * 4 / 2 for length in (1792, 5568)}
    assert eager_overflow_bytes(arch, first) == scores_at[1792]
    for later in (replace(first, steps_per_generation=2), replace(first, gradient_accumulation_steps=2),
                  replace(first, num_iterations=2)):
        assert eager_overflow_bytes(arch, later) == scores_at[5568]
    assert eager_overflow_bytes(arch, replace(first, steps_per_generation=2, gradient_checkpointing=False)) == 0


def test_the_score_segment_an_overflow_pins_is_half_a_score_block_more_until_the_inputs_fit():
    # float32 models at the boundary grid's 8 x 1,280 tokens, scores [8, heads, 1280, 1280] in float32
    train = TrainingConfig(lora_r=16, attn_implementation="eager", max_completion_length=1024)
    for name, overflows in (("Qwen2.5-0.5B", True), ("Llama-3.2-1B", False)):
        arch = catalog_architecture(name)  # 24 layers, 2 x 10 places (350 MiB halves, 35 MiB inputs); 16 layers, 2 x 10
        half = 8 * arch.num_attention_heads * 1280 ** 2 * 4 // 2
        inputs = 8 * 1280 * arch.hidden_size * 4
        assert (pinned_score_segments(eager_forward(arch.num_layers, half, inputs), half) > 0) == overflows
        overflow = reserve_patterns(arch, train, "training")[EAGER_OVERFLOW]
        # Llama's inputs overflow below L* = 8 x 2048 x 4 / (2 x 32) = 1,024 tokens: the bytes of the scores there
        assert overflow == (half if overflows else 8 * arch.num_attention_heads * 1024 ** 2 * 4 / 2)
    assert eager_overflow_bytes(catalog_architecture("Qwen2.5-0.5B"), replace(train, attn_implementation="sdpa")) == 0
    assert eager_overflow_bytes(catalog_architecture("Qwen2.5-0.5B"), replace(train, gradient_checkpointing=False)) == 0


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(["SmolLM2-135M", "Qwen2.5-0.5B", "Llama-3.2-1B", "gemma-2-2b", "Mistral-7B-v0.3"]),
       completion=st.integers(1, 16384), more=st.integers(1, 4096), micro_batch=st.integers(1, 64),
       dtype=st.sampled_from(["float32", "bfloat16"]))
def test_the_overflow_never_falls_as_the_tokens_or_the_micro_batch_grow(name, completion, more, micro_batch, dtype):
    arch = catalog_architecture(name)

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
        assert states_in_head_tile_bytes(catalog_architecture(name), train) == stranded == max(tile - state, 0)
        assert reserve_patterns(catalog_architecture(name), train, "training")[STATES_IN_HEAD_TILE] == stranded
    arch = catalog_architecture("SmolLM2-135M")
    assert states_in_head_tile_bytes(arch, replace(defaults, lora_r=16)) == 0  # the adapters' states are small
    assert states_in_head_tile_bytes(arch, replace(defaults, optim=Optimizer.paged_adamw_8bit)) == 0
    assert states_in_head_tile_bytes(arch, replace(defaults, trl_version="1.10.0")) == 0  # no fused head
    tiny = catalog_architecture(str(Path(__file__).parents[1] / "fixtures" / "tiny-llama-headdim.json"))
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
    phi = catalog_architecture("phi-2")  # the prefill's fc1 output: 2,048 x 10,240 bfloat16, 40 MiB; attention states 25 MiB
    segment, state = 2048 * 10240 * 2, 2560 * 2560 * 4
    allocator = states_across_the_prefill(segment, state, phi.num_layers)
    stranded = allocator.reserved_bytes - allocator.allocated_bytes
    assert stranded == phi.num_layers * 15 * MiB
    assert prefill_state_bytes(phi, defaults) == stranded
    assert reserve_patterns(phi, defaults, "training")[PREFILL_STATES] == stranded
    # 8-bit states of 6.25 MiB are served by the 20 MiB segments' smaller blocks; the MLP's 25 MiB fill past half
    assert prefill_state_bytes(phi, replace(defaults, optim=Optimizer.adamw_8bit)) == phi.num_layers * 15 * MiB
    # Mistral-7B's 8-bit states: the 16 MiB attention ones share a 56 MiB segment, three beside 8 MiB (counted 16)
    mistral = catalog_architecture("Mistral-7B-v0.3")
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
    arch = catalog_architecture(name)

    def stranded(length: int, sequences: int) -> float:
        return pattern(arch, TrainingConfig(dtype=dtype, optim=optim, num_generations=2,
                                            per_device_train_batch_size=2 * sequences, **{tokens_knob: length}))

    assert stranded(tokens + more, batch) >= stranded(tokens, batch)
    assert stranded(tokens, batch + 1) >= stranded(tokens, batch)


def merged_loss_log_probs(logits_bytes: int, one_row_bytes: int, rows: int) -> tuple[CachingAllocator, int]:
    """TRL 0.14's log-prob passes in its loss as the allocator sees them, from an empty cache: the policy's logits,
    accelerate's float32 copy, the logits freed, each sequence's float32 log_softmax kept, the copy freed; then the
    reference's logits. Returns the allocator and the free block beside the reference's logits when its own copy is
    asked for (0: they lie in a block of their own size)."""
    allocator = CachingAllocator()
    logits = allocator.malloc(logits_bytes)
    copy = allocator.malloc(2 * logits_bytes)
    allocator.free(logits)
    for _ in range(rows):
        allocator.malloc(one_row_bytes)
    allocator.free(copy)
    reference = allocator.malloc(logits_bytes)
    after = reference + allocator.block_size(reference)
    beside = [size for address, size in allocator.free_blocks() if address == after]
    return allocator, beside[0] if beside else 0


@pytest.mark.parametrize("completions", [1, 2, 4, 8])
def test_trl_014s_reference_logits_strand_what_the_allocator_strands(completions):
    # oxen.ai's Qwen2.5-0.5B runs: bf16 weights under bf16 autocast, 786-token completions, TRL 0.14 and transformers
    # 4.48 (which honours num_logits_to_keep: 787 positions)
    arch = catalog_architecture("Qwen2.5-0.5B")
    train = TrainingConfig(trl_version="0.14.0", transformers_version="4.48.2", dtype="bfloat16",
                           mixed_precision="bf16", per_device_train_batch_size=1, num_generations=completions,
                           max_completion_length=786)
    assert train.micro_batch_completions == completions
    positions = logit_positions(train, train.release)
    logits_bytes = completions * positions * arch.vocab_size * 2
    one_row = (positions - 1) * arch.vocab_size * 4
    _, stranded = merged_loss_log_probs(logits_bytes, one_row, completions)
    counted = reference_logits_stranded_bytes(arch, train, positions)
    assert counted == pytest.approx(stranded, abs=2 * MiB)  # the segment's rounding
    assert (counted > 0) == (completions > 1)  # one sequence's row is larger than its logits' block
    assert reference_logits_stranded_bytes(arch, replace(train, mixed_precision="no"), positions) == 0  # no copy
    later = replace(train, trl_version="0.15.0")  # the reference scored before the loss
    assert reference_logits_stranded_bytes(arch, later, logit_positions(later, later.release)) == 0
