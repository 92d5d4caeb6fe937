"""vLLM's own tensor-parallel communicators on each rank when TRL colocates vLLM with vllm_tensor_parallel_size T > 1:
device memory outside vLLM's `gpu_memory_utilization` budget, counted beside the training run's NCCL buffers.

Read in vLLM 0.31.0 (the newest TRL 1.16's `vllm` extra accepts, vllm<=0.31.0,>=0.22.0) and 0.22.0:
- Outside the budget. `Worker.init_device` sets up the distributed environment *before* the memory snapshot
  ("Initialize the distributed environment BEFORE taking memory snapshot", v1/worker/gpu_worker.py:466-490; 0.22.0
  :276-300). `request_memory` (v1/worker/utils.py:539-558) then asks for utilization x total of what is free after
  the communicators, and `memory_profiling` measures non-torch memory from that snapshot on: what the communicators
  hold is in neither the requested budget nor its non-torch term. So on the card vLLM holds its budget plus them, and
  its start-up check sees them as taken.
- Which groups. `initialize_model_parallel` (distributed/parallel_state.py:2071-2209): TRL passes no data or pipeline
  parallelism, so only the TP group has T > 1 ranks; the world group has no device communicator
  (parallel_state.py:1468). The TP group's `CudaCommunicator` (device_communicators/cuda_communicator.py:96-148):
  * pynccl: its own NCCL communicator over T ranks (ncclCommInitRank, pynccl.py:180) and a one-element all_reduce
    at once (pynccl.py:188-190): NCCL connects the ring (model/nccl.py counts it for T ranks); its larger all-reduces
    go to the custom all-reduce and symmetric memory below, so no NVLS buffers are counted for it.
  * custom all-reduce (CustomAllreduce, custom_all_reduce.py; T in 2, 4, 6, 8, 16 (:121), more than 2 ranks only
    fully connected by NVLink (:264), P2P needed (:275)): a metadata buffer of meta_size() + max_size (:290-295), an
    IPC buffer of max(max_size, 2 MiB all-gather, 16 MiB reduce-scatter) (:122, :130, :298-307), both cudaMalloc'ed,
    and 8 MiB of rank_data (:313-315); max_size 8 MiB (:140), lowered by CUSTOM_ALL_REDUCE_MAX_SIZES
    (all_reduce_utils.py:31-56) when symmetric memory is on. With multicast (NVSwitch, sm90+) also a symmetric
    buffer of 6 x max(MNNVL all-gather size x T, 16 MiB) (:123-132, :337-342, :354-363).
  * symmetric-memory all-reduce (SymmMemCommunicator, symm_mem.py:88-97; VLLM_ALLREDUCE_USE_SYMM_MEM=1 by
    default): a buffer of SYMM_MEM_ALL_REDUCE_MAX_SIZES[cc][T] (all_reduce_utils.py:58-83), kept even when the
    board has no multicast.
- TRL's own TP group (trl/generation/vllm_generation.py:320-327, `new_subgroups_by_enumeration`) all_gathers the
  prompts of the T ranks before each generation (:685-697): one more NCCL communicator of T ranks, its ring
  connected at the first generation (after vLLM's start-up check).
0.22.0 has no 16 MiB reduce-scatter buffer (its IPC buffer is max_size) and no multicast buffer: 104 MiB less on an
H100 board; the figure is 0.31.0's. Not here: FlashInfer's all-reduce workspace (VLLM_ALLREDUCE_USE_FLASHINFER=1 in
0.31): FlashInferAllReduce sizes it at init but creates it at the first all-reduce (flashinfer_all_reduce.py:364-419),
in the profile run, so vLLM measures it inside its budget (the non-torch term of model/vllm.py); the TP group's torch
NCCL device_group (parallel_state.py:499; torch creates its communicator at the first collective on it, and none was
found on TRL's generate path).
"""

from __future__ import annotations

from dataclasses import dataclass

from vram_planner.model.nccl import align_up, communicator_bytes, nccl_table, sm_tuple, transport_of
from vram_planner.profiles import GpuProfile
from vram_planner.units import GiB, MiB

CUSTOM_AR_WORLD_SIZES = (2, 4, 6, 8, 16)  # CustomAllreduce._SUPPORTED_WORLD_SIZES, custom_all_reduce.py:121
CUSTOM_AR_MAX_BYTES = 8 * MiB  # max_size=8192 * 1024, custom_all_reduce.py:140
CUSTOM_AR_ALL_GATHER_BYTES = 2 * MiB  # _DEFAULT_ALL_GATHER_MAX_SIZE, custom_all_reduce.py:122
CUSTOM_AR_REDUCE_SCATTER_BYTES = 16 * MiB  # _DEFAULT_REDUCE_SCATTER_MAX_SIZE, custom_all_reduce.py:130
CUSTOM_AR_RANK_DATA_BYTES = 8 * MiB  # rank_data, custom_all_reduce.py:313-315
# _DEFAULT_MNNVL_ALL_GATHER_MAX_SIZES (custom_all_reduce.py:123-129) and the multicast buffer's 6 stages (:358)
MNNVL_ALL_GATHER_BYTES = {2: 8 * MiB, 4: 4 * MiB, 6: 2 * MiB, 8: 2 * MiB, 16: 2 * MiB}
MNNVL_REDUCE_SCATTER_BYTES = 16 * MiB  # _DEFAULT_MNNVL_REDUCE_SCATTER_MAX_SIZE, custom_all_reduce.py:131
MNNVL_STAGES = 6
# CUSTOM_ALL_REDUCE_MAX_SIZES and SYMM_MEM_ALL_REDUCE_MAX_SIZES by compute capability and T (all_reduce_utils.py:31-83)
CUSTOM_AR_CAPS = {"9.0": {2: 64 * MiB, 4: 32 * MiB, 6: MiB // 2, 8: MiB // 4},
                  "10.0": {2: 2 * MiB, 4: 2 * MiB, 6: MiB, 8: MiB},
                  "10.3": {2: 4 * MiB, 4: 4 * MiB, 6: 8 * MiB, 8: 4 * MiB}}
SYMM_MEM_BYTES = {"9.0": {2: 64 * MiB, 4: 32 * MiB, 6: 64 * MiB, 8: 64 * MiB},
                  "10.0": {2: 8 * MiB, 4: 32 * MiB, 6: 128 * MiB, 8: 128 * MiB},
                  "10.3": {2: 4 * MiB, 4: 32 * MiB, 6: 32 * MiB, 8: 64 * MiB}}


@dataclass(frozen=True)
class VllmCommFigure:
    """vLLM's TP communicators on one rank (bytes): by part, what exists at vLLM's start-up check, and in words."""

    bytes: int
    at_start_bytes: int  # all but TRL's TP group, connected at the first generation
    parts: dict[str, int]
    source: str


NO_COMMUNICATORS = VllmCommFigure(0, 0, {}, "")


def vllm_comm_figure(gpu: GpuProfile, tp: int) -> VllmCommFigure:
    """What colocated vLLM's tensor-parallel group of `tp` ranks holds on each card like `gpu` (nothing for tp 1)."""
    if tp <= 1:
        return NO_COMMUNICATORS
    table = nccl_table()
    interconnect, row = table.link_of(gpu)
    transport = transport_of(gpu, table)
    ring = sum(communicator_bytes(tp, row, gpu.compute_capability, transport, table, ["ring"]).values())
    parts = {"pynccl": ring}
    cc, gran = gpu.compute_capability, table.granularity_bytes
    symm = SYMM_MEM_BYTES.get(cc, {}).get(tp, 0)
    if symm:
        parts["symm_mem"] = symm
    nvlink = interconnect.startswith("nvlink")
    if tp in CUSTOM_AR_WORLD_SIZES and transport == "p2p" and (tp == 2 or nvlink):
        max_size = min(CUSTOM_AR_MAX_BYTES, CUSTOM_AR_CAPS.get(cc, {}).get(tp, CUSTOM_AR_MAX_BYTES)) if symm else \
            CUSTOM_AR_MAX_BYTES
        ipc = max(max_size, CUSTOM_AR_ALL_GATHER_BYTES, CUSTOM_AR_REDUCE_SCATTER_BYTES)
        # meta_size() (the sync flags, a few KiB) with max_size, each cudaMalloc rounded up to the 2 MiB granule
        parts["custom_all_reduce"] = align_up(max_size + 1, gran) + align_up(ipc, gran) + CUSTOM_AR_RANK_DATA_BYTES
        multicast = row.nvswitch and sm_tuple(cc) >= (9, 0)
        if multicast:
            stage = max(MNNVL_ALL_GATHER_BYTES[tp] * tp, MNNVL_REDUCE_SCATTER_BYTES)
            parts["multicast_buffer"] = MNNVL_STAGES * stage
    at_start = sum(parts.values())
    parts["trl_tp_group"] = ring
    total = at_start + ring
    words = ", ".join(f"{k.replace('_', ' ')} {v / MiB:.0f} MiB" for k, v in parts.items())
    return VllmCommFigure(total, at_start, parts,
                          f"vLLM's tensor-parallel group of {tp} ranks (vLLM 0.31 defaults): {words} = "
                          f"{total / GiB:.2f} GiB per GPU, outside --vllm-gpu-memory-utilization (vLLM sets them up "
                          "before it measures free memory; model/vllm_comm.py)")
