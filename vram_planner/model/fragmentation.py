"""Allocation patterns that leave the caching allocator's cached memory where a step's largest requests cannot use
it: the reserve beyond the tensors that grows with them, in bytes, for the fitted reserve function to weigh
(vram_planner.model.calibration.allocator_reserve_bytes).

Found by replaying traced steps through the allocator model and reading its segments where the step runs out just
below its need (benchmarks/boundary.py; the committed table shows the grid). Pure Python: no torch.
"""

from __future__ import annotations

from vram_planner.allocator.sizes import K_LARGE_BUFFER, K_MIN_LARGE_ALLOC, K_SMALL_SIZE, allocation_size
from vram_planner.model import components as m
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.generation_patterns import generation_patterns
from vram_planner.model.lm_head import fused_tile_bytes
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.stranding import (largest_request_token_bytes, state_element_bytes, stranded_by_kept_inputs,
                                          whole_large_states)

# The patterns by name, as the calibration's reserve coefficients name them beside the tensor components.
PINNED_LAYER_INPUTS = "pinned_layer_inputs"
LATE_GRADIENT = "late_gradient"
LARGEST_REQUEST = "largest_request"
EAGER_SCORES = "eager_scores"
SOFTCAPPED_SCORES = "softcapped_scores"
SMALL_SEGMENTS = "small_segments"
LATER_MICRO_BATCH = "later_micro_batch"
LAYER_GRADIENTS = "layer_gradients"
EAGER_OVERFLOW = "eager_overflow"
STATES_IN_HEAD_TILE = "states_in_head_tile"
PREFILL_STATES = "prefill_states"
# The loss forward/backward's patterns (benchmarks/reserve_fit.py fits them on the steps that run out there)
PATTERNS = (PINNED_LAYER_INPUTS, LATE_GRADIENT, LARGEST_REQUEST, EAGER_SCORES, SOFTCAPPED_SCORES, SMALL_SEGMENTS,
            LATER_MICRO_BATCH, LAYER_GRADIENTS, EAGER_OVERFLOW, STATES_IN_HEAD_TILE, PREFILL_STATES)


def reserve_patterns(arch: ModelArchitecture, train: TrainingConfig, phase: str) -> dict[str, float]:
    """The patterns alive at a phase's peak, in bytes: the loss forward/backward's, and generation's
    (vram_planner.model.generation_patterns); the other phases' reserve is a share of their tensors. Expandable
    segments map pages to fit each request, so none of these strands: theirs are expandable_pages'."""
    if train.expandable_segments:
        return {}
    if phase == "generation":
        return generation_patterns(arch, train)
    if phase != "training":
        return {}
    scores = eager_scores_bytes(arch, train)
    return {PINNED_LAYER_INPUTS: pinned_layer_input_bytes(arch, train),
            LATE_GRADIENT: late_gradient_bytes(arch, train),
            LARGEST_REQUEST: largest_request_bytes(arch, train),
            EAGER_SCORES: scores,
            SOFTCAPPED_SCORES: scores if arch.attn_logit_softcapping else 0.0,
            SMALL_SEGMENTS: float(K_LARGE_BUFFER),
            LATER_MICRO_BATCH: later_micro_batch_bytes(arch, train),
            LAYER_GRADIENTS: layer_gradient_bytes(arch, train),
            EAGER_OVERFLOW: eager_overflow_bytes(arch, train),
            STATES_IN_HEAD_TILE: states_in_head_tile_bytes(arch, train),
            PREFILL_STATES: prefill_state_bytes(arch, train)}


def pinned_layer_input_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Cached bytes the checkpointed layer inputs strand until the backward frees them.

    Under gradient checkpointing each layer's forward runs without keeping its tensors, and its output, the next
    layer's kept input, is allocated as the layer's working tensors are freed. Best fit puts it in the smallest
    cached block that holds it: the block of the layer's largest working tensor, the MLP's gate or up projection
    (tokens x intermediate in the compute dtype), a segment of its own (requests of 10 MiB or more get segments of
    their size). k = segment // input of the inputs share such a segment, and what they leave of it (segment - k x
    input) is too short for the next layer's projection, which takes a new segment: (segment - k x input) / k per
    layer, held until the backward frees the inputs. An input larger than the projection, or one in the small pool,
    strands nothing this way. Exact on the pattern replayed alone (tests/model/test_fragmentation.py); in traced
    steps other tensors fill some of what it leaves.
    """
    if not train.gradient_checkpointing:
        return 0.0
    s = m.sizes(train)
    if s.residual != s.compute:  # a float32 residual stream: the input norm's float32 output, freed before the
        return 0.0  # layer's output is made, is a block of the output's size, and best fit takes it
    tokens = train.micro_batch_completions * train.sequence_length
    return stranded_by_kept_inputs(arch.num_layers, tokens * arch.hidden_size * s.residual,
                                   tokens * arch.intermediate_size * s.compute)


def keeps_whole_gradients(train: TrainingConfig) -> bool:
    """Whether the backward makes every trainable gradient whole and keeps it to the optimizer step, as one GPU does:
    full fine-tuning alone or under ZeRO-1, whose buckets reduce copies of them (at the need of Llama-3.2-1B's ZeRO-1
    on 4 at TRL's own batch its 32 MiB MLP gradients lay in the norm's freed 2,004 MiB fp64 segment and in the
    backward's 934 MiB ones, 1.7 GiB cached when the backward asked for 933 MiB: 6.4% over the estimate without these
    patterns, 1.5% with them). ZeRO-2/3 and FSDP keep partitions, and LoRA's gradients are small."""
    return not train.uses_lora and train.zero_stage in (None, 1) and not train.fsdp


def late_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The largest gradient, the embedding's, made last in the backward (keeps_whole_gradients): it needs a block as
    large as itself when the cache is cut into the layers' smaller pieces, so the allocator frees what it can and
    takes a segment of its own."""
    if not keeps_whole_gradients(train):
        return 0.0
    return float(arch.vocab_size * arch.hidden_size * m.sizes(train).trainable)


def largest_request_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The largest block of the MLP each layer's backward asks for anew: its intermediate activation in float32 (a
    LoRA adapter on the MLP's output projection is float32 and PEFT casts its input to it; a float32 model computes
    its backward there), else in the compute dtype. The segments earlier layers' requests of that size left are cut
    by smaller tensors by then, so it takes a segment of its own beside them."""
    return float(train.micro_batch_completions * train.sequence_length * largest_request_token_bytes(arch, train))


def later_micro_batch_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The largest request's block again, where a step runs more than one micro-batch: the next micro-batch's
    forward finds the cache the previous backward left, and best fit cuts its checkpointed layer inputs from the
    blocks of that backward's largest requests (there are no smaller ones of their size), so the block of the first
    layer's backward is too short when that backward asks for it, and the compute-dtype intermediate freed beside it
    is too short as well. At the need of DeepSeek-R1-Distill-Qwen-1.5B and Llama-3.2-1B LoRA with two micro-batches
    the allocator held 640 + 350 and 560 + 320 MiB cached that way when it asked for a 700 or 640 MiB block. Where one
    generation serves several optimizer steps (steps_per_generation above gradient_accumulation_steps, or
    num_iterations above 1) the next step's first forward finds the previous step's backward cache the same way."""
    if not forward_after_backward(train):
        return 0.0
    return largest_request_bytes(arch, train)


def forward_after_backward(train: TrainingConfig) -> bool:
    """Whether a loss forward runs in the cache a backward left, no generation between: a step of several
    micro-batches, or one generation round serving several micro-batches (steps_per_generation) or iterations."""
    return (train.gradient_accumulation_steps > 1 or train.steps_per_generation_resolved > 1
            or train.num_iterations > 1)


def layer_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The MLP's weight gradients, one per layer, where the backward makes them whole (keeps_whole_gradients) and the
    blocks that layer's intermediate activations freed can hold them (tokens x intermediate in the compute dtype at
    least a gradient, hidden x intermediate in the trainable dtype): best fit cuts each gradient from such a block,
    and what is left of it is too short for the next layer's intermediate; it stays cached, pinned by the gradient,
    until the optimizer step. At the need of Llama-3.2-1B in float32 30 blocks of 96 MiB each held a 64 MiB gradient beside
    32 MiB nobody could use, and Mistral-7B-v0.3 in bfloat16 left 56 and 24 MiB beside its 112 and 32 MiB gradients.
    Counted as stranded_by_gradients bounds it, for the fit to weigh."""
    if not keeps_whole_gradients(train):
        return 0.0
    s = m.sizes(train)
    tokens = train.micro_batch_completions * train.sequence_length
    return stranded_by_gradients(arch.num_layers, arch.hidden_size * arch.intermediate_size * s.trainable,
                                 tokens * arch.intermediate_size * s.compute)


def stranded_by_gradients(layers: int, gradient_bytes: int, intermediate_bytes: int) -> float:
    """The most that `layers` kept gradients of `gradient_bytes` can strand in the freed blocks of `intermediate_bytes`
    requests, one block a layer: k = intermediate // gradient gradients share a block and leave less than a gradient
    beside them, (intermediate - k x gradient) per block; bounded by a gradient a layer, so that it never falls as the
    intermediate grows. Nothing where a gradient does not fit in the block."""
    return float(layers * gradient_bytes) if intermediate_bytes >= gradient_bytes else 0.0


def eager_scores_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Eager attention's float32 scores [B, heads, L, L], a block each layer's forward and backward ask for anew
    (0 with SDPA or FlashAttention). Softcapping (Gemma 2) divides, takes tanh and multiplies them, each a block of
    the same size: more of them in flight for the kept inputs to pin (SOFTCAPPED_SCORES weighs that)."""
    if train.attn_implementation != "eager":
        return 0.0
    b, length = train.micro_batch_completions, train.sequence_length
    return float(b * arch.num_attention_heads * length * length * m.FP32_BYTES)


def eager_overflow_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """A score segment more, which eager attention's forward makes when the checkpointed layer inputs overflow the
    half-score segments, and which the backward finds pinned when it asks for the float32 scores' gradient: half a
    score block beyond the half-score segment that EAGER_SCORES weighs.

    A layer's forward holds two compute-dtype scores [B, heads, L, L] at once (the product q k^T and the masked
    one), then two float32 ones (softmax's input cast and its output): two segments of S / 2 and two of S, S the
    float32 block. Best fit cuts each layer's kept input (tokens x hidden in the residual dtype) from the free
    half-score segments, k = (S / 2) // input to a segment; once the layers outnumber the 2k places, the inputs are
    cut from the score segments, and one pinned while the next layer needs both makes the forward take a third
    (tests/model/test_fragmentation.py replays it). The backward's small tensors then pin it, and S less them is
    cached where the backward asks for S: at the need of Qwen2.5-0.5B in float32 (24 layers, 2 x 10 places, 700 MiB
    scores) 630 MiB of a third 700 MiB segment beside 70 MiB of the backward's tensors; phi-2, Mistral-7B,
    Phi-3-mini, Qwen3-0.6B and SmolLM2-135M in float32 held such a segment too, Llama-3.2-1B (16 layers, 2 x 10
    places) 520 MiB of a half-score segment only.

    The places grow with the sequence ((S / 2) / input is 2 x heads x L / (hidden x residual bytes)), so in a step's
    first forward the inputs stop overflowing from L* = ceil(layers / 2) x hidden x residual bytes / (2 x heads) on;
    from there the bytes stay those of the scores at L*, so that the reserve never falls as the tokens grow (the
    planner's searches rely on memory that grows with every knob). A forward that runs in the cache a backward left
    (forward_after_backward) finds score segments there before the half-score ones fill, and cuts the inputs from them
    whatever L is: at the need of Qwen2.5-1.5B LoRA generating 16 x (512 + 5,056) tokens for two steps (L* 1,792),
    the second step's forward held a 22.7 GiB score segment pinned by one 261 MiB input and another holding a
    bfloat16 score beside 11.4 GiB when it asked for a score block. Nothing without checkpointing (no kept inputs) or
    eager attention."""
    if train.attn_implementation != "eager" or not train.gradient_checkpointing:
        return 0.0
    heads = arch.num_attention_heads
    overflowing = -(-arch.num_layers // 2) * arch.hidden_size * m.sizes(train).residual / (2 * heads)
    length = float(train.sequence_length)
    if not forward_after_backward(train):
        length = min(length, overflowing)
    return train.micro_batch_completions * heads * length * length * m.FP32_BYTES / 2


def states_in_head_tile_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """What the embedding's optimizer state leaves of a segment of the fused LM head's logits tile, cut from it in the
    first optimizer step and kept there for the rest of the run.

    TRL's fused head (lm_head.fused_tile_bytes) asks for its tile in the loss forward and again in the backward, each
    a segment of its own when none is free, and frees it before the loss returns. The first optimizer step then makes
    the states, the embedding's first (vocab x hidden elements each, the largest the step makes); best fit cuts each
    from the smallest free block that holds it, and where a state is smaller than the tile the tile's free segments
    are such blocks. The state keeps its segment from being released, and what it leaves beside it, tile - state, is
    too short when the next step's loss asks for the tile: a segment more. At the need of SmolLM2-135M with TRL's
    defaults (float32, fused AdamW; 4,096 x 32,768 bfloat16 tiles of 256 MiB, 108 MiB states) the two states lay in
    the forward's and the backward's tile segments (77 MiB cached beside one), the next forward took a third, the
    head's gradient was cut from it (148 MiB beside it) and the backward's tile found no segment; with 8-bit AdamW a
    27 MiB state lay in a tile segment beside 180 MiB when the next forward asked for the tile. Counted for one state:
    where the loss leaves other blocks between the state and the tile, best fit may take one of those instead, and the
    fit weighs the pattern.

    Nothing where a state is larger than the tile (the larger vocabularies in float32) or so small the small pool
    serves it (1 MiB or less), under LoRA (the adapters' states are small), with paged, factored or no states, or under
    ZeRO or FSDP (sharded). The tile grows with the scored tokens up to its chunk and the state is fixed, so the bytes
    never fall as the tokens or the micro-batch grow."""
    if not whole_large_states(train):
        return 0.0
    tile = fused_tile_bytes(train, train.release, train.micro_batch_completions)
    state = arch.vocab_size * arch.hidden_size * state_element_bytes(train)
    if state > tile or state <= K_SMALL_SIZE:
        return 0.0
    return float(tile - state)


def prefill_state_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """What the first optimizer step's states leave of the segments generation's prefill left cached, cut from them
    and kept there for the rest of the run (full fine-tuning, generating in this process).

    The prefill, generate()'s forward of the whole generation batch's prompts before the first loss, asks for its
    MLP-wide tensors (prompt tokens x intermediate in the compute dtype), a segment each of their size
    (allocator.sizes.allocation_size; under 10 MiB they share the 20 MiB segments), and frees them layer by layer.
    The first optimizer step then makes the states, per layer one per linear (in x out elements each); best fit cuts
    a state from the smallest free block that holds it, and the prefill's segments, smaller than the loss's, are
    those blocks for a state no larger than one. The state keeps its segment from being released, and what it leaves
    beside it, segment - state where one state fills the segment past half, is too short for the next layer's state
    and for the loss's requests when a later step runs short. phi-2 with TRL's defaults (2,048 prompt tokens: 40 MiB
    segments; 25 MiB float32 attention projections) held 71 such segments at its need, each with a 25 MiB projection's
    gradient beside 15 MiB (the backward cuts the gradients, as large as the states, from them the same way);
    Mistral-7B-v0.3 in float32 with 8-bit AdamW filled its 56 MiB segments with the MLP's 56 MiB states and cut the 16
    MiB attention ones from 112 MiB segments (the float32 MLP-wide tensors of the prefill), 608 MiB beside them; with
    fused AdamW 39 of those held a 64 MiB state beside 48 MiB. The float32 segments are not counted: weighed beside
    these, the fit left more points short (benchmarks/reserve_fit.py).

    Counted per layer as the most one state strands in one such segment, min(segment - state, state) over the states
    of 10 MiB or more that fit (smaller ones find smaller blocks in the 20 MiB segments): exact where one state fills
    the segment past half (tests/model/test_fragmentation.py replays it), a bound where several share it, for the fit
    to weigh. Nothing under LoRA (the adapters' states are small), with vLLM (no prefill in this process), with
    paged, factored or no states, or under ZeRO or FSDP (sharded). The segment grows with the prompts and the
    generation batch, and no term falls as it grows, so the bytes never fall as they do."""
    if train.use_vllm or not whole_large_states(train):
        return 0.0
    request = (train.local_generation_batch_size * train.max_prompt_length * arch.intermediate_size
               * m.sizes(train).compute)
    if request < K_MIN_LARGE_ALLOC:  # packed with others in the 20 MiB segments: no segment of its own to free
        return 0.0
    segment = allocation_size(request, K_LARGE_BUFFER)
    element = state_element_bytes(train)
    states = {linear.in_features * linear.out_features * element for linear in arch.layer_linears()}
    return float(arch.num_layers * max((min(segment - state, state) for state in states
                                        if K_MIN_LARGE_ALLOC <= state <= segment), default=0))


