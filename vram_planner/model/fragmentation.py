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
from vram_planner.model.lm_head import fused_tile_bytes
from vram_planner.model.spec import Optimizer, TrainingConfig

# The patterns by name, as the calibration's reserve coefficients name them beside the tensor components.
PINNED_LAYER_INPUTS = "pinned_layer_inputs"
LATE_GRADIENT = "late_gradient"
LARGEST_REQUEST = "largest_request"
EAGER_SCORES = "eager_scores"
SOFTCAPPED_SCORES = "softcapped_scores"
SMALL_SEGMENTS = "small_segments"
LATER_MICRO_BATCH = "later_micro_batch"
LAYER_GRADIENTS = "layer_gradients"
CACHE_IN_LOSS_SEGMENTS = "cache_in_loss_segments"
CACHE_IN_PREFILL_SEGMENTS = "cache_in_prefill_segments"
STATES_IN_DECODING_SEGMENTS = "states_in_decoding_segments"
CACHE_IN_MICRO_BATCH_SEGMENTS = "cache_in_micro_batch_segments"
EAGER_OVERFLOW = "eager_overflow"
STATES_IN_HEAD_TILE = "states_in_head_tile"
PREFILL_STATES = "prefill_states"
# The loss forward/backward's patterns (benchmarks/reserve_fit.py fits them on the steps that run out there)
PATTERNS = (PINNED_LAYER_INPUTS, LATE_GRADIENT, LARGEST_REQUEST, EAGER_SCORES, SOFTCAPPED_SCORES, SMALL_SEGMENTS,
            LATER_MICRO_BATCH, LAYER_GRADIENTS, EAGER_OVERFLOW, STATES_IN_HEAD_TILE, PREFILL_STATES)
GENERATION_PATTERNS = (CACHE_IN_LOSS_SEGMENTS, CACHE_IN_PREFILL_SEGMENTS, STATES_IN_DECODING_SEGMENTS,
                       CACHE_IN_MICRO_BATCH_SEGMENTS)
# MLP-wide tensors a gated MLP's forward holds at once (act(gate), up and their product; the gate is freed once
# activated), a plain one's (fc1's output and its activation): modeling_llama's and modeling_phi's MLP.forward
GATED_MLP_LIVE, PLAIN_MLP_LIVE = 3, 2


def reserve_patterns(arch: ModelArchitecture, train: TrainingConfig, phase: str) -> dict[str, float]:
    """The patterns alive at a phase's peak, in bytes: the loss forward/backward's, and generation's KV cache in the
    segments the previous step's loss left; the other phases' reserve is a share of their tensors. Expandable
    segments map pages to fit each request, so none of these strands: theirs are expandable_pages'."""
    if train.expandable_segments:
        return {}
    if phase == "generation":
        return {CACHE_IN_LOSS_SEGMENTS: cache_in_loss_segment_bytes(arch, train),
                CACHE_IN_PREFILL_SEGMENTS: cache_in_prefill_segment_bytes(arch, train),
                STATES_IN_DECODING_SEGMENTS: states_in_decoding_segment_bytes(arch, train),
                CACHE_IN_MICRO_BATCH_SEGMENTS: cache_in_micro_batch_segment_bytes(arch, train)}
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


def stranded_by_kept_inputs(layers: int, input_bytes: int, projection_bytes: int) -> float:
    """What `layers` kept inputs of `input_bytes` strand in the freed segments of `projection_bytes` requests: per
    layer (projection - k x input) / k, k = projection // input. Exact where the sizes are whole granules of the
    allocator (512 bytes, 2 MiB segments) and k divides the layers; otherwise within a segment's rounding (the last
    segment, partly filled, strands more or less as later tensors fill it). Unrounded, so that it never falls as the
    tokens grow: the planner's searches rely on memory that grows with every knob."""
    if input_bytes <= K_SMALL_SIZE or projection_bytes < input_bytes:
        return 0.0
    sharing = projection_bytes // input_bytes
    return layers * (projection_bytes - sharing * input_bytes) / sharing


def late_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The largest gradient, the embedding's, made last in the backward (full fine-tuning on one GPU): it needs a
    block as large as itself when the cache is cut into the layers' smaller pieces, so the allocator frees what it
    can and takes a segment of its own."""
    if train.uses_lora or train.zero_stage is not None or train.fsdp:
        return 0.0
    return float(arch.vocab_size * arch.hidden_size * m.sizes(train).trainable)


def largest_request_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The largest block of the MLP each layer's backward asks for anew: its intermediate activation in float32 (a
    LoRA adapter on the MLP's output projection is float32 and PEFT casts its input to it; a float32 model computes
    its backward there), else in the compute dtype. The segments earlier layers' requests of that size left are cut
    by smaller tensors by then, so it takes a segment of its own beside them."""
    return float(train.micro_batch_completions * train.sequence_length * _largest_request_token_bytes(arch, train))


def _largest_request_token_bytes(arch: ModelArchitecture, train: TrainingConfig) -> int:
    s = m.sizes(train)
    reads_intermediate = arch.layer_linears()[-1].name  # the MLP's output projection
    adapted = train.uses_lora and reads_intermediate in arch.resolve_lora_targets(train.lora_targets)
    in_float32 = adapted or s.residual == m.FP32_BYTES
    return arch.intermediate_size * (m.FP32_BYTES if in_float32 else s.compute)


def later_micro_batch_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The largest request's block again, where a step runs more than one micro-batch: the next micro-batch's
    forward finds the cache the previous backward left, and best fit cuts its checkpointed layer inputs from the
    blocks of that backward's largest requests (there are no smaller ones of their size), so the block of the first
    layer's backward is too short when that backward asks for it, and the compute-dtype intermediate freed beside it
    is too short as well. At the need of DeepSeek-R1-Distill-Qwen-1.5B and Llama-3.2-1B LoRA with two micro-batches
    the allocator held 640 + 350 and 560 + 320 MiB cached that way when it asked for a 700 or 640 MiB block."""
    if train.gradient_accumulation_steps < 2:
        return 0.0
    return largest_request_bytes(arch, train)


def layer_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The MLP's weight gradients, one per layer, where full fine-tuning makes them in the backward and the blocks
    that layer's intermediate activations freed can hold them (tokens x intermediate in the compute dtype at least a
    gradient, hidden x intermediate in the trainable dtype): best fit cuts each gradient from such a block, and what
    is left of it is too short for the next layer's intermediate; it stays cached, pinned by the gradient, until the
    optimizer step. At the need of Llama-3.2-1B in float32 30 blocks of 96 MiB each held a 64 MiB gradient beside
    32 MiB nobody could use, and Mistral-7B-v0.3 in bfloat16 left 56 and 24 MiB beside its 112 and 32 MiB gradients.
    Counted as stranded_by_gradients bounds it, for the fit to weigh."""
    if train.uses_lora or train.zero_stage is not None or train.fsdp:
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


def cache_in_loss_segment_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """What the KV cache's last blocks strand in the segments the previous step's loss left cached, generating in
    this process.

    Each decoding step's concatenation makes every layer's keys and values anew, one token longer, so the block a
    layer frees is too short for the next one's request; best fit cuts the growing blocks from the largest cached
    blocks, the segments of the loss's largest requests (largest_request_bytes, cached since the previous step), and a
    block that lives in one keeps the allocator from releasing the segment when it runs short. k = segment // block
    of the last step's blocks share such a segment, and what they leave of it is too short for another:
    stranded_by_kept_inputs, per kind of block (keys, values; full and sliding-window layers). At the need of
    Phi-3-mini LoRA (16 sequences of 2,560 tokens, 2,047-token windows) 27 of the 64 blocks of 193 MiB lay three to
    a 640 MiB segment of the loss beside 60 MiB that none could use, and others one to a 360 or 320 MiB segment of
    the loss or the scoring beside 167 or 127 MiB: 1.6 GiB beside the cache where generation ran out.

    The segment is counted for the whole generation batch in one micro-batch, as the blocks are: k micro-batches'
    segments hold k times the blocks beside k times the rest, the same per block where the rest is short of a block
    (Phi-3-mini's 640 MiB segments for 8 sequences, 1,280 for 16: 21 MiB a block). A micro-batch's own segment would
    make the reserve a sawtooth in the micro-batch, rising as it falls (Phi-3-mini's 4 sequences: 320 MiB segments,
    one block each beside 128 MiB), and the plan's bisection relies on memory that grows with it."""
    if train.use_vllm:  # vLLM's cache is its own reservation
        return 0.0
    segment = train.local_generation_batch_size * train.sequence_length * _largest_request_token_bytes(arch, train)
    last = train.sequence_length - 1  # the tokens cached at the last decoding step
    window = min(last, arch.sliding_window or last)
    row = train.local_generation_batch_size * arch.num_kv_heads * arch.head_dim  # elements of one token, one layer
    layers = ((arch.num_layers - arch.sliding_layers, last), (arch.sliding_layers, window))
    return sum(stranded_by_kept_inputs(count, row * tokens * element, segment)
               for count, tokens in layers if count for element in m.kv_element_bytes(train))


def cache_in_prefill_segment_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """What the KV cache's last blocks strand in the segments generation's own prefill left cached.

    The prefill, generate()'s forward of the whole generation batch's prompts, asks in each layer's MLP for tensors of
    prompt tokens x intermediate in the dtype it computes in, a segment each of their size
    (allocator.sizes.allocation_size), a gated MLP three at once, a plain one two (GATED_MLP_LIVE, PLAIN_MLP_LIVE).
    Each layer's prompt keys and values, kept for the decoding, are cut from those segments once the layer frees
    them (best fit: the smallest free block that holds them), so the next layer's MLP finds its segments cut and
    takes new ones: the prefill leaves the MLP's live segments and as many more as the prompts' cache fills,
    prompt cache / MLP tensor of them (independent of the tokens and the batch, as both scale with them). Decoding
    makes every layer's keys and values anew a token longer, and the freed segments are the largest cached blocks
    until the cache's own grow past them: k = segment // block of the last step's blocks lie in each, and what they
    leave, segment - k x block, is too short for another block when the cache runs short. At the need of
    SmolLM2-360M generating 512 sequences of 64 + 256 tokens (MLP tensors of 160 MiB; 32 layers, 5 heads of 64 in
    bfloat16: 3 + 8 segments) 11 segments of 160 MiB each held one 96 MiB block beside 64 MiB where generation ran
    out (the float32 norms' 120 MiB segments three more beside 24 MiB each, which the fit's coefficient covers).

    Counted with the last step's largest block (keys and values alike, full-attention layers), in no more segments
    than the layers' keys and values fill (2 x layers / k): a bound where other tensors take the places, for the fit
    to weigh (tests/model/test_fragmentation.py replays the prefill and the decoding). The rest per segment
    falls as the completion grows, by no more than the count of segments times the block's growth, less than the
    cache's own growth (two blocks a layer, more than the segments); it jumps up where a block fewer fits and
    vanishes where the block outgrows the segment, so the reserve never falls faster than the cache grows (at the
    decoding's moments, which hold the cache; the prefill's carry no generation pattern: phases._reserve). Nothing
    with vLLM (no prefill in this process) or where the MLP's tensors fall in the 20 MiB segments."""
    if train.use_vllm:
        return 0.0
    generating = m.as_generated(train)
    batch, prompt = train.local_generation_batch_size, train.max_prompt_length
    request = batch * prompt * arch.intermediate_size * m.sizes(generating).compute
    if request < K_MIN_LARGE_ALLOC:
        return 0.0
    segment = allocation_size(request, K_LARGE_BUFFER)
    live = GATED_MLP_LIVE if arch.family.gated_mlp else PLAIN_MLP_LIVE
    segments = live + m.kv_cache_bytes(arch, train, batch, prompt, prefill=True) / request
    block = _last_block_bytes(arch, train)
    if block > segment:
        return 0.0
    places = segment // block
    # the keys and values of the layers that keep every token (sliding windows as long as the sequence too): no more
    # blocks of that size
    windowed = arch.sliding_layers if (arch.sliding_window or 0) < train.sequence_length - 1 else 0
    filled = min(segments, 2 * (arch.num_layers - windowed) / places)
    return float(filled * (segment - places * block))


def cache_in_micro_batch_segment_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """A block of the KV cache's last step, for what each of the previous step's loss segments, one micro-batch's
    largest requests (largest_request_bytes), leaves beside the blocks cut from it.

    cache_in_loss_segment_bytes counts the segments as if the whole generation batch were one micro-batch, so that
    the reserve never falls as the micro-batch grows; where the generation batch is many micro-batches the blocks are
    small next to that and it strands next to nothing, but the loss's segments are a micro-batch's, k = segment //
    block blocks lie in each, and the rest, segment - k x block, is a sawtooth in the micro-batch below a block. At
    the need of Mistral-7B-v0.3 LoRA generating 256 sequences of 64 + 384 tokens (221.5 MiB blocks) 8 segments of the
    loss's 392 MiB intermediates held one block beside 170 MiB, 3 of the 784 MiB float32 ones three beside 120 MiB;
    gemma-3-1b-it's (56 MiB blocks) 12 of 190 and 378 MiB three or six beside 22 to 43 MiB. Counted as its envelope,
    one block, for the fit to weigh by the segments (about ten at those needs); nothing where a block outgrows the
    segment, compared a token at a time (the segment holds every token, the last block all but one: compared whole,
    a block would outgrow the segment as the tokens grow). The block grows with the tokens, and the segment with the
    micro-batch, so the bytes never fall as they do; where the generation batch grows past the segment they vanish,
    less than the cache grows by. Nothing with vLLM (its cache is its own reservation)."""
    if train.use_vllm:
        return 0.0
    segment_token = train.micro_batch_completions * _largest_request_token_bytes(arch, train)
    return float(_last_block_bytes(arch, train)) if _block_token_bytes(arch, train) <= segment_token else 0.0


def _last_block_bytes(arch: ModelArchitecture, train: TrainingConfig) -> int:
    # one layer's keys (or values) of the whole generation batch at the last decoding step, the larger of the two
    return _block_token_bytes(arch, train) * (train.sequence_length - 1)


def _block_token_bytes(arch: ModelArchitecture, train: TrainingConfig) -> int:
    # a token of one layer's keys (or values) for the whole generation batch, the larger of the two
    return train.local_generation_batch_size * arch.num_kv_heads * arch.head_dim * max(m.kv_element_bytes(train))


def states_in_decoding_segment_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The first optimizer step's states of the layers, cut from the segments the first generation's decoding left:
    what they keep the next generation's cache from using (full fine-tuning, generating in this process).

    The decoding's last step asks for every layer's keys and values at their longest, a segment each of its block
    rounded up (allocation_size), and frees them when generate() returns; the first optimizer step then makes the
    states, per layer one per linear (in x out elements each, a large-pool block above 1 MiB), and best fit cuts
    those smaller than such a segment from them, between the loss's and the backward's blocks as they are freed.
    A segment that holds a state is not released, and what the state leaves of it is too short for the next
    generation's blocks, which grow to the segment's size: the allocator takes new segments beside them. At the need
    of SmolLM2-360M generating 512 sequences at once (100 MiB segments; 4.7, 1.8 and 0.6 MiB states) about 13
    segments held 1.1 GiB of states beside 530 MiB none of the cache's blocks could use; phi-2 generating 512 x 320
    tokens (798 MiB segments; 12.5 and 50 MiB states) 9.6 GiB of states beside 3.5 GiB, Qwen3-0.6B (320 MiB; 2, 4
    and 6 MiB) 1.7 GiB beside 0.9 GiB. How many segments they spread over depends on the order the step frees its
    blocks in, so the states' bytes are counted, for the fit to weigh (0.3 to 0.5 of them stranded there).

    Nothing where the blocks share the 20 MiB segments (under 10 MiB: the next ones fit beside the states) or the
    states outgrow the segments, under LoRA (the adapters' states are small), with vLLM (no decoding in this
    process), with paged, factored or no states, or under ZeRO or FSDP (sharded). The segment grows with the
    generation batch and the tokens, so more states fit and the bytes never fall as they do."""
    if train.use_vllm or not _whole_large_states(train):
        return 0.0
    block = _last_block_bytes(arch, train)
    if block < K_MIN_LARGE_ALLOC:  # blocks that share the 20 MiB segments: the next ones fit beside the states
        return 0.0
    segment = allocation_size(block, K_LARGE_BUFFER)
    element = _state_element_bytes(train)
    states = [linear.in_features * linear.out_features * element for linear in arch.layer_linears()]
    return float(arch.num_layers * train.optim.state_tensors
                 * sum(state for state in states if K_SMALL_SIZE < state < segment))


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

    The places grow with the sequence ((S / 2) / input is 2 x heads x L / (hidden x residual bytes)), so the inputs
    stop overflowing from L* = ceil(layers / 2) x hidden x residual bytes / (2 x heads) on; from there the bytes stay
    those of the scores at L*, so that the reserve never falls as the tokens grow (the planner's searches rely on
    memory that grows with every knob). Nothing without checkpointing (no kept inputs) or eager attention."""
    if train.attn_implementation != "eager" or not train.gradient_checkpointing:
        return 0.0
    heads = arch.num_attention_heads
    overflowing = -(-arch.num_layers // 2) * arch.hidden_size * m.sizes(train).residual / (2 * heads)
    length = min(float(train.sequence_length), overflowing)
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
    if not _whole_large_states(train):
        return 0.0
    tile = fused_tile_bytes(train, train.release, train.micro_batch_completions)
    state = arch.vocab_size * arch.hidden_size * _state_element_bytes(train)
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
    if train.use_vllm or not _whole_large_states(train):
        return 0.0
    request = (train.local_generation_batch_size * train.max_prompt_length * arch.intermediate_size
               * m.sizes(train).compute)
    if request < K_MIN_LARGE_ALLOC:  # packed with others in the 20 MiB segments: no segment of its own to free
        return 0.0
    segment = allocation_size(request, K_LARGE_BUFFER)
    element = _state_element_bytes(train)
    states = {linear.in_features * linear.out_features * element for linear in arch.layer_linears()}
    return float(arch.num_layers * max((min(segment - state, state) for state in states
                                        if K_MIN_LARGE_ALLOC <= state <= segment), default=0))


def _whole_large_states(train: TrainingConfig) -> bool:
    # LoRA's adapters' states are small, ZeRO's and FSDP's sharded; paged states live in managed memory, Adafactor's
    # are factored and SGD keeps none
    opt = train.optim
    return not (train.uses_lora or train.zero_stage is not None or train.fsdp or opt.is_paged
                or not opt.state_tensors)


def _state_element_bytes(train: TrainingConfig) -> int:
    # bitsandbytes' 8-bit states are a byte an element, its 32-bit ones float32; torch's follow the parameter
    opt = train.optim
    return 1 if opt.is_8bit else m.FP32_BYTES if opt is Optimizer.lion_32bit else m.sizes(train).trainable
