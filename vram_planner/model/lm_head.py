"""Memory of the LM head and log-prob computation, which TRL releases do in different ways (profiles/trl.toml).

fused_chunked (TRL >= 1.15, trl/kernels/chunked_logprob.py): logits are projected in [4096, 32768] tiles and
never kept. Forward keeps per-token fp32 statistics; backward allocates an fp32 grad_hidden [N, h] and, when the
head is trainable, an fp32 grad_weight [V, h]. full_logits (older TRL): [B, c+1, V] logits in the compute dtype
plus accelerate's fp32 copy, or [B, p+c, V] where the transformers release drops the name TRL asks with
(`logit_positions`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.blocks import blocks
from vram_planner.model.components import FP32_BYTES, Sizes, sizes
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.trl_releases import TrlRelease

# Per-token fp32 statistics of the fused forward: running max, sum exp, x*exp sum, squared sum, z sum,
# max before target, target logit (ChunkedLogProbFunction.forward), each its own storage.
FUSED_FORWARD_STATS = 7
# After its tile loop, beside the statistics and the tile buffer (locals until it returns), per-token fp32 tensors
# at once: `log_z = running_max + torch.log(sum_exp)` (two: the log and the sum), then `logprobs = target_logit -
# log_z`, and with the entropy TRL asks the policy for (outputs=("log_probs", "entropy"), grpo_trainer.py 1.16:1072)
# `entropy = log_z - x_sum_exp / sum_exp` (four: log_z, logprobs, the quotient, the entropy)
FUSED_EPILOGUE_WITH_ENTROPY, FUSED_EPILOGUE = 4, 2
INT64_BYTES = 8
# Kept for backward per scored token: int64 target, fp32 log-normaliser and entropy, and the (N, 2) int64 positions
# `hidden_states[mask]` keeps for its index backward.
FUSED_SAVED_PER_TOKEN = 8 + 2 * FP32_BYTES + 2 * 8
# Rows of the flattened logits entropy_from_logits takes at a time (its chunk_size default, TRL 0.23-1.13)
ENTROPY_ROWS = 128


def _logit_bytes(train: TrainingConfig) -> tuple[float, float]:
    """Bytes per logit from accelerate's float32 copy on (the compute dtype without mixed precision), and while it
    copies (the model's output and the copy)."""
    s = sizes(train)
    if train.mixed_precision == "no":
        return s.compute, s.compute
    return FP32_BYTES, s.compute + FP32_BYTES


def full_logits_bytes(train: TrainingConfig, release: TrlRelease) -> tuple[float, float, float]:
    """Bytes per logit of the full-logits path: (forward transient, kept for backward, backward transient).

    The logits leave the model in the compute dtype; under mixed precision accelerate copies them to float32 (both
    exist while it does), without it they keep the compute dtype (`logit` bytes from there on). Then, per
    profiles/trl.toml full_logits_log_probs, counted by the trace on Llama-3.2-1B (benchmarks/trl_matrix.py):
    "scaled_copy" (0.16-0.29; 1.10-1.13 "beside_output") divides by the temperature into a second copy, kept by the per-sequence logsumexp for
    backward, whose backward holds three logit-sized gradients at once (the gather's, the logsumexp rows', their sum);
    "rows" (0.15) and "scaled_in_place" (1.0-1.9, `logits.div_`) do the same without the copy; "kernel" (1.14) keeps
    the logits themselves and makes one gradient. Without mixed precision the same tensors are in the logits' dtype.
    """
    logit, converting = _logit_bytes(train)
    kind = release.full_logits_log_probs
    if kind == "kernel":
        return converting, logit, logit
    if kind in ("scaled_copy", "scaled_copy_beside_output"):
        return max(converting, 2 * logit), logit, 3 * logit
    return converting, logit, 3 * logit  # "rows", "scaled_in_place": no copy before the per-sequence log-softmax


def _entropy_bytes(arch: ModelArchitecture, train: TrainingConfig, release: TrlRelease, sequences: int,
                   viewed: bool) -> float:
    """What the loss pass's entropy_from_logits adds at its widest (profiles/trl.toml training_entropy): a chunk's
    log_softmax, its exp and their product, in the logits' dtype; by flat rows, first the reshape's copy of logits
    that are a view of the model's output (`viewed`: the slice [:, :-1][:, -c:] of more than one sequence)."""
    logit = _logit_bytes(train)[0]
    c, vocab = train.max_completion_length, arch.vocab_size
    if release.training_entropy == "per_sequence":
        return 3 * c * vocab * logit
    if release.training_entropy == "flat_rows":
        rows = sequences * c
        copy = rows * vocab * logit if viewed and sequences > 1 else 0
        return copy + 3 * min(ENTROPY_ROWS, rows) * vocab * logit
    return 0


def _scaled_copy_memory(arch: ModelArchitecture, train: TrainingConfig, release: TrlRelease, sequences: int,
                        logits: float, inside: float) -> LmHeadMemory:
    """The loss pass of "scaled_copy" releases: `logits[:, :-1][:, -c:] / temperature` is a copy of the completion's
    c positions only (the model's c + 1, or all, are freed once it is made, but for 1.10-1.13, whose loop keeps the
    model's output): the logsumexp rows keep it, and backward holds three gradients of its size (the gather's, the
    rows', their sum). The entropies (0.20 on) are computed beside it. 16-bit logits (no mixed precision) take
    selective_log_softmax's other path (trl/trainer/utils.py): a log_softmax per sequence, whose outputs, their size
    in all, are made beside the copy and kept for backward in its stead; backward makes each sequence's gradient and
    stacks them, one more of that size (the trace of Qwen2.5-0.5B's LoRA without mixed precision under TRL 0.21,
    0.26 and 1.12 peaks in the forward, at the copy, the outputs and the entropies' chunk)."""
    logit = _logit_bytes(train)[0]
    scored = sequences * train.max_completion_length * arch.vocab_size
    per_sequence = logit < FP32_BYTES
    beside = logits * logit if release.full_logits_log_probs == "scaled_copy_beside_output" else 0
    scaling = logits * logit + scored * logit  # the output and its scaled copy
    kept = (2 if per_sequence else 1) * scored * logit  # the copy, and the per-sequence log_softmax outputs
    entropy = beside + kept + _entropy_bytes(arch, train, release, sequences, viewed=False)
    return LmHeadMemory(forward_transient=max(logits * inside, scaling, entropy), saved=scored * logit,
                        backward_transient=(1 if per_sequence else 3) * scored * logit, in_forward=logits * inside,
                        projecting=logits * (inside - (FP32_BYTES if train.mixed_precision != "no" else 0)))


@dataclass(frozen=True)
class LmHeadMemory:
    """Bytes of the LM head during one micro-batch."""

    forward_transient: float  # alive only while the forward runs (tiles, statistics)
    saved: float  # kept from forward to backward
    backward_transient: float  # alive during the LM head's backward
    # the part of forward_transient made before the model's forward returns (its output, accelerate's copy): what
    # meets the forward's own tensors, such as a KV cache its output holds (None: all of it)
    in_forward: float | None = None
    # what exists while the head projects, inside autocast (whose cached weight casts are alive until it exits):
    # the logits in the compute dtype, before accelerate's float32 copy (None: `inside_forward`)
    projecting: float | None = None

    @property
    def at_projection(self) -> float:
        return self.inside_forward if self.projecting is None else self.projecting

    @property
    def inside_forward(self) -> float:
        return self.forward_transient if self.in_forward is None else self.in_forward


def logit_positions(train: TrainingConfig, release: TrlRelease) -> int:
    """Positions per sequence the model's forward projects to logits where TRL materialises them: the completion's
    c + 1 when the transformers release honours the keyword this TRL release passes (profiles/transformers.toml
    logits_to_keep_names, profiles/trl.toml logits_to_keep_argument), else every position of prompt + completion
    (the keyword falls into **kwargs and the forward keeps its default of all positions)."""
    if train.transformers.honours(release.logits_to_keep_argument):
        return train.max_completion_length + 1
    return train.sequence_length


def backward_block_bytes(arch: ModelArchitecture, train: TrainingConfig, release: TrlRelease, sequences: int) -> float:
    """The largest single block the LM head's backward asks for where TRL makes the whole logits: one gradient of the
    logits (profiles/trl.toml full_logits_log_probs "kernel"), else of the completion's scored positions (the gather's,
    the logsumexp rows' and their sum are each that size), in the logits' dtype from accelerate's copy on."""
    positions = logit_positions(train, release) if release.full_logits_log_probs == "kernel" else (
        train.max_completion_length)
    return float(sequences * positions * arch.vocab_size * _logit_bytes(train)[0])


def drops_logits_to_keep(train: TrainingConfig, release: TrlRelease) -> bool:
    """Whether this TRL release's logits cover the whole sequence because transformers ignores its keyword."""
    return release.lm_head == "full_logits" and not uses_fused_head(train, release) and not (
        train.transformers.honours(release.logits_to_keep_argument))


def uses_fused_head(train: TrainingConfig, release: TrlRelease) -> bool:
    if train.use_liger_kernel and release.liger in ("fused_loss", "chunked_logprobs"):
        return True
    return release.lm_head == "fused_chunked"


def fused_tile_bytes(train: TrainingConfig, release: TrlRelease, sequences: int) -> float:
    """The fused head's logits tile for `sequences` sequences: up to lm_head_token_chunk scored tokens by a whole
    vocabulary chunk, whatever V is, in the head's compute dtype (0 where the head is not fused)."""
    if not uses_fused_head(train, release):
        return 0.0
    scored = sequences * train.max_completion_length
    return float(min(scored, release.lm_head_token_chunk) * release.lm_head_vocab_chunk
                 * _fused_head_sizes(train).compute)


def _fused_head_sizes(train: TrainingConfig) -> Sizes:
    """The byte widths the fused head works in. With cast_lm_head_to_fp32 TRL runs it outside autocast on float32
    hidden states (`hidden_states.float()`, trl/trainer/utils.py 1.16.0:1629-1631) and the head's float32 weight,
    so its tiles, its input and its weight gradient are float32 whatever the model's dtypes."""
    s = sizes(train)
    if not train.cast_lm_head_to_fp32:
        return s
    return Sizes(weight=FP32_BYTES, compute=FP32_BYTES, residual=FP32_BYTES, trainable=FP32_BYTES)


def lm_head_memory(arch: ModelArchitecture, train: TrainingConfig, release: TrlRelease,
                   sequences: int, with_grad: bool) -> LmHeadMemory:
    """LM head memory for `sequences` sequences; N (scored tokens) is sequences x c."""
    s = sizes(train)
    scored = sequences * train.max_completion_length
    h, vocab = arch.hidden_size, arch.vocab_size
    if not uses_fused_head(train, release):
        logits = sequences * logit_positions(train, release) * vocab
        forward, saved, backward = full_logits_bytes(train, release)
        inside = _logit_bytes(train)[1]  # the model's logits and accelerate's copy, made before its forward returns
        if with_grad and release.full_logits_log_probs in ("scaled_copy", "scaled_copy_beside_output"):
            return _scaled_copy_memory(arch, train, release, sequences, logits, inside)
        if not with_grad and train.local_generation_batch_size > sequences:
            # A scoring pass over several chunks (TRL 0.17 on) keeps the previous chunk's logits in its loop variable
            # until the next chunk's forward returns: they meet that chunk's logits and accelerate's copy of them
            # (1.10-1.13 keep the previous chunk's model output beside its scaled copy).
            kept = 2 * saved if release.full_logits_log_probs == "scaled_copy_beside_output" else saved
            inside = kept + _logit_bytes(train)[1]
            forward = max(forward, inside)
        # accelerate copies the output to float32 outside autocast (convert_outputs_to_fp32 wraps the autocast
        # forward), so the projection meets the casts and the copy does not
        projecting = inside - (FP32_BYTES if train.mixed_precision != "no" else 0)
        backward_bytes = logits * backward
        if with_grad:  # in place ("scaled_in_place"), the log-probs and the entropies read a view of the output
            forward = max(forward, saved + _entropy_bytes(arch, train, release, sequences, viewed=True) / logits)
            if release.full_logits_log_probs != "kernel":
                # the logsumexp rows' and the gather's gradients are the completion's c positions (the view's), not
                # the output's: the slice's backward makes the full-size gradient only after them
                backward_bytes = sequences * train.max_completion_length * vocab * backward
        return LmHeadMemory(forward_transient=logits * forward, saved=logits * saved if with_grad else 0,
                            backward_transient=backward_bytes if with_grad else 0, in_forward=logits * inside,
                            projecting=logits * projecting)
    chunk = release.lm_head_vocab_chunk
    tile_tokens = min(scored, release.lm_head_token_chunk)
    tile = fused_tile_bytes(train, release, sequences)
    backbone_output = sequences * train.sequence_length * h * s.residual  # referenced while the head runs
    head = _fused_head_sizes(train)
    # cast_lm_head_to_fp32's float32 copy of the backbone's output but its last position, alive to the forward's end
    upcast_output = sequences * (train.sequence_length - 1) * h * head.residual if head.residual != s.residual else 0
    casts_weight = head.weight != head.compute and not train.load_in_4bit
    weight_cast = min(vocab, chunk) * h * head.compute if casts_weight else 0
    hidden_cast = tile_tokens * h * head.compute if head.residual != head.compute else 0
    gathered_hidden = scored * h * head.residual  # hidden_states[mask] copies the scored positions
    # TRL's _fused_forward: the mask `labels != -100` (bool, one per position but the last) and `labels[mask]` (int64)
    selection = blocks(sequences * (train.sequence_length - 1)) + blocks(scored * INT64_BYTES)
    per_token = blocks(scored * FP32_BYTES)
    # the policy's pass asks for the entropy too: the loss's, and the old log-probs' where they are scored
    epilogue = (FUSED_EPILOGUE_WITH_ENTROPY if with_grad or train.computes_old_logps else FUSED_EPILOGUE) * per_token
    # a vocabulary chunk's weight cast lives through its projection, inside the loop; the epilogue after it
    forward = (backbone_output + upcast_output + gathered_hidden + selection + FUSED_FORWARD_STATS * per_token + tile
               + hidden_cast + max(weight_cast, epilogue))
    if not with_grad:
        return LmHeadMemory(forward_transient=forward, saved=0, backward_transient=0)
    grad_weight = vocab * h * FP32_BYTES if not train.uses_lora else 0
    grad_hidden = scored * h * FP32_BYTES  # accumulated in fp32 whatever the dtypes
    # Alive through the whole backward, return included (the loop's locals live until the function returns).
    base = grad_hidden + grad_weight + tile + hidden_cast + scored * FP32_BYTES
    last_chunk = vocab - chunk * ((vocab - 1) // chunk)
    # In the vocabulary loop the next chunk's weight cast is made while the previous one is still referenced; on
    # return both fp32 gradients are cast to their tensors' dtypes while the fp32 ones still exist.
    two_weight_casts = min(vocab, 2 * chunk) * h * head.compute if casts_weight else 0
    at_return = ((last_chunk * h * head.compute if casts_weight else 0)
                 + (scored * h * head.residual if head.residual != FP32_BYTES else 0)
                 + (vocab * h * head.trainable if grad_weight and head.trainable != FP32_BYTES else 0))
    return LmHeadMemory(forward_transient=forward, saved=gathered_hidden + scored * FUSED_SAVED_PER_TOKEN,
                        backward_transient=base + max(two_weight_casts, at_return))
