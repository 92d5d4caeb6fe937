"""One rank of N under FSDP2, counted on fake tensors by running PyTorch's own `fully_shard` on the CPU.

TRL's `fsdp2` accelerate config (trl/accelerate_configs/fsdp2.yaml: TRANSFORMER_BASED_WRAP, reshard after forward,
mixed precision bf16) reaches `accelerate.utils.fsdp_utils.fsdp2_prepare_model`, which this module follows step by
step: trainable parameters upcast to float32 master weights under mixed precision, one FSDP unit per decoder layer
(the model's `_no_split_modules`), the input embedding its own unit when untied, the final norm and the output
projection one unit kept gathered after forward, the root last; `MixedPrecisionPolicy` gathers parameters, reduces
gradients and returns outputs in bf16 (`FullyShardedDataParallelPlugin.set_mixed_precision`).

Collectives run on torch's fake process group (`torch.testing._internal.distributed.fake_pg`): this process is rank
0 of `num_gpus`, every collective "completes" at once and writes nothing, which fake tensors do not need. Rank 0 holds
the largest shard (FSDP2 pads every rank's shard to it), so its bytes are every rank's. What FSDP2 allocates is counted
as on one CUDA device: its all-gather and reduce-scatter buffers are tensors the counter sees; the gathered
parameters are freed and refilled by resizing their storages, which this module reports to the counter.

TRL generates under FSDP2 with the sharded model as it is (trl/distributed.py: `summon_full_params` is a no-op for
FSDP v2): each layer gathers its parameters in its pre-forward and frees them after, at every decoding step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from vram_planner.errors import VramPlanError
from vram_planner.tracing.counter import GRADS, REFERENCE, WEIGHTS, LiveBytes
from vram_planner.tracing.session import Session


@contextlib.contextmanager
def sharded_rank(session: Session) -> Iterator[None]:
    """For an FSDP config: a fake process group of `num_gpus` ranks, the session's models sharded as accelerate shards
    them, and a fresh counter holding rank 0's shards; nothing for other configs.

    Enter it before the session's fake mode and counter (`with sharded_rank(s), s.fake_mode, s.tracker:`): it
    replaces `session.tracker`, so the models' loading events are those of the shards (accelerate's
    `cpu_ram_efficient_loading` builds the whole model on the host and sends each rank its shard).
    """
    if not session.train.fsdp:
        yield
        return
    import torch.distributed as dist

    if dist.is_initialized():
        raise VramPlanError("the FSDP trace runs its own fake process group, and this process already has one")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=session.train.num_gpus, store=FakeStore())
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (session.train.num_gpus,))  # real tensors: it reads the ranks' ids
        with session.fake_mode:
            _shard_models(session, mesh)
        _count_shards(session)
        reference = session.ref_model._get_fsdp_state()._fsdp_param_group if session.ref_model is not None else None
        with _fsdp_counted(session.tracker, reference), _synced_last_micro_batch(session):
            yield
    finally:
        dist.destroy_process_group()


def _shard_models(session: Session, mesh: Any) -> None:
    mixed = session.autocast_dtype
    model = session.base_model
    if mixed is not None:
        # accelerate: "Upcast to fp32 master weights; MixedPrecisionPolicy.param_dtype handles compute cast"
        for p in session.model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.to(torch.float32)
    _fully_shard_as_accelerate(session.model, model, mesh, mixed)
    if session.ref_model is not None:
        # trl/models/utils.py prepare_fsdp: the reference model is one FSDP2 unit, resharded after each forward
        from torch.distributed.fsdp import fully_shard

        fully_shard(session.ref_model, mesh=mesh, mp_policy=_policy(mixed), reshard_after_forward=True)


def _fully_shard_as_accelerate(top: Any, model: Any, mesh: Any, mixed: torch.dtype | None) -> None:
    """accelerate 1.x `fsdp2_prepare_model` with TRL's fsdp2 config: `top` is what the trainer wraps (a PeftModel
    with LoRA), `model` the transformers model inside it."""
    from accelerate.utils.fsdp_utils import _find_final_norm, get_module_children_bottom_up
    from torch.distributed.fsdp import FSDPModule, fully_shard

    policy = _policy(mixed)
    kwargs = {"mesh": mesh, "mp_policy": policy, "reshard_after_forward": True}
    layer_names = set(getattr(model, "_no_split_modules", None) or ())
    for module in get_module_children_bottom_up(top)[:-1]:
        if type(module).__name__ in layer_names and not isinstance(module, FSDPModule):
            fully_shard(module, **kwargs)
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and embed.weight is head.weight
    if not tied and not isinstance(embed, FSDPModule):
        fully_shard(embed, **kwargs)
    tail = (_find_final_norm(model), embed, head) if tied else (_find_final_norm(model), head)
    tail = [m for m in tail if m is not None and not isinstance(m, FSDPModule)]
    if tail:  # the forward's end and the backward's start use them back to back: kept gathered
        fully_shard(tail, **{**kwargs, "reshard_after_forward": False})
    if not isinstance(top, FSDPModule):
        fully_shard(top, mesh=mesh, mp_policy=policy)  # the root: torch's default keeps it gathered
    # FSDP2 finds its root at the first forward, which must be the root's: PEFT's generate() calls the transformers
    # model inside, whose FSDP units would each claim to be a root.
    top._get_fsdp_state()._lazy_init()


def _policy(mixed: torch.dtype | None) -> Any:
    """accelerate's FullyShardedDataParallelPlugin.set_mixed_precision for FSDP2: gathers, reductions and outputs in
    the mixed-precision dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=mixed, reduce_dtype=mixed, output_dtype=mixed)


def _count_shards(session: Session) -> None:
    """A new counter that starts from the shards, the buffers and the reference model's shards."""
    session.tracker = tracker = LiveBytes()
    with tracker.tagged(WEIGHTS, "loading the model"):
        for t in [*session.model.parameters(), *session.model.buffers()]:
            tracker.track(t, WEIGHTS)
        if session.ref_model is not None:
            for t in [*session.ref_model.parameters(), *session.ref_model.buffers()]:
                tracker.track(t, REFERENCE)


@contextlib.contextmanager
def _synced_last_micro_batch(session: Session) -> Iterator[None]:
    """transformers' Trainer runs every micro-batch but the last of an accumulation under accelerate's `no_sync`,
    which for FSDP2 is `set_requires_gradient_sync(False)`: those backwards keep their gathered gradients whole
    and reduce-scatter nothing, and the last one reduces them all. The trace's training phase runs two micro-batches
    when gradients accumulate: one before the last, then the last."""
    if session.train.gradient_accumulation_steps < 2:
        yield
        return
    root = session.model
    forwards = 0

    def before_forward(module: Any, args: Any) -> None:
        nonlocal forwards
        if torch.is_grad_enabled():  # generation and scoring run under no_grad
            forwards += 1
            root.set_requires_gradient_sync(forwards % 2 == 0)

    handle = root.register_forward_pre_hook(before_forward, prepend=True)
    try:
        yield
    finally:
        handle.remove()
        root.set_requires_gradient_sync(True)


@contextlib.contextmanager
def _fsdp_counted(tracker: LiveBytes, reference: Any) -> Iterator[None]:
    """Count FSDP2's storage resizes, and tag its gathers as weights (the `reference` group's as reference weights)
    and its gradient reductions as gradients."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    resize = torch.UntypedStorage.resize_
    hooked: set[int] = set()

    def counted_resize(storage: Any, size: int) -> Any:
        out = resize(storage, size)
        tracker.track_storage(storage)
        return out

    def tagged(method: Any, tag: str) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            with tracker.tagged(REFERENCE if self is reference else tag):
                return method(self, *args, **kwargs)
        return run

    init_unsharded = FSDPParam.init_unsharded_param

    def init_unsharded_param(self: Any) -> None:
        # The gathered parameter is made once and refilled by later gathers; autograd accumulates its gradient,
        # which the reduce-scatter then shards.
        init_unsharded(self)
        param = self._unsharded_param
        if param.requires_grad and id(param) not in hooked:
            hooked.add(id(param))
            param.register_post_accumulate_grad_hook(lambda q: tracker.track(q.grad, GRADS))

    patches = [(torch.UntypedStorage, "resize_", counted_resize),
               (FSDPParamGroup, "unshard", tagged(FSDPParamGroup.unshard, WEIGHTS)),
               (FSDPParamGroup, "wait_for_unshard", tagged(FSDPParamGroup.wait_for_unshard, WEIGHTS)),
               (FSDPParamGroup, "post_backward", tagged(FSDPParamGroup.post_backward, GRADS)),
               (FSDPParam, "init_unsharded_param", init_unsharded_param)]
    saved = [(owner, name, owner.__dict__.get(name, _INHERITED)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            if value is _INHERITED:  # UntypedStorage inherits resize_ from torch._C.StorageBase
                delattr(owner, name)
            else:
                setattr(owner, name, value)


_INHERITED = object()
