"""Model states in the host's RAM: DeepSpeed's ZeRO-Offload (`offload_optimizer`, `offload_param` with device cpu) and
FSDP2's CPUOffloadPolicy, as the engines allocate them; what stays on each GPU is counted in model/components.py.

Pure: no DeepSpeed, no torch. DeepSpeed's constants cite DeepSpeed 0.19.8's source (`deepspeed/...`), FSDP2's and the
pinned-memory allocator's torch 2.13's (`torch/...`, and the C++ headers torch ships in `torch/include`).

- DeepSpeed pins its offload buffers by default: `pin_memory: bool = True` for parameters and for the optimizer
  (runtime/zero/offload_config.py:45 and :75), accelerate's config sets only the device (accelerate/utils/
  dataclasses.py:1308-1316). FSDP2's CPUOffloadPolicy pins too (accelerate/utils/dataclasses.py:2189 makes
  `CPUOffloadPolicy()`, whose `pin_memory` defaults to True, torch/distributed/fsdp/_fully_shard/_fsdp_api.py:199).
- A pinned tensor comes from PyTorch's CachingHostAllocator, which rounds each allocation up to the next power of two
  (torch/include/ATen/core/CachingHostAllocator.h:300-305, "Round up the allocation to the nearest power of two"; the
  thresholds that could stop it are unlimited by default, torch/include/c10/core/AllocatorConfig.h:361-363), so a
  pinned buffer of 3.1 GiB holds 4 GiB of page-locked RAM.
- With an optimizer offloaded, accelerate hands DeepSpeed a DeepSpeedCPUAdam in place of the Trainer's optimizer
  (accelerate/accelerator.py:2374-2383, accelerate/utils/deepspeed.py:41-43), which keeps exp_avg and exp_avg_sq in
  float32 beside each fp32 partition (deepspeed/ops/adam/cpu_adam.py:158-164): 8 bytes per parameter of the partition.

DeepSpeed's own estimators of the offloaded cases (zero/stage_1_and_2.py:4025-4027 and zero/stage3.py:4030-4043) count
more host RAM than these buffers (they multiply by `additional_buffer_factor=1.5` and count the fp32 model every
process loads); the host RAM planned is never below theirs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from vram_planner.model import components as m
from vram_planner.model import fsdp, zero
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.spec import DTYPE_BYTES, TrainingConfig

FP32_BYTES = 4
BIT16_BYTES = 2
# DeepSpeedCPUAdam's exp_avg and exp_avg_sq, float32 (deepspeed/ops/adam/cpu_adam.py:158-164)
CPU_ADAM_STATE_BYTES = 8
# ZeRO-3 keeps its gradient partitions in one flat buffer of gradient_accumulation_dtype (zero/stage3.py:791-795), on
# the CPU when the optimizer is offloaded (zero/stage3.py:333); the engine passes the model's dtype, bf16, unless the
# config sets data_types.grad_accum_dtype (runtime/engine.py:1799-1810), which TRL's configs do not
GRADIENT_PARTITION_BYTES = 2
# DeepSpeed's estimators' factor for what their count leaves out (zero/stage_1_and_2.py:4021, zero/stage3.py:4023)
ESTIMATE_BUFFER_FACTOR = 1.5
# The most GPUs one node holds (the HGX/DGX boards of 8): host RAM is per node, and `--num-gpus auto` plans one node,
# as the printed accelerate config does (num_machines: 1)
MAX_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class HostBuffer:
    """One kind of buffer in the host's RAM on one rank: its tensors' bytes, and what they hold (pinned ones rounded
    up, each tensor to its own power of two)."""

    name: str
    tensor_bytes: int
    held_bytes: int
    pinned: bool


def pinned_bytes(n_bytes: float) -> int:
    """What CachingHostAllocator holds for a pinned tensor of n_bytes: the next power of two."""
    n = math.ceil(n_bytes)
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def _buffer(name: str, n_bytes: float, pinned: bool) -> HostBuffer:
    """One tensor (or one flat buffer) of n_bytes."""
    return HostBuffer(name, math.ceil(n_bytes), pinned_bytes(n_bytes) if pinned else math.ceil(n_bytes), pinned)


def _per_parameter(name: str, numels: list[int], element_bytes: int) -> HostBuffer:
    """A pinned tensor per parameter of these numels."""
    return HostBuffer(name, sum(numels) * element_bytes, sum(pinned_bytes(n * element_bytes) for n in numels), True)


def _trainable(arch: ModelArchitecture, train: TrainingConfig) -> int:
    return arch.lora_params(train.lora_r or 0, train.lora_targets) if train.uses_lora else arch.params


def host_buffers(arch: ModelArchitecture, train: TrainingConfig) -> list[HostBuffer]:
    """The offloaded states one rank keeps in the host's RAM during training (none without offload)."""
    if not train.offloaded:
        return []
    if train.fsdp:
        return _fsdp_buffers(arch, train)
    part = math.ceil(_trainable(arch, train) / train.num_gpus)
    if train.zero_stage == 3:
        return _zero3_buffers(arch, train, part)
    # one flat partition per optimizer group, each pinned on its own
    parts = [math.ceil(sum(group) / train.num_gpus) for group in m.zero_optimizer_groups(arch, train)]
    buffers = [
        _flat("fp32 master partition", parts, FP32_BYTES),  # zero/stage_1_and_2.py:560-565
        _flat("16-bit copy of the partition for the upload", parts, BIT16_BYTES),  # :566-573
        _flat("fp32 gradient partition", parts, FP32_BYTES),  # :936-941
        _buffer("DeepSpeedCPUAdam's moments", sum(parts) * CPU_ADAM_STATE_BYTES, False),
        # the largest parameter's gradient staged on its way to the host (zero/stage_1_and_2.py:653-658)
        _buffer("gradient staging buffer", zero.largest_trainable_layer_params(
            arch, train.lora_r, train.lora_targets) * BIT16_BYTES, True),
    ]
    if train.gradient_accumulation_steps > 1:
        # gradients accumulated across micro-batches, one pinned tensor per parameter in the parameters' dtype
        # (zero/stage_1_and_2.py:1822-1825, used from the second micro-batch or before the boundary, :2166-2167):
        # every parameter with a piece in the partition, whole, so the ones it shares with its neighbours come in full
        touching = [numel for group in m.zero_optimizer_groups(arch, train) for numel in _touching(group, train.num_gpus)]
        buffers.append(_per_parameter("gradients accumulated on the host", touching, BIT16_BYTES))
    return buffers


def _flat(name: str, parts: list[int], element_bytes: int) -> HostBuffer:
    """Pinned flat partitions, one per optimizer group."""
    return HostBuffer(name, sum(parts) * element_bytes, sum(pinned_bytes(p * element_bytes) for p in parts), True)


def _touching(numels: list[int], ranks: int) -> list[int]:
    """The parameters (numels, in order) with a piece in the rank's partition of their flat group that has the most
    elements of them, each whole."""
    return max((zero.partition_pieces(numels, ranks, rank)[1] for rank in range(ranks)), key=sum)


def _zero3_buffers(arch: ModelArchitecture, train: TrainingConfig, part: int) -> list[HostBuffer]:
    parts = [math.ceil(sum(group) / train.num_gpus) for group in m.zero_optimizer_groups(arch, train)]
    # each optimizer group's partition steps in sub-groups of at most zero.SUB_GROUP_ELEMENTS (zero/config.py:182),
    # a pinned fp32 gradient each (zero/stage3.py:1337-1342)
    sub_groups = [size for p in parts for size in [zero.SUB_GROUP_ELEMENTS] * (p // zero.SUB_GROUP_ELEMENTS)
                  + [p % zero.SUB_GROUP_ELEMENTS] if size]
    buffers = [
        _buffer("fp32 master partition", part * FP32_BYTES, False),  # zero/stage3.py:1157-1159, unpinned
        _flat("fp32 gradient of each sub-group", sub_groups, FP32_BYTES),  # zero/stage3.py:1337-1342
        _buffer("gradient partitions", part * GRADIENT_PARTITION_BYTES, True),  # zero/stage3.py:791-795
        _buffer("DeepSpeedCPUAdam's moments", part * CPU_ADAM_STATE_BYTES, False),
    ]
    if train.offload_param == "cpu":
        # the 16-bit parameter partitions, pinned, one per optimizer group (zero/stage3.py:888-907); a frozen base
        # counted the same way, as one more
        frozen = math.ceil((arch.params - _trainable(arch, train)) / train.num_gpus)
        buffers.append(_flat("16-bit parameter partitions", parts + ([frozen] if frozen else []), BIT16_BYTES))
    return buffers


def _fsdp_buffers(arch: ModelArchitecture, train: TrainingConfig) -> list[HostBuffer]:
    """FSDP2 pins each parameter's padded shard on its own (torch/distributed/fsdp/_fully_shard/_fsdp_param.py:
    312-315) and copies each reduced gradient shard to the host (_fsdp_collectives.py:711-743, into pinned memory
    with a non-blocking copy); the optimizer's states are made beside the shards, unpinned."""
    n, master = train.num_gpus, fsdp.master_bytes(train)
    shards = [math.ceil(numel / n) for group in m.zero_optimizer_groups(arch, train) for numel in group]
    frozen = [math.ceil(numel / n) for group in zero.base_groups(arch) for numel in group] if train.uses_lora else []
    on_device = _on_device(train)
    return [_per_parameter("parameter shards", shards, master),
            _per_parameter("frozen parameter shards", frozen, DTYPE_BYTES[train.dtype]),
            _per_parameter("gradient shards", shards, master),
            _buffer("optimizer states", m.optimizer_state_bytes(arch, on_device), False),
            _buffer("optimizer step scratch", m.optimizer_step_temporary_bytes(arch, on_device), False)]


def _on_device(train: TrainingConfig) -> TrainingConfig:
    return replace(train, offload_optimizer="none", offload_param="none")


def loading_bytes(arch: ModelArchitecture, train: TrainingConfig) -> int:
    """The host RAM the model takes while it loads, before the engine moves it: every process builds the whole model
    on the CPU under ZeRO-1/2 (no zero.Init: TRL's zero2 config sets zero3_init_flag false); under FSDP2 only rank 0
    loads the weights (fsdp_cpu_ram_efficient_loading, accelerate/utils/fsdp_utils.py:887-888); ZeRO-3's zero.Init
    partitions each layer as it is built."""
    whole = arch.params * DTYPE_BYTES[train.dtype]
    if train.fsdp:
        return whole
    return whole * min(train.num_gpus, MAX_GPUS_PER_NODE) if train.zero_stage in (1, 2) else 0


def deepspeed_estimate(arch: ModelArchitecture, train: TrainingConfig) -> tuple[int, int] | None:
    """DeepSpeed's estimate with cpu_offload (host RAM of one node, GPU bytes of one rank), as its estimators compute
    it for one node of `num_gpus` (zero/stage_1_and_2.py:4025-4027, zero/stage3.py:4030-4043, zero_init as TRL's
    zero3 config sets it); None where DeepSpeed does not offload."""
    if train.fsdp or train.offload_optimizer != "cpu":
        return None
    p, n, factor = arch.params, train.num_gpus, ESTIMATE_BUFFER_FACTOR
    if train.zero_stage != 3:
        return int(p * max(4 * n, 16) * factor), 2 * p
    largest = 4 * zero.largest_layer_params(arch)
    if train.offload_param == "cpu":
        return int(p * 18 * factor), largest
    return int(p * 16 * factor), largest + int(2 * p / n)


def host_bytes(arch: ModelArchitecture, train: TrainingConfig) -> int:
    """The host RAM one node needs at its peak: the offloaded states of its ranks (or the model while it loads),
    never below DeepSpeed's own estimate; 0 without offload."""
    if not train.offloaded:
        return 0
    ranks = min(train.num_gpus, MAX_GPUS_PER_NODE)
    training = ranks * sum(b.held_bytes for b in host_buffers(arch, train))
    estimate = deepspeed_estimate(arch, train)
    return max(training, loading_bytes(arch, train), estimate[0] if estimate else 0)


def machine_memory_bytes() -> int | None:
    """This machine's RAM (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def host_memory_bytes(train: TrainingConfig) -> int | None:
    """The RAM of one node: --host-memory, else this machine's."""
    if train.host_memory is not None:
        from vram_planner.units import parse_size_bytes

        return parse_size_bytes(train.host_memory)
    return machine_memory_bytes()


def host_note(arch: ModelArchitecture, train: TrainingConfig) -> str | None:
    """The host RAM the offloaded states need beside the node's, in words (None without offload)."""
    if not train.offloaded:
        return None
    from vram_planner.units import format_gib

    need, capacity = host_bytes(arch, train), host_memory_bytes(train)
    where = "--host-memory" if train.host_memory is not None else "this machine's RAM"
    ranks = min(train.num_gpus, MAX_GPUS_PER_NODE)
    head = f"host RAM: the offloaded states of {ranks} rank{'s' * (ranks > 1)} need {format_gib(need)}"
    if capacity is None:
        return f"{head} per node (give --host-memory to judge it)"
    verdict = "fits in" if need <= capacity else "does not fit in"
    return f"{head} per node, which {verdict} {format_gib(capacity)} ({where})"
