"""DeepSpeed ZeRO's model states on one rank, as DeepSpeed 0.19.8 allocates and estimates them.

Every constant cites its place in DeepSpeed 0.19.8's source (`deepspeed/runtime/...`, read from the sdist of
`pip download --no-deps deepspeed==0.19.8`). Pure: no DeepSpeed, no torch.

DeepSpeed's own estimator of the model states per GPU without offload
(`estimate_zero2_model_states_mem_needs`, zero/stage_1_and_2.py:4017-4034, and
`estimate_zero3_model_states_mem_needs`, zero/stage3.py:4016-4052):

- ZeRO-2: 2 P + 18 P / N bytes ("2 = params_16bit, 18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit +
  8_optimizer_states_32bit", zero/stage_1_and_2.py:4029-4031);
- ZeRO-3: 18 P / N + 4 x the largest layer's parameters (zero/stage3.py:4027 and 4046).

The planner counts the bytes each where it lives: the 16-bit parameters as weights, the 16-bit gradient partition as
gradients, the fp32 master partition and Adam's two moments as optimizer states. Under ZeRO-3 the largest layer's
gathered 16-bit parameters (2 bytes per parameter) count as weights and its full 16-bit gradient before the
reduce-scatter (2 bytes) as gradients in generation and the loss, as DeepSpeed's estimator counts them; the gradient
reduction bucket (5e8 16-bit elements, below) counts as gradients wherever it exists. Under gradient accumulation
ZeRO-3's later micro-batches hold what its coordinator prefetches instead (`prefetched_params`: up to
stage3_max_live_parameters, 1e9) and ZeRO-2's every gradient its partition touches, whole
(`accumulated_gradient_bytes`).

The optimizer step (`step_gradient_bytes`) holds what DeepSpeed's step holds at its peak from the second step on, with
Adam's moments alive (the sharded trace runs that step, vram_planner/tracing/zero.py): the 16-bit gradients, a flat
16-bit copy of them and its fp32 copy (ZeRO-1/2: the rank's partition, stage_1_and_2.py:3114-3118; ZeRO-3: one
sub-group, stage3.py:2686-2687), or the fp64 copy the gradient norm makes of each gradient first (zero/utils.py:59-63,
stage_1_and_2.py:2684, stage3.py:2455). ZeRO-3 has released every gathered layer by then (`_partition_all_parameters`,
stage3.py:2878). So ZeRO-1/2 hold at least 2 P + 20 P / N there, more than their estimator's 2 P + 18 P / N (which
leaves out the flat copy and the gradients kept whole), and ZeRO-3 22 P / N and its bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import accumulate

from vram_planner.model import blocks
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.spec import (DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD, DEEPSPEED_PREFETCH_BUCKET_SIZE,
                                     DEEPSPEED_REDUCE_BUCKET_SIZE, TrainingConfig)

# ZeRO-1/2 convert the 16-bit gradient partition to an fp32 copy in step() (zero/stage_1_and_2.py:3118
# `single_grad_partition = flat_grad_partition.to(self.single_partition_of_fp32_groups[i].dtype)`, set as the fp32
# partition's .grad at :3126, freed after the group's step at :3141); ZeRO-3 does the same per sub-group
# (zero/stage3.py:2686-2693, `_prepare_fp32_grad_for_sub_group`); DeepSpeed's estimator counts it for the whole
# partition ("4_grads_32bit", zero/stage_1_and_2.py:4030). Stage 0 with bf16 runs BF16_Optimizer, which keeps an fp32
# gradient buffer of every parameter (bf16_optimizer.py:192, `fp32_groups_gradients_flat`).
FP32_GRADIENT_BYTES = 4
# ZeRO-3 holds the largest layer gathered: "largest_layer_memory = (4 * largest_layer_params)" (zero/stage3.py:4027),
# its 16-bit parameters and their 16-bit gradient before the reduce-scatter.
GATHERED_PARAM_BYTES = 2
GATHERED_GRADIENT_BYTES = 2
# ZeRO-3 steps its partition in sub-groups: one closes at the first parameter whose partition brings it to
# sub_group_size elements (`_create_fp16_sub_groups`, zero/stage3.py:1210-1233; `sub_group_size: int =
# Field(pp_int(1e9))`, zero/config.py:182; TRL's accelerate configs set none)
SUB_GROUP_ELEMENTS = 1_000_000_000
# What DeepSpeed's step makes of the 16-bit gradients (2 bytes an element): a flat copy (`flatten`, torch's
# _flatten_dense_tensors, a view where the partition is one tensor: stage_1_and_2.py:3114-3117, stage3.py:2686) and
# its fp32 copy (:3118, :2687), both alive at once; before them the gradient norm's copy of one gradient at a time in
# fp64, as every accelerator with fp64 (CUDA's, the CPU's) computes it (`get_norm_dtype`, zero/utils.py:59-63;
# stage_1_and_2.py:2684, stage3.py:2455)
FLAT_GRADIENT_BYTES = 2
NORM_COPY_BYTES = 8
# The gradient reduction bucket ("ipg" bucket): DeepSpeed's default reduce_bucket_size is 5e8 elements
# (zero/config.py:113). TRL's accelerate configs set none, and accelerate (accelerator.py, `hidden_size_based_keys`)
# and transformers fill it from the hidden size only where a DeepSpeed config file says "auto"
# (`reduce_bucket_elements`), so the default holds unless a config names it (TrainingConfig.reduce_bucket_size).
# ZeRO-1/2 allocate it at a micro-batch's first gradient (zero/stage_1_and_2.py:3259-3270; a second one where
# overlap_comm is on, :3272-3277, off by default below stage 3, zero/config.py:384-387) and release it when that
# backward ends (`_release_ipg_buffers`, :924-931, from the epilogue at :1061; the sharded trace sees it only in the
# loss phase), in the 16-bit gradients' dtype (:1253-1254 and :397-404; no separate accumulation dtype by default,
# engine.py:1806-1807); ZeRO-3 allocates one at start-up, overlap_comm or not, and keeps it (zero/stage3.py:780-784),
# in the 16-bit communication dtype. Its size does not depend on the model's.
REDUCE_BUCKET_ELEMENTS = DEEPSPEED_REDUCE_BUCKET_SIZE
REDUCE_BUCKET_ELEMENT_BYTES = 2
# ZeRO-3's parameter coordinator, once it holds a complete trace of the modules' order (recorded in a micro-batch's
# forward and backward, complete at the next forward's `reset_step`, partitioned_param_coordinator.py:251-280),
# prefetches ahead of each module's fetch until `stage3_max_live_parameters` are gathered
# (`max_params_to_prefetch = min(max_n_available - n_available, prefetch_bucket_sz)`, :452-484), and keeps a gathered
# parameter whose later use the prefetch has reached or that is used again within `stage3_max_reuse_distance`
# (`__params_to_release`, :634-666). TRL's accelerate configs set none of them and name no DeepSpeed config file, so
# nothing "auto" is filled from the hidden size (accelerate/accelerator.py:2296-2326) and DeepSpeed's defaults hold:
# max_live_parameters and max_reuse_distance 1e9, prefetch_bucket_size 5e7 (zero/config.py:222, :245, :251), unless
# a DeepSpeed config names the bucket (below). TRL 1.5
# on invalidates the trace when its gathered generation puts the hooks back (trl/models/utils.py `add_hooks`), so
# each step's first micro-batch records it again and gathers layer by layer; its later micro-batches hold up to
# max_live_parameters and past it (`prefetched_params`): the limit bounds what a round may start with
# (`__n_available_params`, counted as each all-gather is submitted, partitioned_param_coordinator.py:593), a round
# ends only at the first parameter that takes it past its count (`while ... numel_prefetching <
# max_params_to_prefetch`, :457-476), and the module being fetched gathers what it needs beyond the limit (:381); the
# sharded trace holds 1.026e9 of Llama-3.2-1B's 1.236e9 there, 1e7 above the coordinator's count.
# Each prefetch round of several parameters is one coalesced all-gather into one flat buffer of the round's parameters
# (`_all_gather_dtype`, partition_parameters.py:1343-1346; a round of one parameter is gathered into its own). Its wait
# copies every one of them out into a tensor of its own (`AllGatherCoalescedHandle.wait`, partition_parameters.py:795,
# reached from the coordinator's wait of an in-flight parameter, partitioned_param_coordinator.py:406), but the
# coordinator's registry keeps the handle, and the buffer with it, for each of the round's parameters until that
# parameter's module is fetched: while a round is used, its parameters exist twice (`prefetching_forward_params`); the
# rounds submitted after it hold their parameters once, in their buffers. The sharded trace of Qwen2.5-0.5B with LoRA in
# its second micro-batch: the whole model gathered, a 99.4 MiB round twice.
# The prefetch bucket is the config's `stage3_prefetch_bucket_size` (TrainingConfig's; "auto": transformers fills
# int(0.9 x hidden_size^2), integrations/deepspeed.py:234-238), DeepSpeed's default 5e7.
MAX_LIVE_PARAMETERS = 1_000_000_000
PREFETCH_BUCKET_ELEMENTS = DEEPSPEED_PREFETCH_BUCKET_SIZE
# As ZeRO-3's optimizer step ends it gathers again every parameter of at most `stage3_param_persistence_threshold`
# elements (`persistent_parameters`, stage3.py:2840-2841; `ds_persist`, partition_parameters.py:1292; default 1e5,
# zero/config.py:228, no model-wide cap by default, :235): norms and biases, and a small model's LoRA adapters (r x
# 4,864 elements in Qwen2.5-0.5B's MLP at r=16). They stay until TRL's next generation partitions them with the rest
# (GatheredParameters' exit); the loss fetches and releases them as any other. The threshold is the config's
# `stage3_param_persistence_threshold` ("auto": 10 x hidden_size, integrations/deepspeed.py:239-242).
PARAM_PERSISTENCE_THRESHOLD = DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD
# The estimator's other multipliers (zero/stage_1_and_2.py:4029-4031): 16-bit parameters, and per parameter of the
# partition 2 (16-bit gradients) + 4 (fp32 gradients) + 4 (fp32 parameters) + 8 (Adam's momentum and variance).
ESTIMATE_PARAM_BYTES = 2
ESTIMATE_PARTITIONED_BYTES = 18


def largest_layer_params(arch: ModelArchitecture) -> int:
    """The most parameters one module holds itself, as DeepSpeed's `model_to_params` counts them (zero/stage3.py:
    4059-4063: `sum(p.numel() for p in m.parameters(recurse=False))` over `model.modules()`): the embedding, an untied
    output projection, or a decoder linear (weight and bias)."""
    head = arch.lm_head_params if not arch.tie_word_embeddings else 0
    return max(arch.embedding_params, head, fetched_module_params(arch), arch.norm_params)


def largest_trainable_layer_params(arch: ModelArchitecture, lora_r: int | None,
                                   lora_targets: list[str] | None) -> int:
    """The largest module whose gradient ZeRO-3 reduces: as `largest_layer_params`, or a LoRA adapter's A or B."""
    if not lora_r:
        return largest_layer_params(arch)
    return max((lora_r * max(lin.in_features, lin.out_features) for lin in arch.lora_linears(lora_targets)), default=0)


def fetched_module_params(arch: ModelArchitecture) -> int:
    """The most parameters one module's fetch gathers inside a decoder layer, where the coordinator gathers layer by
    layer (no complete trace): a linear's weight and bias, in one all-gather buffer that lives until the fetch's wait
    has copied them out, the module twice for a moment (`_all_gather_dtype`, partition_parameters.py:1343-1346; the
    sharded trace of a small Llama with LoRA on 4 ranks: its generation and its loss peak there)."""
    return max((lin.params for lin in arch.layer_linears()), default=0)


def prefetched_params(params: int, largest: int) -> int:
    """The parameters ZeRO-3 holds gathered in a micro-batch whose coordinator has a complete trace, at most the whole
    model: max_live_parameters, passed by the round that reaches it by part of its last parameter and by the module
    fetched beyond it (each at most `largest`, the largest parameter after the embedding), and in every sharded trace
    by less than DeepSpeed's default prefetch bucket, whatever bucket the config names: near the limit a round
    gathers only what the limit leaves (`min(max_n_available - n_available, prefetch_bucket_sz)`), so the bucket's
    size does not move what is held past it. A later micro-batch's traces: Llama-3.2-1B on 2 holds 1.020e9, 1.026e9
    and 1.026e9 parameters with buckets of 1e7, 5e7 and 2e8 (1.034e9 counted), Qwen2.5-7B on 4 1.024e9 with 1e7 and
    5e7 (1.05e9 counted)."""
    return min(params, MAX_LIVE_PARAMETERS + min(2 * largest, PREFETCH_BUCKET_ELEMENTS))


def forward_params(arch: ModelArchitecture, lora_r: int | None, lora_targets: list[str] | None) -> list[int]:
    """Every parameter's numel in the order a forward's modules run, as the coordinator's trace holds them: the
    embedding, each decoder layer's tensors (`blocks.layer_shapes`: its linears in order, then its norms) and its LoRA
    adapters, the tail (`blocks.tail_shapes`). Not a vision tower's."""
    layer = [rows * width for rows, width in blocks.layer_shapes(arch)] + _layer_adapters(arch, lora_r, lora_targets)
    tail = [rows * width for rows, width in blocks.tail_shapes(arch)]
    return [arch.embedding_params, *layer * arch.num_layers, *tail]


def persistent_params(arch: ModelArchitecture, lora_r: int | None, lora_targets: list[str] | None,
                      threshold: int = PARAM_PERSISTENCE_THRESHOLD) -> int:
    """The parameters ZeRO-3 gathers again after its optimizer step, each of at most `threshold` elements; a vision
    tower's are not counted."""
    return sum(n for n in forward_params(arch, lora_r, lora_targets) if n <= threshold)


def largest_after_embedding(order: list[int]) -> int:
    # the embedding is gathered first, on its own: the later rounds' overshoot is at most the largest of the rest
    return max(order[1:], default=0)


def _prefetch_rounds(order: list[int], prefetch: int) -> list[tuple[int, int]]:
    """Each prefetch round of a forward whose coordinator has a complete trace, from its first fetch on: its
    parameters, and the second copy it holds while it is used (its flat buffer beside what was copied out of it; none
    for a round of one parameter, which DeepSpeed all-gathers into that parameter's own buffer,
    `_all_gather_sequential`, partition_parameters.py:1598). Each module's fetch submits a round of up to
    `min(max_live_parameters - n_available, prefetch_bucket_size)`, the bucket `prefetch` elements
    (partitioned_param_coordinator.py:452-484), that adds parameters while it holds fewer, so it ends past that by
    part of its last one; the rounds run ahead of the fetches, back to back. Once the limit is reached each round has
    the room a module's release left (at most the largest parameter after the embedding, which is gathered first): one
    more round, past that by as much, stands for them."""
    available, rounds, i = 0, [], 0
    largest = largest_after_embedding(order)
    while i < len(order):
        limit = min(MAX_LIVE_PARAMETERS - available, prefetch)
        if limit <= 0:
            last = min(prefetch, largest) + largest
            return [*rounds, (last, last)]
        numel, start = 0, i
        while i < len(order) and numel < limit:
            numel += order[i]
            i += 1
        rounds.append((numel, numel if i - start > 1 else 0))
        available += numel
    return rounds


def prefetching_forward_params(arch: ModelArchitecture, lora_r: int | None, lora_targets: list[str] | None,
                               prefetch: int = PREFETCH_BUCKET_ELEMENTS) -> int:
    """What a forward whose coordinator prefetches holds gathered at its peak, in parameters: up to max_live_parameters,
    which the last round submitted passes by part of its last parameter (the module being run is always in flight
    already, so no fetch passes it further), and the round in use twice, in its buffer and copied out, while the rounds
    after it wait in theirs. The first round (the embedding first) is waited on by the forward's first fetch before any
    other is submitted: it holds only itself, twice unless it is one parameter (a large embedding alone). The sharded
    traces: Qwen2.5-0.5B with LoRA on 8, its second micro-batch the whole model and a 99 MiB round twice; Llama-3.2-1B
    with LoRA, 1.064e9 parameters' worth; Qwen3-0.6B's widths at 4 layers, whose embedding is three rounds' worth and
    gathered alone, the whole model and a 96 MiB round twice."""
    order = forward_params(arch, lora_r, lora_targets)
    window = min(sum(order), MAX_LIVE_PARAMETERS + largest_after_embedding(order))
    (first, first_copy), *later = _prefetch_rounds(order, prefetch)
    return max(window + _largest_copy(later), first + first_copy)


def round_in_use_params(arch: ModelArchitecture, lora_r: int | None, lora_targets: list[str] | None,
                        prefetch: int = PREFETCH_BUCKET_ELEMENTS) -> int:
    """The second copy a prefetch round after the first holds while it is used, the largest of them, in parameters:
    the bucket passed by part of the round's last parameter (Llama-3.2-1B's rounds of 6.08e7 under a 5e7 bucket)."""
    _, *later = _prefetch_rounds(forward_params(arch, lora_r, lora_targets), prefetch)
    return _largest_copy(later)


def _largest_copy(rounds: list[tuple[int, int]]) -> int:
    return max((copy for _, copy in rounds), default=0)


# transformers' fill of a DeepSpeed config's "auto" sizes from the model's hidden size (`trainer_config_finalize`,
# integrations/deepspeed.py:202-242): the reduction bucket at every stage, the coordinator's two at ZeRO-3
AUTO_FILLED_SIZES: dict[str, Callable[[int], int]] = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h}


def deepspeed_size(train: TrainingConfig, key: str, hidden_size: int) -> int:
    """One of the config's DeepSpeed sizes (AUTO_FILLED_SIZES' keys) in elements, "auto" filled from `hidden_size` as
    transformers fills it."""
    value = getattr(train, key)
    return AUTO_FILLED_SIZES[key](hidden_size) if value == "auto" else value


def prefetch_bucket_elements(arch: ModelArchitecture, train: TrainingConfig) -> int:
    """ZeRO-3's prefetch bucket in elements, which sizes the forward's rounds (`prefetching_forward_params`): the
    config's stage3_prefetch_bucket_size ("auto": int(0.9 x hidden_size^2))."""
    return deepspeed_size(train, "stage3_prefetch_bucket_size", arch.hidden_size)


def persistence_threshold_elements(arch: ModelArchitecture, train: TrainingConfig) -> int:
    """ZeRO-3's persistence threshold in elements: the config's stage3_param_persistence_threshold ("auto":
    10 x hidden_size)."""
    return deepspeed_size(train, "stage3_param_persistence_threshold", arch.hidden_size)


def reduce_bucket_elements(arch: ModelArchitecture, train: TrainingConfig) -> int:
    """The gradient reduction bucket's size in elements: the config's reduce_bucket_size ("auto": hidden_size^2)."""
    return deepspeed_size(train, "reduce_bucket_size", arch.hidden_size)


def overlaps_reduction(train: TrainingConfig) -> bool:
    """Whether DeepSpeed overlaps the gradient reduction with the backward: overlap_comm, on by default at stage 3
    only (`overlap_comm_valid`, zero/config.py:384-387)."""
    return train.zero_stage == 3 if train.overlap_comm is None else train.overlap_comm


def reduce_bucket_bytes(arch: ModelArchitecture, train: TrainingConfig) -> int:
    """The gradient reduction buckets one rank holds under ZeRO-1, 2 or 3 (none without DeepSpeed, nor at stage 0,
    whose BF16_Optimizer accumulates into its fp32 gradient buffers): two below stage 3 with overlap_comm."""
    if train.zero_stage not in (1, 2, 3):
        return 0
    buffers = 2 if train.zero_stage != 3 and overlaps_reduction(train) else 1
    return buffers * reduce_bucket_elements(arch, train) * REDUCE_BUCKET_ELEMENT_BYTES


def deepspeed_estimate_bytes(total_params: int, num_gpus: int, stage: int, largest_layer: int = 0) -> int:
    """DeepSpeed's estimate of the model states per GPU without offload, as its estimators compute it: ZeRO-2
    (zero/stage_1_and_2.py:4031) `2 * total_params + int(18 * total_params / total_gpus)`, ZeRO-3 (zero/stage3.py:4046)
    `largest_layer_memory + int(18 * total_params / total_gpus)`."""
    partitioned = int(ESTIMATE_PARTITIONED_BYTES * total_params / num_gpus)
    if stage == 3:
        return (GATHERED_PARAM_BYTES + GATHERED_GRADIENT_BYTES) * largest_layer + partitioned
    return ESTIMATE_PARAM_BYTES * total_params + partitioned


def reducing_bucket_gradient_bytes(arch: ModelArchitecture, trainable: int, tied_head_waits: bool,
                                   lora: bool = False, partition_buffer: int = 0,
                                   bucket: int = REDUCE_BUCKET_ELEMENTS, ranks: int = 1,
                                   rank: int | None = None) -> int:
    """ZeRO-2/3's 16-bit gradients, besides the bucket, while they reduce a full bucket: the bucket's gradients
    flattened into one new tensor for the collective (ZeRO-2: `allreduce_bucket`, zero/stage_1_and_2.py:2360-2367,
    reached from `reduce_ipg_grads` :2229 through `average_tensor` :1708 with use_multi_rank_bucket_allreduce, on by
    default, config.py:119; ZeRO-3: `reduce_scatter_coalesced`, runtime/comm/coalesced_collectives.py:122, from
    `__avg_scatter_grads`, zero/stage3.py:1931). Where the trainable parameters outgrow a bucket (full fine-tuning)
    a reduction comes inside the backward, from the hook of the gradient that would overflow the bucket, alive beside
    it (`bucket_reductions`), and a tied output projection's gradient waits in autograd for the embedding's; otherwise
    the one reduction, after the backward, flattens every trainable parameter's gradient. ZeRO-2 copies the reduced
    gradients of its partition into a buffer that the first reduction allocates (`grads_in_partition`,
    `accumulated_gradient_bytes`), which a later reduction's arrival meets instead of the flat copy
    (`partition_buffer`, bytes; none where the caller counts it already). Seen so by the sharded trace
    (benchmarks/results/sharded.zero.txt: Llama-3.2-1B on 8 flattens 8 layers and the final norm, 486574080
    elements, beside an MLP matrix's 32 MiB gradient; on 2, the embedding's gradient arrives beside the 1.2 GB
    buffer). A later reduction flattens its bucket too where the bucket's gradients belong to more than one rank's
    partition (`average_tensor` flattens one slice per destination, a lone slice being a view, zero/stage_1_and_2.py:
    1660-1706): with the partition buffer of ZeRO-2's `rank` already made (`partition_buffer_reduction`), that copy
    lies beside it (Qwen2.5-1.5B on 4, rank 1: the embedding's arrival flattens 624.8 MiB of the first layers beside
    its 766.6 MiB buffer and the embedding's 445.1 MiB gradient). `bucket`: its size in elements
    (`reduce_bucket_elements`); `ranks`: the data-parallel ranks."""
    if trainable <= bucket or lora:
        return min(trainable, bucket) * REDUCE_BUCKET_ELEMENT_BYTES
    order = backward_order(arch)
    waiting = arch.vocab_size * arch.hidden_size if tied_head_waits else 0
    # the embedding's gradient, which comes last, is the waiting one summed into it
    reductions = bucket_reductions(order, bucket)
    (flat, arriving, i), *later = reductions
    first = flat + arriving + (0 if i == len(order) - 1 else waiting)
    after = max((arriving + (0 if i == len(order) - 1 else waiting) for _, arriving, i in later), default=0)
    last = _last_reduction_elements(arch, order[reductions[-1][2]:], bucket, ranks)
    beside_buffer = 0
    if rank is not None and partition_buffer:
        made_after = partition_buffer_reduction(arch, ranks, rank, bucket)
        spanning = _spans_partitions(arch, ranks, [i for _, _, i in reductions])
        beside_buffer = max((flat + arriving + (0 if i == len(order) - 1 else waiting)
                             for k, (flat, arriving, i) in enumerate(reductions)
                             if k > made_after and spanning[k]), default=0)
    return max(first * REDUCE_BUCKET_ELEMENT_BYTES,
               partition_buffer + max(after, last, beside_buffer) * REDUCE_BUCKET_ELEMENT_BYTES)


def _spans_partitions(arch: ModelArchitecture, ranks: int, ends: list[int]) -> list[bool]:
    """For each bucket the backward reduces in turn, ending before the gradient `ends[k]` of the backward's order (and
    starting where the one before ended), whether it holds elements of more than one rank's partition of the matrices'
    group: the backward makes that group's gradients in the reverse of its flat order (`backward_order`,
    `base_groups`)."""
    reduced = _matrices_reduced(arch)
    total, share = reduced[-1], _matrices_partition_elements(arch, ranks)
    spanning, start = [], 0
    for end in ends:
        low, high = total - reduced[end], total - reduced[start]
        spanning.append(high > low and low // share != (high - 1) // share)
        start = end
    return spanning


def _matrices_reduced(arch: ModelArchitecture) -> list[int]:
    """The matrices' group's elements among the backward's first i gradients, for i from 0 to all of them."""
    return [0, *accumulate(n if group == 0 else 0 for n, group in _backward_params(arch))]


def _last_reduction_elements(arch: ModelArchitecture, bucketed: list[int], bucket: int, ranks: int) -> int:
    """The 16-bit gradient elements the backward's epilogue holds while it reduces what the bucket holds last
    (`independent_gradient_partition_epilogue`, zero/stage_1_and_2.py:1016-1018): their flat copy for the collective,
    and where that is the embedding alone, larger than the bucket, its gradient too, which bypasses the bucket
    (`extra_large_param_to_reduce`, :1436-1443); its flat copy is a view where it lies in one rank's partition (one
    slice; `_flatten_dense_tensors` of one tensor). The sharded trace of Llama-3.2-1B on 8 with 2e8 buckets: the
    embedding's 501 MiB gradient and its flat copy beside the partition buffer. `bucketed`: the gradients the last
    reduction holds, in the backward's order."""
    last = sum(bucketed)
    if last <= bucket or len(bucketed) > 1:
        return last
    embedding_slices = -(-last // _matrices_partition_elements(arch, ranks))
    return last * (2 if embedding_slices > 1 else 1)


def _matrices_partition_elements(arch: ModelArchitecture, ranks: int) -> int:
    """One rank's share of the matrices' optimizer group (`base_groups`), which ZeRO-1/2 split into equal parts, the
    embedding first."""
    return -(-sum(base_groups(arch)[0]) // ranks)


def backward_order(arch: ModelArchitecture) -> list[int]:
    """The base model's parameters' numels in the order its backward makes their gradients: an untied output
    projection, the final norm, each decoder layer from the last (its linears from the last, their biases, its
    norms), the embedding."""
    return [numel for numel, _ in _backward_params(arch)]


def _backward_params(arch: ModelArchitecture) -> list[tuple[int, int]]:
    """`backward_order`'s parameters as (numel, optimizer group): 0 the matrices, 1 the norms, biases and the rest
    (`base_groups`)."""
    layer = [pair for lin in reversed(arch.layer_linears())
             for pair in (((lin.out_features, 1),) if lin.bias else ()) + ((lin.in_features * lin.out_features, 0),)]
    layer += [(arch.norm_params, 1)] * arch.family.norms_per_layer
    rest = arch.layer_params - sum(n for n, _ in layer)  # q/k norms
    head = [] if arch.tie_word_embeddings else [(arch.lm_head_params, 0)]
    return [*head, (arch.norm_params, 1), *([*layer, *([(rest, 1)] if rest > 0 else [])] * arch.num_layers),
            (arch.embedding_params, 0)]


def partition_reduced_before_embedding(arch: ModelArchitecture, ranks: int, rank: int, bucket: int) -> bool:
    """Whether ZeRO-2 has reduced a gradient of the rank's partition, and so allocated its partition buffer
    (`grads_in_partition`, zero/stage_1_and_2.py:2183-2194), before the embedding's gradient is made: the backward
    reduces the model's parameters from the last (`backward_order`), the embedding's arrival reduces what the bucket
    holds then, and the rank's partition of the matrices' group is its share of it in the model's order
    (`base_groups`). The norms' group is not judged: `backward_order` puts a layer's norms after its linears, while
    its backward makes the first norm's gradient last, so a partition boundary inside the norms of the layer a
    reduction ends at is not placed. The sharded trace: Qwen2.5-0.5B on 2 with "auto" buckets has rank 0's buffer
    there; Llama-3.2-1B on 2 with the default bucket not (layers 7 to 0 still in the bucket, rank 0's norms'
    partition ending 1,024 elements into layer 8's)."""
    last_before = len(backward_order(arch)) - 1
    return any(i < last_before for i in _partition_reductions(arch, ranks, rank, bucket))


def partition_buffer_reduction(arch: ModelArchitecture, ranks: int, rank: int, bucket: int) -> int:
    """Which of the backward's reductions (`bucket_reductions` of `backward_order`, then the epilogue's) first reduces
    a gradient of the rank's partition, and so allocates ZeRO-2's partition buffer after its flat copy
    (`partition_reduced_before_embedding`); the epilogue's where none of the backward's does. The sharded trace of
    Qwen2.5-1.5B on 4 with the default bucket: rank 1's 767 MiB buffer after the second reduction."""
    reductions = [i for _, _, i in bucket_reductions(backward_order(arch), bucket) if i > 0]
    touching = next(_partition_reductions(arch, ranks, rank, bucket), None)
    return reductions.index(touching) if touching is not None else len(reductions)


def _partition_reductions(arch: ModelArchitecture, ranks: int, rank: int, bucket: int) -> Iterator[int]:
    """The backward's reductions that reduce a gradient of the rank's partition of the matrices' group, as the index
    of the gradient whose arrival sets each off."""
    reduced = _matrices_reduced(arch)
    matrices, share = sum(base_groups(arch)[0]), _matrices_partition_elements(arch, ranks)
    for _, _, i in bucket_reductions(backward_order(arch), bucket):
        if i > 0 and reduced[i] > 0 and (rank + 1) * share > matrices - reduced[i]:
            yield i


def bucket_reductions(numels: list[int], bucket: int = REDUCE_BUCKET_ELEMENTS) -> list[tuple[int, int, int]]:
    """Each reduction of a full bucket as the gradients `numels` reach it in turn: (the elements it flattens, those of
    the gradient whose arrival set it off, that gradient's index). ZeRO-2 reduces when `bucket.elements +
    param.numel() > reduce_bucket_size` (zero/stage_1_and_2.py:1422), ZeRO-3 the same for a bucket holding any
    (zero/stage3.py:1583)."""
    reductions, filled = [], 0
    for i, numel in enumerate(numels):
        if filled and filled + numel > bucket:
            reductions.append((filled, numel, i))
            filled = 0
        filled += numel
    return reductions or [(0, 0, 0)]


def optimizer_groups(arch: ModelArchitecture, lora_r: int | None, lora_targets: list[str] | None) -> list[list[int]]:
    """The trainable parameters' numels in the model's order, in the Trainer's optimizer groups, which ZeRO partitions
    apart: a LoRA run's adapters, else the base model's (`base_groups`)."""
    if lora_r:
        return [_layer_adapters(arch, lora_r, lora_targets) * arch.num_layers]
    return base_groups(arch)


def _layer_adapters(arch: ModelArchitecture, lora_r: int | None, lora_targets: list[str] | None) -> list[int]:
    """LoRA's A and B of each adapted linear of one layer, in order (none without LoRA)."""
    if not lora_r:
        return []
    return [rows * width for rows, width in blocks.adapter_shapes(arch, lora_r, lora_targets)]


def base_groups(arch: ModelArchitecture) -> list[list[int]]:
    """The model's parameters' numels in its order, in the Trainer's two groups (weight decay: the matrices; none:
    norms and biases, transformers' get_decay_parameter_names); what the model has besides (q/k norms, a vision
    tower) joins the second."""
    layers, h = arch.num_layers, arch.hidden_size
    norms = [h] * (arch.family.norms_per_layer * (2 if arch.family.layer_norm_bias else 1))
    linears = [lin.in_features * lin.out_features for lin in arch.layer_linears()]
    biases = [lin.out_features for lin in arch.layer_linears() if lin.bias]
    head = [] if arch.tie_word_embeddings else [arch.embedding_params]
    decay = [arch.embedding_params, *linears * layers, *head]
    no_decay = [*(biases + norms) * layers, h]
    rest = arch.params - sum(decay) - sum(no_decay)
    return [decay, no_decay + ([rest] if rest > 0 else [])]


def partition_pieces(numels: list[int], ranks: int, rank: int) -> tuple[list[int], list[int]]:
    """The rank's partition of a flat group of parameters (numels, in order; ZeRO-1/2 split the group into equal
    parts, the last padded): the elements of each parameter inside it, and those parameters whole."""
    part = -(-sum(numels) // ranks)
    start, end, offset = rank * part, (rank + 1) * part, 0
    pieces, whole = [], []
    for numel in numels:
        if offset < end and offset + numel > start:
            pieces.append(min(end, offset + numel) - max(start, offset))
            whole.append(numel)
        offset += numel
    return pieces, whole


def step_gradient_bytes(groups: list[list[int]], ranks: int, stage: int) -> int:
    """The gradients DeepSpeed's optimizer step holds at its peak, without offload, on the rank that holds the most
    (`groups`: `optimizer_groups`); ZeRO-3's 16-bit gradient partition and its bucket, kept throughout, not included.

    ZeRO-1/2 keep each gradient their partition touches whole until its fp32 copy is made: the backward's epilogue
    lists them, a slice (`narrow`) of one that the partition shares keeping its whole storage (`averaged_gradients`,
    stage_1_and_2.py:1046-1053 and :2880-2886; ZeRO-2 copies them whole into its contiguous buffer, :2184-2199),
    freed at :3127-3131. Beside them the norm's fp64 copy of the largest piece, or a group's flat copy and fp32 copy
    (groups in order, the earlier ones freed). ZeRO-3 flattens one sub-group at a time out of its gradient partition.
    """
    if stage == 3:
        subs = [sub for group in groups for sub in _sub_groups([-(-n // ranks) for n in group])]
        pieces = [-(-n // ranks) for group in groups for n in group]
        return max(max(subs, default=0) * (FLAT_GRADIENT_BYTES + FP32_GRADIENT_BYTES),
                   max(pieces, default=0) * NORM_COPY_BYTES)
    return zero12_step_bytes(groups, ranks, stepping_rank(groups, ranks))


def stepping_rank(groups: list[list[int]], ranks: int) -> int:
    """The rank whose ZeRO-1/2 optimizer step holds the most gradients (the first of equals)."""
    return max(range(ranks), key=lambda rank: (zero12_step_bytes(groups, ranks, rank), -rank))


def accumulated_gradient_bytes(groups: list[list[int]], ranks: int) -> int:
    """ZeRO-2's 16-bit gradients that a micro-batch leaves to the next, on the rank that holds the most: every
    gradient its partition touches, whole (`grads_in_partition`, allocated at the first reduction with the numel of
    `params_in_partition` and kept to the step, zero/stage_1_and_2.py:2184-2203)."""
    return whole_gradient_elements(groups, ranks, accumulating_rank(groups, ranks)) * REDUCE_BUCKET_ELEMENT_BYTES


def accumulating_rank(groups: list[list[int]], ranks: int) -> int:
    """The rank whose ZeRO-2 partition touches the most gradients, which it keeps whole from a micro-batch's first
    reduction to the step (the first of equals): with a 1B model's two groups on 8 ranks rank 1, 617 MiB against
    rank 0's 501."""
    return max(range(ranks), key=lambda rank: (whole_gradient_elements(groups, ranks, rank), -rank))


def whole_gradient_elements(groups: list[list[int]], ranks: int, rank: int) -> int:
    """The elements of every gradient the rank's ZeRO-1/2 partition touches (each kept whole)."""
    return sum(sum(partition_pieces(group, ranks, rank)[1]) for group in groups)


def heaviest_rank(groups: list[list[int]], ranks: int, stage: int, phase: str) -> int:
    """The rank that holds the most in `phase`, whose bytes the planner counts there: under ZeRO-1/2 the optimizer
    step's partitions differ (`stepping_rank`), and under ZeRO-2 the gradients a partition keeps from the backward on
    (`accumulating_rank`, every phase but the step); ZeRO-3 splits every parameter evenly, and ZeRO-1's backward
    keeps the whole gradients on every rank: rank 0."""
    if stage in (1, 2) and phase == "optimizer":
        return stepping_rank(groups, ranks)
    return accumulating_rank(groups, ranks) if stage == 2 else 0


def rank_excess_bytes(groups: list[list[int]], ranks: int, stage: int, phase: str, rank: int) -> int:
    """How many more bytes the rank the planner counts in `phase` (`heaviest_rank`) holds there than `rank` does,
    where that difference is the whole difference: ZeRO-1/2's optimizer step, whose peak is its gradients beside what
    every rank holds alike (`zero12_step_bytes`). 0 elsewhere, where the ranks hold the same or the difference
    (ZeRO-2's whole gradients, `whole_gradient_elements`) may or may not be alive at the phase's peak."""
    if stage not in (1, 2) or phase != "optimizer":
        return 0
    heaviest = heaviest_rank(groups, ranks, stage, phase)
    return zero12_step_bytes(groups, ranks, heaviest) - zero12_step_bytes(groups, ranks, rank)


def zero12_step_bytes(groups: list[list[int]], ranks: int, rank: int) -> int:
    """The gradients this rank's ZeRO-1/2 optimizer step holds at its peak (`step_gradient_bytes`)."""
    split = [partition_pieces(group, ranks, rank) for group in groups]
    shares = [-(-sum(group) // ranks) for group in groups]
    # the last rank's partition ends in a tensor of zeros, one more in the list (stage_1_and_2.py:2890-2891)
    kept = [(sum(whole) + share - sum(pieces)) * REDUCE_BUCKET_ELEMENT_BYTES
            for (pieces, whole), share in zip(split, shares)]
    peak = sum(kept) + max((p for pieces, _ in split for p in pieces), default=0) * NORM_COPY_BYTES
    for i, ((pieces, _), share) in enumerate(zip(split, shares)):
        tensors = len(pieces) + (sum(pieces) < share)
        flat = share * FLAT_GRADIENT_BYTES if tensors > 1 else 0
        peak = max(peak, sum(kept[i:]) + flat + share * FP32_GRADIENT_BYTES)
    return peak


def _sub_groups(partitions: list[int]) -> list[int]:
    """The elements of each of ZeRO-3's sub-groups of a group's parameter partitions."""
    return [sum(sub) for sub in sub_group_partitions(partitions)]


def sub_group_partitions(partitions: list[int]) -> list[list[int]]:
    """ZeRO-3's sub-groups of a group's parameter partitions (`_create_fp16_sub_groups`, zero/stage3.py:1210-1233):
    each closes at the partition that brings it to SUB_GROUP_ELEMENTS, the last at the group's end."""
    if sum(partitions) <= SUB_GROUP_ELEMENTS:
        return [list(partitions)]
    subs: list[list[int]] = [[]]
    size = 0
    for n in partitions:
        subs[-1].append(n)
        size += n
        if size >= SUB_GROUP_ELEMENTS:
            subs.append([])
            size = 0
    return [sub for sub in subs if sub]
