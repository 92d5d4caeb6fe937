"""One GRPO step, phase by phase: which components are alive at each phase's peak moment, in bytes on one GPU.

The step in TRL 1.16 (../shared/design/grpo-memory.md, "The step, phase by phase"):
generation of the B x S generation batch -> no-grad log-prob scoring (only when the config needs old or reference
log-probs) -> loss forward/backward per micro-batch -> optimizer step. Optimizer states persist across steps, so
every phase carries them (from step 2 on); gradients live from the first backward until zero_grad after the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vram_planner.model import activations as act
from vram_planner.model import blocks
from vram_planner.model import components as m
from vram_planner.model import zero
from vram_planner.model import fsdp
from vram_planner.model import inference
from vram_planner.model import offload
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.calibration import Calibration, allocator_reserve_bytes
from vram_planner.model.cublas import TRAINING_THREADS, cublas_workspace_bytes
from vram_planner.model.cuda_context import context_bytes as resolved_context_bytes
from vram_planner.model.expandable_pages import expandable_patterns
from vram_planner.model.fragmentation import reserve_patterns
from vram_planner.model.generation_patterns import PREFILL_PATTERNS
from vram_planner.model.lm_head import drops_logits_to_keep, lm_head_memory, logit_positions
from vram_planner.model.spec import TrainingConfig, allocator_conf_notes
from vram_planner.model.stranding import (head_block_stranded_bytes, loaded_weight_segment_bytes,
                                          reference_logits_stranded_bytes)
from vram_planner.model.trl_releases import TrlRelease
from vram_planner.model.trl_semantics import release_assumptions
from vram_planner.model.vllm_comm import NO_COMMUNICATORS, VllmCommFigure
from vram_planner.model.zero_replay import (zero3_step_stranded_bytes, zero12_loss_stranded_bytes,
                                           zero12_step_stranded_bytes)

if TYPE_CHECKING:
    from vram_planner.model.vllm import VllmBudget

# Component names, in the order people read them.
COMPONENTS = ("weights", "reference_weights", "gradients", "optimizer_states", "kv_cache", "activations",
              "lm_head_buffers", "vllm_reservation", "cuda_context", "nccl_buffers", "vllm_communicators",
              "cublas_workspaces", "allocator_overhead")
TENSOR_COMPONENTS = COMPONENTS[:7]
# Device memory outside PyTorch's caching allocator: what it never reserves, beside what it does. vLLM's TP
# communicators are NCCL's buffers (pynccl), cudaMalloc'ed IPC buffers and torch's symmetric memory, none of it the
# caching allocator's; only the custom all-reduce's 8 MiB rank_data is (model/vllm_comm.py), counted here with the rest.
OUTSIDE_ALLOCATOR = ("cuda_context", "nccl_buffers", "vllm_communicators")
OUTSIDE_ALLOCATOR_NAMES = {"cuda_context": "the CUDA context", "nccl_buffers": "NCCL's buffers",
                           "vllm_communicators": "vLLM's TP communicators"}
# TRL 0.14's policy forward as its logits leave the model: under mixed precision accelerate's float32 copy of them
# (convert_outputs_to_fp32) is made while the model's own are alive
POLICY_LOGITS_MOMENT = "policy forward: the logits and accelerate's float32 copy"
# Then the reference's: its logits cut from the block the policy's copy freed
# (stranding.reference_logits_stranded_bytes)
REFERENCE_LOGITS_MOMENT = "reference log-probs while the policy's graph is alive"
# Where the releases that make the whole logits ask for a step's largest block (stranding.head_block_stranded_bytes)
LM_HEAD_BACKWARD_MOMENT = "LM head backward"
# The phases of the first micro-batch of the first step run before any optimizer state exists (and before any
# gradient, when gradients accumulate): they are judged on their own, as a run can die there
FIRST_MICRO_BATCH_PHASES = ("generation", "scoring", "training")
# generate()'s prefill: its moments come before any decoding step, so before the blocks generation's patterns strand
PREFILL, PREFILL_GATHERS = "prefill", "prefill: the first gathers"
PREFILL_MOMENTS = (PREFILL, PREFILL_GATHERS)
PHASE_TITLES = {"generation": "generation", "scoring": "old/ref log-probs", "training": "loss forward/backward",
                "optimizer": "optimizer step"}


def component_label(component: str) -> str:
    """How the table, the plot and the web page name a component."""
    labels = {"nccl_buffers": "NCCL buffers", "vllm_communicators": "vLLM TP communicators"}
    return labels.get(component, component.replace("_", " "))


def outside_allocator_names(components: dict[str, float], *more: str) -> str:
    """What a phase holds outside PyTorch's allocator, in words ("the CUDA context and NCCL's buffers"), the CUDA
    context always, the rest where the phase counts them; `more` joins the list (what the allocator adds)."""
    names = [OUTSIDE_ALLOCATOR_NAMES[c] for c in OUTSIDE_ALLOCATOR if c == "cuda_context" or components.get(c)]
    names += more
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


@dataclass(frozen=True)
class Phase:
    name: str
    components: dict[str, float]
    moment: str = ""  # which moment of the phase is its peak

    @property
    def total_bytes(self) -> float:
        return sum(self.components.values())

    @property
    def tensor_bytes(self) -> float:
        return sum(self.components.get(c, 0) for c in TENSOR_COMPONENTS)


@dataclass(frozen=True)
class Estimate:
    """The per-phase breakdown of one configuration on one GPU."""

    phases: tuple[Phase, ...]
    params: int
    trainable_params: int
    notes: tuple[str, ...] = field(default=())
    vllm: VllmBudget | None = None  # the vLLM this config starts on a planned card (vram_planner/model/vllm.py)
    host_bytes: int = 0  # the host RAM one node needs for offloaded states (vram_planner/model/offload.py)

    @property
    def peak_phase(self) -> Phase:
        return max(self.phases, key=lambda p: p.total_bytes)

    @property
    def peak_bytes(self) -> float:
        return self.peak_phase.total_bytes

    @property
    def tensor_peak_bytes(self) -> float:
        return max(p.tensor_bytes for p in self.phases)

    @property
    def allocated_peak_bytes(self) -> float:
        """What torch.cuda.max_memory_allocated() reads after the step: the tensors and the cuBLAS workspaces, which
        the caching allocator hands out too, at the phase where they peak; neither the allocator's reserve nor
        what lies outside it (the CUDA context, NCCL's buffers), nor colocated vLLM's budget."""
        return max(p.tensor_bytes + p.components.get("cublas_workspaces", 0.0) for p in self.phases)


def estimate(arch: ModelArchitecture, train: TrainingConfig, release: TrlRelease, cal: Calibration,
             capacity_bytes: int, context_bytes: float | None = None, gpu_label: str = "",
             gpu_bf16: bool = True, compute_capability: str = "", first_micro_batch: bool = False,
             nccl_bytes: float = 0.0, vllm_comm: VllmCommFigure = NO_COMMUNICATORS) -> Estimate:
    """The memory of one steady-state GRPO step of `train` on a GPU of `capacity_bytes` whose CUDA context takes
    `context_bytes` (None: the calibration's figure, else the one for a card the catalog does not know) and whose
    `compute_capability` sets the cuBLAS workspaces ("": a card other than compute capability 9.0); `nccl_bytes` is
    NCCL's own device memory on each rank (model/nccl.py; 0 on one GPU); `vllm_comm` what colocated vLLM's
    tensor-parallel communicators hold on each rank, outside its budget (model/vllm_comm.py).

    With `first_micro_batch`, the phases of the first micro-batch of the first step instead: generation, scoring and
    the loss before any optimizer state (or accumulated gradient) exists, and no optimizer step."""
    persistent = persistent_bytes(arch, train, first_micro_batch)
    all_grads = m.gradient_bytes(arch, train)
    # vLLM colocated on this card takes the budget it works out at start-up (all of it, or what sleep mode leaves)
    context = float(resolved_context_bytes(cal) if context_bytes is None else context_bytes)
    vllm, vllm_notes = None, []
    if train.use_vllm:  # vLLM's model loads only for a config that starts one
        from vram_planner.model.vllm import budget_notes, vllm_budget

        vllm = vllm_budget(arch, train, capacity_bytes, context, gpu_label, gpu_bf16, vllm_comm.at_start_bytes)
        vllm_notes = budget_notes(vllm, train)
    colocated = vllm if vllm is not None and vllm.mode == "colocate" else None
    raw = [_generation(arch, train, cal, persistent, colocated)]
    merged = release.step_structure == "loss_merged"  # TRL 0.14: both log-prob passes run inside the loss
    if not merged and (train.computes_old_logps or train.computes_ref_logps):
        raw.append(_scoring(arch, train, release, cal, persistent))
    if release.generation_batch == "micro_batch" and train.gradient_accumulation_steps > 1 and not first_micro_batch:
        # TRL 0.14-0.16 generate (and score) inside every micro-batch: from the second on, next to the gradients the
        # earlier ones accumulated (the trace runs them again after a backward; benchmarks/trl_matrix.py)
        raw = [Phase(p.name, {**p.components, "gradients": all_grads}, p.moment) for p in raw]
    workspaces = cublas_workspace_bytes(compute_capability)
    raw.append(_training(arch, train, release, cal, persistent, all_grads, first_micro_batch, workspaces))
    if not first_micro_batch:
        raw.append(_optimizer(arch, train, cal, persistent))
    raw = [_with_zero_buffers(p, arch, train) for p in raw]
    if not first_micro_batch:
        raw[-1] = _at_least_deepspeeds_estimate(raw[-1], arch, train)
    comm = vllm_comm.bytes if colocated is not None else 0.0  # they stay through sleep mode: not in its pool
    phases = tuple(with_overheads(p, cal, _reservation(colocated, p), train, context, workspaces, arch, nccl_bytes,
                                  comm, steady=not first_micro_batch) for p in raw)
    return Estimate(phases=phases, params=arch.params, trainable_params=m.trainable_params(arch, train),
                    notes=_notes(arch, train, release) + tuple(vllm_notes), vllm=vllm,
                    host_bytes=offload.host_bytes(arch, train))


def _optimizer(arch: ModelArchitecture, train: TrainingConfig, cal: Calibration,
               persistent: dict[str, float]) -> Phase:
    """The optimizer step: DeepSpeed's fp32 copy of the gradient partition exists only inside it (model/zero.py);
    ZeRO-3 gathers its persistent parameters again once it ends, beside the gradient partition (stage3.py:2840-2841;
    the sharded trace's peak where the persistent LoRA adapters outweigh the step's copies of a rank's gradients:
    Qwen2.5-0.5B with r=16 on 8 ranks, 17 MiB of adapters)."""
    partitions = m.step_weight_bytes(arch, train)
    step = Phase("optimizer", {**persistent, "weights": partitions, "gradients": m.step_gradient_bytes(arch, train),
                               "activations": m.optimizer_step_temporary_bytes(arch, train)})
    regathered = m.zero3_persistent_bytes(arch, train)
    if not regathered:
        return step
    after = Phase("optimizer", {**persistent, "weights": partitions + regathered,
                                "gradients": m.zero3_gradient_partition_bytes(arch, train)},
                  "after the step: persistent parameters gathered")
    return _heaviest([step, after], cal, train)


def persistent_bytes(arch: ModelArchitecture, train: TrainingConfig,
                     first_micro_batch: bool = False) -> dict[str, float]:
    """What every phase holds: the weights (the policy's, the reference's) and the optimizer's states, none before
    the first optimizer step."""
    return {"weights": m.weight_bytes(arch, train), "reference_weights": m.reference_weight_bytes(arch, train),
            "optimizer_states": 0.0 if first_micro_batch else m.optimizer_state_bytes(arch, train)}


def _reservation(colocated: VllmBudget | None, phase: Phase) -> float:
    """What colocated vLLM holds at the phase's moment: a moment that says so (the weight push under sleep mode),
    else what it holds during the phase."""
    if colocated is None:
        return 0.0
    return phase.components.get("vllm_reservation", colocated.reservation_in(phase.name))


def _reducing_moments(arch: ModelArchitecture, train: TrainingConfig, persistent: dict[str, float],
                      layer_weights: float, layer_activations: tuple[float, float], grads_before: float,
                      accumulating: bool, prefetched: float, fetching_activations: float) -> list[Phase]:
    """ZeRO-2/3 reducing a full bucket (model/zero.py: its gradients flattened for the collective) beside what the
    earlier micro-batches left (`grads_before`) or ZeRO-3's gradient partition. A reduction comes inside the
    backward, a layer's weights (`layer_weights`) and the first layer's backward activations alive
    (`layer_activations`: the first and the last layer's), only where the trainable parameters outgrow one bucket
    (`bucket.elements + numel > reduce_bucket_size`, zero/stage_1_and_2.py:1422, zero/stage3.py:1583), with a tied
    output projection's gradient waiting in autograd for the embedding's; otherwise the bucket is reduced once, in
    the epilogue after the backward (`independent_gradient_partition_epilogue`, stage_1_and_2.py:1016-1018,
    stage3.py:1407-1410), when the backward's tensors are gone and ZeRO-3's coordinator has released every gathered
    layer but the largest (the sharded trace sees it so: Qwen2.5-0.5B, 4.9e8 trainable parameters under 5e8, holds
    377 MiB of weights on 8 ranks there, not the 1060 MiB prefetched in a later micro-batch)."""
    trainable = m.trainable_params(arch, train)
    tied = arch.tie_word_embeddings and not train.uses_lora
    # ZeRO-2's partition buffer, from a micro-batch's first reduction on: a new one in each micro-batch, beside the
    # one the earlier left while its gradients are still to be reduced (`_release_ipg_buffers` drops the engine's
    # reference at each backward's end, zero/stage_1_and_2.py:924-931; the gradients are views of it)
    kept = m.zero2_accumulated_gradient_bytes(arch, train) if train.zero_stage == 2 else 0
    # ZeRO-3 under accumulation counted without the waiting head gradient, as it was: its sharded trace peaks in the
    # LM head's backward there (Llama-3.2-1B on 8), above this moment
    waits = tied and not (accumulating and train.zero_stage == 3)
    bucket = zero.reduce_bucket_elements(arch, train)
    rank = m.zero_heaviest_rank(arch, train, "training") if train.zero_stage == 2 else None
    reducing = zero.reducing_bucket_gradient_bytes(arch, trainable, waits, train.uses_lora, kept, bucket,
                                                   train.num_gpus, rank)
    kept_before = max(grads_before, m.zero3_gradient_partition_bytes(arch, train))
    # ZeRO-3 gathers the layer it differentiates, its LoRA adapters too (16-bit: TRL builds them in the weights' dtype
    # under ZeRO-3), unless its coordinator holds every one already (`prefetched`). The adapters are what reentrant
    # checkpointing's peak (TRL 1.9 on, PEFT + ZeRO-3) holds beyond the base layer: the sharded trace of
    # Llama-3.2-1B r=16 on 8 ranks, whose non-reentrant peak held one layer's adapters whole
    adapters = (arch.lora_params(train.lora_r, train.lora_targets) // max(arch.num_layers, 1)
                if train.uses_lora else 0)
    gathered = ((arch.layer_params + adapters) * zero.GATHERED_PARAM_BYTES
                if train.zero_stage == 3 and not prefetched else 0)
    if trainable > bucket:
        moments = [Phase("training", {**persistent, "weights": layer_weights + gathered, "gradients": kept_before
                                      + reducing, "activations": layer_activations[0]}, "reducing a gradient bucket")]
    else:
        # an untied output projection, gathered as the backward starts, is still held beside the embedding (the
        # largest layer, in `persistent`) there: the sharded trace of benchmarks/deepspeed_cpu.py's untied model
        head = (min(arch.embedding_params, arch.lm_head_params) * zero.GATHERED_PARAM_BYTES
                if train.zero_stage == 3 and not arch.tie_word_embeddings else 0)
        moments = [Phase("training", {**persistent, "weights": persistent["weights"] + head,
                                      "gradients": kept_before + reducing},
                         "reducing the gradient bucket after the backward")]
    if gathered:
        # the backward's own peak, reductions inside it or not: a layer gathered while it is differentiated, the
        # activations of the last one's backward (the sharded trace: Llama-3.2-1B with LoRA on 8); or, as the first
        # one's fetches its largest module before its backward's working tensors exist (`fetching_activations`), that
        # module's all-gather buffer beside it (a small Llama with LoRA on 4)
        moments += [Phase("training", {**persistent, "weights": layer_weights + gathered, "gradients": kept_before,
                                       "activations": max(layer_activations)}, "backward through a layer, gathered"),
                    Phase("training", {**persistent, "weights": layer_weights + gathered
                                       + m.zero3_fetch_buffer_bytes(arch, train), "gradients": kept_before,
                                       "activations": fetching_activations}, "backward: a module's fetch")]
    return moments


def _reduces_in_backward(arch: ModelArchitecture, train: TrainingConfig, after: bool = False) -> bool:
    """Whether ZeRO-1/2 reduce more than one bucket: the trainable parameters outgrow it. ZeRO-2 (and ZeRO-1 with
    overlap_comm) reduce them inside the backward, ZeRO-1 without it once the backward ends (`after`)."""
    inside = train.zero_stage == 2 or zero.overlaps_reduction(train)
    return inside != after and m.trainable_params(arch, train) > zero.reduce_bucket_elements(arch, train)


def _zero1_partition_moment(arch: ModelArchitecture, train: TrainingConfig, persistent: dict[str, float],
                            all_grads: float) -> Phase:
    """ZeRO-1 reducing bucket after bucket once the backward ends (`reduce_gradients`, zero/stage_1_and_2.py:971-976),
    the parameters in the model's order: each gradient is copied into the bucket (its own tensor freed; one larger
    than the bucket is reduced as it is, `extra_large_param_to_reduce`, :1436-1443), and the first reduction, which
    reaches rank 0's partition, makes its flat copy and then the buffer of every gradient the partition touches
    (`grads_in_partition`, :2183-2194) while the rest are still whole. The bucket is added with the others
    (`_with_zero12_bucket`). The sharded traces on 2: Qwen2.5-0.5B with "auto" buckets, every gradient, the 479 MiB
    partition buffer and the bucket; Llama-3.2-1B with 2e8 ones, its embedding larger than the bucket, the same."""
    bucket = zero.reduce_bucket_elements(arch, train)
    order = m.zero_optimizer_groups(arch, train)[0]
    flat = zero.bucket_reductions(order, bucket)[0][0]
    moved = 0 if order[0] > bucket else flat
    partition = m.zero2_accumulated_gradient_bytes(arch, train)
    gradients = all_grads + max(partition, flat * zero.REDUCE_BUCKET_ELEMENT_BYTES) - moved * (
        zero.REDUCE_BUCKET_ELEMENT_BYTES)
    return Phase("training", {**persistent, "gradients": gradients}, "reducing the gradients after the backward")


def _with_zero_buffers(phase: Phase, arch: ModelArchitecture, train: TrainingConfig) -> Phase:
    """DeepSpeed's gradient reduction bucket (model/zero.py), as gradients: ZeRO-3 holds it from start-up (ZeRO-1/2
    within each backward only, `_with_zero12_bucket`); and ZeRO-3's gradient partition, kept from start-up, in the
    phases before the loss (the loss and the step count it in their gradients)."""
    bucket = zero.reduce_bucket_bytes(arch, train) if train.zero_stage == 3 else 0
    partition = m.zero3_gradient_partition_bytes(arch, train) if phase.name in ("generation", "scoring") else 0
    if not bucket + partition:
        return phase
    gradients = phase.components.get("gradients", 0.0) + bucket + partition
    return Phase(phase.name, {**phase.components, "gradients": gradients}, phase.moment)


def _at_least_deepspeeds_estimate(phase: Phase, arch: ModelArchitecture, train: TrainingConfig) -> Phase:
    """The optimizer step's model states on the GPU never below DeepSpeed's own estimate of them (issue 27), which
    knows full fine-tuning only. ZeRO-1/2 hold more than it (model/zero.py); ZeRO-3 holds less where its partition
    steps in several sub-groups, as its estimator counts the fp32 gradient of the whole partition, or where its
    largest layer, gathered in the loss but not in the step, outweighs it: the rest counts as gradients."""
    if train.zero_stage not in (1, 2, 3) or train.uses_lora:
        return phase
    if train.offloaded:
        floor = (offload.deepspeed_estimate(arch, train) or (0, 0))[1]
    else:
        stage = 3 if train.zero_stage == 3 else 2  # DeepSpeed has no ZeRO-1 estimator
        floor = zero.deepspeed_estimate_bytes(arch.params, train.num_gpus, stage, zero.largest_layer_params(arch))
    held = sum(phase.components.get(c, 0.0) for c in ("weights", "reference_weights", "gradients",
                                                       "optimizer_states"))
    if held >= floor:
        return phase
    return Phase(phase.name, {**phase.components, "gradients": phase.components["gradients"] + floor - held},
                 phase.moment)


def micro_batch_moments(arch: ModelArchitecture, train: TrainingConfig, release: TrlRelease, cal: Calibration,
                        first: bool) -> list[Phase]:
    """Every moment of a micro-batch's loss forward and backward, tensors only: the first micro-batch of the run
    (`first`: no optimizer state, no gradient yet) or a later one, with DeepSpeed's reduction bucket where it lives
    then, as the loss phase counts them."""
    moments = training_moments(arch, train, release, cal, persistent_bytes(arch, train, first),
                               m.gradient_bytes(arch, train), first)
    return [_with_zero_buffers(_with_zero12_bucket(p, arch, train, first), arch, train) for p in moments]


def with_overheads(phase: Phase, cal: Calibration, reservation: float, train: TrainingConfig,
                   context_bytes: float | None = None, workspace_bytes: float = 0.0,
                   arch: ModelArchitecture | None = None, nccl_bytes: float = 0.0,
                   vllm_comm_bytes: float = 0.0, steady: bool = True) -> Phase:
    """The phase's tensors plus vLLM's reservation, the CUDA context (`context_bytes`, as `estimate` takes it), NCCL's
    buffers, colocated vLLM's tensor-parallel communicators, the cuBLAS workspaces and the allocator's reserve (with
    the model's allocation patterns when `arch` is given; `steady`: a phase after an optimizer step, which DeepSpeed's
    buffers have left their segments by)."""
    components = {c: phase.components.get(c, 0.0) for c in TENSOR_COMPONENTS}
    components["vllm_reservation"] = reservation  # what vLLM holds in this phase (VllmBudget.reservation_in)
    components["cuda_context"] = float(resolved_context_bytes(cal) if context_bytes is None else context_bytes)
    components["nccl_buffers"] = float(nccl_bytes)  # outside the caching allocator, like the context
    components["vllm_communicators"] = float(vllm_comm_bytes)  # beside vLLM's budget, not inside it
    components["cublas_workspaces"] = float(workspace_bytes)
    components["allocator_overhead"] = _reserve(phase, cal, train, arch, steady, workspace_bytes)
    return Phase(phase.name, components, phase.moment)


def _reserve(phase: Phase, cal: Calibration, train: TrainingConfig, arch: ModelArchitecture | None = None,
             steady: bool = True, workspace_bytes: float = 0.0) -> float:
    """What the caching allocator holds beyond the phase's tensors, under the run's allocator setting. The patterns
    are the same at every moment of a phase but generation's: at its prefill the decoding's blocks (and the segments
    they strand) do not exist yet, and the prefill's own largest requests are over by the decoding
    (generation_patterns.PREFILL_PATTERNS). Generation's heaviest moment is chosen with them (`arch`), the other
    phases' without. Under ZeRO-1/2 what DeepSpeed's own buffers strand beside the cuBLAS workspaces
    (model/zero_replay.py; `workspace_bytes` for the step's threads) is added as it is, in the optimizer step and in
    the loss of a `steady` step (one after an optimizer step)."""
    tensors = {c: phase.components.get(c, 0.0) for c in TENSOR_COMPONENTS}
    patterns_of = expandable_patterns if train.expandable_segments else reserve_patterns
    patterns = patterns_of(arch, train, phase.name) if arch is not None else None
    if patterns is not None and phase.name == "generation":
        prefilling = phase.moment in PREFILL_MOMENTS
        patterns = {name: value if (name in PREFILL_PATTERNS) == prefilling else 0.0
                    for name, value in patterns.items()}
    exact = loaded_weight_segment_bytes(arch, train) if arch is not None else 0.0
    workspace = int(workspace_bytes) // TRAINING_THREADS
    if arch is not None and phase.name == "optimizer":
        exact += zero12_step_stranded_bytes(arch, train, workspace) + zero3_step_stranded_bytes(arch, train, workspace)
    elif arch is not None and phase.name == "training" and steady:
        exact += zero12_loss_stranded_bytes(arch, train, workspace)
    if arch is not None and phase.moment == REFERENCE_LOGITS_MOMENT:
        exact += reference_logits_stranded_bytes(arch, train, logit_positions(train, train.release))
    if arch is not None and phase.moment == LM_HEAD_BACKWARD_MOMENT and steady:
        exact += head_block_stranded_bytes(arch, train)
    return allocator_reserve_bytes(cal, phase.name, tensors, train.expandable_segments, patterns, exact)


def _heaviest(moments: list[Phase], cal: Calibration, train: TrainingConfig,
              colocated: VllmBudget | None = None, arch: ModelArchitecture | None = None,
              steady: bool = True, workspace_bytes: float = 0.0) -> Phase:
    """The moment that needs the most with the allocator's reserve on it (and what colocated vLLM holds then): its
    tensors alone could pick a moment of fewer bytes but a smaller reserve, and a longer completion would then seem
    to need less. Generation's moments are weighed with its patterns (`arch`), which the prefill has not, and the
    loss's with what the allocator strands at one moment only (the LM head's backward, the reference's logits in
    TRL 0.14's loss), as with_overheads will count it (`steady`, `workspace_bytes`: the replays of DeepSpeed's
    buffers, which take the workspaces, then run once per layout)."""
    return max(moments, key=lambda moment: (moment.tensor_bytes + _reserve(moment, cal, train, arch, steady,
                                                                            workspace_bytes)
                                            + _reservation(colocated, moment)))


def _generation(arch: ModelArchitecture, train: TrainingConfig, cal: Calibration, persistent: dict[str, float],
                colocated: VllmBudget | None = None) -> Phase:
    if train.use_vllm:
        # vLLM generates in its own memory (the reservation); the policy stays as trained, sharded or not, but the
        # weights pushed to vLLM first are gathered on the way (m.vllm_weight_sync_bytes), while sleep mode has
        # woken vLLM's weights only (VLLMGeneration.sync_weights wakes the KV cache later, to generate)
        woken = " woken whole (sleep mode)" if train.vllm_enable_sleep_mode else ""
        generating = Phase("generation", dict(persistent), f"vLLM generates{woken} (its memory is the reservation)")
        sync = {**persistent, "weights": persistent["weights"] + m.vllm_weight_sync_bytes(arch, train)}
        if colocated is not None and colocated.sleep_level is not None:
            sync["vllm_reservation"] = colocated.asleep_bytes + colocated.weights_bytes
        moments = [generating, Phase("generation", sync, "weights pushed to vLLM")]
        return _heaviest(moments, cal, train, colocated)
    return _heaviest(generation_moments(arch, train, cal, persistent), cal, train, arch=arch)


def generation_moments(arch: ModelArchitecture, train: TrainingConfig, cal: Calibration,
                       persistent: dict[str, float]) -> list[Phase]:
    """The moments of generate() in this process (no vLLM) that may hold the most, their tensors only: the prefill
    (FSDP2's first gathers before it), and the last decoding step's cache update, attention and LM head."""
    base = {**persistent, "weights": m.generation_weight_bytes(arch, train)}
    sequences, p = train.local_generation_batch_size, train.max_prompt_length
    run = m.as_generated(train)
    # The last decoding step feeds the last sampled token with p + c - 1 tokens cached.
    kv = m.kv_cache_bytes(arch, train, sequences, train.sequence_length - 1)
    # DynamicCache grows by concatenation: one layer's keys and values exist twice for a moment. (The keys, then the
    # values, cache_utils.py DynamicLayer.update: the tensors alone hold half of that at once, but the caching
    # allocator cannot reuse a step's blocks for the next step's longer ones, and the boundary's needs, measured
    # through it, lie above the half: benchmarks/results/boundary.txt, Phi-3-mini's LoRA with 2,048-token completions)
    kv_growth = kv / max(arch.num_layers, 1)
    # Autocast casts every weight once per forward; the casts of trainable weights stay cached to its end.
    casts = m.layer_weight_cast_bytes(arch, run) + m.adapter_cast_bytes(arch, run)
    with_casts = {**base, "weights": base["weights"] + casts}
    tokens = sequences * p
    if inference.counted(arch, run):
        prefill = inference.prefill_bytes(arch, run, cal, sequences, p)
    else:
        prefill = (m.inference_working_bytes(arch, run, cal, tokens, p) + m.padded_mask_bytes(run, sequences, p)
                   + m.adapter_forward_bytes(arch, run, tokens))
    prompt_kv = m.kv_cache_bytes(arch, train, sequences, p, prefill=True)
    head = m.generation_logits_bytes(arch, run, sequences)
    # ... and the output projection is cast at the LM head, cached or not.
    head_weights = with_casts["weights"] + m.lm_head_cast_bytes(arch, run)
    decoding, prefilling, in_layer, gathers = dict(with_casts), dict(with_casts), dict(with_casts), []
    # inside a layer, bitsandbytes' dequantized copy of a 4-bit weight where the rows are more than its fused kernel's
    prefilling["weights"] += m.dequantized_weight_bytes(arch, train, tokens)
    in_layer["weights"] += m.dequantized_weight_bytes(arch, train, sequences)
    if train.fsdp and not train.load_in_4bit:
        # The prefill's first gathers hold the most (the tail's all-gather output too), before any layer has run;
        # after them, FSDP2 holds at a decoding step's gathers what it holds at every step (model/fsdp.py); inside a
        # layer (where the prefill's activations peak and a decoding step's cache grows) that layer is gathered
        shards = m.weight_bytes(arch, train)
        decoding["weights"] = shards + fsdp.decoding_gathered_bytes(arch, train)
        prefilling["weights"] = shards + fsdp.prefill_layer_gathered_bytes(arch, train)
        in_layer["weights"] = shards + fsdp.decoding_layer_gathered_bytes(arch, train)
        head_weights = shards + fsdp.lm_head_gathered_bytes(arch, train)
        embedded = (sequences * p * arch.hidden_size * m.sizes(run).residual + m.padded_mask_bytes(run, sequences, p)
                    + inference.prefill_inputs_bytes(arch, run, sequences, p))
        gathers = [Phase("generation", {**with_casts, "activations": embedded}, PREFILL_GATHERS),
                   # beside the step's hidden state, generate()'s ids and mask so far, each its own storage
                   Phase("generation", {**decoding, "kv_cache": kv, "lm_head_buffers": 2 * blocks.blocks(
                       inference.batch_ids_bytes(sequences, train.sequence_length - 1) / 2),
                       "activations": blocks.blocks(sequences * arch.hidden_size * m.sizes(run).residual)
                       + inference.decoding_inputs_bytes(arch, run, sequences)},
                         "last decoding step: a layer's gather")]
    return [
        *gathers,
        Phase("generation", {**prefilling, "kv_cache": prompt_kv, "activations": prefill}, PREFILL),
        Phase("generation", {**in_layer, "kv_cache": kv + kv_growth}, "last decoding step: cache update"),
        Phase("generation", {**in_layer, "kv_cache": kv,
                             "activations": inference.decoding_repeated_kv_bytes(
                                 arch, run, kv, train.sequence_length - 1)},
              "last decoding step: attention"),
        Phase("generation", {**decoding, "weights": head_weights, "kv_cache": kv, "lm_head_buffers": head},
              "last decoding step: LM head"),
    ]


def _scoring(arch: ModelArchitecture, train: TrainingConfig, release: TrlRelease, cal: Calibration,
             persistent: dict[str, float]) -> Phase:
    """No-grad forward passes over the generation batch in chunks of B sequences; the peak is in one chunk."""
    b, generated = train.micro_batch_completions, train.local_generation_batch_size
    length = train.sequence_length
    head = lm_head_memory(arch, train, release, b, with_grad=False)
    # the log-probs kept so far, and the batch's ids and mask
    kept_logps = generated * train.max_completion_length * m.FP32_BYTES * (
        int(train.computes_old_logps) + int(train.computes_ref_logps)) + inference.batch_ids_bytes(generated, length)
    cached = release.log_prob_forward_cache == "model_default" and not train.gradient_checkpointing
    if inference.counted(arch, train):  # the old log-probs run the policy with its adapters, the reference without
        layers = inference.scoring_bytes(arch, train, b, length, adapters=train.computes_old_logps, cached=cached)
    else:
        layers = (m.inference_working_bytes(arch, train, cal, b * length, length)
                  + m.padded_mask_bytes(train, b, length))
    casts = _scoring_casts(arch, train)
    prefetched = _zero3_scoring_prefetch_bytes(arch, train)
    if prefetched:
        casts = {**casts, "weights": casts.get("weights", persistent["weights"]) + prefetched}
    # Before TRL 0.22 the log-prob forward keeps the model's use_cache (off only under gradient checkpointing): the
    # chunk's keys and values of every layer stay in a cache its output holds until the forward returns, which
    # the logits and accelerate's copy of them meet, not the log-softmax work after it (a temperature-scaled copy)
    cache = {"kv_cache": m.kv_cache_bytes(arch, train, b, length, forward=train)} if cached else {}
    # Autocast's cached casts live until its context exits, before accelerate copies the output to float32
    # (convert_outputs_to_fp32 wraps the autocast forward): the projection meets them, with the output weight's own
    # cast (TRL's fused head casts its own vocabulary chunks, counted in its forward); the copy and the log-softmax
    # work after it do not
    head_cast = m.lm_head_cast_bytes(arch, train) if head.projecting is not None else 0
    projecting = {name: value + head_cast for name, value in casts.items()}
    gathered = casts if train.fsdp and not train.load_in_4bit else {}  # FSDP2's gathers are no casts: they stay
    dequantized = m.dequantized_weight_bytes(arch, train, b * length)
    in_layers = ({**casts, "weights": casts.get("weights", persistent["weights"]) + dequantized} if dequantized
                 else casts)
    moments = [Phase("scoring", {**persistent, **in_layers, **cache, "activations": kept_logps + layers},
                     "decoder forward"),
               Phase("scoring", {**persistent, **projecting, **cache, "activations": kept_logps,
                                 "lm_head_buffers": head.at_projection}, "LM head of a chunk, projecting"),
               Phase("scoring", {**persistent, **gathered, **cache, "activations": kept_logps,
                                 "lm_head_buffers": head.inside_forward}, "LM head of a chunk, in its forward"),
               Phase("scoring", {**persistent, **gathered, "activations": kept_logps,
                                 "lm_head_buffers": head.forward_transient}, "LM head of a chunk")]
    return _heaviest(moments, cal, train)


def _zero3_scoring_prefetch_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """What ZeRO-3 holds gathered while the log-probs are scored, beyond the weights every phase counts (the partitions
    and the largest layer): each engine's coordinator records the modules' order in its first forward after the
    generation and from the next on prefetches up to max_live_parameters, keeping them gathered through the passes after
    it, and the pass running holds the flat buffer of the round in use beside them (the bucket passed by part of its
    last parameter: `zero.round_in_use_params`; Llama-3.2-1B's widths at 4 layers on 8 were 0.7% under the trace
    counting the bucket). An engine that runs one forward gathers layer by layer. The policy runs the old log-probs'
    chunks (and, under LoRA, the reference's, its adapters off); a full fine-tune's reference is an engine of its own
    (TRL's prepare_deepspeed). The sharded trace of Qwen3-0.6B's widths at 4 layers on 2 (417 MiB in 16 bits, a 95 MiB
    round): 721 MiB of weights in four chunks of old log-probs, or two of the reference's, 1,138 MiB with both (the
    policy's and the reference's whole model, one round), counted as weights by the trace."""
    if train.zero_stage != 3 or train.num_gpus == 1:  # on one GPU a parameter's gather is a view of its partition
        return 0.0
    chunks = -(-train.local_generation_batch_size // train.micro_batch_completions)
    old, ref = int(train.computes_old_logps), int(train.computes_ref_logps)
    forwards = [chunks * (old + ref)] if train.uses_lora else [chunks * old, chunks * ref]
    engines = sum(1 for count in forwards if count > 1)
    if not engines:
        return 0.0
    largest = zero.largest_layer_params(arch) * zero.GATHERED_PARAM_BYTES
    whole = m.zero3_whole_prefetch_bytes(arch, train) + largest
    round_in_use = zero.round_in_use_params(arch, train.lora_r, train.lora_targets,
                                            zero.prefetch_bucket_elements(arch, train))
    return engines * whole - largest + round_in_use * zero.GATHERED_PARAM_BYTES


def _scoring_casts(arch: ModelArchitecture, train: TrainingConfig) -> dict[str, float]:
    """Cached weight casts of the model that scores last: the reference when there is one, else the policy."""
    if train.fsdp and not train.load_in_4bit:  # what FSDP2 has gathered instead (model/fsdp.py)
        if train.computes_ref_logps and not train.uses_lora:
            # the policy's tail, kept gathered since generation; the reference whole
            return {"weights": m.weight_bytes(arch, train) + fsdp.gathered_bytes(arch, train, 0, 1),
                    "reference_weights": m.reference_weight_bytes(arch, train)
                    + fsdp.reference_gathered_bytes(arch, train)}
        # the policy's forwards gather as a later decoding step does: a tied tail stays gathered since the
        # generation, without its all-gather output (the prefill's first gathers were 10-40% above the sharded
        # trace of Qwen3-0.6B, gemma-3-1b-it and Llama-3.2-1B at 4 layers, old log-probs in four chunks)
        return {"weights": m.weight_bytes(arch, train) + fsdp.decoding_gathered_bytes(arch, train)}
    if train.computes_ref_logps and not train.uses_lora:
        return {"reference_weights": m.reference_weight_bytes(arch, train) + m.layer_weight_cast_bytes(arch, train)}
    if train.uses_lora:
        return {"weights": m.weight_bytes(arch, train) + (m.adapter_cast_bytes(arch, train)
                                                          if train.computes_old_logps else 0)}
    return {"weights": m.weight_bytes(arch, train) + m.layer_weight_cast_bytes(arch, train)}


def _training(arch: ModelArchitecture, train: TrainingConfig, release: TrlRelease, cal: Calibration,
              persistent: dict[str, float], all_grads: float, first: bool = False,
              workspace_bytes: float = 0.0) -> Phase:
    """The largest moment of one micro-batch's forward and backward (`first`: the first micro-batch of the run), weighed
    with the cuBLAS workspaces (`workspace_bytes`) as with_overheads will count it."""
    moments = training_moments(arch, train, release, cal, persistent, all_grads, first)
    return _heaviest([_with_zero12_bucket(p, arch, train, first) for p in moments], cal, train, arch=arch,
                     steady=not first, workspace_bytes=workspace_bytes)


def _with_zero12_bucket(moment: Phase, arch: ModelArchitecture, train: TrainingConfig, first: bool) -> Phase:
    """ZeRO-1/2's gradient reduction bucket (model/zero.py) in a moment of the loss from its first parameter gradient
    on: the first gradient hook allocates it (`setup_buckets`, zero/stage_1_and_2.py:3266, from `process_gradients`
    :2287), none exists in the forward, nor in the LM head's backward when the head has no gradient of its own then
    (tied, it waits for the embedding's; frozen under LoRA). The sharded trace's LM head backward holds none
    (Llama-3.2-1B on 8 under ZeRO-2, where the analytic model had counted it there, 2.2% above the trace).
    ZeRO-1 releases it only in the epilogue of the accumulation boundary's reduction (engine.py:3089-3092 calls
    reduce_gradients there only; `_release_ipg_buffers`, stage_1_and_2.py:1061): a later micro-batch of an
    accumulation holds the one the earlier micro-batch made in every moment (the sharded trace of Qwen2.5-0.5B on 8
    with two micro-batches: its 954 MiB beside the LM head's backward, 6.2% above the analytic model without it)."""
    if train.zero_stage not in (1, 2):
        return moment
    left_by_earlier = train.zero_stage == 1 and train.gradient_accumulation_steps > 1 and not first
    head_waits = arch.tie_word_embeddings or train.uses_lora
    if not left_by_earlier and (moment.moment.startswith("forward")
                                or (moment.moment == LM_HEAD_BACKWARD_MOMENT and head_waits)):
        return moment
    gradients = moment.components.get("gradients", 0.0) + zero.reduce_bucket_bytes(arch, train)
    return Phase(moment.name, {**moment.components, "gradients": gradients}, moment.moment)


def training_moments(arch: ModelArchitecture, train: TrainingConfig, release: TrlRelease, cal: Calibration,
                     persistent: dict[str, float], all_grads: float, first: bool = False) -> list[Phase]:
    """Every moment of one micro-batch's forward and backward the model counts, tensors only; `first`: the first
    micro-batch of the run, before any gradient exists."""
    b, length = train.micro_batch_completions, train.sequence_length
    tokens = b * length
    s = m.sizes(train)
    head = lm_head_memory(arch, train, release, b, with_grad=True)
    saved = act.decoder_saved_bytes(arch, train, cal, tokens)
    final_norm = act.final_norm_saved_bytes(arch, train, tokens)
    mask = act.kept_mask_bytes(arch, train, b, length)
    # From the second micro-batch of an accumulation on, every gradient exists before the forward starts.
    accumulating = train.gradient_accumulation_steps > 1 and not first
    if accumulating and train.fsdp:  # kept whole and unreduced under no_sync (model/fsdp.py)
        all_grads = fsdp.accumulated_gradient_bytes(arch, train)
    grads_before = all_grads if accumulating else 0.0
    prefetched = 0.0 if first else m.zero3_prefetched_weight_bytes(
        arch, train, release.zero3_trace_kept_across_generation)
    if train.zero_stage == 3:
        # ZeRO-3's gradient partition, kept from start-up, is all earlier micro-batches leave; a layer's whole
        # gradient lives in its own backward
        grads_before = m.zero3_gradient_partition_bytes(arch, train)
    elif accumulating and train.zero_stage == 2 and not train.optimizer_offloaded:
        # ZeRO-2 keeps every gradient its partition touches whole from the first micro-batch's reduction on
        grads_before = m.zero2_accumulated_gradient_bytes(arch, train)
    forward_casts, backward_casts = _training_casts(arch, train)
    weights = persistent["weights"] + prefetched
    if train.fsdp:  # the tail and a layer gathered beside the shards
        weights += fsdp.training_gathered_bytes(arch, train)
    one_layer = act.one_layer_saved_bytes(arch, train, cal, tokens)
    layer_casts = m.layer_weight_cast_bytes(arch, train) / max(arch.num_layers, 1)
    working = m.backward_working_bytes(arch, train, cal, tokens)
    layer_input = tokens * arch.hidden_size * s.residual
    # Backward through the last layer: only the head's gradients exist; through the first: all of them. A tied
    # output projection's gradient waits in autograd's input buffer for the embedding's, next to the .grad that
    # earlier micro-batches left.
    tied = arch.tie_word_embeddings and not train.uses_lora
    held = _head_gradient_bytes(arch, train) if tied and accumulating else 0.0
    head_grads = (grads_before if train.zero_stage == 3 else all_grads) if accumulating else _head_gradient_bytes(
        arch, train)
    # a layer's backward dequantizes each 4-bit weight for its input's gradient, one at a time
    layer_backward_casts = (layer_casts + m.adapter_cast_bytes(arch, train) / max(arch.num_layers, 1)
                            + m.dequantized_weight_bytes(arch, train, None))
    if train.gradient_checkpointing:
        # the recomputed layer's first norm keeps the checkpointed input itself when it is float32 (the Hub's RMSNorm
        # kernel keeps its input as it came, whatever its dtype)
        kept_as_is = s.residual == m.FP32_BYTES or act.hub_rms_norm(arch, train)
        recompute = one_layer - (layer_input if kept_as_is else 0)
        last_layer = saved - final_norm + mask + recompute + working
        first_layer = layer_input + mask + recompute + working
        last_layer_casts = layer_backward_casts
    else:
        last_layer = saved - final_norm + mask + working
        first_layer = one_layer + mask + working
        last_layer_casts = backward_casts + m.dequantized_weight_bytes(arch, train, None)
    policy_graph = {"weights": weights + forward_casts, "gradients": grads_before, "activations": saved + mask}
    if release.step_structure == "loss_merged":
        cached = _policy_cache_saved_bytes(arch, train, release)
        policy_graph.update(activations=saved + mask - cached, kv_cache=cached)
        # every moment counted here comes after the policy's forward, whose autocast cache is gone with it
        unkept = act.first_layer_unkept_cast_bytes(arch, train)
        returned = {**policy_graph, "weights": weights + forward_casts - unkept}
        head_moments = _merged_log_prob_moments(arch, train, release, persistent, returned, weights + backward_casts)
    else:
        # Autocast's cache empties when the forward returns, before accelerate's float32 copy and TRL's log-prob
        # work; the casts the linears keep for backward stay, the output projection's among them (it is never
        # checkpointed; TRL's fused head casts its own chunks instead, counted in its memory)
        head_cast = m.lm_head_cast_bytes(arch, train) if head.projecting is not None else 0
        after_forward = {**policy_graph, "weights": weights + backward_casts + head_cast}
        head_moments = [
            Phase("training", {**persistent, **policy_graph, "weights": weights + forward_casts + head_cast,
                               "lm_head_buffers": head.at_projection}, "forward: LM head, projecting"),
            Phase("training", {**persistent, **after_forward, "lm_head_buffers": head.forward_transient},
                  "forward: LM head"),
            Phase("training", {**persistent, **after_forward,
                               "lm_head_buffers": head.saved + head.backward_transient}, LM_HEAD_BACKWARD_MOMENT),
        ]
    if train.fsdp:
        # The layer being differentiated and the next one gathered ahead of it (FSDP2's prefetch); the tail is
        # resharded after its own backward unless it holds a tied embedding, whose gradient comes last
        weights += fsdp.layer_unit_bytes(arch, train) - (0 if tied else fsdp.gathered_bytes(arch, train, 0, 1))
    first_layer_weights = weights
    if train.fsdp:  # the unit gathered ahead of the first layer is an untied embedding, larger than a layer
        first_layer_weights += max(fsdp.embedding_unit_bytes(arch, train) - fsdp.layer_unit_bytes(arch, train), 0)
    moments = [
        *head_moments,
        Phase("training", {**persistent, "weights": weights + last_layer_casts, "gradients": head_grads + held,
                           "activations": last_layer}, "backward through the last layer"),
        Phase("training", {**persistent, "weights": first_layer_weights + layer_backward_casts,
                           "gradients": held + (all_grads if accumulating else _first_layer_gradient_bytes(
                               arch, train, all_grads)),
                           "activations": first_layer}, "backward through the first layer"),
    ]
    layer_backwards = moments[-2:]
    # A trace the generation left (without its gather) prefetches the first micro-batch's forward too; it holds no
    # backward, so each module is released after its forward (`__params_to_release` finds no later use)
    if prefetched or m.zero3_follows_generation_trace(train):
        # Inside a layer's forward the prefetch round in use is there twice, in its buffer and copied out, beside
        # every parameter gathered (model/zero.py prefetching_forward_params), the layers before it saved, its own
        # transients as a no-grad forward's
        moments.append(Phase("training", {
            **persistent, **policy_graph,
            "weights": weights - prefetched + m.zero3_prefetching_forward_bytes(arch, train) + forward_casts,
            "activations": policy_graph["activations"] - final_norm + m.inference_working_bytes(
                arch, train, cal, tokens, length) + m.adapter_forward_bytes(arch, train, tokens)},
            "forward: a prefetch round in use"))
    recomputing = act.recomputed_forward_bytes(arch, train, tokens)
    # The gradient reaching a layer (as the final norm's backward leaves it: its input's gradient and the weighted
    # one's, two hidden tensors) before the layer's backward makes its own working tensors: under checkpointing its
    # forward is run again, to its MLP's output projection, the fetch of its largest module
    incoming = 2 * layer_input
    if train.zero_stage in (2, 3) and not train.optimizer_offloaded:
        moments += _reducing_moments(arch, train, persistent, first_layer_weights + layer_backward_casts,
                                     (first_layer, last_layer), grads_before, accumulating, prefetched,
                                     first_layer - working + incoming + recomputing)
    if recomputing:
        moments += [Phase("training", {**p.components, "activations": p.components["activations"] - working
                                       + incoming + recomputing}, f"{p.moment}: its forward recomputed")
                    for p in layer_backwards]
    eager = act.eager_softmax_backward_bytes(arch, train, cal, tokens)
    if eager:
        # Inside a layer's eager attention, softmax's backward: the layer's later tensors are gone, the scores'
        # float32 gradients are there (act.eager_softmax_backward_bytes), in place of one_layer + working.
        swap = eager - one_layer - working
        moments += [Phase("training", {**p.components, "activations": p.components["activations"] + swap},
                          f"{p.moment}: eager attention's softmax") for p in layer_backwards]
    if train.fsdp:
        moments += _fsdp_moments(arch, train, persistent, policy_graph, all_grads, accumulating, layer_input)
    if tied and train.fsdp:
        # The embedding's dense gradient before it joins the output projection's, which waits unreduced; the tail
        # still gathered, the first layer's gradient not yet reduced
        unreduced = fsdp.gathered_bytes(arch, train, 1, 1) - fsdp.tail_shard_gradient_bytes(arch, train)
        tail_kept = persistent["weights"] + fsdp.gathered_bytes(arch, train, 0, 1)
        moments.append(Phase("training", {**persistent, "weights": tail_kept,
                                           "gradients": all_grads + held + (0 if accumulating else unreduced),
                                           "activations": _head_gradient_bytes(arch, train) + layer_input},
                             "embedding backward"))
    elif tied and train.zero_stage == 2 and not train.optimizer_offloaded:
        # ZeRO-2: the output projection's gradient waiting, the embedding's dense gradient made beside it, the bucket
        # (`_with_zero12_bucket`), and where a reduction inside the backward reached the rank's partition, its buffer
        # (the sharded trace of Qwen2.5-0.5B on 2 with "auto" buckets). Where the trainable parameters fit one bucket
        # it is reduced after the backward, and this moment can outweigh that one: Qwen2.5-0.5B's widths at 4 layers
        # on 8 (1.96e8 parameters, 70% of them the embedding) held 1,214 MiB of gradients and the embedding's 260 MiB
        # one here, 147 MiB above the bucket's reduction
        dense = _head_gradient_bytes(arch, train)
        # under accumulation the earlier micro-batches' buffer (`grads_before`) holds the embedding's gradient too
        rank = m.zero_heaviest_rank(arch, train, "training")
        made = _reduces_in_backward(arch, train) and zero.partition_reduced_before_embedding(
            arch, train.num_gpus, rank, zero.reduce_bucket_elements(arch, train))
        kept = grads_before + (m.zero2_accumulated_gradient_bytes(arch, train) if made else 0)
        moments.append(Phase("training", {**persistent, "gradients": kept + dense,
                                           "activations": dense + layer_input}, "embedding backward"))
    elif tied:
        # The embedding's dense gradient joins the output projection's before they are summed. Under
        # cast_lm_head_to_fp32 the embedding is float32 and TRL's hook casts its output back to the weights' dtype,
        # so the gradient reaches it as a float32 copy of the layers'.
        dense = _head_gradient_bytes(arch, train)
        incoming = tokens * arch.hidden_size * m.FP32_BYTES if train.cast_lm_head_to_fp32 else layer_input
        moments.append(Phase("training", {**persistent, "gradients": all_grads + held + dense,
                                           "activations": incoming}, "embedding backward"))
    elif train.zero_stage == 1:
        # ZeRO-1 reduces once every gradient is made, the bucket beside them (`_with_zero12_bucket`): the engine's
        # allreduce_gradients after the backward (stage_1_and_2.py:958 reduce_gradients); the real 2-rank run's peak
        # (benchmarks/deepspeed_cpu.py, untied)
        moments.append(Phase("training", {**persistent, "gradients": all_grads, "activations": layer_input},
                             "every gradient made"))
    elif not train.uses_lora and train.zero_stage is None and not train.fsdp:
        # An untied embedding's backward ends it: its dense gradient is made beside every other one, the layers'
        # gradient reaching it; it becomes the .grad, or is added to the one earlier micro-batches left. Until then
        # it is a tensor of the backward (as the trace, whose splits the allocator's reserve is fitted to, tags it).
        dense = arch.vocab_size * arch.hidden_size * s.trainable
        made = all_grads if accumulating else all_grads - dense
        moments.append(Phase("training", {**persistent, "gradients": made, "activations": dense + layer_input},
                             "embedding backward"))
    if train.zero_stage == 1 and not train.optimizer_offloaded and _reduces_in_backward(arch, train, after=True):
        moments.append(_zero1_partition_moment(arch, train, persistent, all_grads))
    return moments


def _fsdp_moments(arch: ModelArchitecture, train: TrainingConfig, persistent: dict[str, float],
                  policy_graph: dict[str, float], all_grads: float, accumulating: bool,
                  layer_input: float) -> list[Phase]:
    """FSDP2's own moments of the loss forward and backward (model/fsdp.py): a layer's gather in the forward (its
    copy-out beside its own and the previous layer's all-gather outputs), and, when the embedding trains, the first
    layer's reduce-scatter and the one that ends the backward (the tail's, or an untied embedding's, gathered for its
    backward)."""
    shards = persistent["weights"]
    gathering = shards + fsdp.gathered_bytes(arch, train, fsdp.FORWARD_GATHER_LAYERS, 1)
    moments = [Phase("training", {**persistent, **policy_graph, "weights": gathering}, "forward: a layer's gather")]
    if accumulating or train.uses_lora:
        return moments
    embedding = fsdp.embedding_unit_bytes(arch, train)  # 0 when tied: the embedding is in the tail
    # The first layer resharded, the unit before it gathered (FSDP2's backward prefetch: an untied embedding, or the
    # tied tail, kept since the forward), the layer's input gradient
    ahead = embedding or fsdp.tail_unit_bytes(arch, train)
    moments.append(Phase("training", {**persistent, "weights": shards + ahead,
                                      "gradients": _fsdp_first_layer_gradient_bytes(
                                          arch, train, all_grads, fsdp.whole_gradient_bytes(
                                              fsdp.layer_tensors(arch, train), train)),
                                      "activations": layer_input}, "reduce-scatter of the first layer"))
    moments.append(Phase("training", {**persistent, "weights": shards + embedding,
                                      "gradients": all_grads + fsdp.tail_reduction_bytes(arch, train),
                                      "activations": layer_input}, "reduce-scatter of the last unit"))
    if embedding:
        # An untied embedding's backward: its unit gathered with its all-gather output, its dense gradient, the
        # first layer's gradient not yet reduced
        unreduced = fsdp.layer_unit_bytes(arch, train) - fsdp.embedding_shard_gradient_bytes(arch, train)
        moments.append(Phase("training", {**persistent, "weights": shards + fsdp.embedding_unit_bytes(
                                              arch, train, fsdp.GATHER_COPIES),
                                          "gradients": all_grads + unreduced, "activations": embedding + layer_input},
                             "embedding backward"))
    return moments


def _merged_log_prob_moments(arch: ModelArchitecture, train: TrainingConfig, release: TrlRelease,
                             persistent: dict[str, float], policy_graph: dict[str, float],
                             backward_weights: float) -> list[Phase]:
    """TRL 0.14's compute_loss: the policy's forward with grad over full logits and a log_softmax per completion
    (each kept for backward), then the reference's log-probs while the policy's graph (`policy_graph`) is alive,
    then the backward of those rows.

    Under mixed precision accelerate converts the model's outputs to float32 (the compute-dtype logits exist too
    while it does); without autocast the logits keep the weights' dtype. Iterating over the logits unbinds them, so
    backward holds every row's gradient until it stacks them into one tensor.
    """
    s = m.sizes(train)
    autocast = train.mixed_precision != "no"
    logit = m.FP32_BYTES if autocast else s.compute  # bytes per logit as the loop sees them
    sequences, vocab = train.micro_batch_completions, arch.vocab_size
    positions = logit_positions(train, release)  # c + 1, or p + c where transformers drops num_logits_to_keep
    logits = sequences * positions * vocab
    # every row's log_softmax (forward) or gradient (backward): each covers the logits less the last position
    rows = sequences * (positions - 1) * vocab * logit  # (the gather reads only the first c of each row)
    one_row = (positions - 1) * vocab * logit
    converting = logits * (s.compute + logit) if autocast else logits * logit  # the model's output and its copy
    reference = dict(policy_graph)
    for name, value in _scoring_casts(arch, train).items():  # the reference's weight casts, cached by autocast
        reference[name] = reference.get(name, persistent[name]) + value - persistent[name]
    # The reference's output (and the KV cache it holds where use_cache is left on: log_prob_forward_cache) goes
    # once its logits are copied to float32; its rows' log_softmax, one at a time, meets that copy alone
    cache = (m.kv_cache_bytes(arch, train, sequences, train.sequence_length, forward=train)
             if release.log_prob_forward_cache == "model_default" and not train.gradient_checkpointing else 0)
    # Before its logits, the reference's decoder forward: its widest layer (no grad, adapters disabled) beside the
    # policy's graph and rows, with its KV cache filled to the full sequence
    decoder = (inference.scoring_bytes(arch, train, sequences, train.sequence_length, adapters=False,
                                       cached=bool(cache)) if inference.counted(arch, train) else 0)
    return [
        Phase("training", {**persistent, **policy_graph, "lm_head_buffers": converting}, POLICY_LOGITS_MOMENT),
        Phase("training", {**persistent, **policy_graph, "lm_head_buffers": logits * logit + rows},
              "policy log-probs: the logits and every row's log_softmax"),
        Phase("training", {**persistent, **reference, "kv_cache": reference.get("kv_cache", 0) + cache,
                           "activations": reference["activations"] + decoder, "lm_head_buffers": rows},
              "reference forward while the policy's graph is alive"),
        Phase("training", {**persistent, **reference, "kv_cache": reference.get("kv_cache", 0) + cache,
                           "lm_head_buffers": rows + converting}, REFERENCE_LOGITS_MOMENT),
        # the loop's `log_probs` still holds the previous row's log_softmax while the next is made (no graph keeps
        # the reference's)
        Phase("training", {**persistent, **reference, "lm_head_buffers": rows + logits * logit + 2 * one_row},
              "reference log-probs: a row's log_softmax while the policy's graph is alive"),
        Phase("training", {**persistent, **policy_graph, "weights": backward_weights,
                           "lm_head_buffers": 2 * rows + one_row}, "log-prob backward: every row's gradient, stacked"),
    ]


def _policy_cache_saved_bytes(arch: ModelArchitecture, train: TrainingConfig, release: TrlRelease) -> float:
    """The keys and values the policy's forward with grad keeps for backward in its own KV cache (TRL 0.14's
    compute_loss leaves use_cache on without checkpointing: log_prob_forward_cache). From transformers 4.56 each
    layer's cache starts as an empty tensor and concatenates the states onto it (cache_utils.py
    DynamicLayer.lazy_initialization, `torch.cat([self.keys, key_states], dim=-2)`), and attention reads the cache's
    copies; where SDPA takes them as they are (no mask and grouped heads unrepeated, or one key/value head per query
    head) and in their own dtype, the copies it keeps for backward are the cache's storage, which the trace counts
    as kv_cache: they move there from the layers' activations. Before 4.56 the cache keeps the states themselves,
    made by the layer (activations)."""
    if (release.log_prob_forward_cache != "model_default" or train.gradient_checkpointing
            or train.transformers.kv_values_dtype != "keys" or train.attn_implementation != "sdpa"):
        return 0
    unrepeated = arch.num_kv_heads == arch.num_attention_heads or (
        release.log_prob_attention_mask == "none" and train.transformers.sdpa_gqa_without_mask)
    compute = m.sizes(train).compute
    if not unrepeated or m.kv_element_bytes(train, forward=train) != (compute, compute):
        return 0
    return m.kv_cache_bytes(arch, train, train.micro_batch_completions, train.sequence_length, forward=train)


def _training_casts(arch: ModelArchitecture, train: TrainingConfig) -> tuple[float, float]:
    """Weight casts alive at the end of the forward (autocast's cache) and kept for backward."""
    layers = m.layer_weight_cast_bytes(arch, train)
    adapters = m.adapter_cast_bytes(arch, train)
    if train.gradient_checkpointing:  # nothing is kept; the cache empties when the forward's autocast exits
        return (0 if train.uses_lora else layers) + adapters, 0
    # frozen weights are cast per use, not cached, but their linears keep the casts for backward (but those that read
    # a first layer's input that needs no gradient)
    return layers + adapters, layers + adapters - act.first_layer_unkept_cast_bytes(arch, train)


def _first_layer_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig, all_grads: float) -> float:
    """Gradients that exist at the peak of the first layer's backward: every later layer's, and of its own only the
    MLP output projection's (backward reaches it first; the peak comes as the MLP's input gradients form). The
    embedding's comes last, unless it is tied to the output projection."""
    if train.uses_lora or (train.zero_stage is not None and train.optimizer_offloaded):
        return all_grads  # ZeRO-Offload: what stays on the GPU (model/components.py) does not grow with the backward
    if train.fsdp:
        # As the sharded trace finds the peak, in a checkpointed layer's backward as the MLP's input gradients form
        return _fsdp_first_layer_gradient_bytes(arch, train, all_grads, fsdp.mlp_output_gradient_bytes(arch, train))
    missing = arch.layer_params - arch.layer_linears()[-1].params
    if not arch.tie_word_embeddings:
        missing += arch.embedding_params
    return all_grads - m.shard_bytes(train, missing * m.sizes(train).trainable, 2)


def _fsdp_first_layer_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig, all_grads: float,
                                     own: float) -> float:
    """FSDP2's gradients in the first layer's backward: every later unit's reduced shard, the layer's own whole
    gradients made so far (`own`), and a reduce-scatter input, which FSDP2 keeps until the next unit's reduce-scatter
    frees it just before allocating its own (`reduce_scatter_states`, torch/distributed/fsdp/_fully_shard/
    _fsdp_param_group.py:639-658): the layer after's, then its own; a tied output projection's whole gradient
    waiting for the embedding's, an untied embedding's shard to come."""
    layer = fsdp.layer_tensors(arch, train)
    held = all_grads - fsdp.layer_shard_gradient_bytes(arch, train) + own + fsdp.reduce_scatter_input_bytes(layer, train)
    if arch.tie_word_embeddings:
        return (held + fsdp.whole_gradient_bytes(fsdp.tail_tensors(arch, train), train)
                - fsdp.tail_shard_gradient_bytes(arch, train))
    return held - fsdp.embedding_shard_gradient_bytes(arch, train)


def _head_gradient_bytes(arch: ModelArchitecture, train: TrainingConfig) -> float:
    """Gradients that exist when backward leaves the LM head: the output projection's, its bias's where it has one
    (phi's), with full fine-tuning; float32 with cast_lm_head_to_fp32."""
    if train.uses_lora:
        return 0
    trainable = m.sizes(train).trainable
    head = arch.vocab_size * (arch.hidden_size + (1 if arch.family.lm_head_bias else 0))
    return head * trainable + m.trained_head_upcast_bytes(arch, train, trainable)


def _notes(arch: ModelArchitecture, train: TrainingConfig, release: TrlRelease) -> tuple[str, ...]:
    notes = release_assumptions(train)
    if drops_logits_to_keep(train, release):
        notes.append(f"logits: transformers {train.transformers.version} ignores the {release.logits_to_keep_argument} "
                     f"TRL {release.version} passes, so the logits (and accelerate's float32 copy under mixed "
                     f"precision) cover all {train.sequence_length} positions of prompt + completion, not the "
                     f"completion's {train.max_completion_length + 1}")
    if (host := offload.host_note(arch, train)) is not None:
        notes.append(host)
    if act.hub_rms_norm(arch, train):
        how = ("use_kernels kernelizes the model" if train.use_kernels else
               f"transformers {train.transformers.version} kernelizes the model by default")
        notes.append(f"kernels: {how}, and on CUDA the Hub's RMSNorm kernel (LigerRMSNorm) keeps each norm's input and "
                     "a float32 rstd per row for backward where the torch code keeps a float32 copy"
                     + ("" if train.use_kernels else "; a run with use_kernels false (model_init_kwargs) or "
                        "USE_HUB_KERNELS=NO keeps more"))
    if act.hub_rotary_refuses(arch, train):
        notes.append(f"kernels: transformers {train.transformers.version} swaps in the Hub's rotary kernel "
                     "(kernels-community/rotary) for training, whose op takes q and cos in one dtype; float32 weights "
                     "under mixed precision give a 16-bit q beside a float32 cos, which its source refuses (not yet "
                     "run on a GPU by vram-plan): should the first step fail there, load 16-bit weights (--dtype "
                     "bfloat16) or turn the kernels off (use_kernels false in model_init_kwargs, or "
                     "USE_HUB_KERNELS=NO); counted as the torch code runs")
    if not arch.exact:
        notes.append(f"model_type {arch.model_type!r} is not one vram-plan knows; it was read as a Llama-style "
                     "decoder, so counts may be off")
    if train.attn_implementation == "eager" and not train.transformers.supports_sdpa(arch.model_type):
        notes.append(f"attention: eager, as transformers {train.transformers.version} runs {arch.model_type} (it has "
                     "no SDPA path for this model), which keeps each layer's attention probabilities for backward")
    if arch.max_position_embeddings and train.sequence_length > arch.max_position_embeddings:
        notes.append(f"prompt + completion ({train.sequence_length} tokens) exceeds the model's "
                     f"max_position_embeddings ({arch.max_position_embeddings})")
    if train.allocator_conf:
        notes += [f"allocator: {note}" for note in allocator_conf_notes(train.allocator_conf)]
    return tuple(notes)
