"""Which tensor of a GRPO step each live block of a memory snapshot is: by its size against the plan's tensors, in
the order a step makes them, and by the frames that made it where the run recorded them.

A snapshot's trace names no tensors. The plan does: every parameter's size (weights, then a reference copy), the
trainable ones' gradients (made in the first backward, kept until zero_grad) and optimizer states (made at the first
optimizer step, kept), the logits (a whole number of vocabulary rows), one layer's K or V for the generation batch (a
whole number of positions, grown a position at a time by DynamicCache's torch.cat). A block is taken for the first
of these its size matches, in the order the step makes them; what matches nothing is an activation once the step has
begun, and other (loading's temporaries, buffers) before.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

ROLES = ("weights", "gradients", "optimizer_states", "activations", "logits", "kv_cache", "other")
COUNTED = ("weights", "gradients", "optimizer_states")  # roles whose tensors the plan lists one by one
# Frames that say what a block is, whatever its size: (a part of "file:line in function", role)
FRAME_ROLES = (("cache_utils.py", "kv_cache"), ("/optim/", "optimizer_states"), ("bitsandbytes/optim", "optimizer_states"),
               ("modeling_utils.py", "weights"))


@dataclass(frozen=True)
class PlannedTensors:
    """The byte sizes of the plan's tensors, one entry per tensor."""

    weights: Counter  # every parameter as loaded (base and adapters), and a reference model's copy
    gradients: Counter  # the trainable parameters' gradients
    optimizer_states: Counter  # the optimizer's per-parameter states
    vocab_size: int
    weight_casts: frozenset  # a weight matrix cast to the compute dtype: divisible by the vocabulary, yet no logits
    kv_position_bytes: tuple  # one layer's K (or V) per position for the generation batch, in the dtypes it may have
    kv_positions: int  # the most positions a K or V tensor reaches
    num_layers: int


def planned_tensors(arch: Any, train: Any) -> PlannedTensors:
    """The plan's tensors for a single-GPU run (sharded runs' shards are not listed: their blocks count as other)."""
    from vram_planner.model.components import reference_weight_bytes, sizes

    s = sizes(train)
    base = _parameter_numels(arch)
    linear = {numel for numel, is_linear in base if is_linear}
    weights: Counter = Counter()
    for numel, is_linear in base:
        weights[(numel + 1) // 2 if train.load_in_4bit and is_linear else numel * s.weight] += 1
    trainable = ([n for lin in arch.lora_linears(train.lora_targets) for n in
                  (train.lora_r * lin.in_features, lin.out_features * train.lora_r)] * arch.num_layers
                 if train.uses_lora else [numel for numel, _ in base])
    if train.uses_lora:
        weights.update(n * s.trainable for n in trainable)
    if reference_weight_bytes(arch, train):
        weights.update({size: count for size, count in weights.items()})
    gradients = Counter(n * s.trainable for n in trainable)
    optimizer_states: Counter = Counter()
    for _ in range(_states_per_parameter(train)):
        optimizer_states.update(n * s.trainable for n in trainable)
    per_position = train.local_generation_batch_size * arch.num_kv_heads * arch.head_dim
    return PlannedTensors(weights, gradients, optimizer_states, arch.vocab_size,
                          frozenset(n * b for n in linear | {arch.vocab_size * arch.hidden_size} for b in (2, 4)),
                          tuple(sorted({per_position * s.compute, per_position * s.residual})),
                          train.sequence_length, arch.num_layers)


def _parameter_numels(arch: Any) -> list[tuple[int, bool]]:
    """Each parameter tensor's elements, and whether it is a decoder layer's linear weight (what 4-bit packs)."""
    f, h = arch.family, arch.hidden_size
    norm = [(h, False)] * (2 if f.layer_norm_bias else 1)
    layer = []
    for lin in arch.layer_linears():
        layer.append((lin.in_features * lin.out_features, True))
        if lin.bias:
            layer.append((lin.out_features, False))
    layer += norm * f.norms_per_layer + ([(arch.head_dim, False)] * 2 if f.qk_norm else [])
    head = [] if arch.tie_word_embeddings else [(arch.vocab_size * h, False)]
    head += [(arch.vocab_size, False)] if f.lm_head_bias else []
    return [(arch.vocab_size * h, False)] + layer * arch.num_layers + norm + head


def _states_per_parameter(train: Any) -> int:
    """Full-width states per trainable parameter (8-bit and factored states are not listed: they count as other)."""
    optim = train.optim.value
    if "8bit" in optim or optim in ("adafactor", "sgd"):
        return 0
    return 1 if optim in ("rmsprop", "adagrad", "lion_32bit") else 2


@dataclass
class Tagged:
    """The live blocks at a moment, each with its role, and what the step had reached."""

    live: dict[int, tuple[int, str]]  # address -> (requested bytes, role)
    stepping: bool  # the first step had begun (a logits or K/V block seen)
    last_role: str | None  # the role of the last block allocated before the moment
    by_frames: int = 0  # blocks whose role their frames gave
    alloc_sizes: Counter = field(default_factory=Counter)


def tag_blocks(events: list, stop: int, planned: PlannedTensors | None,
               frames: dict[int, tuple[str, ...]]) -> Tagged:
    """Replay the trace's allocs and frees before event `stop`, giving each block a role as it is made (a freed
    block gives its planned size back, so the next tensor of that size takes it)."""
    free_action = "free_completed" if any(e[0] == "free_completed" for e in events) else "free_requested"
    remaining = {role: Counter(getattr(planned, role)) for role in COUNTED} if planned else {}
    tagged = Tagged({}, stepping=planned is None, last_role=None)
    for index, (action, address, size, _) in enumerate(itertools.islice(events, stop)):
        if action == "alloc":
            if address in tagged.live:
                _give_back(remaining, *tagged.live.pop(address))
            role = _role(size, frames.get(index), planned, remaining, tagged)
            tagged.live[address] = (size, role)
            tagged.last_role = role
            tagged.alloc_sizes[size] += 1
        elif action == free_action and address in tagged.live:
            _give_back(remaining, *tagged.live.pop(address))
    if planned is not None:
        _find_kv_cache(tagged, planned)
    return tagged


def _give_back(remaining: dict[str, Counter], size: int, role: str) -> None:
    if role in remaining:
        remaining[role][size] += 1


def _role(size: int, frames: tuple[str, ...] | None, planned: PlannedTensors | None, remaining: dict[str, Counter],
          tagged: Tagged) -> str:
    by_frames = next((role for part, role in FRAME_ROLES for frame in frames or () if part in frame), None)
    if by_frames is not None:
        tagged.by_frames += 1
        if by_frames in remaining and remaining[by_frames][size] <= 0:
            return "other"  # the optimizer's or the loader's scratch, not one of their tensors
        if by_frames in remaining:
            remaining[by_frames][size] -= 1
        tagged.stepping = tagged.stepping or by_frames == "kv_cache"
        return by_frames
    if planned is None:
        return "other"
    for role in COUNTED if not tagged.stepping else COUNTED[1:]:
        if remaining[role][size] > 0:
            remaining[role][size] -= 1
            return role
    if size % planned.vocab_size == 0 and size >= 2 * planned.vocab_size and size not in planned.weight_casts:
        tagged.stepping = True
        return "logits"
    return "activations" if tagged.stepping else "other"


def _find_kv_cache(tagged: Tagged, planned: PlannedTensors) -> None:
    """Activations that are a layer's K and V: a whole number of positions for the generation batch, the same size
    in every layer (2 per layer live), and grown from one position less (made before at least as often)."""
    live_sizes = Counter(size for size, role in tagged.live.values() if role == "activations")
    layers = 2 * planned.num_layers
    kv_sizes = {size for size, count in live_sizes.items() if count >= layers and any(
        size % unit == 0 and 1 < size // unit <= planned.kv_positions and tagged.alloc_sizes[size - unit] >= layers
        for unit in planned.kv_position_bytes)}
    for address, (size, role) in tagged.live.items():
        if role == "activations" and size in kv_sizes:
            tagged.live[address] = (size, "kv_cache")
