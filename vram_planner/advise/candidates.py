"""The tensors of a step that could have asked for an OOM's failed allocation, each to the byte, and the match.

PyTorch prints the failed request rounded to two decimals of its unit ("1.90 GiB" is anything from 1.895 up to 1.905
GiB), so a tensor of the planned step is the request when its size rounds to the same figure; a match within
MATCH_TOLERANCE is accepted and its error printed. When none matches, the size of a tensor whose bytes grow with the
positions of the sequence (the logits) is solved for the positions that make it exact, and that is said as the
assumption that would make it so: a longer or shorter sequence, a transformers release that drops the keyword TRL asks
for the completion's logits with.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import Any

from vram_planner.allocator.conf import parse_allocator_conf
from vram_planner.allocator.sizes import K_LARGE_BUFFER, K_MIN_LARGE_ALLOC, allocation_size, round_size
from vram_planner.units import GiB, MiB

# A candidate within this share of the request is accepted; beyond it the sizes disagree and it is no answer.
MATCH_TOLERANCE = 0.03
KiB = 2**10


@dataclass(frozen=True)
class Candidate:
    """A tensor of the planned step and when it is allocated."""

    name: str
    size: int  # bytes
    phase: str  # as the phases name themselves: generation, scoring, training, optimizer
    moment: str = ""  # the model's moment (vram_planner.model.phases) at which it is allocated, where it has one
    per_position: int = 0  # bytes per position of the sequence, for a tensor that spans positions (the logits)
    positions: int = 0  # positions per sequence it spans as planned
    fewer_than_logits: int = 0  # positions it spans fewer than the logits (a log_softmax row drops the last)
    whole_sequence: bool = False  # it spans prompt + completion whatever the release (a decoder layer's activation)
    shape: str = ""  # its shape in words, "{n}" standing for its positions

    def described(self) -> str:
        return f"{self.name}: {self.shape.format(n=self.positions)}" if self.shape else self.name


@dataclass(frozen=True)
class Match:
    candidate: Candidate
    error: float  # size / request - 1
    exact: bool  # the size is the request: its segment rounds to the figure the message printed, or a snapshot's bytes
    assumption: str = ""  # what had to differ from the planned config for it to match ("" where nothing did)
    positions: int = 0  # the positions of prompt + completion the logits span for it to be exact, where they differ


def rounding_bytes(request: int) -> float:
    """Half the rounding step of PyTorch's format_size for this figure: two decimals of bytes, KiB, MiB or GiB."""
    unit = 1 if request < KiB else KiB if request < MiB else MiB if request < GiB else GiB
    return 0.005 * unit


def printed_bytes(size: int) -> int:
    """The bytes an out-of-memory message says it tried to allocate for a tensor of `size` bytes: the segment the
    allocator asked CUDA for (CUDACachingAllocator.cpp formats alloc_size: 2 MiB up to 1 MiB, 20 MiB up to 10 MiB,
    else the size rounded up to 2 MiB)."""
    return allocation_size(round_size(size, parse_allocator_conf("").roundup_power2_divisions), K_LARGE_BUFFER)


def _judged(size: int, request: int, exact_request: bool) -> tuple[float, bool]:
    if exact_request:  # a snapshot's own bytes
        return size / request - 1, size == request
    return size / request - 1, abs(printed_bytes(size) - request) <= rounding_bytes(request)


def best_match(candidates: list[Candidate], request: int, exact_request: bool = False) -> Match | None:
    """The candidate nearest the request when it is within MATCH_TOLERANCE, exact ones first; `exact_request` where
    the request is the tensor's own bytes (a snapshot's), not a message's rounded figure."""
    judged = [(c, *_judged(c.size, request, exact_request)) for c in candidates if c.size > 0]
    near = [(c, err, exact) for c, err, exact in judged if abs(err) <= MATCH_TOLERANCE]
    if not near:
        return None
    c, err, exact = min(near, key=lambda item: (not item[2], abs(item[1])))
    return Match(c, err, exact)


def positions_for(candidate: Candidate, request: int, exact_request: bool = False) -> int | None:
    """The whole number of positions per sequence at which a per-position tensor is the request (the middle of
    those the message's figure allows), or None."""
    if candidate.per_position <= 0:
        return None
    low, high = positions_range(candidate, request, exact_request)
    return (low + high) // 2 if 1 <= low <= high else None


def positions_range(candidate: Candidate, request: int, exact_request: bool = False) -> tuple[int, int]:
    """The least and most positions at which the tensor is the request: exactly its bytes, or printed as the
    message's figure (empty where low > high). A message solves only tensors of 10 MiB and more, whose figure grows
    with them (2 MiB steps); below, every tensor prints as 2 or 20 MiB."""
    per = candidate.per_position
    if exact_request:
        return (request // per, request // per) if request % per == 0 else (1, 0)
    half = rounding_bytes(request)
    first = -(-K_MIN_LARGE_ALLOC // per)  # the fewest positions that make 10 MiB
    most = max(int(request + half) // per + 1, first)
    ns = range(first, most + 1)
    low = first + bisect.bisect_left(ns, request - half, key=lambda n: printed_bytes(n * per))
    high = first + bisect.bisect_right(ns, request + half, key=lambda n: printed_bytes(n * per)) - 1
    return low, high


def logits_candidates(arch: Any, train: Any, release: Any) -> list[Candidate]:
    """The logits a release without the fused head makes for one micro-batch: the model's own (compute dtype) and,
    under mixed precision, accelerate's float32 copy of them (convert_outputs_to_fp32), allocated as the forward
    returns; TRL 0.14 then takes a float32 log_softmax of every row."""
    from vram_planner.model.components import sizes
    from vram_planner.model.lm_head import logit_positions
    from vram_planner.model.phases import POLICY_LOGITS_MOMENT

    b, vocab = train.micro_batch_completions, arch.vocab_size
    positions = logit_positions(train, release)
    merged = release.step_structure == "loss_merged"
    moment = POLICY_LOGITS_MOMENT if merged else "forward: LM head"
    span = ("the whole prompt + completion" if positions == train.sequence_length and positions !=
            train.max_completion_length + 1 else "the completion")
    compute = sizes(train).compute
    def shape(per: int) -> str:
        return f"{b} completion{'s' * (b != 1)} x {{n}} positions x {vocab} vocabulary entries x {per} B"

    out = []
    if train.mixed_precision != "no" or compute == 4:
        out.append(Candidate(f"accelerate's float32 copy of the policy's logits over {span}",
                             b * positions * vocab * 4, "training", moment, b * vocab * 4, positions, shape=shape(4)))
    if compute != 4:
        out.append(Candidate(f"the policy's {'bf16' if compute == 2 else 'compute-dtype'} logits over {span}",
                             b * positions * vocab * compute, "training", moment, b * vocab * compute, positions,
                             shape=shape(compute)))
    if train.mixed_precision == "no" and compute != 4:
        # a float32 request the size of the logits says the run had mixed precision on
        out.append(Candidate(f"accelerate's float32 copy of the policy's logits over {span}, which exists only under "
                             "mixed precision (so the run most likely had bf16=True)",
                             b * positions * vocab * 4, "training", moment, b * vocab * 4, positions, shape=shape(4)))
    if merged:
        logit = 4 if train.mixed_precision != "no" else compute
        out.append(Candidate(f"one completion's log_softmax (TRL {release.version} takes one per row)",
                             (positions - 1) * vocab * logit, "training",
                             "policy log-probs: the logits and every row's log_softmax", vocab * logit, positions - 1,
                             fewer_than_logits=1, shape=f"1 row x {{n}} positions x {vocab} vocabulary entries x "
                                                        f"{logit} B"))
    return out


def other_candidates(arch: Any, train: Any, release: Any) -> list[Candidate]:
    """Tensors whose size does not follow the positions the logits span."""
    from vram_planner.model.components import sizes

    s = sizes(train)
    b, v, h = train.micro_batch_completions, arch.vocab_size, arch.hidden_size
    out = [
        Candidate("the LM head's fp32 weight gradient (V x h)", v * h * 4, "training"),
        Candidate("one fp32 Adam state of the embedding (created at the first optimizer step)", v * h * 4, "optimizer"),
        Candidate("the KV cache of one layer for the generation batch",
                  train.local_generation_batch_size * train.sequence_length * arch.num_kv_heads * arch.head_dim * 2
                  * s.residual, "generation"),
        _mlp_activation(arch, train, s.compute),
    ]
    if release.lm_head == "fused_chunked":
        out.insert(0, Candidate("a logits tile of the fused LM head",
                                min(b * train.max_completion_length, release.lm_head_token_chunk)
                                * release.lm_head_vocab_chunk * s.compute, "training"))
    if train.distributed == "ddp":
        out.append(Candidate("a DDP gradient bucket (25 MiB by default)", 25 * MiB, "training"))
    return out


def _mlp_activation(arch: Any, train: Any, compute: int) -> Candidate:
    """One decoder layer's MLP-wide tensor for the micro-batch (the gate or up projection, or their product): made
    in the training forward, and again in the backward where gradient checkpointing recomputes the layer."""
    b, width = train.micro_batch_completions, arch.intermediate_size
    when = "; gradient checkpointing makes it again in the backward" if train.gradient_checkpointing else ""
    return Candidate(f"an MLP activation of one layer (its gate or up projection{when})",
                     b * train.sequence_length * width * compute, "training", per_position=b * width * compute,
                     positions=train.sequence_length, whole_sequence=True,
                     shape=f"{b} sequence{'s' * (b != 1)} x {{n}} positions x {width} x {compute} B")


def explain_positions(candidate: Candidate, request: int, train: Any, release: Any,
                      exact_request: bool = False) -> Match | None:
    """A per-position candidate made exact by another number of positions: what that takes, in words."""
    n = positions_for(candidate, request, exact_request)
    if n is None or n == candidate.positions:
        return None
    from vram_planner.model.transformers_releases import transformers_releases
    from vram_planner.model.trl_releases import version_tuple

    low, high = positions_range(candidate, request, exact_request)
    c, p, length = train.max_completion_length, train.max_prompt_length, train.sequence_length
    total = n + candidate.fewer_than_logits  # the positions of prompt + completion the logits then span
    off = candidate.fewer_than_logits
    allowed = f"{low + off}-{high + off}" if low != high else str(low + off)
    if candidate.whole_sequence:  # every position of prompt + completion passes the layers, whatever the release
        what = (f"sequences of {n} positions: " + (f"a {n - c}-token prompt with {c}-token completions"
                                                   if n > c else "completions that ended early")
                + (f", or {p} + {n - p}" if n - p >= 1 and n - c != p else "")
                + f" (the plan assumed {length} = {p} + {c})")
    elif total <= c + 1:
        what = (f"completions of {total - 1} tokens, not {c} (every completion ended early), the logits over the "
                "completion only")
        if not train.transformers.honours(release.logits_to_keep_argument):
            honouring = sorted({r.min_version for r in transformers_releases()
                                if r.honours(release.logits_to_keep_argument)}, key=version_tuple)
            what += f" (a transformers release that honours {release.logits_to_keep_argument}, {honouring[0]} on)"
    else:
        prompt = total - c
        dropping = [r for r in transformers_releases() if not r.honours(release.logits_to_keep_argument)
                    and version_tuple(r.min_version)[0] == version_tuple(train.transformers.version)[0]
                    and any(version_tuple(o.min_version) < version_tuple(r.min_version) and
                            o.honours(release.logits_to_keep_argument) for o in transformers_releases())]
        since = min((r.min_version for r in dropping), key=version_tuple, default=None)
        where = (f"transformers {train.transformers.version} ignores" if not train.transformers.honours(
            release.logits_to_keep_argument) else f"a transformers release that ignores (from {since})"
            if since else "a transformers release that ignores")
        what = (f"the logits over the whole prompt + completion, {total} positions ({where} the "
                f"{release.logits_to_keep_argument} TRL {release.version} passes): a {prompt}-token prompt with "
                f"{c}-token completions" + (f", or {p} + {total - p}" if prompt != p and total - p >= 1 else "")
                + f" (the plan assumed {length} = {p} + {c})")
    figure = "the snapshot's request" if exact_request else "the message's figure"
    assumption = f"exact with {what}; {figure} allows {allowed} positions"
    exact = replace(candidate, size=n * candidate.per_position, positions=n)
    return Match(exact, exact.size / request - 1, True, assumption, total)
