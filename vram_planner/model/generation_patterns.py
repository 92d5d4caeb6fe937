"""Generation's allocation patterns: where the KV cache's blocks, the prompts' forward and the first optimizer step's
states leave the caching allocator's cached memory where generate()'s largest requests cannot use it, in bytes, for
the fitted reserve function to weigh (vram_planner.model.calibration.allocator_reserve_bytes) on top of the phase's
per-component shares. The decoding's patterns weigh on its moments, the prefill's on the prefill's
(vram_planner.model.phases._reserve): at the prefill no decoding block exists yet.

Found as the loss's were (vram_planner.model.fragmentation): replaying traced steps through the allocator model and
reading its segments where the step runs out just below its need. Pure Python: no torch.
"""

from __future__ import annotations

import functools
import math

from vram_planner.allocator.sizes import (K_LARGE_BUFFER, K_MIN_LARGE_ALLOC, K_ROUND_LARGE, K_SMALL_SIZE,
                                          allocation_size)
from vram_planner.model import components as m
from vram_planner.model import inference
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.stranding import (largest_request_token_bytes, state_element_bytes, stranded_by_kept_inputs,
                                          whole_large_states)

CACHE_IN_LOSS_SEGMENTS = "cache_in_loss_segments"
CACHE_IN_PREFILL_SEGMENTS = "cache_in_prefill_segments"
STATES_IN_DECODING_SEGMENTS = "states_in_decoding_segments"
CACHE_IN_MICRO_BATCH_SEGMENTS = "cache_in_micro_batch_segments"
PREFILL_LARGEST_REQUEST = "prefill_largest_request"
DECODING_REPEATED_KV = "decoding_repeated_kv"
# Those of generate()'s forward of the prompts, weighed at its moments; the rest at the decoding's
PREFILL_PATTERNS = (PREFILL_LARGEST_REQUEST,)
GENERATION_PATTERNS = (CACHE_IN_LOSS_SEGMENTS, CACHE_IN_PREFILL_SEGMENTS, STATES_IN_DECODING_SEGMENTS,
                       CACHE_IN_MICRO_BATCH_SEGMENTS, DECODING_REPEATED_KV, *PREFILL_PATTERNS)
# MLP-wide tensors a gated MLP's forward holds at once (act(gate), up and their product; the gate is freed once
# activated), a plain one's (fc1's output and its activation): modeling_llama's and modeling_phi's MLP.forward
GATED_MLP_LIVE, PLAIN_MLP_LIVE = 3, 2
# The segments below a step's tried for the last lengths each holds, at the least: the 2 MiB rounding makes one more
# block fit a few tokens before the step, and flicker below it (one more fits just after each rounding up, one fewer
# before it); further down where the segment grows little faster than the blocks (_PrefillSegments.flickering_segments),
# up to FLICKER_STEPS below the highest: where the segment outgrows the blocks by less than a 64th of its growth, the
# rounding flickers over more sizes than an estimate tries (a bound: a config of any size stays a few hundred lengths)
ROUNDING_STEPS = 3
FLICKER_STEPS = 64


def generation_patterns(arch: ModelArchitecture, train: TrainingConfig) -> dict[str, float]:
    """Generation's patterns, in bytes: the KV cache's last blocks in the segments the previous step's loss, the
    prefill and one micro-batch's loss left, the first step's states in the decoding's segments, the decoding's
    copies of grouped keys and values, and the prefill's largest request beside a segment the previous layer's
    left."""
    return {CACHE_IN_LOSS_SEGMENTS: cache_in_loss_segment_bytes(arch, train),
            CACHE_IN_PREFILL_SEGMENTS: cache_in_prefill_segment_bytes(arch, train),
            STATES_IN_DECODING_SEGMENTS: states_in_decoding_segment_bytes(arch, train),
            CACHE_IN_MICRO_BATCH_SEGMENTS: cache_in_micro_batch_segment_bytes(arch, train),
            DECODING_REPEATED_KV: decoding_repeated_kv_request_bytes(arch, train),
            PREFILL_LARGEST_REQUEST: prefill_largest_request_bytes(arch, train)}


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
    segment = train.local_generation_batch_size * train.sequence_length * largest_request_token_bytes(arch, train)
    last = train.sequence_length - 1  # the tokens cached at the last decoding step
    window = min(last, arch.sliding_window or last)
    row = train.local_generation_batch_size * arch.num_kv_heads * arch.head_dim  # elements of one token, one layer
    layers = ((arch.num_layers - arch.sliding_layers, last), (arch.sliding_layers, window))
    return sum(stranded_by_kept_inputs(count, row * tokens * element, segment)
               for count, tokens in layers if count for element in m.kv_element_bytes(train))


def cache_in_prefill_segment_bytes(arch: ModelArchitecture, train: TrainingConfig,
                                   shorter_prompts: bool = True) -> float:
    """What the KV cache's last blocks strand in the segments generation's own prefill left cached (without
    `shorter_prompts`: at max_prompt_length only, as a step traced there meets it).

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
    With eager attention the layer's largest tensor can be the float32 scores softmax makes, [B, heads, p, p]
    (prefill_largest_request_bytes), one alive at a time: where they outgrow the MLP's tensors the prefill's segments
    are theirs, 1 + prompt cache / scores of them. At the need of Qwen3-0.6B LoRA generating 512 sequences of 256 +
    128 tokens (2 GiB scores against the MLP's 768 MiB; 383 MiB blocks) nine 2 GiB segments held three to five blocks
    each beside 133 to 902 MiB, none room for the repeated keys' 766 MiB, where generation ran out.

    Counted with the last step's largest block (keys and values alike, full-attention layers), in no more segments
    than the layers' keys and values fill (2 x layers / k): a bound where other tensors take the places, for the fit
    to weigh (tests/model/test_generation_patterns.py replays the prefill and the decoding). The rest per segment
    falls as the completion grows, by no more than the count of segments times the block's growth, less than the
    cache's own growth (two blocks a layer, more than the segments); it jumps up where a block fewer fits and
    vanishes where the block outgrows the segment, so the reserve never falls faster than the cache grows (at the
    decoding's moments, which hold the cache; the prefill's weigh its own patterns only: phases._reserve).

    A batch's prompts are as long as its longest, so a run meets every prompt length up to max_prompt_length, and
    the rest per segment falls by nearly a block where one more block fits as the prompt grows (the segment, prompt
    tokens x a width, outgrows the block, prompt + completion tokens x a narrower one): at Qwen3-0.6B LoRA generating
    64 sequences of p + 512 tokens the exact engine needs 15.64 GiB at p = 1,000 and 13.93 GiB at p = 1,024, where
    two blocks fit. A shorter prompt's rest is counted less the cache it does not make (most_stranded): the
    decoding holds that cache, so the moment never needs less for a longer prompt, and a rest the shorter cache
    outweighs counts for nothing (at 512 x (127 + 128) tokens Qwen3-0.6B's eager LoRA strands more
    than at 256 + 128, and needs 18.2 GiB against 28.5). Nothing with vLLM (no prefill in this process) or where the
    largest tensors fall in the 20 MiB segments."""
    if train.use_vllm:
        return 0.0
    try:
        hash(train)
    except TypeError:  # a list of LoRA target modules: counted afresh
        return _prefill_segment_bytes(arch, train, shorter_prompts)
    return _cached_prefill_segment_bytes(arch, train, shorter_prompts)


def _prefill_segment_bytes(arch: ModelArchitecture, train: TrainingConfig, shorter_prompts: bool) -> float:
    segments = _PrefillSegments(arch, train)
    prompt = train.max_prompt_length
    return segments.most_stranded(prompt) if shorter_prompts else segments.stranded(prompt)


# every generation moment of an estimate asks, and the shorter prompts cost a few dozen layouts
_cached_prefill_segment_bytes = functools.lru_cache(maxsize=4096)(_prefill_segment_bytes)


class _PrefillSegments:
    """cache_in_prefill_segment_bytes for one config at any prompt length: the prefill's largest request and the
    last decoding step's block, per prompt token."""

    def __init__(self, arch: ModelArchitecture, train: TrainingConfig) -> None:
        self.arch = arch
        self.completion = train.max_completion_length
        batch = train.local_generation_batch_size
        self.block_token = _block_token_bytes(arch, train)
        # a prompt token's bytes of one MLP tensor; eager attention's scores: times the prompt squared
        self.mlp_token = batch * arch.intermediate_size * m.sizes(m.as_generated(train)).compute
        self.scores_token = _eager_prefill_scores_bytes(arch, train, 1)
        self.mlp_live = GATED_MLP_LIVE if arch.family.gated_mlp else PLAIN_MLP_LIVE
        self.cache_token_layer = batch * m.kv_cache_bytes(arch, train, 1, 1, prefill=True) / arch.num_layers
        self.keep_all = train.transformers.sliding_prefill_storage == "prompt"

    def request(self, prompt: int) -> tuple[int, int]:
        """The prefill's largest request and how many of its size are alive at once."""
        mlp, scores = self.mlp_token * prompt, self.scores_token * prompt * prompt
        return (scores, 1) if scores > mlp else (mlp, self.mlp_live)

    def block(self, prompt: int) -> int:
        return self.block_token * (prompt + self.completion - 1)

    def stranded(self, prompt: int) -> float:
        """What the last step's blocks leave of the prefill's segments where the longest prompt is `prompt` tokens."""
        request, live = self.request(prompt)
        segment, block = allocation_size(request, K_LARGE_BUFFER), self.block(prompt)
        if request < K_MIN_LARGE_ALLOC or block > segment:
            return 0.0
        places = segment // block
        return self.filled(prompt, places) * (segment - places * block)

    def filled(self, prompt: int, places: int) -> float:
        """The prefill's segments that hold the last step's blocks: the largest request's live ones and as many more
        as the prompts' cache fills, no more than the blocks of the layers that keep every token (sliding windows as
        long as the sequence too) fill."""
        request, live = self.request(prompt)
        segments = live + self.cache_token_layer * self.arch.kv_layers_tokens(prompt, self.keep_all) / request
        windowed = self.arch.sliding_layers if (self.arch.sliding_window or 0) < prompt + self.completion - 1 else 0
        return min(segments, 2 * (self.arch.num_layers - windowed) / places)

    def cache(self, prompt: int) -> float:
        """The KV cache the last decoding step holds for prompts of `prompt` tokens."""
        return self.cache_token_layer * self.arch.kv_layers_tokens(prompt + self.completion - 1)

    def most_stranded(self, prompt: int) -> float:
        """The most stranded at any prompt length up to `prompt`, a shorter prompt's less the cache it does not make.
        The rest per segment grows with the prompt while the count of blocks, the largest request and the layers the
        blocks come from hold, and falls where one of them steps: just before `places` + 1 blocks fit (stretch_end)
        `places` leave nearly a block each (candidates)."""
        length, rest = self.heaviest(prompt)
        return rest - (self.cache(prompt) - self.cache(length))

    def heaviest(self, prompt: int) -> tuple[int, float]:
        """The prompt length up to `prompt` whose rest, with the cache it makes, is the most, and that rest (the
        longer of equals)."""
        return max(self.candidates(prompt), key=lambda found: (found[1] + self.cache(found[0]), found[0]))

    def candidates(self, prompt: int) -> list[tuple[int, float]]:
        """`prompt` and the shorter prompt lengths where the rest may be largest, each with what it strands: the
        last lengths before one more block fits, and the lengths of the segment they end in and of the segments below
        it that may strand the most (the segments' rounding up to 2 MiB makes one more fit some tokens early, and
        flicker below the step: flickering_segments), and those of the prompt's own segment (stair)."""
        request, _ = self.request(prompt)
        if request < K_MIN_LARGE_ALLOC:  # nor at any shorter prompt
            return [(prompt, 0.0)]
        segment = allocation_size(request, K_LARGE_BUFFER)
        lengths = [math.floor(step) for step in self.steps() if 1 <= step < prompt] + self.stair(segment)
        for places in range(1, int(segment // self.block(prompt))):
            end = self.stretch_end(places + 1)
            last = prompt - 1 if end >= prompt else math.ceil(end) - 1  # the last whole length with a block fewer
            if last >= 1:
                lengths.append(last)
                for below in self.flickering_segments(places + 1, last):
                    lengths += self.stair(below)
            if end >= prompt:  # the stretches of more blocks end later still
                break
        return [(prompt, self.stranded(prompt))] + [(length, self.stranded(length)) for length in set(lengths)
                                                    if 1 <= length < prompt]

    def flickering_segments(self, places: int, last: int) -> list[int]:
        """The segments, from the one of length `last` down, in which `places` blocks may fit or not as the 2 MiB
        rounding falls: ROUNDING_STEPS below it, and those of the lengths where the segment falls short of the
        blocks by less than 2 MiB, down from `last` to where the segment rounded up by nearly 2 MiB first holds them
        (stretch_end with that slack): 2 MiB over how much faster the segment grows than the blocks. At gemma-2-2b's
        float32 cache of 64 x (p + 8) tokens (0.25 MiB a token a block) four blocks fit in the bfloat16 MLP segments
        (1.125 MiB a token) from p = 64 on, and at every even p from 48: nine segment sizes below, where three left 13
        to 15 MiB each at every odd p (found by the hypothesis sweep of tests/model/test_generation_patterns.py).
        Where the blocks grow faster than the segment, only prompts short enough that the gap stays under 2 MiB."""
        def segment(length: int) -> int:
            return allocation_size(self.request(length)[0], K_LARGE_BUFFER)

        below = segment(last)
        found = set(range(below, below - ROUNDING_STEPS * K_ROUND_LARGE - 1, -K_ROUND_LARGE))
        start, longest = self.stretch_end(places, slack=K_ROUND_LARGE), last
        step = places * self.block_token
        if not math.isfinite(start):
            start = 1
            if step > self.mlp_token and not self.scores_token:
                gap = K_ROUND_LARGE - step * (self.completion - 1)
                longest = min(last, math.floor(gap / (step - self.mlp_token)))
        if longest >= 1:
            highest = segment(longest)
            lowest = max(segment(min(max(math.floor(start), 1), longest)), highest - FLICKER_STEPS * K_ROUND_LARGE)
            found.update(range(highest, lowest - 1, -K_ROUND_LARGE))
        return sorted((size for size in found if size >= K_MIN_LARGE_ALLOC), reverse=True)

    def stair(self, segment: int) -> list[int]:
        """The prompt lengths whose largest request takes a segment of `segment` bytes that may strand the most in
        it: its first and its last, and the first after each block fewer fits. In one segment the block grows with
        the prompt, so the rest falls a block per token for every block it holds (faster than the cache grows where
        the blocks are the keys' wider elements: float32 keys beside bfloat16 values) and jumps up by nearly a
        block where one fewer fits (phi-2's float32 8 x (103 + 1) tokens, the first of its 18 MiB segment, strands
        19.6 MiB counted at 111, less the cache 103 does not make, where 111 itself strands 17.1)."""
        first, last = self.longest_within(segment - K_ROUND_LARGE) + 1, self.longest_within(segment)
        if first > last:  # a token asks for more than 2 MiB: no length takes this segment, the last below is tried
            return [last]
        fewer = [segment // (places * self.block_token) - self.completion + 2  # k blocks of it no longer fit
                 for places in range(int(segment // self.block(last)) + 1, int(segment // self.block(first)) + 1)]
        return [first, last, *(length for length in fewer if first < length <= last)]

    def steps(self) -> list[float]:
        """Where the largest request or the layers the blocks come from change: the scores outgrowing the MLP's
        tensors, the sequence outgrowing the sliding window and the prompts filling it."""
        found = [self.mlp_token / self.scores_token] if self.scores_token else []
        if self.arch.sliding_window:
            found += [self.arch.sliding_window - self.completion + 1, self.arch.sliding_window]
        return found

    def longest_within(self, request: int) -> int:
        """The longest prompt whose largest request is at most `request` bytes (0: none)."""
        longest = max(request, 0) // self.mlp_token
        return min(longest, math.isqrt(max(request, 0) // self.scores_token)) if self.scores_token else longest

    def stretch_end(self, places: int, slack: int = 0) -> float:
        """The prompt length from which `places` of the last step's blocks fit in the prefill's (unrounded) segment
        and `slack` bytes more (inf: never)."""
        step = places * self.block_token  # segment + slack >= places x block: width x p + slack >= step x (p + c - 1)
        need = step * (self.completion - 1) - slack
        roots = [need / (self.mlp_token - step)] if self.mlp_token > step else []
        if self.scores_token:  # scores x p^2 + slack >= step x (p + c - 1); with no real root, from any length
            discriminant = step * step + 4 * self.scores_token * need
            roots.append((step + math.sqrt(discriminant)) / (2 * self.scores_token) if discriminant >= 0 else 0.0)
        return min(roots, default=math.inf)


def heaviest_prompt_length(arch: ModelArchitecture, train: TrainingConfig) -> int:
    """The longest prompt of a batch, up to max_prompt_length, at which cache_in_prefill_segment_bytes counts what
    the prefill's segments strand: where the run's step may need the most, for the exact engine to trace
    (benchmarks/boundary.py)."""
    if train.use_vllm:
        return train.max_prompt_length
    length, _ = _PrefillSegments(arch, train).heaviest(train.max_prompt_length)
    return length


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
    segment_token = train.micro_batch_completions * largest_request_token_bytes(arch, train)
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
    if train.use_vllm or not whole_large_states(train):
        return 0.0
    block = _last_block_bytes(arch, train)
    if block < K_MIN_LARGE_ALLOC:  # blocks that share the 20 MiB segments: the next ones fit beside the states
        return 0.0
    segment = allocation_size(block, K_LARGE_BUFFER)
    element = state_element_bytes(train)
    states = [linear.in_features * linear.out_features * element for linear in arch.layer_linears()]
    return float(arch.num_layers * train.optim.state_tensors
                 * sum(state for state in states if K_SMALL_SIZE < state < segment))


def prefill_largest_request_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The largest block generate()'s prefill asks for in a layer, once more: the segment the previous layer's request
    of that size left is cut by a smaller tensor that lives through the layer, so the request takes a segment beside it.

    The prefill runs the whole generation batch's prompts through each layer at once. Its largest requests are the
    MLP's intermediate activation as the output projection reads it (largest_request_token_bytes: float32 under a
    LoRA adapter there) and, with eager attention, the float32 scores softmax makes [B, heads, p, p]; each is a segment
    of its own, freed before the next layer asks again. Best fit cuts the next layer's smaller tensors (the float32
    copy of its normalised input the attention's adapters read, its prompt keys and values) from the smallest free
    block that holds them, and once the smaller segments are taken that is the freed largest one: one such tensor
    alive when the layer's largest request comes keeps its segment from serving it, and cudaMalloc is asked for
    another. At the need of Qwen2.5-0.5B LoRA generating 512 prompts of 512 tokens the previous layer's 4,864 MiB
    segment held an 896 MiB float32 input beside 3,968 MiB when the down projection's float32 input asked for 4,864
    MiB; Qwen2.5-1.5B LoRA with eager attention (512 prompts of 256 tokens) held four 64 MiB prompt key and value
    blocks beside 4,224 MiB of a 4,480 MiB segment. Counted as the request, for the fit to weigh
    (benchmarks/reserve_fit.py), at the prefill's moments only.

    The request grows with the prompts and the generation batch, so the bytes never fall as they do. Nothing with
    vLLM (no prefill in this process) or where the request falls in the 20 MiB segments."""
    if train.use_vllm:
        return 0.0
    generating = m.as_generated(train)
    batch, prompt = train.local_generation_batch_size, train.max_prompt_length
    mlp = batch * prompt * largest_request_token_bytes(arch, generating)
    request = max(mlp, _eager_prefill_scores_bytes(arch, train))
    return float(request) if request >= K_MIN_LARGE_ALLOC else 0.0


def _eager_prefill_scores_bytes(arch: ModelArchitecture, train: TrainingConfig, prompt: int | None = None) -> int:
    # the float32 scores eager attention's softmax makes for the whole generation batch's prompts, [B, heads, p, p]
    if train.attn_implementation != "eager":
        return 0
    prompt = train.max_prompt_length if prompt is None else prompt
    return train.local_generation_batch_size * arch.num_attention_heads * prompt * prompt * m.FP32_BYTES


def decoding_repeated_kv_request_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """The decoding's largest request where attention copies grouped keys and values to every query head, which the
    segments the cache's blocks are cut from must leave room for.

    Eager attention copies each layer's keys and values to every query head at each decoding step (transformers'
    repeat_kv: heads / kv_heads times the cache's block, the keys' copy and the values' alive at once), and so did
    SDPA's masked decoding before transformers 5.23 (inference.decoding_repeated_kv_bytes counts both copies among
    the step's tensors). The cache's blocks fill the segments they are cut from k to a segment, and what they leave,
    a rest the other patterns count against a block, must also hold the copy, n_rep blocks: at the need of
    Qwen3-0.6B LoRA with eager attention generating 512 sequences of 256 + 128 tokens (16 heads on 8: 766 MiB copies
    of 383 MiB blocks) the largest cached block was 764 MiB when the last decoding step asked for the keys' copy, and
    gemma-2-2b LoRA generating 256 sequences of 256 + 512 tokens (8 heads on 4, 767 MiB copies) ran out there too.
    Counted as one copy, for the fit to weigh (at most twice: the keys' and the values' copies), at the decoding's
    moments.

    The copy grows with the tokens and the generation batch, so the bytes never fall as they do. Nothing where no
    copy is made (FlashAttention, SDPA from 5.23 on, ungrouped heads, a single key-value head's view), with vLLM (no
    decoding in this process) or where the copy falls in the 20 MiB segments."""
    if train.use_vllm:
        return 0.0
    tokens = train.sequence_length - 1  # cached at the last decoding step
    kv = m.kv_cache_bytes(arch, train, train.local_generation_batch_size, tokens)
    copy = inference.decoding_repeated_kv_bytes(arch, m.as_generated(train), kv, tokens) / 2
    return float(copy) if copy >= K_MIN_LARGE_ALLOC else 0.0
