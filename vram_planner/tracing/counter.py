"""Live tensor bytes by component: a dispatch mode that sees every allocation and free of a fake-tensor run.

CUDA-free: it counts storages as torch.cuda.memory_allocated would (512-byte blocks), and answers the questions fake
tensors cannot (values read on the host, sizes of boolean selections) with assumptions it records for the notes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vram_planner.tracing.cache_growth import growth_requests
from vram_planner.tracing.events import ALLOC, FREE, LOADING, OPTIMIZER, Event

aten = torch.ops.aten
# The CUDA caching allocator rounds every block up to 512 bytes (kMinBlockSize in c10/cuda/CUDACachingAllocator.cpp);
# torch.cuda.memory_allocated counts the rounded sizes.
CUDA_BLOCK_BYTES = 512
# Component tags, as vram_planner.model.phases names them. Optimizer-step temporaries count as activations there.
WEIGHTS, REFERENCE, GRADS, STATES = "weights", "reference_weights", "gradients", "optimizer_states"
KV, ACTS, HEAD = "kv_cache", "activations", "lm_head_buffers"
STEP = "optimizer_step"  # everything the optimizer step allocates, split into states and temporaries afterwards
LAYER_OF_NODE = "vram_planner_layer"  # an autograd node's metadata key: the decoder layer whose forward made it
_TRACING_DIR = os.path.dirname(os.path.abspath(__file__))


def _storage(t: Any) -> Any:
    """The untyped storage behind a strided tensor (a DTensor's: its local shard's), or None."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
        return None  # a meta tensor holds no memory on any device (DeepSpeed's ZeRO-1/2 keep one per parameter)
    t = getattr(t, "_local_tensor", t)  # FSDP2's sharded parameters, gradients and optimizer states are DTensors
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _same_layout_operands(args: Any, kwargs: dict[str, Any]) -> bool:
    a, b = (args + (None, None))[:2]
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.is_contiguous() and kwargs.get("alpha", 1) == 1 and len(args) == 2)


def _rounded(n_bytes: int) -> int:
    return -(-n_bytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


class PhaseState:
    """What the phases tell a meter as they run: the component being allocated, the moment, the run's shape."""

    def __init__(self) -> None:
        self.tag = ACTS
        self.phase = LOADING  # the step's phase running now (vram_planner.tracing.events names them)
        self.moment = ""
        # The decoder layer whose forward runs now (patches.layer_marking), -1 outside one; a backward op takes its
        # layer from the autograd node running it, which the forward marked (LAYER_OF_NODE in its metadata).
        self.layer = -1
        self.peak_moment = ""
        self.peak_split: dict[str, int] = {}
        self.selected_tokens: tuple[int, int] | None = None  # (mask elements, selected elements) of a boolean index
        self.assumptions: Counter[tuple[str, str]] = Counter()  # (what was assumed, file:line)
        self.in_backward = False
        self.assumed_number = 0

    @contextlib.contextmanager
    def tagged(self, tag: str, moment: str | None = None) -> Iterator[None]:
        saved = self.tag, self.moment
        self.tag, self.moment = tag, moment or self.moment
        try:
            yield
        finally:
            self.tag, self.moment = saved

    @contextlib.contextmanager
    def backward(self, moment: str) -> Iterator[None]:
        """A backward pass: tagged as the LM head's buffers at `moment`, with autograd's gradient sums counted as
        CUDA makes them in place (`in_backward`)."""
        with self.tagged(HEAD, moment):
            self.in_backward = True
            try:
                yield
            finally:
                self.in_backward = False


class LiveBytes(PhaseState, TorchDispatchMode):
    """Counts the bytes of every live tensor storage by component tag, and the peak of their sum.

    Entered inside a FakeTensorMode, it sees each op with fake inputs and fake outputs: a new storage is an
    allocation, tagged with `self.tag`; a weakref callback on the storage is its free. Each allocation and free is
    also an `Event` in `events`, in order, for the allocator model. It also answers the questions fake tensors
    cannot (a value read on the host, the size of a boolean selection) with assumptions it records.
    """

    def __init__(self) -> None:
        PhaseState.__init__(self)
        TorchDispatchMode.__init__(self)
        # id(storage) -> [raw bytes, rounded bytes, tag, weakref, block (the id its events carry), the block's bytes,
        # the decoder layer its allocation belongs to]
        self._live: dict[int, list[Any]] = {}
        self.by_tag: Counter[str] = Counter()
        self.total = 0
        self.peak = 0
        self.events: list[Event] = []
        self._blocks = 0
        self._peak_check_pending = False
        self._sum: tuple[list[Any], set[int]] | None = None  # a gradient sum's output record and its operands
        self._script: Script | None = None  # what a call being recorded does (`recording`)

    def _event(self, kind: str, block: int, raw: int, layer: int | None = None) -> None:
        if raw:  # the CUDA allocator never sees an empty storage (no block, a null pointer)
            layer = self._layer_now() if layer is None else layer
            self.events.append(Event(kind, block, raw, self.phase, self.moment, layer))

    def _layer_now(self) -> int:
        if self.layer >= 0:
            return self.layer
        node = torch._C._current_autograd_node()
        return -1 if node is None else node.metadata.get(LAYER_OF_NODE, -1)

    def _unrepeatable(self) -> None:
        """What runs now rewrites what was counted before it: a call being recorded cannot be replayed."""
        if self._script is not None:
            self._script.broken = True

    def _new_block(self, raw: int, layer: int | None = None) -> int:
        self._blocks += 1
        self._event(ALLOC, self._blocks, raw, layer)
        return self._blocks

    def live_blocks(self, tag: str) -> list[tuple[int, int]]:
        """(block, bytes) of the live storages tagged `tag`, as their events name them."""
        return [(record[4], record[5]) for record in self._live.values() if record[2] == tag]

    def block_of(self, t: Any) -> tuple[int, int]:
        """(block, bytes) of the storage behind `t` in the events."""
        record = self._live[id(t.untyped_storage())]
        return record[4], record[5]

    @contextlib.contextmanager
    def unrecorded(self, replaced: list[tuple[int, int]]) -> Iterator[None]:
        """Count what runs inside without recording its events, which the caller records itself (`record_growth`):
        only frees of blocks made before it stay, but those of the `replaced` blocks."""
        self._unrepeatable()
        start = len(self.events)
        try:
            yield
        finally:
            window = self.events[start:]
            dropped = {e.block for e in window if e.kind == ALLOC} | {block for block, _ in replaced}
            self.events[start:] = [e for e in window if e.block not in dropped]

    @contextlib.contextmanager
    def transients_unrecorded(self) -> Iterator[None]:
        """Count what runs inside without the events of the blocks it both makes and frees; what it leaves alive
        keeps its allocation (for what an earlier step ran, which the events' step starts after)."""
        self._unrepeatable()
        start = len(self.events)
        try:
            yield
        finally:
            window = self.events[start:]
            made = {e.block for e in window if e.kind == ALLOC}
            gone = made & {e.block for e in window if e.kind == FREE}
            self.events[start:] = [e for e in window if e.block not in gone]

    def record_growth(self, tensors: list[Any], before: list[tuple[int, int]],
                      steps: list[list[tuple[int, ...]]], layers: list[int]) -> None:
        """Events of storages that a real run makes anew at every step (a KV cache growing by concatenation) where
        the trace grew them in fewer steps, `unrecorded`.

        Args:
            tensors: the tensors after the growth; their storages' frees, later, free the last blocks.
            before: (block, bytes) of each one's storage before the growth.
            steps: per step, the bytes of each one's new storage, in groups made together: a group's new blocks are
                allocated, then the blocks they replace are freed.
            layers: the decoder layer of each one's cache.
        """
        self._unrepeatable()
        current, made, outside = list(before), list(before), self.layer
        for allocated, i, size in growth_requests(steps):
            self.layer = layers[i]
            if allocated:
                made[i] = (self._new_block(size), size)
            else:
                self._event(FREE, *current[i])
                current[i] = made[i]
        self.layer = outside
        for t, (block, size) in zip(tensors, current, strict=True):
            record = self._live.get(id(t.untyped_storage()))
            if record is not None:
                record[4], record[5] = block, size

    # Bookkeeping
    def track(self, t: Any, tag: str | None = None) -> None:
        """Count `t`'s storage (once) under `tag`, or retag it if it is already counted."""
        self.track_storage(_storage(t), tag)

    def track_storage(self, st: Any, tag: str | None = None) -> None:
        """`track` for a storage itself: FSDP2 frees and refills its gathered parameters by resizing their storages
        (`UntypedStorage.resize_`, which no dispatch mode sees), so the resize is counted here."""
        if st is None:
            return
        key = id(st)
        record = self._live.get(key)
        if record is None:
            raw = st.nbytes()
            ref = weakref.ref(st, self._freed_callback(key))
            layer = self._layer_now()
            record = self._live[key] = [raw, _rounded(raw), tag or self.tag, ref, self._new_block(raw, layer), raw,
                                        layer]
            self.by_tag[record[2]] += record[1]
            self.total += record[1]
            if self._script is not None:
                self._script.steps.append((ALLOC, record[4], raw, record[2], self.phase, self.moment, layer))
            return
        if st.nbytes() != record[0]:  # resized in place (resize_, set_): CUDA allocates anew, copies, frees
            self._unrepeatable()
            block = self._new_block(st.nbytes())
            self._event(FREE, record[4], record[5])
            record[4], record[5] = block, st.nbytes()
            grown = _rounded(st.nbytes()) - record[1]
            record[0], record[1] = st.nbytes(), record[1] + grown
            self.by_tag[record[2]] += grown
            self.total += grown
        if tag is not None and tag != record[2]:
            self._unrepeatable()
            self.by_tag[record[2]] -= record[1]
            self.by_tag[tag] += record[1]
            record[2] = tag

    def _freed_callback(self, key: int) -> Callable[[Any], None]:
        def freed(ref: Any) -> None:
            record = self._live.get(key)
            if record is not None and record[3] is ref:
                del self._live[key]
                self.by_tag[record[2]] -= record[1]
                self.total -= record[1]
                if not self._summed_in_place(key, record):
                    layer = self._layer_now()
                    self._event(FREE, record[4], record[5], layer)
                    if self._script is not None:
                        self._script.steps.append((FREE, record[4], record[5], record[2], self.phase, self.moment,
                                                   layer))
        return freed

    def _summed_in_place(self, key: int, freed: list[Any]) -> bool:
        """Whether this free ends a gradient sum that autograd does in place on a real run (see __torch_dispatch__):
        then the sum never had a block of its own, it is the freed operand's block."""
        if self._sum is None or key not in self._sum[1]:
            return False
        out, self._sum = self._sum[0], None
        last = self.events[-1] if self.events else None
        if out[5] != freed[5] or last is None or last.kind != ALLOC or last.block != out[4]:
            return False
        self.events.pop()
        out[4] = freed[4]
        self._unrepeatable()
        return True

    def forget(self, tensors: list[Any]) -> int:
        """Stop counting the storages behind `tensors`, as if they had never been on the device (their allocations
        leave the events too); returns their counted bytes."""
        self._unrepeatable()
        dropped, blocks = 0, set()
        for key in {id(st) for st in map(_storage, tensors) if st is not None}:
            record = self._live.pop(key, None)
            if record is None:
                continue
            self.by_tag[record[2]] -= record[1]
            self.total -= record[1]
            dropped += record[1]
            blocks.add(record[4])
        self.events = [e for e in self.events if e.block not in blocks]
        return dropped

    def bytes_of(self, tensors: list[Any], tag: str | None = None) -> int:
        """Counted bytes of the distinct storages behind `tensors` (those counted under `tag` only, when given)."""
        keys = {id(st) for st in map(_storage, tensors) if st is not None}
        return sum(self._live[k][1] for k in keys if k in self._live and tag in (None, self._live[k][2]))

    def reset_peak(self) -> None:
        self._unrepeatable()
        self.peak, self.peak_split, self.peak_moment = self.total, dict(self.by_tag), self.moment

    def _note_peak(self) -> None:
        if self._script is not None and self._script.steps and self._script.steps[-1][0] != PEAK:
            self._script.steps.append((PEAK, self.moment))
        if self.total > self.peak:
            self.peak, self.peak_split, self.peak_moment = self.total, dict(self.by_tag), self.moment

    # Repeated calls (vram_planner.tracing.repeats)
    @contextlib.contextmanager
    def recording(self) -> Iterator[Script]:
        """What runs inside, step by step as this counter saw it: each storage made and freed (with its block, bytes,
        tag, phase and moment) and each time the peak was looked at. Inside another recording, or with a gradient
        sum's peak still to be looked at, nothing is recorded and the script is broken."""
        if self._script is not None or self._peak_check_pending:
            yield Script(broken=True)
            return
        script = self._script = Script()
        try:
            yield script
        finally:
            self._script = None
            script.end = (self.tag, self.moment, self.phase)

    def replay(self, steps: list[tuple[Any, ...]], made_by_call: dict[int, Callable[[], Any]],
               end: tuple[str, str, str]) -> None:
        """Count `steps` (a recording's, their blocks renumbered) as if what made them ran again: each block gets a
        new number in the events. The blocks in `made_by_call` are storages the caller keeps: their functions make
        them (through this counter, which then counts their frees when they go). It ends at the recording's `end`
        (tag, moment, phase), as what ran left them, in the layer it began in."""
        blocks: dict[int, int] = {}
        layer = self.layer
        for step in steps:
            if step[0] == PEAK:
                self.moment = step[1]
                self._note_peak()
                continue
            kind, block, raw, tag, self.phase, self.moment, self.layer = step
            if block in made_by_call:
                self.tag = tag
                made_by_call[block]()
            elif kind == ALLOC:
                blocks[block] = self._new_block(raw)
                self.by_tag[tag] += _rounded(raw)
                self.total += _rounded(raw)
            else:
                self._event(FREE, blocks.pop(block), raw)
                self.by_tag[tag] -= _rounded(raw)
                self.total -= _rounded(raw)
        self.tag, self.moment, self.phase = end
        self.layer = layer


    # Dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if self._peak_check_pending:
            self._peak_check_pending, self._sum = False, None
            self._note_peak()
        if func is aten._local_scalar_dense.default:
            return self._assume_scalar(args[0])
        if func is aten.index.Tensor and any(_is_mask(i) for i in args[1]):
            args = (args[0], self._mask_to_positions(args[1]))
        if func is aten.nonzero.default:
            out = self._assume_selection(args[0])
        elif func is aten.masked_select.default:
            count = self._selected_count(torch.broadcast_shapes(args[0].shape, args[1].shape).numel())
            out = args[0].new_empty((count,))
        elif func is aten.multinomial.default and _draws_by_exponential_noise(args, kwargs):
            # The device kernel draws argmax(p / q), q ~ Exp(1), in a tensor like the probabilities it allocates
            # beside them (aten/src/ATen/native/Distributions.cpp multinomial_out: `at::empty_like(self)`), which
            # the fake tensor's meta kernel never makes: generate()'s every sampling step holds it at its peak
            noise = torch.empty_like(args[0])
            self.track(noise)
            out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if func is aten._to_copy.default and self._is_whole_weight(args[0]):
            self.track(out, self._live[id(args[0].untyped_storage())][2])  # autocast's cast of a weight
        outputs = tree_flatten(out)[0]
        if self.phase == OPTIMIZER and self.layer < 0:  # each output in the layer of the parameter it updates
            for t, layer in zip(outputs, self._layers_computed_from(func, args, len(outputs)), strict=True):
                self.layer = layer
                self.track(t)
            self.layer = -1
        else:
            for t in outputs:
                self.track(t)
        if self.in_backward and func is aten.add.Tensor and _same_layout_operands(args, kwargs):
            # Autograd sums the gradients that reach one input in place (InputBuffer::accumulate) when it holds the
            # last reference, but never for tensor subclasses like FakeTensor, which get `old + new` instead. Look
            # at the peak after the next op, when the old sum is gone if it was the last reference; in the events,
            # that free and the sum's allocation are one block reused in place.
            self._peak_check_pending = True
            self._sum = self._sum_operands(out, args)
        else:
            self._note_peak()
        return out

    def _layers_computed_from(self, func: Any, args: Any, outputs: int) -> list[int]:
        """The layer of the parameter each output of an optimizer-step op is computed from: a foreach op's i-th
        output's is its first list's i-th tensor's, another op's its first tensor argument's (-1 for none)."""
        sources = None
        if func.overloadpacket.__name__.startswith("_foreach_"):
            sources = next((a for a in args if isinstance(a, (list, tuple)) and len(a) == outputs), None)
        if sources is None:
            sources = [next((a for a in args if isinstance(a, torch.Tensor)), None)] * outputs
        layers = []
        for t in sources:
            st = _storage(t)
            record = self._live.get(id(st)) if st is not None else None
            layers.append(record[6] if record is not None else -1)
        return layers

    def _sum_operands(self, out: Any, args: Any) -> tuple[list[Any], set[int]] | None:
        st = _storage(out)
        record = self._live.get(id(st)) if st is not None else None
        operands = {id(s) for s in map(_storage, args[:2]) if s is not None}
        return (record, operands) if record is not None else None

    def _is_whole_weight(self, t: Any) -> bool:
        # Autocast caches casts of whole fp32 leaf weights; TRL's LM head casts slices (views) of the weight.
        if not isinstance(t, torch.Tensor) or t._is_view() or not t.is_floating_point():
            return False
        record = self._live.get(id(t.untyped_storage()))
        return record is not None and record[2] in (WEIGHTS, REFERENCE)

    def _assume_scalar(self, t: torch.Tensor) -> Any:
        # A value read on the host (`.item()`, `if tensor:`). generate() asks "is there right padding?", "is every
        # token attended?": False plans for padded batches. Numbers are `assumed_number` (the optimizer's step).
        value = False if t.dtype == torch.bool else self.assumed_number
        self.assumptions[(f"values read on the host were taken as {value}", _caller())] += 1
        return float(value) if t.dtype.is_floating_point else value

    def _selected_count(self, numel: int) -> int:
        if self.selected_tokens is not None and self.selected_tokens[0] == numel:
            return self.selected_tokens[1]
        self.assumptions[(f"boolean selections of {numel} elements were taken to keep them all", _caller())] += 1
        return numel

    def _mask_to_positions(self, indices: list[Any]) -> list[Any]:
        # Indexing with a boolean mask is indexing with the positions nonzero() finds, one tensor per mask dim.
        positions: list[Any] = []
        for index in indices:
            if _is_mask(index):
                found = self._assume_selection(index)
                self.track(found)
                positions.extend(found.unbind(1))
            else:
                positions.append(index)
        return positions

    def _assume_selection(self, mask: torch.Tensor) -> torch.Tensor:
        # `hidden_states[mask]` asks nonzero() how many positions the mask keeps: the completion tokens.
        count = self._selected_count(mask.numel())
        return torch.empty((count, mask.dim()), dtype=torch.long, device=mask.device)


def _draws_by_exponential_noise(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether torch.multinomial takes its exponential-noise path: one sample per row, or any without replacement."""
    samples = args[1] if len(args) > 1 else kwargs.get("num_samples", 1)
    replacement = args[2] if len(args) > 2 else kwargs.get("replacement", False)
    return samples == 1 or not replacement


def _caller() -> str:
    """The innermost frame outside torch's dispatch machinery and this module, as file:line (for notes)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TRACING_DIR) and not any(part in name for part in _MACHINERY):
            return f"{name.split('site-packages/')[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


_MACHINERY = ("/torch/_", "/torch/utils/", "/torch/autograd/", "<")


PEAK = "peak"  # a recording's step: the peak was looked at (after an op), at this moment


@dataclass
class Script:
    """A recording (`LiveBytes.recording`): (ALLOC or FREE, block, bytes, tag, phase, moment, layer) per storage
    made or freed and (PEAK, moment) where the peak was looked at; `broken` where something rewrote what was counted."""

    steps: list[tuple[Any, ...]] = field(default_factory=list)
    broken: bool = False
    end: tuple[str, str, str] = ("", "", "")  # the counter's tag, moment and phase as the recorded run left them


@dataclass
class PhasePeak:
    """The peak of one phase: total live bytes, their split by tag, and the moment it happened."""

    name: str
    peak_bytes: int
    split: dict[str, int]
    moment: str
    seconds: float = 0.0
