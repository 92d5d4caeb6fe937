"""DeepSpeed ZeRO-1/2's and ZeRO-3's own large buffers, allocated and freed in the order DeepSpeed 0.19.8 does,
replayed through the allocator model: what their segments strand when the optimizer step asks for its fp32 gradient
partition, and (ZeRO-1/2) when the next loss's backward asks for its reduction buckets. ZeRO-3's at the end
(zero3_step_stranded_bytes).

The step (zero/stage_1_and_2.py:3013-3170) copies each gradient its partition holds to fp64 for the norm, one at a
time, then flattens the partition's 16-bit gradients and converts the flat copy to fp32 (`single_grad_partition`,
:3114-3118), both the partition's size, alive at once beside the Adam moments, the fp32 master partition and the
16-bit model. At the need the allocator has none of those large blocks free: each request that finds no cached block
makes cudaMalloc fail and frees every whole free segment, so what is cached is what the living buffers leave of the
segments they were cut from. The sharded traces (benchmarks/deepspeed_configs.py) show it: Qwen2.5-0.5B on 2 ranks
cuts the 471 MiB flat copy from the segment of the norm's 1,039 MiB fp64 copy of the embedding's gradient (569 MiB
beside it) and its 479 MiB gradient partition buffer from a 944 MiB segment (465 MiB beside it), so the 942 MiB fp32
copy takes a segment of its own over 1,034 MiB that nothing uses; Llama-3.2-1B on 2 cuts the flat copy from the
previous step's 2,358 MiB fp32 copy and its partition buffer from a 2,358 MiB segment, 2,340 MiB beside them.

No fitted coefficient weighs this: the buffers' sizes and order are DeepSpeed's, the rules the allocator model's. The
cuBLAS workspaces are in the stream too: made as the generation and the first backward begin and kept, they are cut
from the start-up's freed segments (Qwen2.5-0.5B's 260 MiB embedding segment, 196 MiB beside them; Qwen2.5-1.5B's
446 MiB one, which is then too short for the head's 445 MiB gradient, so that lands in the zeroed fp32 segment and
the partition buffer beside it). With them the replay strands what the traces' segments held: 1,241 against 1,230
MiB for Qwen2.5-0.5B on 2, 1,838 against 1,827 for Qwen2.5-1.5B on 4. The stream leaves out the steps' activations
and the 16-bit gradients autograd makes: at the need their segments are free and released before the step asks for
its large blocks. Pure Python, no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from itertools import count
from pathlib import Path

from vram_planner import allocator as allocator_package
from vram_planner.allocator.replay import ALLOC, FREE
from vram_planner.allocator.sizes import K_SMALL_BUFFER, K_SMALL_SIZE
from vram_planner.model import components as m
from vram_planner.model import zero
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.lm_head import uses_fused_head
from vram_planner.model.spec import TrainingConfig

# What the replays' answers depend on beyond their layout: the allocator model, and the streams' makers (this
# module, zero.py and what they use of the memory model's)
_REPLAY_SOURCES = (Path(allocator_package.__file__).parent, Path(__file__).parent)

# The master weights' and gradients' fp32 copies (zero/stage_1_and_2.py:560-577, :3118)
FP32_BYTES = 4


def zero12_step_stranded_bytes(arch: ModelArchitecture, train: TrainingConfig, workspace_bytes: int = 0) -> float:
    """What DeepSpeed's large buffers strand when ZeRO-1/2's optimizer step needs most: the least capacity their
    replay runs in (allocator.need.least_capacity) less the most bytes they hold at once. Nothing without ZeRO-1/2,
    with the optimizer offloaded (its partitions live on the host), or under expandable segments (each request
    mapped page by page: nothing strands). `workspace_bytes`: one thread's cuBLAS workspace on the card
    (model/cublas.py), which the generation's and the backward's first matrix products make and keep."""
    if not _replayed(arch, train):
        return 0.0
    return float(_stranding(*_replay_arguments(arch, train, workspace_bytes))[0])


def _replayed(arch: ModelArchitecture, train: TrainingConfig) -> bool:
    return (train.zero_stage in (1, 2) and not train.optimizer_offloaded and not train.expandable_segments
            and m.trainable_params(arch, train) > 0)


def _replay_arguments(arch: ModelArchitecture, train: TrainingConfig, workspace_bytes: int = 0) -> tuple:
    """step_events' arguments for this config, hashable."""
    bucket = zero.reduce_bucket_elements(arch, train)
    targets = None if train.lora_targets is None else tuple(train.lora_targets)
    groups, rank, order, buffer_after = _layout(arch, train.lora_r, targets, train.num_gpus, bucket)
    return (groups, train.num_gpus, rank, bucket, zero.overlaps_reduction(train), train.gradient_accumulation_steps,
            _state_tensors(train), order, buffer_after, _head_gradients(arch, train), workspace_bytes)


@functools.lru_cache(maxsize=256)
def _layout(arch: ModelArchitecture, lora_r: int | None, lora_targets: tuple[str, ...] | None, ranks: int,
            bucket: int) -> tuple:
    """The optimizer groups, the stepping rank, the backward's order and the reduction the partition buffer follows:
    the same for every estimate of a layout (plan's searches ask thousands), so worked out once."""
    groups = zero.optimizer_groups(arch, lora_r, None if lora_targets is None else list(lora_targets))
    rank = zero.stepping_rank(groups, ranks)
    if lora_r is not None:  # the adapters' gradients, in one reduction after the backward
        return tuple(map(tuple, groups)), rank, None, 0
    return (tuple(map(tuple, groups)), rank, tuple(zero.backward_order(arch)),
            zero.partition_buffer_reduction(arch, ranks, rank, bucket))


def _head_gradients(arch: ModelArchitecture, train: TrainingConfig) -> tuple[int, ...]:
    """The output projection's weight gradient as its backward makes it, in bytes: TRL's fused head (1.15 on)
    accumulates it in fp32 and casts it to the weight's dtype on return (model/lm_head.py), older releases make it in
    the weight's dtype; none under LoRA (the head is frozen)."""
    if train.uses_lora:
        return ()
    gradient = arch.vocab_size * arch.hidden_size
    cast = (gradient * zero.REDUCE_BUCKET_ELEMENT_BYTES,)
    return (gradient * FP32_BYTES, *cast) if uses_fused_head(train, train.release) else cast


def zero12_loss_stranded_bytes(arch: ModelArchitecture, train: TrainingConfig, workspace_bytes: int = 0) -> float:
    """What DeepSpeed's large buffers strand when the next loss's backward asks for its reduction buckets: what the
    segments holding a living buffer hold beside it once the cache's whole free segments are released, as a card at
    the need releases them (allocator.caching's release on a failed cudaMalloc). The first step's Adam moments are cut
    from the smallest free segment that holds them, a reduction bucket's where the partition's states are smaller
    than the bucket, and that segment is then too short for the bucket: Qwen2.5-0.5B's LoRA on 2 with two 2e8
    buckets (overlap_comm) kept two 16.8 MiB moments in a 382 MiB bucket segment, 348 MiB beside them, when the next
    backward asked for its second bucket. Nothing where zero12_step_stranded_bytes counts nothing; `workspace_bytes`
    as it says."""
    if not _replayed(arch, train):
        return 0.0
    return float(_stranding(*_replay_arguments(arch, train, workspace_bytes))[1])


def _state_tensors(train: TrainingConfig) -> tuple[int, ...]:
    """Bytes per element of each optimizer state the partition keeps (Adam's two fp32 moments)."""
    opt = train.optim
    if opt.is_8bit:
        return (1,) * opt.state_tensors
    return (FP32_BYTES,) * opt.state_tensors


@functools.lru_cache(maxsize=256)
def _stranding(*layout) -> tuple[int, int]:
    """_replayed_stranding, once per layout (plan's searches estimate one config thousands of times) and, kept in
    the user's cache folder, once per layout and version of the code that replays it."""
    return _remembered("zero12", layout, lambda: _replayed_stranding(*layout))


def _remembered(name: str, layout: tuple, replay: Callable[[], object]):
    """`replay()`, as an earlier process on this machine worked it out for `layout`: its bisections take a tenth of
    a second or so each, and `--num-gpus auto` asks for one or two on every count of GPUs it tries (a second, where
    the estimate without them takes a tenth)."""
    from vram_planner.profile_cache import remembered, sources_version

    return remembered((__name__, name, *layout), sources_version(*_REPLAY_SOURCES), replay)


def _replayed_stranding(groups: tuple[tuple[int, ...], ...], ranks: int, rank: int, bucket: int, overlap: bool,
                        accumulation: int, states: tuple[int, ...], order: tuple[int, ...] | None, buffer_after: int,
                        head: tuple[int, ...], workspace: int) -> tuple[int, int]:
    """The stream of step_events replayed: what the step strands (the least capacity it runs in less its tensor
    peak), and what the segments holding a living buffer hold beside it when, the cache's free segments released,
    the next backward opens."""
    from vram_planner.allocator.caching import CachingAllocator
    from vram_planner.allocator.need import least_capacity
    from vram_planner.model.stranding import rest_beside_large_blocks

    events = _without_repeats(step_events(groups, ranks, rank, bucket, overlap, accumulation, states, order,
                                          buffer_after, head, workspace))
    need = least_capacity(events)
    allocator, addresses, requested = CachingAllocator(), {}, {}

    def alloc(n_bytes: int) -> int:
        address = allocator.malloc(n_bytes)
        requested[address] = n_bytes
        return address

    def free(address: int) -> None:
        del requested[address]
        allocator.free(address)

    for action, block, size in events:
        if action == ALLOC:
            addresses[block] = alloc(size)
        else:
            free(addresses.pop(block))
    allocator.empty_cache()
    _backward_opening(alloc, free, head, bucket, overlap)
    return max(0, need.capacity_bytes - need.tensor_peak_bytes), rest_beside_large_blocks(allocator, requested)


def _backward_opening(alloc: Callable[[int], int], free: Callable[[int], None], head: tuple[int, ...], bucket: int,
                      overlap: bool) -> tuple[list[int], list[int]]:
    """What a backward asks for first: the output projection's weight gradient as `head` makes it (all but the last,
    the fp32 accumulation, freed once cast), then its reduction buckets (two with overlap_comm)."""
    made = [alloc(size) for size in head]
    for block in made[:-1]:
        free(block)
    return made, [alloc(bucket * zero.REDUCE_BUCKET_ELEMENT_BYTES) for _ in range(2 if overlap else 1)]


def _recorder() -> tuple[list[tuple[str, int | str, int]], Callable[[int], int], Callable[[int], None]]:
    """An event list, and the alloc and free that append to it (alloc numbers the blocks in order)."""
    ids = count()
    events: list[tuple[str, int | str, int]] = []

    def alloc(n_bytes: int) -> int:
        block = next(ids)
        events.append((ALLOC, block, int(n_bytes)))
        return block

    def free(block: int) -> None:
        events.append((FREE, block, 0))

    return events, alloc, free


def _without_repeats(events: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The stream without the requests that change nothing: in a run of requests each freed at once (a bucket's flat
    copies, the norm's copies one gradient at a time), one no larger than an earlier one of the run in the same pool
    is cut from the block that one left free and merged back into it, so replaying the run without it decides the
    same, faster."""
    kept: list[tuple[str, int, int]] = []
    largest = {False: 0, True: 0}  # the run's largest request so far, per pool (small: up to 1 MiB)
    i = 0
    while i < len(events):
        action, block, size = events[i]
        paired = action == ALLOC and i + 1 < len(events) and events[i + 1][:2] == (FREE, block)
        if not paired:
            largest = {False: 0, True: 0}
            kept.append(events[i])
            i += 1
            continue
        pool = size <= K_SMALL_SIZE
        if size > largest[pool]:
            largest[pool] = size
            kept += events[i:i + 2]
        i += 2
    return kept


def step_events(groups: tuple[tuple[int, ...], ...], ranks: int, rank: int, bucket: int, overlap: bool,
                accumulation: int, states: tuple[int, ...], order: tuple[int, ...] | None, buffer_after: int,
                head: tuple[int, ...] = (), workspace: int = 0) -> list[tuple[str, int, int]]:
    """The stream, as the sharded trace runs it: DeepSpeed's start-up, a step's `accumulation` backwards, the
    optimizer step that made the moments, then the optimizer step beside them, on `rank` of `ranks` (the one whose
    step holds the most, zero.stepping_rank). `groups`: the trainable parameters' numels per optimizer group (a LoRA
    run's frozen base model lies in segments of its own, whose rests are the weights', not the step's); `order`: the
    gradients' numels in the backward's order (None: every trainable gradient reduced once, after the backward);
    `buffer_after`: the reduction after whose flat copy the partition buffer is made
    (zero.partition_buffer_reduction); `head`: the output projection's weight gradient as its backward makes it, the
    last kept to the backward's last reduction (`_head_gradients`: a tied head's waits for the embedding's; an untied
    one's is copied into the bucket sooner, which the stream does not place); `workspace`: one thread's cuBLAS
    workspace, the generation's made after the start-up and the backward's as the first backward begins, both kept
    (none: 0), which best fit cuts from the start-up's freed segments (Qwen2.5-1.5B on 4: from the embedding's 446
    MiB one, too short then for the head's 445 MiB gradient)."""
    events, alloc, free = _recorder()
    shares = [-(-sum(group) // ranks) for group in groups]
    split = [zero.partition_pieces(list(group), ranks, rank) for group in groups]
    grad = zero.REDUCE_BUCKET_ELEMENT_BYTES
    # start-up: the trainable parameters as loaded, in 16 bits, each group flattened into one buffer of the whole group
    # (:509-524, padded to the ranks) and its parameters freed; the rank's fp32 master partition made from a clone of
    # its 16-bit partition (:560-577); a zeroed fp32 gradient per group, freed once all exist
    # (`initialize_optimizer_states`, :934-951)
    loaded = [alloc(numel * grad) for group in groups for numel in group]
    for share in shares:
        alloc(share * ranks * grad)
    for block in loaded:
        free(block)
    for share in shares:
        clone = alloc(share * grad)
        alloc(share * FP32_BYTES)
        free(clone)
    for zeroed in [alloc(share * FP32_BYTES) for share in shares]:
        free(zeroed)
    # the gradients the step keeps whole until their fp32 copy exists (zero.zero12_step_bytes): ZeRO-2's partition
    # buffer, from the first reduction on (:2184-2203)
    kept = sum((sum(whole) + share - sum(pieces)) * grad for (pieces, whole), share in zip(split, shares))
    reductions = [flat for flat, _, i in zero.bucket_reductions(list(order), bucket) if i > 0] if order else []
    flats = [*reductions, sum(map(sum, groups)) - sum(reductions)]
    if workspace:
        alloc(workspace)
    partition = None
    for micro_batch in range(accumulation):
        if workspace and micro_batch == 0:
            alloc(workspace)
        made, buckets = _backward_opening(alloc, free, head, bucket, overlap)
        # each full bucket's gradients flattened for the collective (zero.reducing_bucket_gradient_bytes), then what
        # the bucket holds last, as the backward ends; the partition buffer after the first of its gradients
        for k, flat in enumerate(flats):
            if made and k == len(flats) - 1:
                free(made[-1])
            free(alloc(flat * grad))
            if partition is None and k >= buffer_after:
                partition = alloc(kept)
        for block in buckets:
            free(block)
    # the step that made the moments, as the trace runs it: each group's fp32 gradient beside its new moments
    for share in shares:
        fp32 = alloc(share * FP32_BYTES)
        for element_bytes in states:
            alloc(share * element_bytes)
        free(fp32)
    # the norm: each gradient piece of the partition copied to fp64, one at a time (:2684)
    for pieces, _ in split:
        for piece in pieces:
            free(alloc(piece * zero.NORM_COPY_BYTES))
    for i, ((pieces, _), share) in enumerate(zip(split, shares)):
        tensors = len(pieces) + (sum(pieces) < share)
        flat = alloc(share * zero.FLAT_GRADIENT_BYTES) if tensors > 1 else None
        fp32 = alloc(share * FP32_BYTES)
        if flat is not None:
            free(flat)
        if i == 0 and partition is not None:
            free(partition)
            partition = None
        free(fp32)
    return events


def zero3_step_stranded_bytes(arch: ModelArchitecture, train: TrainingConfig, workspace_bytes: int = 0) -> float:
    """What DeepSpeed's large buffers strand when ZeRO-3's optimizer step needs most, as zero12_step_stranded_bytes
    says for ZeRO-1/2 (zero3_step_events: the start-up's flat buffers, a step's sub-groups). Where the reduction
    bucket is large, the start-up cuts it and the gradient partition's buffer from the segment of the zeroed fp32
    gradient it has just freed, too little is left beside them for a sub-group's flat 16-bit copy, which best fit
    then cuts from the segment of the previous step's fp32 gradient, so the fp32 copy takes a segment of its own:
    the sharded trace of Llama-3.2-1B on 2 with a 5e8-element bucket held 1,179 MiB beside the flat copy and 226 MiB
    beside the two buffers when the step asked for its 2,357 MiB fp32 gradient; with transformers' "auto" bucket
    (hidden^2 elements, 8 MiB) the flat copy fits beside the buffers and nothing strands. Nothing with an offload
    (the partitions live on the host) or under expandable segments."""
    if not (train.zero_stage == 3 and not train.optimizer_offloaded and not train.expandable_segments
            and m.trainable_params(arch, train) > 0):
        return 0.0
    groups = tuple(map(tuple, zero.optimizer_groups(arch, train.lora_r, train.lora_targets)))
    return float(_zero3_stranding(groups, train.num_gpus, zero.reduce_bucket_elements(arch, train),
                                  _state_tensors(train), workspace_bytes))


@functools.lru_cache(maxsize=256)
def _zero3_stranding(*layout) -> int:
    return _remembered("zero3", layout, lambda: _replayed_zero3_stranding(*layout))


def _replayed_zero3_stranding(groups: tuple[tuple[int, ...], ...], ranks: int, bucket: int, states: tuple[int, ...],
                              workspace: int) -> int:
    from vram_planner.allocator.need import least_capacity, live_peak_bytes

    as_requested = zero3_step_events(groups, ranks, bucket, states, workspace, per_request=True)
    need = least_capacity(_without_repeats(zero3_step_events(groups, ranks, bucket, states, workspace)))
    if need.capacity_bytes <= sum(size for segment in _partitioned_segments(groups, ranks) for size, _ in segment):
        # the start-up itself is what a card that small runs short of, and its own requests release segments there
        # that the remade start-up holds at once: they decide (tiny layouts only)
        need = least_capacity(_without_repeats(as_requested))
    # the tensors as DeepSpeed's own requests make them: the remade start-up holds its free blocks for a moment
    return max(0, need.capacity_bytes - live_peak_bytes(as_requested))


def _partitioning_requests(groups: tuple[tuple[int, ...], ...], ranks: int) -> list[tuple[str, int, int]]:
    """ZeRO-3's start-up up to its flat buffer, request by request: the trainable parameters loaded whole in 16 bits,
    each replaced by its partition (a rank's ceil(numel / ranks) elements), the partitions moved into one flat buffer
    and freed (`_create_fp16_partitions_with_defragmentation`, zero/stage3.py:913-975). The flat buffer is the block
    "flat"; the others are numbered."""
    grad = zero.REDUCE_BUCKET_ELEMENT_BYTES
    partitions = [-(-numel // ranks) for group in groups for numel in group]
    events: list[tuple[str, int | str, int]] = [(ALLOC, i, numel * grad)
                                                for i, numel in enumerate(n for group in groups for n in group)]
    for i, partition in enumerate(partitions):
        events += [(ALLOC, len(partitions) + i, partition * grad), (FREE, i, 0)]
    events.append((ALLOC, "flat", sum(partitions) * grad))
    return events + [(FREE, len(partitions) + i, 0) for i in range(len(partitions))]


@functools.lru_cache(maxsize=64)
def _partitioned_segments(groups: tuple[tuple[int, ...], ...], ranks: int) -> tuple[tuple[tuple[int, bool], ...], ...]:
    """The segments `_partitioning_requests` leave, in address order, each its blocks as (bytes, live): the live one
    is the flat buffer's, with the rest of the block it was cut from where that was too short to split off."""
    from vram_planner.allocator.caching import CachingAllocator

    allocator, addresses = CachingAllocator(), {}
    for action, block, size in _partitioning_requests(groups, ranks):
        if action == ALLOC:
            addresses[block] = allocator.malloc(size)
        else:
            allocator.free(addresses.pop(block))
    return tuple(tuple((size, live) for _, size, live in segment)
                 for segment in sorted(allocator.segment_blocks(), key=lambda segment: segment[0][0]))


def zero3_step_events(groups: tuple[tuple[int, ...], ...], ranks: int, bucket: int, states: tuple[int, ...],
                      workspace: int = 0, per_request: bool = False) -> list[tuple[str, int | str, int]]:
    """ZeRO-3's own large buffers as the sharded trace makes them (DeepSpeed 0.19.8, zero/stage3.py): the start-up's
    flat buffer of the 16-bit partitions (`_partitioning_requests`); per sub-group the fp32 master partition, a clone
    of the flat partition's fp32 conversion (`_create_fp32_partitions`, :1081-1174); a zeroed fp32 gradient of the
    largest sub-group, freed once every sub-group has its view of it (`initialize_optimizer_states`, :1301-1371); the
    reduction bucket (`reduce_bucket_size` 16-bit elements, with contiguous_gradients, on by default) and the 16-bit
    gradient partition's buffer (`_setup_for_real_optimizer`, :779-793), both kept; the cuBLAS workspaces (zero12's
    step_events says where); the step that made the moments, as the trace runs it (each sub-group's zeroed fp32
    gradient beside its new moments); the norm's fp64 copy of one gradient partition at a time; then a step's
    sub-groups in turn, each flattening its 16-bit gradients (a view where the sub-group is one tensor) and converting
    the flat copy to fp32 (`_prepare_fp32_grad_for_sub_group`, :2683-2696), the fp32 copy freed after its update. The
    forward's and backward's gathered parameters and the activations are left out: at the need their segments are
    free and released before the step asks for its blocks.

    The start-up comes as the segments it leaves (`_partitioned_segments`), made again in address order (a new
    segment lies above every earlier one, and no request finds a free block until the free ones are freed): the same
    allocator state in a third of the requests, so that a plan's searches replay the step in time; `per_request`:
    as DeepSpeed's requests themselves (tests/model/test_zero_replay.py holds the two to the same need)."""
    events, alloc, free = _recorder()
    grouped = [[-(-numel // ranks) for numel in group] for group in groups]
    partitions = [partition for group in grouped for partition in group]
    subs = [sub for group in grouped for sub in zero.sub_group_partitions(group)]
    if per_request:
        events += [(action, f"start-up {block}", size) for action, block, size in _partitioning_requests(groups, ranks)]
    else:
        _remade(_partitioned_segments(groups, ranks), alloc, free)
    for sub in subs:
        converted = alloc(sum(sub) * FP32_BYTES)
        alloc(sum(sub) * FP32_BYTES)
        free(converted)
    free(alloc(max(map(sum, subs)) * FP32_BYTES))
    alloc(bucket * zero.REDUCE_BUCKET_ELEMENT_BYTES)
    alloc(sum(partitions) * zero.REDUCE_BUCKET_ELEMENT_BYTES)
    for _ in range(2 if workspace else 0):
        alloc(workspace)
    for sub in subs:
        zeroed = alloc(sum(sub) * FP32_BYTES)
        for element_bytes in states:
            alloc(sum(sub) * element_bytes)
        free(zeroed)
    for partition in partitions:
        free(alloc(partition * zero.NORM_COPY_BYTES))
    for sub in subs:
        flat = alloc(sum(sub) * zero.FLAT_GRADIENT_BYTES) if len(sub) > 1 else None
        fp32 = alloc(sum(sub) * FP32_BYTES)
        if flat is not None:
            free(flat)
        free(fp32)
    return events


def _remade(segments: tuple[tuple[tuple[int, bool], ...], ...], alloc: Callable[[int], int],
            free: Callable[[int], None]) -> None:
    """Requests that leave these segments (address order; each its blocks as (bytes, live)) and nothing else: a large
    one asked for whole, then, where it holds a live block, freed and cut into its blocks, each asked for as large as
    it is; a small one (2 MiB, no request of which reaches the large pool) block by block, its free ones in requests
    of the small pool; every free block freed once all exist. The live blocks are as large as their blocks, not as
    their requests: the tensors' bytes are the requests' (`_zero3_stranding`)."""
    placeholders = []
    for segment in segments:
        if sum(size for size, _ in segment) == K_SMALL_BUFFER:
            for size, live in segment:
                pieces = [size] if live else [min(K_SMALL_SIZE, size - i) for i in range(0, size, K_SMALL_SIZE)]
                made = [alloc(piece) for piece in pieces]
                if not live:
                    placeholders += made
            continue
        whole = alloc(sum(size for size, _ in segment))
        if not any(live for _, live in segment):
            placeholders.append(whole)
            continue
        free(whole)
        for size, live in segment:
            block = alloc(size)
            if not live:
                placeholders.append(block)
    for block in placeholders:
        free(block)
