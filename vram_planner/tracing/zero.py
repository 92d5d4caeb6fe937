"""One rank of N under DeepSpeed ZeRO-1/2/3, counted on fake tensors by running DeepSpeed's own engine on the CPU.

TRL's zero1/2/3 accelerate configs (trl/accelerate_configs/zero{1,2,3}.yaml: the stage, bf16, no offload) become a
DeepSpeed config in accelerate's `DeepSpeedPlugin` (accelerate/utils/dataclasses.py, `__post_init__` and
`set_mixed_precision`); transformers' Trainer fills its "auto" values from the training arguments
(integrations/deepspeed.py `trainer_config_process`) and, as the config names no optimizer, hands DeepSpeed its own
(`deepspeed_optim_sched`: `zero_allow_untested_optimizer`). `deepspeed.initialize` then builds DeepSpeed's engine and
ZeRO optimizer around the session's fake-tensor model: this process is one rank of `num_gpus` on torch's fake process
group (as `vram_planner.tracing.sharded` runs FSDP2), every collective "completes" at once and writes nothing. The rank
is the one the planner counts (`vram_planner.model.zero.heaviest_rank`): ZeRO-1/2 split each flat group of parameters
into equal parts, so a rank's partition touches more whole gradients or a larger piece than another's.

The phases run as TRL and accelerate run them: generation inside TRL's own `unwrap_model_for_generation` (under
ZeRO-3 it gathers every parameter when `ds3_gather_for_generation` is on, and lets each layer's hooks gather it
otherwise), the loss's backward through `engine.backward` with accelerate's accumulation boundary
(`DeepSpeedEngineWrapper.backward`), after an earlier step's loss under ZeRO-3 (`earlier_loss`: its parameter
coordinator as a later step finds it), the optimizer phase as `engine.step()` runs from the second step on, with Adam's
moments made by an earlier step (`_states_of_earlier_steps`). A full fine-tune's reference model (beta > 0) is
TRL's own `prepare_deepspeed` of it (`_prepare_reference`). What DeepSpeed allocates is tagged by where it lives:
the 16-bit parameters (ZeRO-3: their partitions and its gathers) as weights, the fp32 master partition and Adam's
moments as optimizer states, the reduction buckets, gradient partitions and what the step makes of them (the flat,
fp32 and the norm's fp64 copies) as gradients, the client optimizer's own temporaries as the step's.

Shimmed, each the smallest piece that cannot run here, none of them memory on a GPU:
- DeepSpeed's CPU accelerator stands in for CUDA's (`deepspeed.accelerator.set_accelerator`): its device is "cpu",
  where the fake tensors live;
- the CPU accelerator's shared-memory all-reduce op (`deepspeed/comm/torch.py` `build_shm_op`) is a C++ extension
  DeepSpeed compiles on first use for CPU ranks of one node; a CUDA run reduces through NCCL instead, so it is not
  built: marked incompatible with DeepSpeed's own switch, as the CPU ranks of `vram-plan run` mark it
  (`shared_memory_all_reduce_off`), and marked back on exit;
- ZeRO's cross-rank consistency checks (`deepspeed/runtime/zero/utils.py` `assert_ints_same_as_other_ranks`) compare
  the ranks' lists through an all-gather, which a fake process group does not write: they are skipped;
- the engine's `module.to(device)` (runtime/engine.py:2093-2094) swaps every parameter for itself, which a fake
  parameter refuses (torch keeps a weak reference to it): the fake parameters are on the CPU device already;
- the model is built whole and partitioned by `deepspeed.initialize`, not under `deepspeed.zero.Init` (TRL's zero3
  config sets `zero3_init_flag`): the same partitions from the first phase on, a different peak while loading only.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

from vram_planner.errors import VramPlanError
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.zero import AUTO_FILLED_SIZES, deepspeed_size
from vram_planner.tracing.counter import GRADS, REFERENCE, STATES, STEP, WEIGHTS, PhasePeak
from vram_planner.tracing.optimizer_peak import host_step_scalars, step_peak
from vram_planner.tracing.session import Session

# GRPOConfig's max_grad_norm (transformers' TrainingArguments default), which trainer_config_process copies into
# "gradient_clipping" (transformers/integrations/deepspeed.py:161)
MAX_GRAD_NORM = 1.0
# What ZeRO-1/2 and ZeRO-3 optimizers run while backward reduces gradients (zero/stage_1_and_2.py and stage3.py):
# everything they allocate there is a bucket or a gradient partition.
REDUCING_METHODS = ("process_gradients", "reduce_ready_partitions_and_remove_grads", "reduce_gradients",
                    "independent_gradient_partition_epilogue", "overlapping_partition_gradients_reduce_epilogue",
                    "update_hook_state_and_maybe_run_epilogue")
# Where ZeRO-1/2 and ZeRO-3 take the gradients' norm in their step (stage_1_and_2.py:2943, stage3.py:2573)
NORM_METHODS = ("scaled_global_norm", "_get_norm_groups")


def deepspeed_config(session: Session) -> dict[str, Any]:
    """The DeepSpeed config a TRL run under `accelerate launch --config_file zero{S}.yaml` hands `deepspeed.initialize`.

    accelerate's own DeepSpeedPlugin builds it from the yaml's fields; the "auto" values are filled as transformers'
    `trainer_config_process` fills them (integrations/deepspeed.py:143-161), with the world size of the run.
    """
    from accelerate.utils import DeepSpeedPlugin

    train = session.train
    stage = train.zero_stage
    # zero3_init_flag is left off: on, the plugin registers a process-wide HfDeepSpeedConfig that makes transformers
    # build every later model under zero.Init (see the module's docstring)
    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=train.gradient_accumulation_steps,
                             offload_optimizer_device="none", offload_param_device="none", zero3_init_flag=False,
                             zero3_save_16bit_model=stage == 3)
    plugin.set_mixed_precision(train.mixed_precision)
    config = dict(plugin.deepspeed_config)
    micro = train.per_device_train_batch_size
    config.update(train_micro_batch_size_per_gpu=micro,
                  train_batch_size=micro * train.gradient_accumulation_steps * train.num_gpus,
                  gradient_clipping=MAX_GRAD_NORM,
                  zero_allow_untested_optimizer=True)  # transformers/integrations/deepspeed.py:589
    # a DeepSpeed config file's bucket and overlap, and at ZeRO-3 its coordinator's sizes, "auto" filled as
    # transformers fills it
    zero = config["zero_optimization"] = dict(config["zero_optimization"])
    sizes = [key for key in AUTO_FILLED_SIZES if key == "reduce_bucket_size" or stage == 3]
    hidden = _hidden_size(session.model) if any(getattr(train, key) == "auto" for key in sizes) else 0
    zero.update({key: deepspeed_size(train, key, hidden) for key in sizes})
    if train.overlap_comm is not None:
        zero["overlap_comm"] = train.overlap_comm
    return config


def _hidden_size(model: Any) -> int:
    """The hidden size transformers fills a DeepSpeed config's "auto" buckets from (`trainer_config_finalize`,
    integrations/deepspeed.py:211-222): the config's, else its largest, else its text model's."""
    for config in (model.config, getattr(model.config, "text_config", None)):
        if getattr(config, "hidden_size", None) is not None:
            return config.hidden_size
        if getattr(config, "hidden_sizes", None):
            return max(config.hidden_sizes)
    raise ValueError("the model's config has no hidden size to fill DeepSpeed's 'auto' buckets from")


@contextlib.contextmanager
def zero_rank(session: Session, optimizer_recipe: tuple[type, dict[str, Any]], rank: int = 0) -> Iterator[None]:
    """For a ZeRO config: a fake process group of `num_gpus` ranks, this process `rank` of them, and DeepSpeed's
    engine around the session's model, built with the Trainer's optimizer (`optimizer_recipe`); nothing for other
    configs.

    Enter it inside the session's fake mode and counter: the engine's own allocations are counted as it makes them.
    """
    if session.train.zero_stage is None:
        yield
        return
    config = deepspeed_config(session)
    with _deepspeed_on_cpu(session.train.num_gpus, rank) as deepspeed:
        _initialize(session, deepspeed, config, optimizer_recipe)
        if session.ref_model is not None:
            _prepare_reference(session, config)
        try:
            with _zero_counted(session):
                yield
        finally:
            session.engine = None


def _initialize(session: Session, deepspeed: Any, config: dict[str, Any], recipe: tuple[type, dict[str, Any]]) -> None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    tracker, model = session.tracker, session.model
    cls, kwargs = recipe
    with unset_fake_temporarily():  # as run_optimizer builds it: outside the fake world, over the fake parameters
        optimizer = cls([p for p in model.parameters() if p.requires_grad], **kwargs)
    # What the engine keeps besides the parameters and the master partition: buckets and gradient partitions
    with _moved_in_place(model), tracker.tagged(GRADS, "deepspeed.initialize"):
        engine, zero_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    _count_parameters(session, model, WEIGHTS)
    # The fp32 master partitions the client optimizer steps: its parameters under ZeRO-1/2; ZeRO-3 hands it one
    # sub-group at a time (stage3.py `_optimizer_step`) and keeps them in `fp32_partitioned_groups_flat`
    masters = [p for group in zero_optimizer.optimizer.param_groups for p in group["params"]]
    for p in [*masters, *getattr(zero_optimizer, "fp32_partitioned_groups_flat", [])]:
        tracker.track(p, STATES)
    session.engine, session.optimizer = engine, zero_optimizer


def _prepare_reference(session: Session, config: dict[str, Any]) -> None:
    """The reference model as GRPOTrainer prepares it under DeepSpeed: TRL's own `prepare_deepspeed`
    (trl/models/utils.py), an inference engine of the run's config, ZeRO-3 partitioned with TRL's smaller buckets and
    persistence threshold, else stage 0 (whole on every rank)."""
    from trl.models import prepare_deepspeed

    tracker, model = session.tracker, session.ref_model
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config)))
    # at stage 0 DeepSpeed's BF16_Optimizer prints rank 0's memory use to stdout (runtime/utils.py
    # see_memory_usage), where --json prints the report
    with _moved_in_place(model), tracker.tagged(REFERENCE, "deepspeed.initialize"), \
            contextlib.redirect_stdout(io.StringIO()):
        engine = prepare_deepspeed(model, accelerator)
    _count_parameters(session, model, REFERENCE)
    session.ref_model = engine
    if session.trainer is not None:
        session.trainer.ref_model = engine


@contextlib.contextmanager
def _moved_in_place(model: Any) -> Iterator[None]:
    """The engine's `module.to(device)` (engine.py:2093-2094) a no-op while DeepSpeed builds it (the module's
    docstring)."""
    model.to = lambda *args, **kwargs: model
    try:
        yield
    finally:
        del model.to


def _count_parameters(session: Session, model: Any, tag: str) -> None:
    """The model's parameters and buffers counted as `tag`, with ZeRO-3's partition of each (the parameter empty)."""
    for p in [*model.parameters(), *model.buffers()]:
        session.tracker.track(p, tag)
        if getattr(p, "ds_tensor", None) is not None:
            session.tracker.track(p.ds_tensor, tag)


@contextlib.contextmanager
def _deepspeed_on_cpu(num_gpus: int, rank: int = 0) -> Iterator[Any]:
    """DeepSpeed imported on its CPU accelerator, `rank` of a fake process group of `num_gpus`, with the shims of the
    module's docstring; everything restored on exit."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        raise VramPlanError("the ZeRO trace runs its own fake process group, and this process already has one")
    saved_env = {k: os.environ.get(k) for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    # ZeRO-3 swaps torch's F.linear for its own, "until manually reset" (runtime/zero/partition_parameters.py:412-419):
    # a later trace in this process would run it too (its generation held 9% less on the tiny fixture)
    linear = torch.nn.functional.linear
    # DeepSpeed's engine asserts a launcher set LOCAL_RANK (runtime/engine.py:1972)
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(num_gpus))
    patched: list[tuple[Any, str, Any]] = []
    restore_shared_memory: Callable[[], None] = lambda: None
    try:
        deepspeed = _import_on_cpu()
        restore_shared_memory = shared_memory_all_reduce_off()
        importlib.import_module("deepspeed.runtime.zero.stage3")
        importlib.import_module("deepspeed.runtime.zero.partitioned_param_coordinator")
        for name, module in list(sys.modules.items()):
            if name.startswith("deepspeed.runtime.zero") and hasattr(module, "assert_ints_same_as_other_ranks"):
                patched.append((module, "assert_ints_same_as_other_ranks", lambda ints: None))
        patched = [(owner, name, value, getattr(owner, name)) for owner, name, value in patched]
        for owner, name, value, _ in patched:
            setattr(owner, name, value)
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=rank, world_size=num_gpus, store=FakeStore())
        # DeepSpeed keeps the process groups it makes in module globals, which die with this process group
        groups = importlib.import_module("deepspeed.utils.groups")
        kept = {name: copy.copy(value) for name, value in vars(groups).items() if re.fullmatch(r"_[A-Z_]+", name)}
        try:
            deepspeed.init_distributed(dist_backend="fake")
            yield deepspeed
        finally:
            dist.destroy_process_group()
            importlib.import_module("deepspeed.comm.comm").cdb = None  # the next trace initializes its own
            for name, value in kept.items():
                setattr(groups, name, value)
    finally:
        torch.nn.functional.linear = linear
        restore_shared_memory()
        for owner, name, _, original in patched:
            setattr(owner, name, original)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def shared_memory_all_reduce_off() -> Callable[[], None]:
    """DeepSpeed's shared-memory all-reduce for CPU ranks marked incompatible, so that its backend does not compile it
    when it starts (deepspeed/comm/torch.py `build_shm_op`: a C++ extension, about a minute on two cores, for
    tensor-parallel inference's all-reduce alone; ZeRO reduces through the process group). DeepSpeed's own switch, as
    it marks the op off Linux (`deepspeed.ops.__compatible_ops__`); CUDA's accelerator has no such op. Returns what
    puts the entry back as it was."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    ops, name = deepspeed.ops.__compatible_ops__, ShareMemCommBuilder.NAME
    had, before = name in ops, ops.get(name)
    ops[name] = False

    def restore() -> None:
        if had:
            ops[name] = before
        else:
            ops.pop(name, None)
    return restore


def _import_on_cpu() -> Any:
    try:
        # DeepSpeed's logger writes to the sys.stdout of its first import, where --json prints the report
        with contextlib.redirect_stdout(sys.stderr):
            from deepspeed.accelerator import set_accelerator
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

            set_accelerator(CPU_Accelerator())
            import deepspeed
    except ImportError as exc:
        raise VramPlanError(f"the ZeRO trace runs DeepSpeed's own engine, which cannot be imported ({exc}): "
                            "pip install 'vram-plan[deepspeed]'") from exc
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    return deepspeed


@contextlib.contextmanager
def _zero_counted(session: Session) -> Iterator[None]:
    """ZeRO's reductions tagged as gradients and ZeRO-3's gathers as weights, per instance where DeepSpeed calls its
    own methods through `self`; the coordinator's and GatheredParameters' on their classes, undone on exit."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    tracker, optimizer = session.tracker, session.optimizer

    def tagged(method: Any, tag: str, moment: str | None = None) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with tracker.tagged(tag, moment):
                return method(*args, **kwargs)
        return run

    for name in REDUCING_METHODS:
        if hasattr(optimizer, name):
            setattr(optimizer, name, tagged(getattr(optimizer, name), GRADS))
    if hasattr(optimizer, "_post_step"):  # ZeRO-3 gathers its persistent parameters again (stage3.py:2840-2841)
        optimizer._post_step = tagged(optimizer._post_step, WEIGHTS, "optimizer step: persistent parameters gathered")
    for name in NORM_METHODS:  # the step's fp64 copies of the gradients, one at a time
        if hasattr(optimizer, name):
            setattr(optimizer, name, tagged(getattr(optimizer, name), GRADS, "optimizer step: the gradient norm"))
    classes = [(PartitionedParameterCoordinator, "fetch_sub_module"), (GatheredParameters, "__enter__")]
    saved = [(owner, name, owner.__dict__[name]) for owner, name in classes]
    try:
        for owner, name, method in saved:
            setattr(owner, name, tagged(method, WEIGHTS))
        yield
    finally:
        for owner, name, method in saved:
            setattr(owner, name, method)


@contextlib.contextmanager
def generating(session: Session) -> Iterator[None]:
    """Generation as TRL runs it: inside `unwrap_model_for_generation`, which under ZeRO-3 gathers the whole model
    when `ds3_gather_for_generation` is on (trl/models/utils.py `_unwrap_model_for_generation`)."""
    if session.engine is None:
        yield
        return
    from trl.models.utils import unwrap_model_for_generation

    engine = session.engine
    accelerator = SimpleNamespace(unwrap_model=lambda model, **kwargs: engine.module,
                                  state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(
                                      zero_stage=session.train.zero_stage), fsdp_plugin=None))
    with unwrap_model_for_generation(engine, accelerator,
                                     gather_deepspeed3_params=session.train.ds3_gather_for_generation):
        yield


def runs_earlier_loss(train: TrainingConfig) -> bool:
    """Whether the trace runs an earlier step's loss first (`earlier_loss`)."""
    return train.zero_stage == 3 and train.ds3_gather_for_generation


def loss_micro_batches(train: TrainingConfig) -> int:
    """How many of the loss's micro-batches the trace runs: the first, before any gradient exists, and a later one,
    where every gradient does; under ZeRO-3 on several GPUs a third where a generation round serves three or more
    (steps_per_generation), the first whose coordinator may prefetch. A forward-only trace of the modules' order left
    before the loss (the policy's engine scoring log-probs, or generating without the gather) is complete at the
    first micro-batch's forward, which follows it, and its backward invalidates it (`trace_prologue`,
    partitioned_param_coordinator.py:202-219): the second records, the third prefetches up to max_live_parameters,
    in the step or in the next, which does not generate. The sharded trace of Qwen3-0.6B's widths at 4 layers on 2
    with LoRA and old log-probs (steps_per_generation 6, three micro-batches): the third holds the whole model, 5.6%
    above the first two."""
    runs = 2 if train.gradient_accumulation_steps > 1 else 1
    if train.zero_stage == 3 and train.num_gpus > 1 and train.steps_per_generation_resolved >= 3:
        return 3
    return runs


def earlier_loss(session: Session, run_training: Callable[[Session], Any]) -> None:
    """ZeRO-3 with `ds3_gather_for_generation`: the loss forward and backward of an earlier step, run uncounted
    before the step's phases, so that the step's loss finds DeepSpeed's parameter coordinator as every step after the
    first does. `run_training` is the trace's loss phase (tracing.trainer.run_training), passed in because that
    module imports this one.

    The coordinator records the order of the modules' gathers in the first forward and backward it sees
    (partitioned_param_coordinator.py:251-280: `reset_step`, at each forward's start, parameter_offload.py:303-306,
    turns INVALID into RECORD, RECORD into COMPLETE); with the trace COMPLETE it prefetches ahead until
    `stage3_max_live_parameters` are gathered (:452-484) and keeps a parameter whose later use the prefetch reached or
    that is used again within `stage3_max_reuse_distance` (:634-666). TRL's gathered generation removes the modules'
    hooks but not that forward pre-hook, and from TRL 1.5 on invalidates the trace when it puts them back
    (trl/models/utils.py:83-100, :147-150): the step's first micro-batch records again, as the first step's did, and
    this changes nothing there; before 1.5 every step's loss finds the trace complete. Without the gather the
    generation's own forwards record a forward-only trace that the loss's backward invalidates (:202-219), at every
    step alike: nothing to run then. The optimizer step that ends the earlier step releases every gathered parameter
    and zeroes the gradients (stage3.py:2878, :2370-2374)."""
    tracker = session.tracker
    with tracker.transients_unrecorded():
        run_training(session)
        session.optimizer._partition_all_parameters()
        session.optimizer.zero_grad()
    tracker.reset_peak()


def backward(session: Session, loss: Any, last: bool) -> None:
    """accelerate's `DeepSpeedEngineWrapper.backward` (accelerate/utils/deepspeed.py): the accumulation boundary set
    on the last micro-batch, then the engine's backward (its step is the optimizer phase)."""
    session.engine.set_gradient_accumulation_boundary(is_boundary=last)
    session.engine.backward(loss)


def run_step(session: Session) -> PhasePeak:
    """`engine.step()` as every step after the first runs it, Adam's moments alive from its start (their bytes to
    `session.state_bytes`): ZeRO's fp32 gradient partition, the client optimizer's update of the fp32 master
    partition, the 16-bit parameters refreshed from it."""
    _states_of_earlier_steps(session)
    tracker = session.tracker
    client = session.optimizer.optimizer
    step = client.step

    def counted_step(*args: Any, **kwargs: Any) -> Any:
        # ZeRO sets the fp32 gradient partition as the master partition's .grad just before (stage_1_and_2.py:3118
        # and :3126, stage3.py `_prepare_fp32_grad_for_sub_group`)
        for group in client.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    tracker.track(p.grad, GRADS)
        tracker.assumed_number = 1  # the step count, read for bias corrections
        try:
            with tracker.tagged(STEP, "optimizer step: the update of the fp32 partition"):
                return step(*args, **kwargs)
        finally:
            tracker.assumed_number = 0

    client.step = counted_step
    # Before it, ZeRO reads its overflow flag on the host: 0 (no overflow; bf16 has no loss scale to skip for)
    tracker.moment, tracker.assumed_number = "optimizer step: the fp32 gradient partition", 0
    tracker.reset_peak()
    try:
        # What ZeRO allocates in its step besides the update: the 16-bit gradients flattened and their fp32 copy
        # (stage_1_and_2.py:3114-3118, stage3.py:2686-2687), the norms' scalars
        with tracker.tagged(GRADS):
            session.engine.step()
    finally:
        del client.step
    return step_peak(session, client)


def _states_of_earlier_steps(session: Session) -> None:
    """The client optimizer's states as an earlier step left them, made by DeepSpeed's own `_optimizer_step` of each
    group (ZeRO-1/2, zero/stage_1_and_2.py:2967) or sub-group (ZeRO-3, zero/stage3.py:1235) over a zero fp32 gradient.

    The first step makes Adam's moments lazily, in the client's step, after ZeRO has built the fp32 gradient
    partition from the 16-bit one (stage_1_and_2.py:3114-3118, stage3.py:2686-2687); every later step builds it with
    the moments alive, 8 bytes per parameter of the partition more at that moment than the first step holds. The
    real 2-rank CPU run (benchmarks/deepspeed_cpu.py) measures its second step apart: ZeRO-3's is this one's to a few
    kilobytes.
    """
    import torch

    tracker, optimizer = session.tracker, session.optimizer
    masters = getattr(optimizer, "fp32_partitioned_groups_flat", None) or optimizer.single_partition_of_fp32_groups
    tracker.moment, tracker.assumed_number = "an earlier optimizer step", 1
    with tracker.tagged(STATES):
        for i, master in enumerate(masters):
            master.grad = torch.zeros_like(master)
            optimizer._optimizer_step(i)
            master.grad = None
    # torch keeps a non-fused optimizer's step scalars on the host (tracing.optimizer_peak)
    tracker.forget(host_step_scalars(optimizer.optimizer))
    tracker.assumed_number = 0
