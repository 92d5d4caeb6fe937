"""What the allocation patterns are made of: the rest a kept block leaves of the cached block best fit cut it from,
the largest block a layer asks for per token, and the optimizer states that strand segments; and the one pattern
every phase holds, the loaded weights' segments. Shared by the loss's patterns (vram_planner.model.fragmentation) and
generation's (vram_planner.model.generation_patterns). Pure Python."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from vram_planner.allocator.sizes import K_MIN_LARGE_ALLOC, K_SMALL_SIZE
from vram_planner.model import blocks
from vram_planner.model import components as m
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.lm_head import backward_block_bytes, uses_fused_head
from vram_planner.model.spec import Optimizer, TrainingConfig

if TYPE_CHECKING:
    from vram_planner.allocator.caching import CachingAllocator


def loaded_weight_segment_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """What the loaded weights' segments hold beyond the weights, for the whole run: a pattern the allocator's rules
    make exactly, added to every phase's fitted reserve as it is (phases._reserve), not weighed by a fit.

    The weights are the first tensors the process puts on the card, one cudaMalloc each under torch's default
    allocator: a weight of 10 MiB or more gets a segment of its own, rounded up to 2 MiB (allocator.sizes.
    allocation_size), and what that leaves beside it, less than 2 MiB, serves only a request between the small pool's
    1 MiB and itself; the segment is never released while the weight lives. The later weights of 1 to 10 MiB are cut
    from such rests where they fit (DeepSeek-R1-Distill-Qwen-1.5B's 1.5 MiB float32 key and value projections fill
    the 1.5 MiB its 52.5 MiB MLP weights leave), so the parameters are loaded through the allocator model in the
    model's order (the policy's, then a reference model's: beta without PEFT) and what the segments of the large
    weights hold beside them is counted, a remainder under 1 MiB included, which the allocator leaves inside the
    weight's block (the same model's 445.1 MiB bfloat16 embedding takes a 446 MiB block). At the need of
    Qwen2.5-0.5B's float32 LoRA (896 x 4,864 MLP weights of 16.6 MiB in 18 MiB segments) 72 such rests held 99 MiB
    of a 2.5 GiB step, none of it used; Qwen2.5-1.5B's bfloat16 MLP weights (26.25 MiB) leave 1.75 MiB each,
    Llama-3.2-1B's and Mistral-7B's (whole 2 MiB multiples) nothing. Weights under 10 MiB share 20 MiB segments with
    later tensors, and what they leave there is not counted.

    Nothing under expandable segments (weights are mapped page by page, end to end), with 4-bit weights (packed and
    quantized on the way in), or under ZeRO or FSDP (flattened and sharded)."""
    if train.expandable_segments or train.load_in_4bit or train.zero_stage is not None or train.fsdp:
        return 0.0
    copies = 2 if train.computes_ref_logps and not train.uses_lora else 1
    return float(_loaded_rest_bytes(arch, m.sizes(train).weight, copies))


def reference_logits_stranded_bytes(arch: ModelArchitecture, train: TrainingConfig, positions: int) -> float:
    """What the reference's logits strand as accelerate copies them to float32, inside TRL 0.14's loss (the release's
    step_structure "loss_merged": the reference's log-probs are computed after the policy's forward, while its graph
    is alive): added at that moment as it is, not weighed by a fit (phases._reserve).

    The policy's pass asks for its logits in the compute dtype (L bytes), for accelerate's float32 copy of them
    (2L), frees the logits, makes each sequence's log_softmax in float32 (kept for backward, R bytes each, about 2L
    / B for B sequences), and frees the copy. Best fit cuts the log_softmax rows from the logits' freed block of L,
    the smallest that holds one, so that block is taken when the reference asks for its own logits of L; the
    smallest free block that holds them is then the copy's of 2L, and what they leave of it, L, is too short for the
    reference's float32 copy, which takes a segment of its own. One granule below the need of Qwen2.5-0.5B's LoRA
    with 4 x 787 completion logits (TRL 0.14, bf16 weights under bf16 autocast, oxen.ai's settings) two of the
    policy's 456 MiB rows lay in a 914 MiB segment, and the reference's 912 MiB logits in the copy's 1,826 MiB one
    beside 914 MiB free when its 1,825 MiB copy ran out.

    What the allocator does with this at a step's need varies with what came before, and one half is what it strands
    most often (benchmarks/results/boundary-trl-0.14.0.txt): where the card is tight enough that cudaMalloc fails
    during the reference's forward, the copy's wholly free segment is released first, and the reference's logits take
    a segment of their size (Llama-3.2-1B's checkpointed step with 8-bit AdamW: nothing stranded at its need, the
    estimate 8.5% over it); where the policy's rows that the logits' block cannot hold took half of a segment the
    previous backward freed, and the reference's forward cut a few MiB from the other half, both segments strand a
    half (Qwen2.5-0.5B's checkpointed full fine-tuning, 8 x 1,025 logits: 9.1% under, in TRL 0.14's own band).

    Nothing without autocast (no copy: the logits' own block is free again when the reference asks for the same
    size), where a row is larger than the logits' block (one sequence: it stays free for the reference's logits), or
    in releases that score the reference before the loss. `positions`: the logits' positions per sequence
    (lm_head.logit_positions)."""
    if train.release.step_structure != "loss_merged" or train.mixed_precision == "no":
        return 0.0
    compute = m.sizes(train).compute
    if compute >= m.FP32_BYTES:
        return 0.0
    logits = train.micro_batch_completions * positions * arch.vocab_size * compute
    one_row = (positions - 1) * arch.vocab_size * m.FP32_BYTES
    return float(logits) if one_row <= logits else 0.0


def scores_whole_logits_apart(train: TrainingConfig) -> bool:
    """Whether the release makes the whole logits and scores them in a loss of their own (profiles/trl.toml lm_head
    "full_logits", step_structure "phased": TRL 0.15 to 1.14), under torch's default allocator."""
    release = train.release
    return (release.lm_head == "full_logits" and release.step_structure == "phased"
            and not uses_fused_head(train, release) and not train.expandable_segments)


def head_block_counted(train: TrainingConfig) -> bool:
    """Whether head_block_stranded_bytes counts the block: not for LoRA under gradient checkpointing, where what
    strands it is one tensor that lands there by chance (verdict.need_above_band gives those steps a band)."""
    return scores_whole_logits_apart(train) and not (train.gradient_checkpointing and train.uses_lora)


def head_block_stranded_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """What the previous backward's freed logits blocks strand when the LM head's backward asks for its largest block
    (lm_head.backward_block_bytes, B), in the releases that make the whole logits and score them in a loss of their
    own (scores_whole_logits_apart): added at that moment of a step after the first as it is, not weighed by a fit
    (phases._reserve).

    The previous step's (or micro-batch's) LM head backward leaves segments of B cached, the largest blocks there are.
    The next loss forward keeps its tensors in the blocks of their sizes the previous backward freed; those no such
    block is left for (some went to generation, to the optimizer step's gradients) are cut from the smallest free
    block that holds them, one of B, and what they leave of it is too short when the LM head's backward asks for B
    again: a segment of B more. One granule below the need of Qwen2.5-0.5B's bfloat16 full fine-tuning without
    checkpointing, 8 x 1,024 completions (TRL 0.19.1, transformers 4.53.1), its last layer's three 114 MiB MLP tensors
    and the final norm's output lay in a 4,748 MiB segment, 4,364 MiB free beside them, when the backward asked for
    4,748 MiB; every point of boundary-trl-0.19.1.txt and boundary-trl-1.0.0.txt runs out there.

    The whole of B is counted, the bound rather than the mean: what the forward cuts is small beside it, and how much
    more the backward's row blocks use varies with what came before (Llama-3.2-1B's bfloat16 full fine-tuning, same
    batch, stranded 0.65 B at its need under TRL 0.19). Under gradient checkpointing with LoRA the forward keeps only
    the layers' inputs, which find the blocks the previous forward left, and the block is free again for the backward
    unless the one tensor kept after them, the final norm's output, lands in it (head_block_counted): not counted, as
    counting it would put those steps up to 24% over their need under TRL 1.0, where 5 of 15 such points stranded it
    (SmolLM2-135M's LoRA with 128 x 256 completions 16.2% under its need; verdict.need_above_band). How it lands
    there (benchmarks/held_below_need.py --placements training, that point under TRL 1.14): at the need the first
    step's LM head backward cannot cudaMalloc its block and releases every whole cached segment (12, 10,308 MiB), so
    of the forward's MLP segments only those the checkpointed inputs pin survive; the second forward fills them with
    its inputs, two 72 MiB ones to each 192 MiB segment, and the last layers' working tensors (192 and 384 MiB) and
    the final norm's float32 144 MiB input are cut from the free logits segment instead. Where a larger segment that
    an input pins survives beside them (SmolLM2-135M's LoRA with 16 x 4,096 completions: a 578 MiB one), the working
    tensors and that input land there and nothing strands: which segments survive depends on the moment of the
    release, which no closed form here follows."""
    if not head_block_counted(train):
        return 0.0
    return backward_block_bytes(arch, train, train.release, train.micro_batch_completions)


@functools.lru_cache(maxsize=256)
def _loaded_rest_bytes(arch: ModelArchitecture, element_bytes: float, copies: int) -> int:
    # plan's searches estimate one model thousands of times: the loading is replayed once per model and dtype
    from vram_planner.allocator.caching import CachingAllocator, OutOfMemory

    allocator, requested = CachingAllocator(), {}
    try:
        for _ in range(copies):
            for elements in blocks.parameter_tensors(arch):
                size = int(blocks.blocks(elements * element_bytes))
                requested[allocator.malloc(size)] = size
    except OutOfMemory:  # a weight past what cudaMalloc is ever asked for (1 EB): no card loads it, the bytes say so
        return 0
    return rest_beside_large_blocks(allocator, requested)


def rest_beside_large_blocks(allocator: CachingAllocator, requested: dict[int, int]) -> int:
    """What the allocator model's segments that hold a live block of 10 MiB or more hold beyond the requests living
    in them (`requested`: each live block's address and requested size): their free blocks, and the part of a block
    the allocator did not split off (a large block keeps a remainder under 1 MiB: CUDACachingAllocator.cpp
    should_split)."""
    return sum(size - requested[address] if allocated else size
               for segment in allocator.segment_blocks()
               if any(allocated and size >= K_MIN_LARGE_ALLOC for _, size, allocated in segment)
               for address, size, allocated in segment)


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


def largest_request_token_bytes(arch: ModelArchitecture, train: TrainingConfig) -> int:
    """A token's share of the largest block a layer asks for: the MLP's intermediate activation in float32 where the
    output projection reads it so (a LoRA adapter on it is float32 and PEFT casts its input to it; a float32 model
    computes there), else in the compute dtype."""
    s = m.sizes(train)
    reads_intermediate = arch.layer_linears()[-1].name  # the MLP's output projection
    adapted = train.uses_lora and reads_intermediate in arch.resolve_lora_targets(train.lora_targets)
    in_float32 = adapted or s.residual == m.FP32_BYTES
    return arch.intermediate_size * (m.FP32_BYTES if in_float32 else s.compute)


def whole_large_states(train: TrainingConfig) -> bool:
    # LoRA's adapters' states are small, ZeRO's and FSDP's sharded; paged states live in managed memory, Adafactor's
    # are factored and SGD keeps none
    opt = train.optim
    return not (train.uses_lora or train.zero_stage is not None or train.fsdp or opt.is_paged
                or not opt.state_tensors)


def state_element_bytes(train: TrainingConfig) -> int:
    # bitsandbytes' 8-bit states are a byte an element, its 32-bit ones float32; torch's follow the parameter
    opt = train.optim
    return 1 if opt.is_8bit else m.FP32_BYTES if opt is Optimizer.lion_32bit else m.sizes(train).trainable
