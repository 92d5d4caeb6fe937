"""What expandable segments keep mapped beside long-lived tensors made among transients: the reserve beyond the
tensors under expandable_segments:True, in bytes, for the fitted reserve function to weigh
(vram_planner.model.calibration.allocator_reserve_bytes).

Under expandable segments a pool has one segment that maps pages as requests need them: 20 MiB pages in the large
pool, 2 MiB in the small one (allocator/expandable.py). When a request finds no room, the allocator unmaps every whole
free page and retries (release_cached_blocks); what it cannot unmap is the free memory in the pages live blocks share.
A tensor kept while the transients made around it are freed is an island: the free runs on either side of it reach
into the pages at its two ends, and each end keeps the part of its page up to the page boundary mapped, from nothing
to a page (less where the free run is shorter). A run of islands made one per layer keeps about a page a layer
mapped, where the step runs short (tests/model/test_expandable_pages.py replays it through the allocator model).
Where the islands' ends fall in their pages depends on every size before them, so the patterns count a page an
island, the mean of two ends uniformly placed, for the fit to weigh (benchmarks/reserve_fit.py, on the boundary grid's
expandable points' whole-step needs).

Found by replaying traced steps through the allocator model one granule below their need (benchmarks/boundary.py's
expandable points, and the held-out sweep's, benchmarks/boundary_heldout.py): the mapped free memory after the release
lay beside the backward's layer gradients (full fine-tuning), the first optimizer step's states, and the forward's
kept activations without checkpointing. Pure Python: no torch.
"""

from __future__ import annotations

from vram_planner.allocator.sizes import K_LARGE_BUFFER, K_SMALL_BUFFER, K_SMALL_SIZE
from vram_planner.model import components as m
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.spec import TrainingConfig

# The patterns by name, as the calibration's expandable_segments reserve coefficients name them
GRADIENT_PAGES = "gradient_pages"
KEPT_ACTIVATION_PAGES = "kept_activation_pages"
CHECKPOINTED_INPUT_RUNS = "checkpointed_input_runs"
EXPANDABLE_PATTERNS = (GRADIENT_PAGES, KEPT_ACTIVATION_PAGES, CHECKPOINTED_INPUT_RUNS)


def expandable_patterns(arch: ModelArchitecture, train: TrainingConfig, phase: str) -> dict[str, float]:
    """The patterns alive at the loss forward/backward's peak under expandable segments, in bytes; the other
    phases' reserve is a share of their tensors."""
    if phase != "training":
        return {}
    return {GRADIENT_PAGES: gradient_page_bytes(arch, train),
            KEPT_ACTIVATION_PAGES: kept_activation_page_bytes(arch, train),
            CHECKPOINTED_INPUT_RUNS: checkpointed_input_run_bytes(arch, train)}


def page_bytes(tensor_bytes: float) -> int:
    """The page of the pool a tensor of this size is cut from: 2 MiB for the small pool's (1 MiB or less), else
    20 MiB (torch 2.13's large_segment_size)."""
    return K_SMALL_BUFFER if tensor_bytes <= K_SMALL_SIZE else K_LARGE_BUFFER


def islands_bytes(islands: int, run_bytes: float) -> float:
    """What `islands` live tensors keep mapped beside them once the transients between them, free runs of
    `run_bytes`, are freed and the whole free pages released: a page a run, of the pool such a run is cut from (the
    two partial pages at its ends, each uniformly placed: half a page each on average), and no more than the run
    where it is shorter than a page. Never falls as the run grows. The patterns take the run as long as the layer's
    kept tensor: the transients around it are of its order of size."""
    return float(islands * min(page_bytes(run_bytes), run_bytes))


def gradient_page_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Full fine-tuning's weight gradients, made in each layer's backward among its transients (the intermediates'
    gradients, the recomputed forward under checkpointing) and kept until the optimizer step: a page a layer, the run
    as long as the layer's largest gradient. At the need of Qwen2.5-0.5B in float32 (24 layers) 344 MiB stayed mapped
    in 72 free blocks, most beside the MLP's 16.6 MiB and the attention's 3.1 MiB gradients; gemma-3-1b-it in float32
    (26 layers) 578 MiB in 91 blocks beside its 30.4 MiB MLP gradients.

    The first optimizer step's states, cut by best fit from the free runs between the gradients and kept for the rest
    of the run, keep pages mapped the same way (SmolLM2-135M in bfloat16 with 8-bit AdamW: 47 MiB in 29 blocks of the
    small pool's 2 MiB pages between its sub-MiB states; held out, Qwen3-0.6B in float32 with 8-bit AdamW about 600 MiB
    beside its 2-3 MiB states): a page a layer as well, which the fit could not tell from the gradients' (counted
    apart, as large as the layer's largest state, it weighed them 0), so one pattern counts both. Nothing under LoRA
    (the adapters' gradients and states are small) or ZeRO and FSDP (sharded)."""
    if train.uses_lora or train.zero_stage is not None or train.fsdp:
        return 0.0
    return islands_bytes(arch.num_layers, _largest_weight_elements(arch) * m.sizes(train).trainable)


def kept_activation_page_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Without gradient checkpointing each layer's forward keeps its saved tensors for the backward among the
    tensors it frees: a page a layer, of the pool of its residual-stream tensor (tokens x hidden in the compute
    dtype). At the need of SmolLM2-135M LoRA without checkpointing (30 layers, 22.5 MiB kept tensors) 661 MiB stayed
    mapped in 160 free blocks, 505 MiB of it in 58 blocks beside the kept tensors; held out, SmolLM2-135M and phi-2
    LoRA without checkpointing were 3.1% and 1.1% under their needs that way. Nothing with checkpointing (the forward
    keeps one input a layer, made as the layer's tensors are freed: fragmentation's pinned inputs)."""
    if train.gradient_checkpointing:
        return 0.0
    tokens = train.micro_batch_completions * train.sequence_length
    return islands_bytes(arch.num_layers, tokens * arch.hidden_size * m.sizes(train).compute)


def checkpointed_input_run_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Under gradient checkpointing each layer's forward keeps one tensor, the next layer's input, made while the
    layer's transients are alive: once they are freed, the free runs beside the inputs stay partly mapped where the
    step runs short, a few MiB a layer whatever the input's size. At the need of SmolLM2-135M's float32 LoRA with 4 x
    256 tokens a micro-batch (held-out seed 4; 2.2 MiB inputs) 89 MiB stayed mapped in 85 free blocks, most of them
    2.1 MiB runs between its 31 inputs; at the grid's bfloat16 LoRA with 32 x 2,304 tokens (81 MiB inputs) 101 MiB
    in 45 blocks. A share of the step that grows as the step shrinks: 3 to 8% of the held-out SmolLM2 steps of one or
    two GiB that ran 2 to 4% short of their needs. Counted as a small page a layer, for the fit to weigh; the grid's
    laptop steps (LoRA, 4 x 256 tokens), added after the pattern was read, were 1.0% to 2.6% under their needs at 3 of
    10 models without it. Nothing without checkpointing (kept_activation_page_bytes)."""
    if not train.gradient_checkpointing:
        return 0.0
    return float(arch.num_layers * K_SMALL_BUFFER)


def decoding_cache_hole_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """A bound on what generate()'s growing keys and values keep mapped beyond the live tensors under expandable
    segments: a page a layer, or the layer's block of keys (or values) at the last step where shorter; the allocator
    model's replays of the decoding alone reached at most 0.69 of it. Not a pattern the reserve weighs but the band
    the verdict reads (verdict.Verdict.near_boundary): what the decoding strands there has no closed form.

    Each decoding step concatenates every layer's keys and values into blocks a token longer than the ones it frees,
    so no freed block fits the next step's request; best fit places the new blocks in free runs that merged or in new
    pages, and the freed blocks left between them, each shorter than the next request, cannot be unmapped where they
    hold no whole page. At the need of held-out seed 1's QLoRA SmolLM2-360M (64 sequences of 64 + 384 tokens, 32
    layers of 17.5 MiB blocks) 16 of them, 13.8 to 16.3 MiB each, lay between pairs of live blocks: 339 MiB mapped and
    free where a 52 MiB request failed, the estimate 10.2% under the need. How many such runs the decoding leaves
    depends on every size before them: 265 MiB replayed for that shape, 35 MiB with 30 layers, 24 MiB with 96-token
    prompts (benchmarks/decoding_holes.py, which replays random shapes beside this bound).
    Nothing where vLLM generates or under torch's default allocator (generation_patterns counts its segments)."""
    if not train.expandable_segments or train.use_vllm:
        return 0.0
    kv = m.kv_cache_bytes(arch, train, train.local_generation_batch_size, train.sequence_length - 1)
    return islands_bytes(arch.num_layers, kv / (2 * max(arch.num_layers, 1)))


def _largest_weight_elements(arch: ModelArchitecture) -> int:
    return max(linear.in_features * linear.out_features for linear in arch.layer_linears())
