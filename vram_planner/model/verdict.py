"""`check`: the verdict for exactly one configuration on one GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

from vram_planner.errors import ConfigError, closest_names, field_name
from vram_planner.model.architecture import FAMILIES, ModelArchitecture
from vram_planner.model import offload
from vram_planner.model.calibration import Calibration
from vram_planner.model.cuda_context import ContextFigure, context_figure
from vram_planner.model.expandable_pages import decoding_cache_hole_bytes
from vram_planner.model.lm_head import uses_fused_head
from vram_planner.model.nccl import NcclFigure, nccl_figure, nccl_note
from vram_planner.model.phases import Estimate, estimate
from vram_planner.model.spec import TrainingConfig, with_changes
from vram_planner.model.stranding import head_block_counted, scores_whole_logits_apart
from vram_planner.model.trl_releases import TrlRelease
from vram_planner.model.vllm_comm import NO_COMMUNICATORS, VllmCommFigure, vllm_comm_figure
from vram_planner.profiles import GpuProfile
from vram_planner.request import DEFAULT_SAFETY_MARGIN

MAX_SAFETY_MARGIN = 0.5  # keeping more than half the card free is a typo, not a margin
# How far the exact need of a step has been measured from the estimate (benchmarks/boundary.py: the traced step's need,
# bisected through the allocator model, beside the analytic peak; benchmarks/results/boundary.txt, and
# boundary_heldout.py's random configs off that grid, boundary-heldout*.txt): up to this much above it, and this much
# below. Above: 7.3% (24 GiB held-out seed 2's SmolLM2-1.7B bfloat16 LoRA with 8-bit AdamW, 8 x (1,024 + 384) tokens
# a micro-batch, drawn 2026-12-01 and read by nobody before it ran: one granule below its need its checkpointed 44 MiB
# layer inputs lay in the 64 to 256 MiB segments generation's prefill left, up to 36 MiB beside five of them, where
# the backward asked for a 176 MiB block; no pattern counts that yet, and the 5% margin does not cover it, so such a
# "fits" is flagged near the boundary); 4.9% before it (held-out SmolLM2-135M's float32 LoRA with eager attention,
# 64 x 704 tokens a micro-batch; with SDPA 4.0%, seed 1's SmolLM2-135M's LoRA). Eager attention had a band of its own
# (6.7%: seed 4's Qwen2.5-1.5B's LoRA, 16 x 5,568 tokens a micro-batch, whose second step's forward cut a checkpointed
# 261 MiB layer input from a 22 GiB score segment the first step's backward left) until the overflow of the inputs into
# the score segments was counted at every length for a forward that runs in a backward's cache
# (fragmentation.eager_overflow_bytes, 2026-11-29: -1.1%). Steps without gradient checkpointing whose loss forward
# follows a generation of several micro-batches at once under torch's default allocator
# (kept_tensors_in_decoding_segments): 8.2%, seed 3's Qwen3-1.7B's bfloat16 full fine-tuning, 32 x 896 tokens a
# micro-batch, 128 sequences generated, whose kept 112 MiB forward tensors were cut one each from the decoding's
# 194-222 MiB segments, 16 GiB beside them that no pattern counts (the decoding's growing keys and values are
# larger than the kept tensors only where the generation batch is; expandable segments strand none: other steps
# without checkpointing up to 2.1%). Why none can count it closely: each decoding step's blocks outgrow the last
# step's segments, and each cudaMalloc that fails releases every whole free segment (release_cached_blocks; without
# max_split_size release_available_cached_blocks releases nothing), so the segments left for the loss are those the
# decoding made since its last release, a sawtooth in the capacity (Qwen3-0.6B's bfloat16 full fine-tuning, 32 x 896
# tokens a micro-batch, 128 generated, at its need: 760 segments made and 621 released in the first generation, 147
# left, 32 GiB; the kept tensors cut all of them and strand 5.9 GiB; Qwen3-1.7B's 233 and 15.4 GiB, Phi-3-mini's 180
# and 14.6 GiB, none for Llama-3.2-1B or Mistral-7B-v0.3, whose blocks fit in the prefill's segments). A pattern
# could only bound it, by the room beyond generation's live memory.
# Below, the estimate is conservative where a modelled pattern strands less than it can (the need 15.5% below it, the
# estimate 18.3% over, for held-out seed 6's Qwen2.5-3B float32 full fine-tuning with eager attention, 32 x 3,456
# tokens a micro-batch, whose 24 GiB float32 score blocks the eager patterns weigh as they weigh the grid's smaller
# ones; on the grid 13.7%, gemma-3-1b-it's eager LoRA generating 512 prompts at once, whose four heads make small score
# blocks: the reserve is fitted to fall short of a need rarely, so it runs long where a pattern strands less;
# benchmarks/reserve_fit.py). A verdict whose peak lies that close to the card could be the other way round:
# `check --exact` decides it.
# Under DeepSpeed (benchmarks/deepspeed_configs.py: one rank's traced step, its need bisected through the allocator
# model, beside the analytic peak; benchmarks/results/deepspeed_configs.txt) ZeRO-1/2's optimizer step strands what
# its fp32 gradient partition cannot use, and the next backward's reduction buckets what the first step's Adam moments
# leave of the segments they were cut from (model/zero_replay.py counts both: every config whose estimate peaks in the
# step needs 2.4% to 3.1% less than it); their loss has needed up to 5.1% more than the estimate, inside the band of
# one GPU (Qwen2.5-0.5B's ZeRO-2 on 8 with "auto" buckets and two micro-batches: its partition buffers cut from the LM
# head's freed logits segments, which the replay does not see; Llama-3.2-1B's ZeRO-1 on 4 at TRL's own batch 6.4%
# until ZeRO-1's whole gradients were weighed as one GPU's, fragmentation.keeps_whole_gradients: 1.5%; a band of
# their own, 7%, until then). ZeRO-3's step is replayed too (a sub-group's flat 16-bit copy and fp32 copy beside the
# start-up's bucket and gradient buffer): its configs need at most 3.0% more than the estimate (Qwen2.5-0.5B's LoRA on
# 8 with a 2e8 prefetch bucket); 5.4% before the replay (Llama-3.2-1B on 2 with DeepSpeed's 5e8 bucket).
# The releases that make the whole logits (profiles/trl.toml lm_head "full_logits": TRL 0.14 to 1.14, which recipes
# pin) were traced in their environments (benchmarks/boundary.py --suffix trl-X). TRL 0.14, which scores the reference
# inside its loss, has a band of its own: 10.0% above (boundary-trl-0.14.0.txt, under transformers 4.48: Qwen2.5-0.5B's
# bfloat16 full fine-tuning under autocast with checkpointing, 8 x 1,025 completion logits of 2.3 GiB, whose
# overflowing log_softmax rows took half of the previous backward's 4.6 GiB float32 copy segment, and the reference's
# logits, a few MiB too large for the half they left, half of the policy's copy segment: two halves stranded where
# stranding.reference_logits_stranded_bytes counts one; 24.2% before that pattern was counted, 2026-12-03, the oxen.ai
# runs' windows among them). TRL 0.15 to 1.14 strand a logits block at the LM head's backward
# (stranding.head_block_stranded_bytes; before it was counted 13 windows of 30 points under TRL 0.19 and 13 under 1.0,
# 9.7% and 19.3% above): since, 4.4% above at most under 0.19 (SmolLM2-135M's float32 full fine-tuning) and 0.7%
# under 1.0 outside LoRA with checkpointing, inside the band of every step; LoRA with checkpointing, where the block is
# stranded only when the final norm's output lands in it and is not counted, 19.3% above (boundary-trl-1.0.0.txt,
# under transformers 5.4: SmolLM2-135M's LoRA with 128 x 256 completions; 5 windows of its 15 points, each flagged
# near the boundary by this band, where `check --exact` decides). TRL 1.14's log-prob kernel asks in its backward for
# blocks of the whole sequence's logits, not the completion's: its LoRA steps with checkpointing have needed 33.2% above
# (boundary-trl-1.14.2.txt, under transformers 5.19: the same SmolLM2-135M point, whose second step's final norm output
# lay in one of the two 6,168 MiB segments the first step's backward left; 5 windows of 15 such points, flagged).
NEED_ABOVE_ESTIMATE = 0.08
NEED_ABOVE_ESTIMATE_DECODING_SEGMENTS = 0.09
NEED_ABOVE_ESTIMATE_MERGED_LOSS = 0.11
NEED_ABOVE_ESTIMATE_HEAD_BLOCK_UNCOUNTED = 0.20
NEED_ABOVE_ESTIMATE_KERNEL_HEAD_BLOCK_UNCOUNTED = 0.34
NEED_BELOW_ESTIMATE = 0.17


def need_above_estimate(train: TrainingConfig) -> float:
    """The most a step of this kind has been measured to need above its estimate."""
    return need_above_band(train)[0]


def need_above_band(train: TrainingConfig) -> tuple[float, str]:
    """need_above_estimate, and the steps it was measured on, in words ("steps" where no kind has a band of its own)."""
    bands = [(NEED_ABOVE_ESTIMATE, "steps")]
    if kept_tensors_in_decoding_segments(train):
        bands.append((NEED_ABOVE_ESTIMATE_DECODING_SEGMENTS,
                      "steps without gradient checkpointing that generate for several micro-batches at once"))
    if train.release.step_structure == "loss_merged" and not uses_fused_head(train, train.release):
        bands.append((NEED_ABOVE_ESTIMATE_MERGED_LOSS,
                      "steps of the TRL releases that score the reference inside the loss (0.14)"))
    if scores_whole_logits_apart(train) and not head_block_counted(train):
        if train.release.full_logits_log_probs == "kernel":
            bands.append((NEED_ABOVE_ESTIMATE_KERNEL_HEAD_BLOCK_UNCOUNTED,
                          "LoRA steps with gradient checkpointing of TRL 1.14 (its log-prob kernel's backward asks "
                          "for blocks of the whole logits)"))
        else:
            bands.append((NEED_ABOVE_ESTIMATE_HEAD_BLOCK_UNCOUNTED,
                          "LoRA steps with gradient checkpointing of the TRL releases that make the whole logits "
                          "(0.15 to 1.13)"))
    return max(bands, key=lambda band: band[0])


def kept_tensors_in_decoding_segments(train: TrainingConfig) -> bool:
    """Whether the loss forward keeps its tensors without checkpointing after a generation in this process of more
    sequences than a micro-batch, under torch's default allocator: the decoding's keys and values, larger than the
    kept tensors there, leave segments that best fit cuts them from."""
    return (not train.gradient_checkpointing and not train.expandable_segments and not train.use_vllm
            and train.local_generation_batch_size > train.micro_batch_completions)


def check_safety_margin(value: object) -> float:
    """The share of the card a verdict keeps free: a number from 0 to MAX_SAFETY_MARGIN (ConfigError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0 <= value <= MAX_SAFETY_MARGIN):
        raise ConfigError([f"{field_name('safety_margin')} should be a share of the card from 0 to {MAX_SAFETY_MARGIN} "
                           f"(0.05 keeps 5% free; got {value!r})"])
    return float(value)


@dataclass(frozen=True)
class Context:
    """What a verdict is judged against, besides the training config."""

    arch: ModelArchitecture
    gpu: GpuProfile
    release: TrlRelease
    calibration: Calibration
    safety_margin: float = DEFAULT_SAFETY_MARGIN
    model_id: str = ""

    def __post_init__(self) -> None:
        check_safety_margin(self.safety_margin)

    @property
    def capacity_bytes(self) -> int:
        return self.gpu.capacity_bytes

    @property
    def margin_bytes(self) -> float:
        return self.safety_margin * self.capacity_bytes

    @property
    def budget_bytes(self) -> float:
        return self.capacity_bytes - self.margin_bytes

    @property
    def cuda_context(self) -> ContextFigure:
        """The CUDA context the card holds: the calibration's measured figure, else the GPU catalog's."""
        return context_figure(self.calibration, self.gpu)

    def allocatable_bytes(self, train: TrainingConfig) -> int:
        """What cudaMalloc can hand out on the card: what the CUDA context (as `check` takes it) and NCCL's buffers
        leave of it."""
        return max(int(self.capacity_bytes - self.cuda_context.bytes - self.nccl(train).bytes), 0)

    def nccl(self, train: TrainingConfig) -> NcclFigure:
        """NCCL's own device memory on each rank of `train`'s GPUs (nothing on one GPU)."""
        return nccl_figure(self.gpu, train.num_gpus, train.distributed)

    def vllm_comm(self, train: TrainingConfig) -> VllmCommFigure:
        """Colocated vLLM's tensor-parallel communicators on each rank (nothing without vLLM or tensor parallelism)."""
        colocated = train.use_vllm and train.vllm_mode == "colocate" and train.release.accepts_vllm_mode
        return vllm_comm_figure(self.gpu, train.vllm_tensor_parallel_size) if colocated else NO_COMMUNICATORS


@dataclass(frozen=True)
class ReplayedCopy:
    """The exact engine's copy of this step (vram_planner.step_copy), kept by `check --exact --keep-copy` for the
    model and knobs at other lengths, replayed through the allocator model on the card: where the estimate lies near
    the boundary, its answer is the verdict."""

    runs: bool  # whether the step runs where cudaMalloc can hand out what the CUDA context leaves of the card
    made: str  # when the copy was made (ISO 8601, UTC)
    seconds: float  # making the step's stream from the copy and replaying it
    requests: int  # the stream's allocations and frees, both steps


@dataclass(frozen=True)
class Verdict:
    """One configuration judged on one GPU."""

    context: Context
    train: TrainingConfig
    estimate: Estimate
    replayed: ReplayedCopy | None = None  # a kept copy of the exact engine decided it (near the boundary)

    @property
    def fits(self) -> bool:
        # vLLM that cannot start in its budget stops the run, however much the trainer leaves spare
        vllm = self.estimate.vllm
        memory = self.estimate.peak_bytes <= self.context.budget_bytes if self.replayed is None else self.replayed.runs
        return memory and (vllm is None or vllm.problem is None) and self.host_fits

    @property
    def fits_from_bytes(self) -> float:
        """The least card capacity on which this estimate "fits": its peak with the safety margin kept free."""
        return self.estimate.peak_bytes / (1 - self.context.safety_margin)

    @property
    def host_fits(self) -> bool:
        """Whether one node's RAM holds the offloaded states (model/offload.py; true without offload)."""
        capacity = offload.host_memory_bytes(self.train)
        return capacity is None or self.estimate.host_bytes <= capacity

    @cached_property
    def first_micro_batch(self) -> Estimate:
        """The first micro-batch of the first step, judged on its own: its phases run before any optimizer state
        (or accumulated gradient) exists, so a run can die there, before its first optimizer step."""
        return _estimate(self.context, self.train, first_micro_batch=True)

    @property
    def first_micro_batch_fits(self) -> bool:
        return self.first_micro_batch.peak_bytes <= self.context.budget_bytes

    @property
    def spare_bytes(self) -> float:
        """Capacity left at the peak (negative: missing), before the safety margin."""
        return self.context.capacity_bytes - self.estimate.peak_bytes

    @property
    def decoding_holes_bytes(self) -> float:
        """What generate()'s growing keys and values may keep mapped beyond the estimate under expandable segments
        (expandable_pages.decoding_cache_hole_bytes; 0 elsewhere)."""
        return decoding_cache_hole_bytes(self.context.arch, self.train)

    @property
    def generation_band_bytes(self) -> float:
        """The generation phase's estimate with the decoding's holes on it: a bound on its need (0 where the
        decoding strands nothing beyond the estimate)."""
        holes = self.decoding_holes_bytes
        generation = next((p for p in self.estimate.phases if p.name == "generation"), None)
        return 0.0 if generation is None or not holes else generation.total_bytes + holes

    @property
    def need_bound_bytes(self) -> float:
        """The most this step's need has been measured above its estimate: the share band of its kind of step on the
        peak, or under expandable segments generation with what its growing cache can strand, whichever is more."""
        return max(self.estimate.peak_bytes * (1 + need_above_estimate(self.train)), self.generation_band_bytes)

    @property
    def near_boundary(self) -> bool:
        """Whether the step's need could lie on the other side of the card than the verdict says, as far from the
        estimate as needs have been measured (`--exact` then decides); never for a vLLM that cannot start."""
        vllm = self.estimate.vllm
        if (vllm is not None and vllm.problem is not None) or not self.host_fits or self.replayed is not None:
            return False
        peak, capacity = self.estimate.peak_bytes, self.context.capacity_bytes
        if self.fits:
            return self.need_bound_bytes > capacity
        return peak * (1 - NEED_BELOW_ESTIMATE) <= capacity


def judge(context: Context, train: TrainingConfig) -> Verdict:
    """The estimate of `train` in this context, with the context's own notes (a TRL release read as another)."""
    return Verdict(context, train, _estimate(context, train))


def _estimate(context: Context, train: TrainingConfig, first_micro_batch: bool = False) -> Estimate:
    nccl, vllm_comm = context.nccl(train), context.vllm_comm(train)
    est = estimate(context.arch, train, context.release, context.calibration, context.capacity_bytes,
                   context.cuda_context.bytes, context.gpu.label, context.gpu.bf16, context.gpu.compute_capability,
                   first_micro_batch, nccl.bytes, vllm_comm)
    if nccl.bytes:
        est = replace(est, notes=est.notes + (nccl_note(nccl),))
    if vllm_comm.bytes:
        est = replace(est, notes=est.notes + (vllm_comm.source,))
    for note in (context.release.note, context.gpu.note, emulated_bf16_note(train, context.gpu)):
        if note:
            est = replace(est, notes=est.notes + (note,))
    return est


def gpu_problems(train: TrainingConfig, gpu: GpuProfile) -> list[str]:
    """Settings this GPU cannot run at all, whatever the memory."""
    problems = []
    cc = f" (compute capability {gpu.compute_capability})" if gpu.compute_capability else ""
    if train.attn_implementation == "flash_attention_2" and not gpu.flash_attention_2:
        problems.append(f"{field_name('attn_implementation')} flash_attention_2 does not run on {gpu.label}{cc}; "
                        "use sdpa")
    return problems


def uses_bf16(train: TrainingConfig) -> bool:
    """Whether the step computes or keeps anything in bfloat16: autocast's or the weights'."""
    return train.mixed_precision == "bf16" or train.dtype == "bfloat16"


def emulated_bf16_note(train: TrainingConfig, gpu: GpuProfile) -> str | None:
    """A pre-Ampere card runs bfloat16 all the same: torch emulates it in float32 arithmetic (torch.cuda.
    is_bf16_supported() answers True there, so transformers' TrainingArguments accepts bf16=True and TRL's default
    runs), as fast as float32 at best; its tensor cores run float16."""
    if gpu.bf16 or not uses_bf16(train):
        return None
    cc = f" (compute capability {gpu.compute_capability})" if gpu.compute_capability else ""
    return (f"{gpu.label}{cc} has no native bf16: torch emulates it in float32 arithmetic, so the bf16 step runs (the "
            "memory is the same) at float32 speed at best; fp16 autocast (fp16=True) with float16 (LoRA) or float32 "
            "weights runs on its tensor cores")


def adapt_to_gpu(train: TrainingConfig, gpu: GpuProfile, explicit: set[str]) -> TrainingConfig:
    """Defaults the user did not set that this GPU runs better otherwise: fp16 autocast in place of bf16 on a
    pre-Ampere card, which only emulates bf16; bf16 (emulated) stays where fp16 cannot train the config (float16
    weights in full: the grad scaler refuses their gradients)."""
    if not gpu.bf16 and train.mixed_precision == "bf16" and "mixed_precision" not in explicit:
        try:
            train = with_changes(train, mixed_precision="fp16")
        except ConfigError:
            pass
    return train


def adapt_to_model(train: TrainingConfig, arch: ModelArchitecture, explicit: set[str]) -> TrainingConfig:
    """The attention the installed transformers runs this model with when the run names none: eager where the
    model's code has no SDPA (gemma2 from transformers 5.21: SDPA has no softcapping)."""
    if ("attn_implementation" not in explicit and train.attn_implementation == "sdpa"
            and not train.transformers.supports_sdpa(arch.model_type)):
        return with_changes(train, attn_implementation="eager")
    return train


def attention_problems(train: TrainingConfig, arch: ModelArchitecture) -> list[str]:
    """An attention implementation the model's code refuses to load with."""
    if train.attn_implementation == "sdpa" and not train.transformers.supports_sdpa(arch.model_type):
        return [f"{field_name('attn_implementation')} sdpa: transformers {train.transformers.version} has no SDPA "
                "attention for "
                f"{arch.model_type} (from_pretrained refuses it); use eager (its default) or flash_attention_2"]
    return []


def lora_target_problems(train: TrainingConfig, arch: ModelArchitecture) -> list[str]:
    """LoRA target names that are not linear layers of this model's decoder layers, with the closest names.

    PEFT would fail on them only once the model is loaded (or silently adapt fewer layers than asked). A model_type
    read as Llama-style may name its layers otherwise, so its names are left to PEFT.
    """
    if not train.uses_lora or train.lora_targets is None or arch.model_type not in FAMILIES:
        return []
    known = [lin.name for lin in arch.layer_linears()]
    unknown = [name for name in train.lora_targets if name not in known]
    if not unknown:
        return []
    named = []
    for name in unknown:
        near = closest_names(name, known)
        named.append(f"{name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    verb = "is not a linear layer" if len(unknown) == 1 else "are not linear layers"
    return [f"{field_name('lora_target_modules')} {', '.join(named)} {verb} of {arch.name or arch.model_type}; "
            "choose from "
            f"{', '.join(known)}, or all-linear"]


def cast_lm_head_arch_problems(train: TrainingConfig, arch: ModelArchitecture) -> list[str]:
    """Where TRL's own cast_lm_head_to_fp32 fails at start-up: with tied embeddings it hooks
    `model.model.embed_tokens` (grpo_trainer.py 1.16.0:1037-1043), which neither a PEFT wrapper (its `.model` is the
    causal LM) nor a multimodal model (the text model sits one level further in) has: AttributeError."""
    if not (train.cast_lm_head_to_fp32 and arch.tie_word_embeddings):
        return []
    flag = field_name("cast_lm_head_to_fp32")
    if train.uses_lora:
        return [f"{flag} with LoRA fails in TRL's GRPOTrainer on {arch.name or arch.model_type}, whose embeddings are "
                "tied to the LM head ('object has no attribute embed_tokens'); train without the cast or fully"]
    if arch.vision_params:
        return [f"{flag} fails in TRL's GRPOTrainer on {arch.name or arch.model_type}, a multimodal model whose "
                "embeddings are tied to the LM head ('object has no attribute embed_tokens'); train without the cast"]
    return []


def qlora_generation_problems(train: TrainingConfig) -> list[str]:
    """Where TRL 0.22-0.25 fail at the first generation of a 4-bit model under bf16: their set-up (PEFT's
    prepare_model_for_kbit_training, then peft_module_casting_to_bf16; TrlRelease.qlora_setup) leaves the norms
    float32 and puts the LM head back to bfloat16, and generate() runs the model outside autocast (PEFT's generate()
    calls the base model's, whose forward accelerate does not wrap), so the head multiplies the final norm's float32
    output by bfloat16 weights: 'expected mat1 and mat2 to have the same dtype' (peft#1515; the trace of TRL 0.23.1
    with transformers 4.56.2 stops there). vLLM generates apart from the training model."""
    if not (train.load_in_4bit and generates_no_4bit_model(train)):
        return []
    return [f"{field_name('load_in_4bit')} under bf16 fails at the first generation in TRL "
            f"{train.release.version or '0.22-0.25'}: its set-up leaves the final norm float32 and the LM head "
            "bfloat16, which generate() multiplies outside autocast ('expected mat1 and mat2 to have the same "
            f"dtype'); use TRL 0.26 or later, or generate with vLLM ({field_name('use_vllm')})"]


def generates_no_4bit_model(train: TrainingConfig) -> bool:
    """Whether this release, precision and generation could not generate with a 4-bit model
    (qlora_generation_problems)."""
    return (train.release.qlora_setup == "prepare_kbit_training" and train.mixed_precision == "bf16"
            and not train.use_vllm)


def qlora_left_out_note(train: TrainingConfig) -> str | None:
    """Why a plan that found nothing offers no 4-bit weights (QLoRA, the ladder's last saver), where that is why."""
    if train.load_in_4bit or not generates_no_4bit_model(train):
        return None
    return (f"4-bit weights (QLoRA) are left out: TRL {train.release.version} cannot generate with them under bf16 "
            "(its set-up leaves the final norm float32 and the LM head bfloat16); TRL 0.26 or later can, or vLLM's "
            "generation (--use-vllm)")  # a note: the document's words, as notes are


def _vllm_problems(train: TrainingConfig, arch: ModelArchitecture) -> list[str]:
    if not train.use_vllm:  # vLLM's model loads only for a config that starts one
        return []
    from vram_planner.model.vllm import vllm_config_problems

    return vllm_config_problems(train, arch)


def check_training(train: TrainingConfig, context: Context) -> None:
    """Refuse settings this GPU cannot run or this model does not have, all problems at once."""
    problems = (gpu_problems(train, context.gpu) + attention_problems(train, context.arch)
                + lora_target_problems(train, context.arch) + cast_lm_head_arch_problems(train, context.arch)
                + qlora_generation_problems(train) + _vllm_problems(train, context.arch))
    if problems:
        raise ConfigError(problems)
