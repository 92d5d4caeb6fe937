"""One GRPO step, phase by phase: which components are alive at each phase's peak moment, in bytes on one GPU.

The step in TRL 1.16 (../shared/design/grpo-memory.md, "The step, phase by phase"):
generation of the B x S generation batch -> no-grad log-prob scoring (only when the config needs old or reference
log-probs) -> loss forward/backward per micro-batch -> optimizer step. Optimizer states persist across steps, so
every phase carries them (from step 2 on); gradients live from the first backward until zero_grad after the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vram_planner import memory as m
from vram_planner.architecture import ModelArchitecture
from vram_planner.calibration import Calibration
from vram_planner.lm_head import lm_head_memory
from vram_planner.spec import TrainingConfig
from vram_planner.trl_releases import TrlRelease

# Component names, in the order people read them.
COMPONENTS = ("weights", "reference_weights", "gradients", "optimizer_states", "kv_cache", "activations",
              "lm_head_buffers", "vllm_reservation", "cuda_context", "allocator_overhead")
TENSOR_COMPONENTS = COMPONENTS[:7]
PHASE_TITLES = {"generation": "generation", "scoring": "old/ref log-probs", "training": "loss forward/backward",
                "optimizer": "optimizer step"}


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

    @property
    def peak_phase(self) -> Phase:
        return max(self.phases, key=lambda p: p.total_bytes)

    @property
    def peak_bytes(self) -> float:
        return self.peak_phase.total_bytes

    @property
    def tensor_peak_bytes(self) -> float:
        return max(p.tensor_bytes for p in self.phases)


def estimate(arch: ModelArchitecture, train: TrainingConfig, release: TrlRelease, cal: Calibration,
             capacity_bytes: int) -> Estimate:
    """The memory of one steady-state GRPO step of `train` on a GPU of `capacity_bytes`."""
    persistent = {
        "weights": m.weight_bytes(arch, train),
        "reference_weights": m.reference_weight_bytes(arch, train),
        "optimizer_states": m.optimizer_state_bytes(arch, train),
    }
    all_grads = m.gradient_bytes(arch, train)
    raw = [_generation(arch, train, cal, persistent)]
    if train.computes_old_logps or train.computes_ref_logps:
        raw.append(_scoring(arch, train, release, cal, persistent))
    raw.append(_training(arch, train, release, cal, persistent, all_grads))
    raw.append(Phase("optimizer", {**persistent, "gradients": all_grads,
                                   "activations": m.optimizer_step_temporary_bytes(arch, train)}))
    reservation = train.vllm_gpu_memory_utilization * capacity_bytes if _colocated_vllm(train) else 0
    phases = tuple(_with_overheads(p, cal, reservation, train) for p in raw)
    return Estimate(phases=phases, params=arch.params, trainable_params=m.trainable_params(arch, train),
                    notes=_notes(arch, train))


def _colocated_vllm(train: TrainingConfig) -> bool:
    return train.use_vllm and train.vllm_mode == "colocate"


def _with_overheads(phase: Phase, cal: Calibration, reservation: float, train: TrainingConfig) -> Phase:
    components = {c: phase.components.get(c, 0.0) for c in TENSOR_COMPONENTS}
    # vLLM's sleep mode releases its weights and KV cache outside generation.
    asleep = train.vllm_enable_sleep_mode and phase.name != "generation"
    components["vllm_reservation"] = 0.0 if asleep else reservation
    components["cuda_context"] = float(cal.cuda_context_bytes)
    components["allocator_overhead"] = cal.allocator_overhead_fraction * sum(
        components[c] for c in TENSOR_COMPONENTS)
    return Phase(phase.name, components, phase.moment)


def _generation(arch: ModelArchitecture, train: TrainingConfig, cal: Calibration,
                persistent: dict[str, float]) -> Phase:
    base = {**persistent, "weights": m.generation_weight_bytes(arch, train)}
    if train.use_vllm:
        return Phase("generation", base, "vLLM generates (its memory is the reservation)")
    sequences, length = train.local_generation_batch_size, train.sequence_length
    kv = m.kv_cache_bytes(arch, train, sequences, length)
    # DynamicCache grows by concatenation: one layer's keys exist twice for a moment.
    kv_growth = kv / max(arch.num_layers, 1) / 2
    prefill = (m.inference_working_bytes(arch, train, cal, sequences * train.max_prompt_length)
               + m.padded_prefill_mask_bytes(train, sequences))
    decode = m.generation_logits_bytes(arch, sequences)
    prompt_kv = m.kv_cache_bytes(arch, train, sequences, train.max_prompt_length)
    prefill_moment = Phase("generation", {**base, "kv_cache": prompt_kv, "activations": prefill}, "prefill")
    decode_moment = Phase("generation", {**base, "kv_cache": kv + kv_growth, "lm_head_buffers": decode},
                          "last decoding step")
    return max(prefill_moment, decode_moment, key=lambda p: p.total_bytes)


def _scoring(arch: ModelArchitecture, train: TrainingConfig, release: TrlRelease, cal: Calibration,
             persistent: dict[str, float]) -> Phase:
    """No-grad forward passes over the generation batch in chunks of B sequences."""
    b, generated = train.per_device_train_batch_size, train.local_generation_batch_size
    head = lm_head_memory(arch, train, release, b, with_grad=False)
    kept_logps = generated * train.max_completion_length * m.FP32_BYTES * (
        int(train.computes_old_logps) + int(train.computes_ref_logps))
    forward = m.inference_working_bytes(arch, train, cal, b * train.sequence_length)
    return Phase("scoring", {**persistent, "activations": forward + kept_logps,
                             "lm_head_buffers": head.forward_transient}, "LM head of a chunk")


def _training(arch: ModelArchitecture, train: TrainingConfig, release: TrlRelease, cal: Calibration,
              persistent: dict[str, float], all_grads: float) -> Phase:
    """The largest of three moments of one micro-batch's forward/backward."""
    b = train.per_device_train_batch_size
    tokens = b * train.sequence_length
    head = lm_head_memory(arch, train, release, b, with_grad=True)
    saved = m.forward_saved_bytes(arch, train, cal, tokens)
    # From the second micro-batch of an accumulation on, every gradient exists before backward starts. With one
    # micro-batch, backward starts with none and fills them in while it frees the saved activations.
    accumulating = train.gradient_accumulation_steps > 1
    head_grads = all_grads if accumulating else (
        0.0 if train.uses_lora else min(all_grads, arch.vocab_size * arch.hidden_size * m.sizes(train).trainable))
    last_layer_saved = saved / max(arch.num_layers, 1)
    moments = [
        Phase("training", {**persistent, "gradients": all_grads if accumulating else 0.0,
                           "activations": saved, "lm_head_buffers": head.forward_transient + head.saved},
              "LM head forward"),
        Phase("training", {**persistent, "gradients": head_grads, "activations": saved,
                           "lm_head_buffers": head.saved + head.backward_transient}, "LM head backward"),
        Phase("training", {**persistent, "gradients": all_grads,
                           "activations": last_layer_saved + m.backward_working_bytes(arch, train, cal, tokens)},
              "backward through the first layer"),
    ]
    return max(moments, key=lambda p: p.total_bytes)


def _notes(arch: ModelArchitecture, train: TrainingConfig) -> tuple[str, ...]:
    notes = []
    if not arch.exact:
        notes.append(f"model_type {arch.model_type!r} is not one vram-plan knows; it was read as a Llama-style "
                     "decoder, so counts may be off")
    if arch.max_position_embeddings and train.sequence_length > arch.max_position_embeddings:
        notes.append(f"prompt + completion ({train.sequence_length} tokens) exceeds the model's "
                     f"max_position_embeddings ({arch.max_position_embeddings})")
    return tuple(notes)
