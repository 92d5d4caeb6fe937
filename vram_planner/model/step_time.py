"""Seconds per optimizer step, phase by phase: a roofline over the work of each pass (vram_planner/model/step_work.py).

Each pass takes the longer of the host's time to launch its eager operations and the device's work: its matmuls'
FLOPs at the card's dense tensor throughput for the compute dtype plus the bytes its kernels move at the card's memory
bandwidth, each peak scaled by an efficiency factor. Decoding a token moves every weight and the whole KV cache for a few FLOPs per
byte, so generation is bandwidth- (or, for small models in eager PyTorch, launch-) bound; prefill, the log-prob passes
and the loss are compute-bound; the optimizer step streams its states. vLLM decodes from CUDA graphs (no per-op
launches) with paged-attention kernels, and TRL copies the policy's weights into it every round.

Figures are per GPU and per optimizer step; every completion runs to max_completion_length (an upper bound: a
model that stops early generates fewer tokens). The efficiency factors below are priors with their sources;
`vram-plan probe` measures phase times on a card and fits them into its calibration (Calibration.step_time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from vram_planner.errors import ProfileError
from vram_planner.model import components as m
from vram_planner.model import optimizer_work as o
from vram_planner.model import step_work as w
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.spec import TrainingConfig
from vram_planner.profiles import GpuProfile

# Share of the dense tensor peak that matmuls of training reach. Megatron-LM sustains 52% of A100 peak on large
# models (Narayanan et al., SC'21, table 1), PaLM 46.2% model FLOPs utilization (Chowdhery et al. 2022, table 3);
# the small models a single card trains make smaller matmuls, which reach less: 0.4.
MATMUL_EFFICIENCY = 0.4
# Share of the datasheet bandwidth that streaming kernels (the optimizer, casts, dequantization) reach: 80-90% in
# BabelStream's and NVIDIA's bandwidthTest copies on A100/H100 HBM; the lower end, as PyTorch's kernels are no
# hand-tuned copy.
BANDWIDTH_EFFICIENCY = 0.8
# Share of the bandwidth that the optimizer's multi-tensor kernels reach (torch's _fused_adamw_ and foreach kernels:
# four to seven streams per element in chunks of 65536, bitsandbytes' blockwise 8-bit kernels): the same prior as the
# other streaming kernels, fitted apart as its phase is timed apart.
OPTIMIZER_BANDWIDTH_EFFICIENCY = BANDWIDTH_EFFICIENCY
# Share of the bandwidth that eager decoding in transformers reaches (GEMV-shaped matmuls, cache concatenation):
# gpt-fast reaches about 60-70% of an A100's bandwidth only once torch.compile fuses the step (PyTorch blog
# "Accelerating Generative AI with PyTorch II: GPT, Fast", 2023); eager transformers sits at or below that: 0.5.
DECODE_BANDWIDTH_EFFICIENCY = 0.5
# vLLM's decoding (CUTLASS/cuBLAS GEMMs and paged attention in CUDA graphs) sits at the upper end: 0.7.
VLLM_BANDWIDTH_EFFICIENCY = 0.7
# Host time per eager op of a model's forward (Python, nn.Module calls, the dispatcher, the launch): gpt-fast's eager
# starting point decodes Llama-2-7B at batch 1 on an A100 at 25.5 tokens/s, "heavily CPU overhead bound" (PyTorch
# blog "Accelerating Generative AI with PyTorch II: GPT, Fast", 2023): 39.2 ms per token for 32 layers of about 51
# kernels each (its model.py: two RMSNorms of 8, the fused qkv, rotary on q and k of 9 each, two cache index_puts,
# two repeat_interleaves of 2, SDPA, the output's contiguous copy, wo, SwiGLU's 5, two residual adds) and about 25
# around them: 24 microseconds per op.
EAGER_OP_SECONDS = 24e-6
# Host time per kernel of the training passes: the same Python and dispatcher path as EAGER_OP_SECONDS's in the
# forward, with autograd recording a node per op and autocast's dispatch on top, and autograd's C++ engine launching
# the backward's; no source splits them, so the prior is EAGER_OP_SECONDS and probes fit it apart from decoding's.
TRAIN_OP_SECONDS = EAGER_OP_SECONDS
# Host time per tensor that torch.optim's per-parameter Python loops spend (AdamW.step's _init_group: reading the
# grad and the state of each parameter and appending five lists, about twenty CPython statements of which three
# cross into C++; the clip's and zero_grad's loops are shorter), an estimate from that count at a few hundred
# nanoseconds per statement: 5 microseconds (a prior for probes to fit: LoRA's optimizer step is made of it).
TENSOR_SECONDS = 5e-6
# vLLM's host work per decoding step (scheduling, sampling, output processing) once CUDA graphs take the launches:
# the v0.6.0 release post measured milliseconds per step before multi-step scheduling hid most of it (vLLM blog,
# 2024-09-05): 2 ms.
VLLM_STEP_SECONDS = 2e-3
# Share of a link's bandwidth that NCCL's collectives reach on large messages: nccl-tests' bus bandwidth sits at
# 70-85% of NVLink and PCIe peaks in NVIDIA's published runs: 0.7.
INTERCONNECT_EFFICIENCY = 0.7
# TRL's host work per generation round beside the passes: decoding the completions to text, the rewards' gather,
# the advantages and the metrics it logs; tens of milliseconds (a prior for probes to fit).
ROUND_OVERHEAD_SECONDS = 0.05
# vLLM's sleep mode moves its weights to the host and back each round over PCIe: pinned copies reach about 25 GB/s
# on PCIe Gen4 x16 (NVIDIA's bandwidthTest).
HOST_LINK_GB_S = 25.0


@dataclass(frozen=True)
class Efficiency:
    """The factors between a card's datasheet and what GRPO's passes reach on it (a calibration may fit them)."""

    matmul: float = MATMUL_EFFICIENCY
    bandwidth: float = BANDWIDTH_EFFICIENCY
    optimizer_bandwidth: float = OPTIMIZER_BANDWIDTH_EFFICIENCY
    decode_bandwidth: float = DECODE_BANDWIDTH_EFFICIENCY
    vllm_bandwidth: float = VLLM_BANDWIDTH_EFFICIENCY
    op_seconds: float = EAGER_OP_SECONDS
    train_op_seconds: float = TRAIN_OP_SECONDS
    tensor_seconds: float = TENSOR_SECONDS
    vllm_step_seconds: float = VLLM_STEP_SECONDS
    interconnect: float = INTERCONNECT_EFFICIENCY
    round_overhead_seconds: float = ROUND_OVERHEAD_SECONDS


def efficiency_names() -> list[str]:
    return [f.name for f in fields(Efficiency)]


def efficiency_from(fitted: dict[str, float]) -> Efficiency:
    """The priors with a calibration's fitted factors in place; ProfileError naming an unknown or bad factor."""
    names = efficiency_names()
    bad = [f"{k}={v!r}" for k, v in fitted.items() if k not in names or not (isinstance(v, (int, float))
                                                                              and math.isfinite(v) and v > 0)]
    if bad:
        raise ProfileError(f"calibration step_time: {', '.join(bad)} (known factors, each a positive number: "
                           f"{', '.join(names)})")
    return replace(Efficiency(), **{k: float(v) for k, v in fitted.items()})


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step on each GPU, by phase, and what bounds each phase."""

    seconds: dict[str, float]
    bounds: dict[str, str]
    completions_per_step: int  # trained per optimizer step, all GPUs
    completion_tokens_per_step: float  # generated per optimizer step, all GPUs
    prompts_per_step: float  # dataset prompts one optimizer step consumes
    notes: tuple[str, ...] = field(default=())

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def completion_tokens_per_second(self) -> float:
        return self.completion_tokens_per_step / self.step_seconds

    def epoch_seconds(self, prompts: int) -> float:
        """One pass over `prompts` dataset prompts."""
        return prompts / self.prompts_per_step * self.step_seconds


class NoSpeedFigures(ProfileError):
    """The card has no bandwidth or throughput figures to predict with."""


def card_tflops(gpu: GpuProfile, train: TrainingConfig) -> float:
    """Dense tensor TFLOPS for the dtype the matmuls run in: autocast's, DeepSpeed's bf16, else the weights'."""
    if train.mixed_precision != "no" or train.zero_stage is not None:
        dtype = "bfloat16" if train.mixed_precision == "bf16" or train.zero_stage is not None else "float16"
    else:
        dtype = train.dtype
    if dtype == "bfloat16" and not gpu.bf16:
        dtype = "float32"  # torch emulates bf16 there in float32 arithmetic, without tensor cores
    figure = {"bfloat16": gpu.bf16_tflops, "float16": gpu.fp16_tflops, "float32": gpu.fp32_tflops}[dtype]
    if figure is None or gpu.memory_bandwidth_gb_s is None:
        raise NoSpeedFigures(f"{gpu.label} has no memory bandwidth or {dtype} throughput in the GPU catalog: name a "
                             "catalog card (`vram-plan gpus`) to predict step times")
    return figure


@dataclass(frozen=True)
class Card:
    """A card's peaks for one config's compute dtype, in FLOP/s and bytes/s, and the efficiency factors."""

    flops_per_s: float
    bytes_per_s: float
    link_bytes_per_s: float | None
    eff: Efficiency

    @classmethod
    def of(cls, gpu: GpuProfile, train: TrainingConfig, eff: Efficiency = Efficiency()) -> Card:
        """NoSpeedFigures where the catalog has no figures for the card."""
        link = None if gpu.interconnect_gb_s is None else gpu.interconnect_gb_s * 1e9
        return cls(card_tflops(gpu, train) * 1e12, gpu.memory_bandwidth_gb_s * 1e9, link, eff)

    def seconds(self, work: w.Work, bandwidth_eff: float, op_seconds: float) -> tuple[float, str]:
        """The roofline of one pass between two waits for the device: the longer of the host's launches and the
        device's work, which is its matmuls' time and its other kernels' bytes (different kernels, one after the
        other on the stream); the host launches ahead asynchronously, so the shorter hides under the longer."""
        compute = work.flops / (self.flops_per_s * self.eff.matmul)
        memory = work.bytes_moved / (self.bytes_per_s * bandwidth_eff)
        launches = work.ops * op_seconds
        if launches >= compute + memory:
            return launches, "launch"
        return compute + memory, "compute" if compute >= memory else "memory"


def step_time(arch: ModelArchitecture, train: TrainingConfig, gpu: GpuProfile, eff: Efficiency = Efficiency(),
              reward_seconds: float = 0.0, vllm_sequences: int | None = None) -> StepTime:
    """Seconds of one optimizer step of `train` on `gpu`, phase by phase.

    Args:
        reward_seconds: the reward functions' time per completion (0: a regex or a format check, microseconds).
        vllm_sequences: how many sequences vLLM decodes at once (its KV cache's room, VllmBudget.batch_sequences);
            None: the whole generation round.
    """
    card = Card.of(gpu, train, eff)
    s = train.steps_per_generation_resolved
    rounds = train.gradient_accumulation_steps / (s * train.num_iterations)
    b, c = train.micro_batch_completions, train.max_completion_length
    seconds, bounds = {}, {}
    gen, bounds["generation"] = generation_round_seconds(arch, train, card, vllm_sequences)
    seconds["generation"] = rounds * (gen + eff.round_overhead_seconds)
    passes = int(train.computes_old_logps) + int(train.computes_ref_logps)
    if passes:
        one, bounds["scoring"] = scoring_pass_seconds(arch, train, card)
        seconds["scoring"] = rounds * s * passes * one
    micro, bounds["training"] = micro_batch_seconds(arch, train, card)
    seconds["training"] = train.gradient_accumulation_steps * micro
    seconds["optimizer"] = optimizer_seconds(arch, train, card)
    bounds["optimizer"] = _optimizer_bound(arch, train, card)
    notes = []
    if train.num_gpus > 1:
        if card.link_bytes_per_s is None:
            notes.append(f"{gpu.label} has no interconnect figure: communication between GPUs not counted")
        else:
            seconds["communication"] = _communication_bytes(arch, train, rounds) / (card.link_bytes_per_s
                                                                                   * eff.interconnect)
            bounds["communication"] = "interconnect"
    completions = b * train.gradient_accumulation_steps * train.num_gpus
    if reward_seconds:
        seconds["rewards"] = reward_seconds * completions / train.num_gpus / train.num_iterations
        bounds["rewards"] = "reward functions"
    prompts = completions / (train.num_generations * train.num_iterations)
    return StepTime(seconds=seconds, bounds=bounds, completions_per_step=completions,
                    completion_tokens_per_step=completions * c / train.num_iterations, prompts_per_step=prompts,
                    notes=tuple(notes))


def scoring_pass_seconds(arch: ModelArchitecture, train: TrainingConfig, card: Card) -> tuple[float, str]:
    """One no-grad log-prob forward of a micro-batch (TRL scores the generation batch in micro-batches)."""
    b, p, c = train.micro_batch_completions, train.max_prompt_length, train.max_completion_length
    return card.seconds(w.forward_work(arch, train, b, p + c, (p + c) / 2, c), card.eff.bandwidth,
                        card.eff.op_seconds)


def micro_batch_seconds(arch: ModelArchitecture, train: TrainingConfig, card: Card) -> tuple[float, str]:
    """The loss forward and backward of one micro-batch: each the longer of the host's launches and the device's
    work, as the host waits for the device between them (the LM head's mask and the loss's metrics synchronize),
    and what bounds the longer."""
    passes = w.training_passes(arch, train, train.micro_batch_completions, train.max_prompt_length,
                               train.max_completion_length)
    timed = [card.seconds(work, card.eff.bandwidth, card.eff.train_op_seconds) for work in passes]
    return sum(seconds for seconds, _ in timed), max(timed)[1]


def optimizer_step_seconds(arch: ModelArchitecture, train: TrainingConfig, card: Card) -> float:
    """optimizer.step() alone (what a probe times): its Python loop over the tensors, then its kernels' bytes or
    their launches, whichever is longer."""
    work = o.optimizer_work(arch, train)
    return work.step_visits * card.eff.tensor_seconds + _streamed(card, work.step_bytes, work.step_launches)


def optimizer_seconds(arch: ModelArchitecture, train: TrainingConfig, card: Card) -> float:
    """The whole optimizer phase of a step: the gradient clipping, optimizer.step() and zero_grad."""
    work = o.optimizer_work(arch, train)
    clip = work.clip_visits * card.eff.tensor_seconds + _streamed(card, work.clip_bytes, work.clip_launches)
    return optimizer_step_seconds(arch, train, card) + clip


def _streamed(card: Card, n_bytes: float, launches: float) -> float:
    return max(n_bytes / (card.bytes_per_s * card.eff.optimizer_bandwidth), launches * card.eff.op_seconds)


def generation_round_seconds(arch: ModelArchitecture, train: TrainingConfig, card: Card,
                             vllm_sequences: int | None = None, new_tokens: int | None = None) -> tuple[float, str]:
    """One generation round: the prefill of every prompt, then `new_tokens` - 1 decoding steps (max_completion_length
    - 1 by default) at the average context, in transformers' generate() or in vLLM; with the weights' trip into
    vLLM, and what bounds the decoding."""
    n, p = train.local_generation_batch_size, train.max_prompt_length
    c = train.max_completion_length if new_tokens is None else new_tokens
    eff = card.eff
    generated = m.as_generated(train)
    if train.use_vllm:
        at_once = min(n, vllm_sequences or n)
        waves = math.ceil(n / at_once)
        held = _as_vllm_holds_it(train)
        prefill, _ = card.seconds(w.forward_work(arch, held, n, p, p / 2, 1), eff.bandwidth, 0.0)
        step = w.forward_work(arch, held, at_once, 1, p + c / 2, 1)
        step = replace(step, bytes_moved=step.bytes_moved + w.kv_read_bytes(arch, held, at_once, p + c / 2), ops=0)
        decode, bound = card.seconds(step, eff.vllm_bandwidth, 0.0)
        decode += eff.vllm_step_seconds
        return prefill + waves * (c - 1) * decode + _vllm_sync_seconds(arch, train, card), bound
    prefill, _ = card.seconds(w.forward_work(arch, generated, n, p, p / 2, 1), eff.bandwidth, eff.op_seconds)
    step = w.forward_work(arch, generated, n, 1, p + c / 2, 1)
    kv = w.kv_read_bytes(arch, train, n, p + c / 2) * w.eager_kv_passes(arch, train)
    step = step + w.Work(bytes_moved=kv, ops=w.GENERATE_OPS_PER_TOKEN)
    if train.fsdp:  # FSDP2 gathers each layer for every forward, every decoding step's too (model/fsdp.py)
        step = step + w.Work(bytes_moved=arch.params * 2 * (train.num_gpus - 1) / train.num_gpus)
    # generate() reads `unfinished_sequences.max() == 0` on the host every step, which waits for the device
    # (transformers' generation/utils.py, StopCheck), so the host never runs ahead into the next step; within a step
    # the device runs each kernel as the host launches it (launches are asynchronous), and the step lasts the longer
    # of the two
    device, bound = card.seconds(w.Work(step.flops, step.bytes_moved), eff.decode_bandwidth, 0.0)
    launches = step.ops * eff.op_seconds
    return prefill + (c - 1) * max(device, launches), "launch" if launches > device else bound


def _optimizer_bound(arch: ModelArchitecture, train: TrainingConfig, card: Card) -> str:
    """`memory` where the step's bytes take longer than its host loop and launches, else `host`."""
    work = o.optimizer_work(arch, train)
    streaming = work.step_bytes / (card.bytes_per_s * card.eff.optimizer_bandwidth)
    host = work.step_visits * card.eff.tensor_seconds + work.step_launches * card.eff.op_seconds
    return "memory" if streaming >= host else "host"


def _as_vllm_holds_it(train: TrainingConfig) -> TrainingConfig:
    """The model as vLLM loads it: 16-bit weights and KV cache (4-bit where TRL loads bitsandbytes), LoRA merged."""
    return replace(train, dtype="bfloat16", mixed_precision="no", zero_stage=None, fsdp=False, lora_r=None,
                   lora_alpha=None, lora_target_modules=None)


def _vllm_sync_seconds(arch: ModelArchitecture, train: TrainingConfig, card: Card) -> float:
    """TRL's copy of the policy into vLLM each round (merged adapters under LoRA): on the card when colocated, over
    the link to the server otherwise; with sleep mode, vLLM's weights back from the host and out again."""
    weights = arch.params * 2  # vLLM holds 16-bit weights
    if train.vllm_mode == "server":
        link = card.link_bytes_per_s or HOST_LINK_GB_S * 1e9
        seconds = weights / (link * card.eff.interconnect)
    else:
        seconds = 2 * weights / (card.bytes_per_s * card.eff.bandwidth)  # read the policy's, write vLLM's
    if train.vllm_enable_sleep_mode:
        seconds += 2 * weights / (HOST_LINK_GB_S * 1e9)
    return seconds


def _communication_bytes(arch: ModelArchitecture, train: TrainingConfig, rounds: float) -> float:
    """Bytes each GPU sends per optimizer step in ring collectives ((n - 1)/n of the data per all-gather or
    reduce-scatter, twice that per all-reduce): DDP all-reduces the gradients once per step (no_sync while
    accumulating); ZeRO-1 also gathers the updated 16-bit weights; ZeRO-2 reduce-scatters every micro-batch's
    gradients; ZeRO-3 and FSDP gather the weights for every forward and backward, and once per generation round
    for ZeRO-3's generation (ds3_gather_for_generation); FSDP's decoding gathers are in the generation phase."""
    n, ga = train.num_gpus, train.gradient_accumulation_steps
    ring = (n - 1) / n
    grads = m.trainable_params(arch, train) * m.sizes(train).trainable
    weights16 = arch.params * 2
    kind = train.distributed
    if kind in ("ddp", "zero0"):
        return 2 * ring * grads
    if kind == "zero1":
        return 2 * ring * grads + ring * m.trainable_params(arch, train) * 2
    if kind == "zero2":
        return ga * ring * grads + ring * m.trainable_params(arch, train) * 2
    passes_per_micro_batch = 3 if train.gradient_checkpointing else 2
    scoring = (int(train.computes_old_logps) + int(train.computes_ref_logps)) * train.steps_per_generation_resolved
    gathers = ga * passes_per_micro_batch + rounds * (scoring + (1 if kind == "zero3" else 0))
    return ring * (gathers * weights16 + ga * grads)
