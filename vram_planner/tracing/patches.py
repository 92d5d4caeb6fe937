"""Where TRL and transformers behave differently on CUDA than on the CPU, or read values fake tensors lack.

Each patch is undone on exit. Fake tensors cannot live on a fake "cuda" device in a CPU-only torch build (autograd
aborts the process in `InputMetadata` without a CUDA device guard), so the trace runs CPU kernels and patches the
few places where a CUDA-only path changes memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from vram_planner.tracing.counter import ACTS, GRADS, HEAD, KV, LAYER_OF_NODE, LiveBytes
from vram_planner.tracing.session import Session, decoder_layers

_HEAD_SUFFIX = ": LM head"


@contextlib.contextmanager
def cuda_like_behaviour(session: Session) -> Iterator[None]:
    """Patches, undone on exit, that make the CPU run allocate what the CUDA run allocates.

    - TRL's fused LM head scores only the completion tokens (`hidden_states[mask]`) where Triton runs, every
      position elsewhere: take the Triton (CUDA) path.
    - The Triton kernels fold each logits tile in place; their torch stand-ins allocate fp32 copies of the tile.
      On CUDA `torch.addmm(..., out_dtype=float32, out=acc)` accumulates without the fp32 casts of the CPU path.
    - generate() stops when every sequence has hit EOS, which fake tensors cannot tell: stop after the one step
      each call is asked for.
    - The fused LM head's loops over its tiles run their representative iterations only (`_representative_range`),
      so the trace's time does not grow with the tokens of a micro-batch.
    - Where transformers kernelizes by default (5.25 on), the Hub's RMSNorm and rotary kernels replace the torch
      code on CUDA: stand-ins that allocate and keep what they do (`tracing.hub_kernels`).
    - Dropout (PEFT's `lora_dropout`, TRL's default 0.05 for its scripts' adapters) takes CUDA's fused kernel, which
      keeps a bool mask for backward where the CPU path keeps a noise tensor of the input's dtype (`_fused_dropout`).
    - bitsandbytes' 4-bit matmul dequantizes the whole weight where its CUDA kernel would not fuse
      (`_matmul_4bit_as_cuda`).
    """
    import torch.nn.functional as F
    import transformers.generation.utils as gen_utils

    from vram_planner.tracing.hub_kernels import hub_kernel_patches
    from vram_planner.tracing.session import uses_fused_lm_head
    from vram_planner.tracing.shims import one_step_generation

    fused = uses_fused_lm_head(session.train)
    patches = [one_step_generation(gen_utils), *_logprob_kernel_patches(fused), *hub_kernel_patches(session),
               (F, "dropout", _fused_dropout(F.dropout))]
    if session.train.load_in_4bit:
        import bitsandbytes

        patches.append((bitsandbytes, "matmul_4bit", _matmul_4bit_as_cuda(bitsandbytes.matmul_4bit)))
    if fused:  # TRL 1.15 and later
        import trl.kernels.chunked_logprob as chunked
        import trl.trainer.utils as trl_utils

        patches = [(trl_utils, "_use_triton", lambda device: True),
                   *_tile_kernel_patches(chunked),
                   (chunked, "_addmm_fp32", _in_place_kernel),
                   (chunked, "range", _representative_range),  # a module global shadows the builtin in its loops
                   *patches]
    saved = [(owner, name, owner.__dict__.get(name, _ABSENT)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        heads = _head_gradients_tagged(session.tracker) if fused else contextlib.nullcontext()
        with _tagged_cache_updates(session.tracker), _sliding_window_tensor_on_the_device(session.tracker), heads:
            yield
    finally:
        for owner, name, value in saved:
            if value is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


_ABSENT = object()


def _matmul_4bit_as_cuda(matmul_4bit: Callable[..., Any]) -> Callable[..., Any]:
    """`bnb.matmul_4bit` as its CUDA kernel for `bitsandbytes::gemm_4bit` allocates (backends/cuda/ops.py 0.50.2),
    where the fake kernel only makes the output. The fused kernel (`_gemm_4bit_kernel_impl`) reads A contiguous;
    above its rows, or where the inner dimension is not a whole number of blocks, `_dequant_linear_fallback`
    dequantizes the double-quantized absmax and adds its offset, then the whole weight in A's dtype, and holds them
    while F.linear writes the output. Which rows fuse is calibrated per GPU there; the planner's bound
    (model.components.fused_4bit) stands for it."""
    import torch

    from vram_planner.model.components import fused_4bit

    def as_cuda(A: Any, B: Any, quant_state: Any, out: Any = None, bias: Any = None) -> Any:
        inner = A.shape[-1]
        if fused_4bit(A.numel() // inner, inner):
            held = [A.contiguous()]  # the kernel's copy of a strided A
        else:
            held = []
            if quant_state.nested:
                dequantized_absmax = torch.empty_like(quant_state.absmax, dtype=torch.float32)
                held += [dequantized_absmax, dequantized_absmax + quant_state.offset]
            held.append(torch.empty(tuple(quant_state.shape), dtype=A.dtype, device=A.device))
        result = matmul_4bit(A, B, quant_state, out=out, bias=bias)  # the fake kernel makes the output
        del held
        return result

    return as_cuda


def _fused_dropout(cpu_dropout: Callable[..., Any]) -> Callable[..., Any]:
    """`F.dropout` as CUDA runs it. at::dropout (aten/src/ATen/native/Dropout.cpp) takes the fused kernel when
    `is_fused_kernel_acceptable`: a CUDA input, 0 < p < 1, not empty; native_dropout then returns the output and a
    bool mask, which its backward keeps (1 byte an element). On the CPU it multiplies the input by a noise tensor of
    the input's dtype, which the product's backward keeps (4 bytes an element beside float32 activations: a LoRA
    adapter's float32 input under 0.05 dropout kept 3.1 GiB where CUDA keeps 0.8, Qwen2.5-0.5B, 4 x 1,042 tokens).
    The rest (no training, p 0 or 1, in place) is the same on both."""
    import torch

    def dropout(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        if training and 0 < p < 1 and not inplace and input.numel() > 0:
            return torch.native_dropout(input, p, True)[0]
        return cpu_dropout(input, p, training, inplace)

    return dropout


def _logprob_kernel_patches(fused: bool) -> list[tuple[Any, str, Any]]:
    """TRL 1.14 scores full logits with a Triton kernel on CUDA (trl/kernels/logprob_entropy.py) and with torch ops
    (a temperature-scaled copy of the logits, log-softmax, entropy) elsewhere: take the kernel's path, with a stand-in
    that allocates what the kernel allocates (`LogProbEntropyKernel`). Releases without the kernel: nothing."""
    import trl.trainer.utils as trl_utils

    if fused or not hasattr(trl_utils, "_supports_trl_loss_kernel"):
        return []
    return [(trl_utils, "_supports_trl_loss_kernel", _kernel_takes),
            (trl_utils, "_fused_logprob_entropy", LogProbEntropyKernel.select)]


def _kernel_takes(logits: Any, index: Any = None, row_mask: Any = None) -> bool:
    """`_supports_trl_loss_kernel` with the logits on CUDA: the dtype and layout checks, which TRL's calls meet."""
    import torch

    return (logits.dtype in (torch.float16, torch.bfloat16, torch.float32) and 1 <= logits.ndim <= 3
            and logits.stride(-1) == 1 and logits.shape[-1] > 0)


def _logprob_entropy_function() -> Any:
    import torch

    class Function(torch.autograd.Function):
        """trl.kernels.logprob_entropy._LogProbEntropyFunction's allocations: forward makes four float32 values per
        row (log-probs, entropy, log-normaliser, expected logit) and keeps the logits themselves for backward, which
        makes one gradient of the logits' shape (`torch.empty_like`); the Triton kernels allocate nothing."""

        @staticmethod
        def forward(ctx: Any, logits: Any, index: Any, temperature: float, row_mask: Any) -> Any:
            logprobs = torch.empty(logits.shape[:-1], device=logits.device, dtype=torch.float32)
            entropy, log_z, expected_logit = (torch.empty_like(logprobs) for _ in range(3))
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(logits, index, log_z, expected_logit, row_mask)
            return logprobs, entropy

        @staticmethod
        def backward(ctx: Any, grad_logprobs: Any, grad_entropy: Any) -> Any:
            logits = ctx.saved_tensors[0]
            for grad in (grad_logprobs, grad_entropy):
                if grad is not None:
                    grad.contiguous()
            return torch.empty_like(logits, memory_format=torch.contiguous_format), None, None, None

    return Function


class LogProbEntropyKernel:
    """The stand-in for trl.kernels.selective_log_softmax_and_entropy (TRL 1.14's Triton kernel)."""

    @staticmethod
    def select(logits: Any, index: Any, temperature: float = 1.0, row_mask: Any = None) -> Any:
        return _logprob_entropy_function().apply(logits, index, temperature, row_mask)


def _representative_range(*args: int) -> range | list[int]:
    """The iterations of a tile loop whose allocations stand for all of them: the first two and the last two.

    The fused LM head loops over [4096-token x 32768-vocab] tiles, so a micro-batch of 1e12 sequences takes 1e12
    iterations (minutes to years) while its memory does not grow: from the second iteration on each allocates
    exactly what the second did (the same tile shapes, the previous chunk freed as the next is made) and only the
    last may be smaller. On fake tensors the skipped iterations compute nothing either.
    """
    steps = range(*args)
    return steps if len(steps) <= 4 else [steps[0], steps[1], steps[-2], steps[-1]]


def _in_place_kernel(*args: Any, **kwargs: Any) -> None:
    """A Triton kernel (or cuBLAS addmm into an fp32 accumulator): works in place, allocates nothing."""


class _InPlaceLaunch:
    """A Triton kernel launched as `kernel[grid](...)`: works in place on the buffers it is given."""

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return _in_place_kernel


def _tile_kernel_patches(chunked: Any) -> list[tuple[Any, str, Any]]:
    """The fused head's per-tile work, in place: TRL 1.16 calls `_forward_tile`/`_backward_tile`, which launch the
    Triton kernels or run torch stand-ins; TRL 1.15 launches `_forward_kernel[grid]`/`_backward_kernel[grid]`
    itself (and imports triton unconditionally)."""
    if hasattr(chunked, "_forward_tile"):
        return [(chunked, "_forward_tile", _in_place_kernel), (chunked, "_backward_tile", _in_place_kernel)]
    return [(chunked, "_forward_kernel", _InPlaceLaunch()), (chunked, "_backward_kernel", _InPlaceLaunch())]


@contextlib.contextmanager
def _head_gradients_tagged(tracker: LiveBytes) -> Iterator[None]:
    """The LM head's weight gradient leaves the fused backward as the parameter's gradient: count it as one."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    original = ChunkedLogProbFunction.backward

    def backward(ctx: Any, *grads: Any) -> Any:
        out = original(ctx, *grads)
        for t in out[1:3]:  # grad_weight, grad_bias
            tracker.track(t, GRADS)
        return out

    ChunkedLogProbFunction.backward = staticmethod(backward)
    try:
        yield
    finally:
        ChunkedLogProbFunction.backward = staticmethod(original)


@contextlib.contextmanager
def _sliding_window_tensor_on_the_device(tracker: LiveBytes) -> Iterator[None]:
    """transformers 5's sliding-window cache layer makes its window as a tensor on the host when the cache is made
    and moves it to the device in its first update, inside its layer's forward (cache_utils.py,
    DynamicSlidingWindowLayer.lazy_initialization): on the CPU the move is none, so the host tensor is forgotten and
    the move made a copy. Releases without it: nothing."""
    from transformers import cache_utils

    layer_class = getattr(cache_utils, "DynamicSlidingWindowLayer", None)
    if layer_class is None or "lazy_initialization" not in layer_class.__dict__:
        yield
        return
    init, lazy = layer_class.__init__, layer_class.lazy_initialization

    def made(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        window = getattr(self, "_sliding_window_tensor", None)
        if window is not None:
            tracker.forget([window])

    def moved(self: Any, *args: Any, **kwargs: Any) -> None:
        window = getattr(self, "_sliding_window_tensor", None)
        lazy(self, *args, **kwargs)
        if window is not None and self._sliding_window_tensor is window:
            self._sliding_window_tensor = window.clone()

    layer_class.__init__, layer_class.lazy_initialization = made, moved
    try:
        yield
    finally:
        layer_class.__init__, layer_class.lazy_initialization = init, lazy


@contextlib.contextmanager
def _tagged_cache_updates(tracker: LiveBytes) -> Iterator[None]:
    """Count what the KV cache allocates and keeps as kv_cache (`Cache.update` in transformers 5; 4.x's
    DynamicCache has an update of its own)."""
    from transformers.cache_utils import Cache, DynamicCache

    from vram_planner.tracing.shims import cache_layer

    def tagged(original: Callable[..., Any]) -> Callable[..., Any]:
        def update(self: Any, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
            with tracker.tagged(KV):
                out = original(self, key_states, value_states, layer_idx, *args, **kwargs)
            layer = cache_layer(self, layer_idx)
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                tracker.track(t, KV)  # a layer may keep the incoming states themselves
            return out
        return update

    owners = [cls for cls in (Cache, DynamicCache) if "update" in cls.__dict__]
    originals = [cls.__dict__["update"] for cls in owners]
    for cls, original in zip(owners, originals, strict=True):
        cls.update = tagged(original)
    try:
        yield
    finally:
        for cls, original in zip(owners, originals, strict=True):
            cls.update = original


@contextlib.contextmanager
def head_tagging(session: Session) -> Iterator[None]:
    """Tag what runs after the decoder stack (the LM head, sampling, the loss) as lm_head_buffers.

    Forward: from the backbone's output to the next forward's start. Backward: from the loss until the gradient of
    the backbone's output exists (the fused head's backward and the scatter of its gradient into [B, L, h]).
    """
    tracker = session.tracker

    def forward_starts(module: Any, args: Any) -> None:
        tracker.tag, tracker.moment = ACTS, tracker.moment.split(_HEAD_SUFFIX)[0]

    def backbone_done(module: Any, args: Any, output: Any) -> None:
        tracker.tag, tracker.moment = HEAD, tracker.moment.split(_HEAD_SUFFIX)[0] + _HEAD_SUFFIX
        hidden = getattr(output, "last_hidden_state", None)
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(_switch_to_backbone_backward(tracker))

    handles = []
    for top in (session.base_model, session.ref_model):
        if top is not None:
            handles.append(top.register_forward_pre_hook(forward_starts))
            handles.append(top.base_model.register_forward_hook(backbone_done))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _switch_to_backbone_backward(tracker: LiveBytes) -> Callable[[Any], None]:
    def hook(grad: Any) -> None:
        tracker.tag, tracker.moment = ACTS, "backward through the decoder"
    return hook


@contextlib.contextmanager
def layer_marking(session: Session) -> Iterator[None]:
    """Mark each event with the decoder layer it belongs to (`Event.layer`): its forward (generation, scoring, the
    loss, a checkpointed layer's recomputation) by the layer's forward hooks, its backward by the autograd nodes its
    forward made, which a forward hook marks in their metadata (the backward runs no module hooks of its own). A
    layer checkpointed reentrantly runs its forward without a graph inside one node of its own, whose backward
    (the recomputation, then a backward of its own graph) counts in that layer."""
    import torch.utils.checkpoint as checkpoint

    tracker = session.tracker
    outer: list[int] = []
    entered = [-1]  # the layer entered last

    def entering(index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            _mark_nodes((args, kwargs), -1)  # what fed the layer was made before it
            outer.append(tracker.layer)
            tracker.layer = entered[0] = index
        return hook

    def leaving(index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            _mark_nodes(output, index)
            tracker.layer = outer.pop() if outer else -1
        return hook

    reentrant = checkpoint.CheckpointFunction
    forward, backward = reentrant.forward, reentrant.backward

    def checkpointed(ctx: Any, *args: Any) -> Any:
        out = forward(ctx, *args)
        ctx.vram_planner_layer = entered[0]
        return out

    def run_back(ctx: Any, *grads: Any) -> Any:
        saved, tracker.layer = tracker.layer, getattr(ctx, "vram_planner_layer", -1)
        try:
            return backward(ctx, *grads)
        finally:
            tracker.layer = saved

    handles = []
    for top in (session.base_model, session.ref_model):
        for index, layer in enumerate(decoder_layers(top)):
            handles.append(layer.register_forward_pre_hook(entering(index), with_kwargs=True, prepend=True))
            handles.append(layer.register_forward_hook(leaving(index), with_kwargs=True))
    reentrant.forward, reentrant.backward = staticmethod(checkpointed), staticmethod(run_back)
    try:
        yield
    finally:
        reentrant.forward, reentrant.backward = staticmethod(forward), staticmethod(backward)
        for handle in handles:
            handle.remove()


def _mark_nodes(value: Any, layer: int) -> None:
    """Mark `layer` in the metadata of every autograd node that made the tensors in `value` and is not marked yet,
    and of those before it: a layer's nodes, once what fed it is marked before it runs."""
    from torch.utils._pytree import tree_flatten

    stack = [getattr(t, "grad_fn", None) for t in tree_flatten(value)[0]]
    while stack:
        node = stack.pop()
        if node is None or LAYER_OF_NODE in node.metadata:
            continue
        node.metadata[LAYER_OF_NODE] = layer
        stack.extend(next_node for next_node, _ in node.next_functions)
