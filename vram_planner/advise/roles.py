"""Which tensor of a GRPO step each live block of a memory snapshot is: by its size against the plan's tensors, in
the order a step makes them, and by the frames that made it where the run recorded them.

A snapshot's trace names no tensors. The plan does: every parameter's size (weights, then a reference copy), the
trainable ones' gradients (made in the first backward, kept until zero_grad) and optimizer states (made at the first
optimizer step, kept), the logits (a whole number of vocabulary rows), one layer's K or V for the generation batch (a
whole number of positions, grown a position at a time by DynamicCache's torch.cat). Until every weight is loaded a
block is a weight or other (loading's temporaries, buffers); then the first of the others its size matches, in the
order the step makes them, else an activation.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# A decoding step's events per layer (its projections, attention, MLP and the K/V concatenation, each an alloc and
# frees): the K/V one position shorter were made within this many events per layer before the longer ones.
KV_STEP_EVENTS = 200
# An optimizer's own scalars (Adam's step count per parameter on the device, fused or capturable): a few bytes each
OPTIMIZER_SCALAR_BYTES = 512
ROLES = ("weights", "gradients", "optimizer_states", "activations", "logits", "kv_cache", "other")
COUNTED = ("weights", "gradients", "optimizer_states")  # roles whose tensors the plan lists one by one
# Frames that say what a block is, whatever its size: (a part of "file:line in function", role)
FRAME_ROLES = (("cache_utils.py", "kv_cache"), ("/optim/", "optimizer_states"),
               ("bitsandbytes/optim", "optimizer_states"), ("modeling_utils.py", "weights"))


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
    logit_positions: int = 0  # the most positions per sequence the logits span (0: any)
    logit_batches: tuple = ()  # the sequences a logits tensor may hold rows for: one, a micro-batch, a generation batch


def planned_tensors(arch: Any, train: Any, release: Any = None) -> PlannedTensors:
    """The plan's tensors for a single-GPU run (sharded runs' shards are not listed: their blocks count as other);
    with the TRL `release`, the positions its logits span."""
    from vram_planner.model.components import reference_weight_bytes, sizes
    from vram_planner.model.lm_head import logit_positions

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
                          train.sequence_length, arch.num_layers,
                          logit_positions(train, release) if release is not None else train.sequence_length,
                          (1, train.micro_batch_completions, train.local_generation_batch_size))


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
    return 0 if train.optim.is_8bit else train.optim.state_tensors


@dataclass
class Tagged:
    """The live blocks at a moment, each with its role, and what the step had reached."""

    live: dict[int, tuple[int, str]]  # address -> (requested bytes, role)
    stepping: bool  # the first step had begun: every planned weight loaded, or a logits or K/V block seen
    last_role: str | None  # the role of the last block allocated before the moment
    by_frames: int = 0  # blocks whose role their frames gave
    made_at: dict[int, int] = field(default_factory=dict)  # address -> the event that allocated its live block
    allocs_of: dict[int, list[int]] = field(default_factory=dict)  # size -> the events that allocated it, in order


def tag_blocks(events: list, stop: int, planned: PlannedTensors | None,
               frames: dict[int, tuple[str, ...]], before: dict[int, int] | None = None) -> Tagged:
    """Replay the trace's allocs and frees before event `stop`, giving each block a role as it is made (a freed
    block gives its planned size back, so the next tensor of that size takes it). The blocks made `before` the
    recorded history (address -> requested bytes) are given theirs first."""
    from vram_planner.allocator.snapshot import free_action

    freed = free_action(events)
    remaining = {role: Counter(getattr(planned, role)) for role in COUNTED} if planned else {}
    tagged = Tagged({}, stepping=planned is None, last_role=None)
    _tag_before_history(tagged, before or {}, planned, remaining)
    for index, (action, address, size, _) in enumerate(itertools.islice(events, stop)):
        if action == "alloc":
            if address in tagged.live:
                _give_back(remaining, *tagged.live.pop(address))
            role = _role(size, frames.get(index), planned, remaining, tagged)
            tagged.live[address] = (size, role)
            tagged.last_role = role
            tagged.made_at[address] = index
            tagged.allocs_of.setdefault(size, []).append(index)
        elif action == freed and address in tagged.live:
            _give_back(remaining, *tagged.live.pop(address))
    if planned is not None:
        _find_kv_cache(tagged, planned)
        _find_accumulated_gradients(tagged, planned, events, stop)
    return tagged


def _find_accumulated_gradients(tagged: Tagged, planned: PlannedTensors, events: list, stop: int) -> None:
    """Blocks taken for optimizer states because every gradient was already live: a later micro-batch's gradient,
    made apart and then added into .grad (gradient accumulation), when fewer than all the states are live and the
    step went on making tensors no optimizer makes (neither a parameter's size nor a scalar like Adam's step) after
    the first of them."""
    states = [tagged.made_at[a] for a, (_, role) in tagged.live.items() if role == "optimizer_states"]
    if not states or len(states) >= sum(planned.optimizer_states.values()):  # none, or a finished optimizer step's
        return
    sizes = set(planned.weights) | set(planned.gradients) | set(planned.optimizer_states)
    if all(size in sizes or size <= OPTIMIZER_SCALAR_BYTES for action, _, size, _ in
           itertools.islice(events, min(states) + 1, stop) if action == "alloc"):
        return
    for address, (size, role) in tagged.live.items():
        if role == "optimizer_states":
            tagged.live[address] = (size, "gradients")


def _tag_before_history(tagged: Tagged, before: dict[int, int], planned: PlannedTensors | None,
                        remaining: dict[str, Counter]) -> None:
    """The blocks made before the history, in the order a run makes the plan's tensors whatever order they were
    made in: the weights, then the gradients and the optimizer's states; a logits-sized block is logits, any other
    is other (nothing says which activation or buffer it was)."""
    roles: dict[int, str] = {}
    for role in COUNTED if planned else ():
        if role != "weights" and not tagged.stepping:
            break  # a step's tensors only once every weight is loaded
        for address, size in sorted(before.items()):
            if address not in roles and remaining[role][size] > 0:
                remaining[role][size] -= 1
                roles[address] = role
        tagged.stepping = tagged.stepping or not +remaining["weights"]
    for address, size in before.items():
        role = roles.get(address) or ("logits" if planned is not None and tagged.stepping
                                      and _logits_sized(size, planned) else "other")
        tagged.live[address] = (size, role)
        tagged.made_at[address] = -1


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
    for role in COUNTED[1:] if tagged.stepping else COUNTED[:1]:
        if remaining[role][size] > 0:
            remaining[role][size] -= 1
            tagged.stepping = tagged.stepping or (role == "weights" and not +remaining["weights"])
            return role
    if _logits_sized(size, planned):
        tagged.stepping = True
        return "logits"
    return "activations" if tagged.stepping else "other"


def _logits_sized(size: int, planned: PlannedTensors) -> bool:
    """A whole number of vocabulary rows (bf16 or float32), as many as sequences times positions the logits may span:
    an MLP-wide activation can be a whole number of rows too (SmolLM2's vocabulary is 32 MLP widths), of positions
    the logits never span."""
    if size % planned.vocab_size or size < 2 * planned.vocab_size or size in planned.weight_casts:
        return False
    return not planned.logit_batches or any(
        size % (planned.vocab_size * element) == 0 and any(
            rows % batch == 0 and rows // batch <= planned.logit_positions for batch in planned.logit_batches)
        for element in (2, 4) for rows in [size // (planned.vocab_size * element)])


def _find_kv_cache(tagged: Tagged, planned: PlannedTensors) -> None:
    """Blocks that are a layer's K and V: a whole number of positions for the generation batch, grown from one
    position less (made before once per layer's K and V), and a K and V for every layer live (some layers a
    position ahead of the others mid-step). A K/V the size of a LoRA adapter's gradient or state was taken for one
    as it was made, or one a whole number of vocabulary rows for logits: the growth says otherwise."""
    taken = ("activations", "gradients", "optimizer_states", "logits")
    window = KV_STEP_EVENTS * planned.num_layers
    grown = [address for address, (size, role) in tagged.live.items() if role in taken and any(
        size % unit == 0 and 1 < size // unit <= planned.kv_positions
        and _made_within(tagged.allocs_of.get(size - unit, []), tagged.made_at[address], window)
        for unit in planned.kv_position_bytes)]
    if len(grown) < 2 * planned.num_layers:
        return
    for address in grown:
        tagged.live[address] = (tagged.live[address][0], "kv_cache")


def _made_within(indices: list[int], index: int, window: int) -> bool:
    """Whether one of the sorted event indices lies in the `window` events before `index`."""
    at = bisect.bisect_left(indices, index)
    return at > 0 and indices[at - 1] >= index - window
