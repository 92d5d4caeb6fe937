"""vLLM as TRL starts it: the budget vLLM itself works out at start-up, and whether it can live in it.

Rules read from the source of the vLLM releases TRL 1.16 accepts (vllm>=0.22.0,<=0.31.0; checked in 0.22.0 and
0.31.0, the same rules in both unless said):

- Budget. `request_memory` (vllm/v1/worker/utils.py) asks for ceil(gpu_memory_utilization x total memory) and
  refuses to start ("Free memory on device ... is less than desired GPU memory utilization") when the device has less
  free memory than that at start-up. Colocated with the trainer (TRL's colocate mode: one process), the trainer's
  CUDA context and weights are already on the card then (GRPOTrainer.__init__ places the model before it builds
  VLLMGeneration; the reference model and the optimizer come later). With vllm_tensor_parallel_size > 1 vLLM's own
  TP communicators are on the card too: set up before the snapshot that request_memory reads, they are outside the
  budget and inside its free-memory check (model/vllm_comm.py).
- What the budget holds. `Worker.determine_available_memory` (vllm/v1/worker/gpu_worker.py) with `memory_profiling`
  (vllm/utils/mem_utils.py): KV cache = requested - (weights + the torch peak increase of `profile_run` + non-torch
  memory) - the CUDA graph estimate. Weights are what loading allocated (`GPUModelRunner.load_model`,
  model_memory_usage); the profile run is one forward over max_num_batched_tokens tokens, then the sampler over
  min(max_num_seqs, max_num_batched_tokens) rows of logits (`GPUModelRunner.profile_run`, `_dummy_sampler_run`);
  non-torch memory is NCCL's and the kernels' (everything but torch's allocator). CUDA graph memory is inside the
  budget: `profile_cudagraph_memory` estimates it and it is subtracted (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1,
  the default since 0.21). 0.31 counts the same terms as total_consumed + transient_peak_headroom.
- KV cache. Blocks of 16 tokens (CacheConfig.DEFAULT_BLOCK_SIZE); a full-attention layer's page is
  2 x block x kv heads x head_dim x dtype bytes (AttentionSpec.real_page_size_bytes, vllm/v1/kv_cache_interface.py);
  a sliding-window layer keeps cdiv(min(window - 1 + max_num_batched_tokens, len), block) + 1 blocks
  (SlidingWindowSpec). Tensor parallelism splits the KV heads, max(1, kv heads // tp) per rank.
- One sequence. `_check_enough_kv_cache_memory` (vllm/v1/core/kv_cache_utils.py) refuses to start when the KV cache
  is zero or less ("No available memory for the cache blocks") or smaller than one request of max_model_len ("To serve
  at least one request with the model's max seq len ...").
- max_model_len. Unset, vLLM derives it from the config (`_get_and_verify_max_len`, vllm/config/model.py; see
  ModelArchitecture.context_length). TRL 1.16 passes vllm_max_model_length, None by default; TRL 0.18-0.25 passed
  max_prompt_length + max_completion_length.
- Weights. dtype "auto": the config's 16-bit dtype, float32 configs downcast (`_resolve_auto_dtype`); TRL does not
  pass a dtype, so the trainer's --dtype does not matter. TRL passes quantization="bitsandbytes" when the trainer's
  model has 4-bit layers (vLLM quantizes the checkpoint in flight: nf4 with double quantization,
  bitsandbytes_loader.py) and refuses 8-bit ("vLLM does not support in-flight 8-bit quantization").
- TRL's arguments (trl/generation/vllm_generation.py VLLMGeneration.__init__, trainer/grpo_trainer.py):
  max_num_seqs = per_device_train_batch_size x vllm_tensor_parallel_size x steps_per_generation (x
  gradient_accumulation_steps in 0.18), max_num_batched_tokens = 4096 (from 0.19), tensor_parallel_size,
  enable_sleep_mode, distributed_executor_backend "external_launcher". Sleep: level 2 from TRL 0.25 (weights and KV
  cache discarded, the trainer re-pushes the weights on wake-up; only the model's buffers go to host RAM,
  `Worker.sleep`), level 1 in 0.23-0.24 (weights offloaded to host RAM).
- Server mode (`trl vllm-serve`, trl/scripts/vllm_serve.py, runs `vllm serve`): gpu_memory_utilization 0.9, dtype
  and kv-cache dtype auto, max_model_len unset; vLLM's server defaults (EngineArgs
  `_set_default_max_num_seqs_and_batched_tokens_args`, 0.31): max_num_seqs 1024 and max_num_batched_tokens 8192 on
  cards of 70 GiB or more other than the A100 (16384 from 160 GiB), else 256 and 2048.

What the source measures at run time is a coefficient here: non-torch memory and the memory of one CUDA graph (public
vLLM logs, cited below); both are owed a measurement on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from vram_planner.errors import field_name
from vram_planner.model import components as m
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.trl_releases import version_tuple
from vram_planner.model.vllm_comm import vllm_comm_figure
from vram_planner.units import GiB, MiB

BLOCK_TOKENS = 16  # CacheConfig.DEFAULT_BLOCK_SIZE
TRL_MAX_NUM_BATCHED_TOKENS = 4096  # VLLMGeneration: "the v1 profiler is misled by the high default"
LLM_CLASS_BATCHED_TOKENS = (16384, 8192)  # vLLM's LLM() default on >= 70 GiB non-A100 cards / others (TRL 0.18)
SERVER_GPU_MEMORY_UTILIZATION = 0.9  # trl vllm-serve's default
UTILIZATION_STEP = 0.05  # what plan recommends: a multiple of this
# Non-torch memory of one vLLM worker beside an existing CUDA context: 0.16-0.33 GiB in vLLM's single-GPU profiling
# logs (vllm#12126, vllm#14452, vllm#14447). With tensor parallelism the same: its communicators are set up before
# vLLM's memory snapshot (gpu_worker.py:466-490), so they are outside this term and the budget (model/vllm_comm.py;
# the 0.59-0.73 GiB logged with TP 2 in nlzy/vllm-gfx906#10, a ROCm fork, is no longer used for it).
NON_TORCH_BYTES = int(0.3 * GiB)
# vLLM's CUDA graph estimate per captured graph: 0.36 GiB for 16 graphs (gpustack/runner#251, vLLM 0.27), "the real
# FULL graphs cost ~24 MiB each" (vllm#50780).
CUDA_GRAPH_BYTES = 24 * MiB
# The sampler of the profile run (vllm/v1/sample/sampler.py, topk_topp_sampler.py forward_native, processed_logprobs
# as TRL asks): logits in the model's dtype, their float32 copy, the processed log-probs, the probabilities and the
# exponential noise of random sampling, each [rows, vocab] in float32.
SAMPLER_FP32_COPIES = 4
TINY_BYTES = 1.0  # a budget this close to its need is a float sum's noise, not a shortfall


@dataclass(frozen=True)
class VllmBudget:
    """vLLM's memory on one GPU (one tensor-parallel rank), as vLLM works it out at start-up."""

    mode: str  # "colocate" (on the training GPU) or "server" (trl vllm-serve on its own card)
    gpu_label: str
    capacity_bytes: int
    gpu_memory_utilization: float
    tensor_parallel_size: int
    weights_bytes: float
    activation_bytes: float  # torch peak increase of the profile run
    cuda_graph_bytes: float
    non_torch_bytes: float
    kv_cache_bytes: float  # what one generation round's sequences need at full length
    kv_available_bytes: float  # what the budget leaves for the KV cache (negative: vLLM cannot start)
    one_sequence_bytes: float  # KV cache of one request of max_model_len
    sequence_bytes: float  # KV cache of one prompt + completion
    free_at_start_bytes: float
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    batch_sequences: int  # sequences of one generation round vLLM runs at once
    sequence_tokens: int  # prompt + completion
    sleep_level: int | None
    host_bytes: float  # host RAM vLLM holds while asleep
    four_bit: bool = False  # bitsandbytes weights

    @property
    def reservation_bytes(self) -> float:
        """What vLLM takes on the card while awake: its whole budget, whatever the KV cache makes of it."""
        return float(math.ceil(self.gpu_memory_utilization * self.capacity_bytes))

    @property
    def non_kv_bytes(self) -> float:
        return self.weights_bytes + self.activation_bytes + self.cuda_graph_bytes + self.non_torch_bytes

    @property
    def asleep_bytes(self) -> float:
        """What sleep mode leaves on the card: CUDA graphs and non-torch memory (it frees weights and KV cache)."""
        return self.cuda_graph_bytes + self.non_torch_bytes

    @property
    def kv_capacity_sequences(self) -> int:
        """Prompt + completion sequences the KV cache holds at once (vLLM queues the rest)."""
        return max(0, math.floor(self.kv_available_bytes / self.sequence_bytes))

    def reservation_in(self, phase: str) -> float:
        """vLLM's bytes on the card during a phase: all of it, or what sleep mode leaves outside generation."""
        if self.sleep_level is not None and phase != "generation":
            return self.asleep_bytes
        return self.reservation_bytes

    def needed_utilization(self, kv_bytes: float) -> float:
        """The utilization whose budget holds the start-up needs and `kv_bytes` of KV cache."""
        return (self.non_kv_bytes + kv_bytes) / self.capacity_bytes

    @property
    def max_gpu_memory_utilization(self) -> float:
        """The largest utilization vLLM accepts at start-up: the free memory it finds, as a share of the card."""
        return self.free_at_start_bytes / self.capacity_bytes

    @property
    def min_gpu_memory_utilization(self) -> float | None:
        """The smallest utilization (two decimals, rounded up) with which vLLM starts and holds one sequence of
        max_model_len; None when no utilization vLLM accepts does."""
        value = _round_up(self.needed_utilization(max(self.one_sequence_bytes, TINY_BYTES)), 0.01)
        return value if value <= min(self.max_gpu_memory_utilization, 0.99) else None

    @property
    def recommended_gpu_memory_utilization(self) -> float | None:
        """The smallest multiple of 0.05 that holds the start-up needs and the whole round's KV cache."""
        need = max(self.kv_cache_bytes, self.one_sequence_bytes, TINY_BYTES)
        value = _round_up(self.needed_utilization(need), UTILIZATION_STEP)
        return value if value <= min(self.max_gpu_memory_utilization, 0.95 + 1e-9) else None

    @property
    def problem(self) -> str | None:
        """Why vLLM cannot start in this budget, in one line, or None."""
        return start_problem(self)


def _round_up(value: float, step: float) -> float:
    """`value` rounded up to a multiple of `step`, as people write it (0.35, not 0.35000000000000003)."""
    return round(math.ceil(round(value / step, 9)) * step, 2)


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / GiB:.2f} GiB"


def start_problem(b: VllmBudget) -> str | None:
    """vLLM's own refusals at start-up (request_memory, _check_enough_kv_cache_memory), in the planner's words."""
    u, flag = b.gpu_memory_utilization, _utilization_flag(b)
    smallest = b.min_gpu_memory_utilization
    fix = (f"the smallest value that works is {smallest}" if smallest is not None else
           f"no value works on {b.gpu_label}: {_alternatives(b)}")
    if b.reservation_bytes > b.free_at_start_bytes + TINY_BYTES:
        held = ("the trainer's CUDA context and weights" if b.mode == "colocate" else "the CUDA context") + (
            " and vLLM's tensor-parallel communicators" if b.tensor_parallel_size > 1 else "")
        free = (f"only {_gib(b.free_at_start_bytes)} of the {_gib(b.capacity_bytes)} card are free when it starts "
                f"({held} are there)" if b.free_at_start_bytes > 0 else f"{held} already take "
                f"{_gib(b.capacity_bytes - b.free_at_start_bytes)} of the {_gib(b.capacity_bytes)} card")
        return (f"vLLM refuses to start: {flag} {u} asks for {_gib(b.reservation_bytes)}, but {free}; "
                f"{fix}{_shorter_context(b)}")
    if b.kv_available_bytes <= 0:
        return (f"vLLM cannot start in {flag} {u} ({_gib(b.reservation_bytes)}): weights {_gib(b.weights_bytes)}, "
                f"profile run {_gib(b.activation_bytes)}, CUDA graphs {_gib(b.cuda_graph_bytes)} and non-torch "
                f"memory {_gib(b.non_torch_bytes)} leave no room for a KV cache; {fix}{_shorter_context(b)}")
    if b.kv_available_bytes + TINY_BYTES < b.one_sequence_bytes:
        return (f"vLLM cannot hold one sequence of max_model_len {b.max_model_len} tokens: it needs "
                f"{_gib(b.one_sequence_bytes)} of KV cache and {flag} {u} leaves {_gib(b.kv_available_bytes)}; "
                f"{fix}{_shorter_context(b)}")
    return None


def _utilization_flag(b: VllmBudget) -> str:
    return "--vllm-gpu-memory-utilization" if b.mode == "colocate" else "trl vllm-serve's --gpu_memory_utilization"


def _shorter_context(b: VllmBudget) -> str:
    """What a max_model_len of prompt + completion would need instead of the model's whole context."""
    if b.sequence_tokens >= b.max_model_len:
        return ""
    value = _round_up(b.needed_utilization(max(b.sequence_bytes, TINY_BYTES)), 0.01)
    with_it = f"{value} " if value <= min(b.max_gpu_memory_utilization, 0.99) else "no value works even "
    return f" ({with_it}with --vllm-max-model-length {b.sequence_tokens}, prompt + completion)"


def _alternatives(b: VllmBudget) -> str:
    four_bit = "" if b.four_bit or b.mode == "server" else ", or 4-bit weights (--lora-r with --load-in-4bit)"
    if b.mode == "server":
        return "a larger card, or more --vllm-tensor-parallel-size"
    return f"--vllm-mode server with --vllm-server-gpu, --vllm-tensor-parallel-size over several GPUs{four_bit}"


def _since(train: TrainingConfig, version: str) -> bool:
    """Whether the config's TRL release is `version` or later."""
    return version_tuple(train.release.version) >= version_tuple(version)


def dtype_bytes(arch: ModelArchitecture, gpu_bf16: bool = True) -> int:
    """Bytes of vLLM's weights and KV cache under dtype "auto" (`_resolve_auto_dtype`): the config's 16-bit dtype,
    float32 configs downcast, a card without bf16 runs float16; Gemma 2 and 3 refuse float16, so there they stay
    float32."""
    if not gpu_bf16 and arch.model_type in ("gemma2", "gemma3_text"):
        return 4
    return 2


def weights_bytes(arch: ModelArchitecture, four_bit: bool, tp: int, width: int) -> float:
    """Weights on one tensor-parallel rank: linear layers and the vocabulary split across ranks, norms on each;
    bitsandbytes' in-flight 4-bit leaves embeddings, head and norms in `width` bytes."""
    replicated = (arch.num_layers * arch.family.norms_per_layer + 1) * arch.norm_params
    if four_bit:
        linear = arch.linear_params * (m.NF4_BYTES_PER_PARAM + m.NF4_DOUBLE_QUANT_ABSMAX_BYTES_PER_PARAM)
        sharded = linear + (arch.params - arch.linear_params - replicated) * width
    else:
        sharded = (arch.params - replicated) * width
    return sharded / tp + replicated * width


def kv_heads(arch: ModelArchitecture, tp: int) -> int:
    """KV heads on one rank: split across ranks, replicated when there are fewer heads than ranks."""
    return max(1, arch.num_kv_heads // tp)


def page_bytes(arch: ModelArchitecture, tp: int, width: int) -> int:
    """One block of one layer: keys and values of BLOCK_TOKENS tokens."""
    return 2 * BLOCK_TOKENS * kv_heads(arch, tp) * arch.head_dim * width


def request_kv_bytes(arch: ModelArchitecture, tokens: int, tp: int, width: int, batched_tokens: int) -> int:
    """KV cache of one request of `tokens` tokens (FullAttentionSpec / SlidingWindowSpec max_memory_usage_bytes)."""
    blocks = (arch.num_layers - arch.sliding_layers) * -(-tokens // BLOCK_TOKENS)
    if arch.sliding_layers and arch.sliding_window:
        window_tokens = min(arch.sliding_window - 1 + batched_tokens, tokens)
        blocks += arch.sliding_layers * (-(-window_tokens // BLOCK_TOKENS) + 1)
    return blocks * page_bytes(arch, tp, width)


def profile_activation_bytes(arch: ModelArchitecture, batched_tokens: int, max_num_seqs: int, tp: int,
                             width: int) -> float:
    """The torch peak increase of `profile_run`: the larger of one decoder layer's working set over
    `batched_tokens` tokens (residual and hidden stream, then the MLP's gate/up and activation or q/k/v and the
    attention output, split across ranks) and the sampler over min(max_num_seqs, batched_tokens) rows of logits."""
    t, h = batched_tokens, arch.hidden_size
    mlp = arch.intermediate_size * (3 if arch.family.gated_mlp else 2) / tp
    attention = (2 * arch.num_attention_heads / tp + 2 * kv_heads(arch, tp)) * arch.head_dim
    forward = t * width * (2 * h + max(mlp, attention))
    rows = min(max_num_seqs, t)
    per_logit = width + 4 * (SAMPLER_FP32_COPIES - (1 if width == 4 else 0))
    sampler = t * h * width + 2 * rows * h * width + rows * arch.vocab_size * per_logit
    return max(forward, sampler)


def capture_sizes(max_num_seqs: int, batched_tokens: int) -> list[int]:
    """CUDA graph batch sizes (VllmConfig._set_cudagraph_sizes): 1, 2, 4, multiples of 8 below 256, then of 16,
    up to min(2 x max_num_seqs, 512, max_num_batched_tokens)."""
    largest = min(2 * max_num_seqs, 512, batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= largest]
    if largest >= 8:
        sizes += range(8, min(largest + 1, 256), 8)
    if largest >= 256:
        sizes += range(256, largest + 1, 16)
    if batched_tokens <= largest and batched_tokens not in sizes:
        sizes.append(batched_tokens)
    return sorted(sizes)


def cuda_graph_bytes(max_num_seqs: int, batched_tokens: int) -> float:
    """vLLM's estimate of its CUDA graphs (FULL_AND_PIECEWISE, the default): a piecewise graph for every capture
    size and a full decode graph for every size up to max_num_seqs, CUDA_GRAPH_BYTES each."""
    sizes = capture_sizes(max_num_seqs, batched_tokens)
    return (len(sizes) + sum(1 for s in sizes if s <= max_num_seqs)) * CUDA_GRAPH_BYTES


def trl_max_model_len(arch: ModelArchitecture, train: TrainingConfig) -> int:
    """max_model_len as TRL passes it: prompt + completion before 0.26, then vllm_max_model_length or (None) the
    context vLLM derives from the config (prompt + completion when the config gives none)."""
    if not _since(train, "0.26.0"):
        return train.sequence_length
    return train.vllm_max_model_length or arch.context_length or train.sequence_length


def trl_max_num_seqs(train: TrainingConfig) -> int:
    """B x vllm_tensor_parallel_size x steps_per_generation (gradient_accumulation_steps in TRL 0.18)."""
    steps = train.steps_per_generation_resolved if _since(train, "0.19.0") else train.gradient_accumulation_steps
    return train.per_device_train_batch_size * train.vllm_tensor_parallel_size * steps


def large_card(capacity_bytes: int, label: str) -> bool:
    """vLLM's larger defaults: 70 GiB or more, and not an A100 (PR 17885: a larger batch slows it)."""
    return capacity_bytes >= 70 * GiB and "a100" not in label.lower()


@dataclass(frozen=True)
class _Launch:
    """How vLLM is started: on which card, with what TRL or trl vllm-serve passes."""

    mode: str
    gpu_label: str
    capacity_bytes: int
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    batch_sequences: int
    free_at_start_bytes: float
    four_bit: bool
    sleep_level: int | None
    width: int


def colocated_budget(arch: ModelArchitecture, train: TrainingConfig, capacity_bytes: int, cuda_context_bytes: float,
                     gpu_label: str = "", gpu_bf16: bool = True, comm_bytes: float = 0.0) -> VllmBudget | None:
    """vLLM in the trainer's process on each training GPU (colocate mode, TRL 0.18 and later), or None; `comm_bytes`:
    its tensor-parallel communicators, set up before it measures free memory (model/vllm_comm.py)."""
    if not (train.use_vllm and train.vllm_mode == "colocate" and train.release.accepts_vllm_mode):
        return None
    batched = (TRL_MAX_NUM_BATCHED_TOKENS if _since(train, "0.19.0") else
               LLM_CLASS_BATCHED_TOKENS[0 if large_card(capacity_bytes, gpu_label) else 1])
    seqs = trl_max_num_seqs(train)
    sleep = (2 if _since(train, "0.25.0") else 1) if train.vllm_enable_sleep_mode else None
    # at start-up the trainer has its CUDA context and its weights on the card, and vLLM its TP communicators
    free = capacity_bytes - cuda_context_bytes - m.weight_bytes(arch, train) - comm_bytes
    launch = _Launch("colocate", gpu_label or "this card", capacity_bytes, train.vllm_gpu_memory_utilization, seqs,
                     batched, trl_max_model_len(arch, train), seqs, free, train.load_in_4bit, sleep,
                     dtype_bytes(arch, gpu_bf16))
    return _budget(arch, train, launch)


@lru_cache(maxsize=16)
def server_gpu(name: str):  # -> GpuProfile
    """The card --vllm-server-gpu names (resolved once: `auto` asks nvidia-smi)."""
    from vram_planner.profiles import GpuProfile

    return GpuProfile.from_name(name)


def server_budget(arch: ModelArchitecture, train: TrainingConfig, cuda_context_bytes: float) -> VllmBudget | None:
    """`trl vllm-serve` on each of vllm_tensor_parallel_size cards of --vllm-server-gpu, or None."""
    if not (train.use_vllm and train.vllm_mode == "server" and train.vllm_server_gpu):
        return None
    gpu = server_gpu(train.vllm_server_gpu)
    big = large_card(gpu.capacity_bytes, gpu.label)
    seqs = 1024 if big else 256
    batched = 16384 if gpu.capacity_bytes >= 160 * GiB else 8192 if big else 2048
    max_len = train.vllm_max_model_length or arch.context_length or train.sequence_length
    # the server's workers set up their TP communicators before the snapshot too (model/vllm_comm.py)
    comm = vllm_comm_figure(gpu, train.vllm_tensor_parallel_size).at_start_bytes
    launch = _Launch("server", gpu.label, gpu.capacity_bytes, SERVER_GPU_MEMORY_UTILIZATION, seqs, batched, max_len,
                     min(train.generation_batch_size, seqs), gpu.capacity_bytes - cuda_context_bytes - comm, False,
                     None, dtype_bytes(arch, gpu.bf16))
    return _budget(arch, train, launch)


def _budget(arch: ModelArchitecture, train: TrainingConfig, launch: _Launch) -> VllmBudget:
    tp, width, batched = train.vllm_tensor_parallel_size, launch.width, launch.max_num_batched_tokens
    weights = weights_bytes(arch, launch.four_bit, tp, width)
    sequence = request_kv_bytes(arch, train.sequence_length, tp, width, batched)
    budget = VllmBudget(
        mode=launch.mode, gpu_label=launch.gpu_label, capacity_bytes=launch.capacity_bytes,
        gpu_memory_utilization=launch.gpu_memory_utilization, tensor_parallel_size=tp, weights_bytes=weights,
        activation_bytes=profile_activation_bytes(arch, batched, launch.max_num_seqs, tp, width),
        cuda_graph_bytes=cuda_graph_bytes(launch.max_num_seqs, batched), non_torch_bytes=NON_TORCH_BYTES,
        kv_cache_bytes=launch.batch_sequences * sequence, kv_available_bytes=0.0,
        one_sequence_bytes=request_kv_bytes(arch, launch.max_model_len, tp, width, batched), sequence_bytes=sequence,
        free_at_start_bytes=launch.free_at_start_bytes, max_num_seqs=launch.max_num_seqs,
        max_model_len=launch.max_model_len, max_num_batched_tokens=batched, batch_sequences=launch.batch_sequences,
        sequence_tokens=train.sequence_length, sleep_level=launch.sleep_level, host_bytes=0.0,
        four_bit=launch.four_bit)
    # the sleeping model's buffers (the rotary cos/sin cache) go to host RAM; level 1 offloads the weights too
    buffers = (arch.max_position_embeddings or launch.max_model_len) * arch.head_dim * width
    host = 0.0 if launch.sleep_level is None else buffers + (weights if launch.sleep_level == 1 else 0.0)
    return replace(budget, kv_available_bytes=budget.reservation_bytes - budget.non_kv_bytes, host_bytes=host)


def vllm_budget(arch: ModelArchitecture, train: TrainingConfig, capacity_bytes: int, cuda_context_bytes: float,
                gpu_label: str = "", gpu_bf16: bool = True, comm_bytes: float = 0.0) -> VllmBudget | None:
    """The vLLM this config starts on a planned card: colocated on the training GPU (`comm_bytes`: its TP
    communicators at start-up), or the server's card."""
    return (colocated_budget(arch, train, capacity_bytes, cuda_context_bytes, gpu_label, gpu_bf16, comm_bytes)
            or server_budget(arch, train, cuda_context_bytes))


def budget_notes(budget: VllmBudget | None, train: TrainingConfig) -> list[str]:
    """What the plan assumed about vLLM and what to watch, in words (for a config that starts vLLM)."""
    if budget is None:
        if not train.release.accepts_vllm_mode:
            return [f"TRL {train.release.version} runs vLLM on a GPU of its own: this card holds none of it "
                    "(--vllm-server-gpu CARD plans that card as trl vllm-serve would start it)"]
        return ["vLLM runs as a server (trl vllm-serve) on other GPUs: this card holds none of it; --vllm-server-gpu "
                "CARD plans the server's card"]
    notes = [_summary(budget)]
    if budget.problem is None and budget.kv_capacity_sequences < budget.batch_sequences:
        better = budget.recommended_gpu_memory_utilization
        notes.append(f"warning: vLLM's KV cache holds {budget.kv_capacity_sequences} of the "
                     f"{budget.batch_sequences} sequences of a generation round ({train.sequence_length} tokens "
                     "each); it queues the rest: slower, not an error"
                     + (f" ({_utilization_flag(budget)} {better} holds them all)" if better else ""))
    if budget.sleep_level is not None:
        notes.append(f"vLLM sleep mode (level {budget.sleep_level}): outside generation its weights and KV cache "
                     f"leave the card ({_gib(budget.asleep_bytes)} of CUDA graphs and non-torch memory stay), host RAM "
                     f"holds {_gib(budget.host_bytes)}"
                     + (" (the weights)" if budget.sleep_level == 1 else " (its buffers; TRL re-sends the weights)")
                     + "; it wakes whole for each generation, which the generation phase counts")
    if train.vllm_max_model_length is None and _since(train, "0.26.0") and budget.max_model_len == \
            train.sequence_length and budget.mode == "colocate":
        notes.append("the model's config gives no context length for vLLM to derive max_model_len from: planned with "
                     "prompt + completion (set --vllm-max-model-length)")
    return notes


def _summary(b: VllmBudget) -> str:
    where = (f"vLLM colocated (--vllm-gpu-memory-utilization {b.gpu_memory_utilization}: "
             f"{_gib(b.reservation_bytes)} per GPU)" if b.mode == "colocate" else
             f"vLLM server on {b.tensor_parallel_size} x {b.gpu_label} (trl vllm-serve --tensor_parallel_size "
             f"{b.tensor_parallel_size} --gpu_memory_utilization {b.gpu_memory_utilization} --max_model_len "
             f"{b.max_model_len}: {_gib(b.reservation_bytes)} per GPU)")
    return (f"{where}: weights {_gib(b.weights_bytes)}, profile run {_gib(b.activation_bytes)}, CUDA graphs "
            f"{_gib(b.cuda_graph_bytes)}, non-torch {_gib(b.non_torch_bytes)}; {_gib(max(b.kv_available_bytes, 0))} "
            f"left for the KV cache, where a round of {b.batch_sequences} sequences needs {_gib(b.kv_cache_bytes)} "
            f"(max_num_seqs {b.max_num_seqs}, max_model_len {b.max_model_len})")


def vllm_config_problems(train: TrainingConfig, arch: ModelArchitecture) -> list[str]:
    """vLLM settings this model or card cannot run, whatever the memory (vLLM's own checks at start-up), for a config
    that starts vLLM."""
    problems = []
    tp = train.vllm_tensor_parallel_size
    if arch.num_attention_heads % tp:  # ModelConfig.verify_with_parallel_config
        problems.append(f"{field_name('vllm_tensor_parallel_size')} {tp}: vLLM needs the attention heads "
                        f"({arch.num_attention_heads}) divisible by the tensor parallel size")
    if train.vllm_max_model_length and arch.context_length and train.vllm_max_model_length > arch.context_length:
        problems.append(f"{field_name('vllm_max_model_length')} {train.vllm_max_model_length} exceeds the model's "
                        "context "
                        f"({arch.context_length} tokens): vLLM refuses it")
    elif train.vllm_max_model_length and train.sequence_length > train.vllm_max_model_length:
        problems.append(context_problem(train, arch))
    if train.vllm_server_gpu:
        from vram_planner.errors import VramPlanError

        try:
            server_gpu(train.vllm_server_gpu)
        except VramPlanError as exc:
            reason = exc.worded(field_name).removeprefix(field_name("gpu") + " ")
            problems.append(f"{field_name('vllm_server_gpu')}: {reason}")
    return problems


def context_problem(train: TrainingConfig, arch: ModelArchitecture) -> str:
    """Why vLLM cannot generate the planned completions when prompt + completion exceed the max_model_len TRL passes
    (vllm_max_model_length; trl vllm-serve's --max_model_len in server mode), in vLLM's terms: the server refuses
    each such request (its OpenAI endpoint, which TRL's client calls, checks prompt + max_tokens against
    max_model_len); the colocated engine refuses a prompt that leaves no room for one token
    (InputProcessor._validate_prompt_len) and otherwise stops each sequence at max_model_len (check_stop), so no
    completion reaches max_completion_length and the memory planned for it is not what runs."""
    p, c, m = train.max_prompt_length, train.max_completion_length, train.vllm_max_model_length
    if train.vllm_mode == "server":
        why = (f"vLLM's server refuses every such request (\"This model's maximum context length is {m} tokens\", "
               f"and {p} prompt + {c} completion tokens are {p + c})")
    elif p >= m:
        why = (f"vLLM refuses the prompt (\"The decoder prompt (length {p}) plus the number of requested output "
               f"tokens (at least 1) is longer than the maximum model length of {m}\")")
    else:
        why = f"vLLM stops each sequence at {m} tokens, so no completion reaches {c} tokens after a {p}-token prompt"
    fixes = [f"--max-completion-length {m - p} or less"] if m > p else []
    if arch.context_length is None or p + c <= arch.context_length:
        fixes.insert(0, f"--vllm-max-model-length {p + c} or more")
    fix = ", or ".join(fixes) if fixes else "a shorter --max-prompt-length or --max-completion-length"
    return (f"--max-prompt-length {p} + --max-completion-length {c} = {p + c} tokens exceed --vllm-max-model-length "
            f"{m}, vLLM's context for prompt and completion together: {why}; use {fix}")
