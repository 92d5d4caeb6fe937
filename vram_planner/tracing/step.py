"""The trace engine: exact tensor bytes of one GRPO step, counted on the CPU with no GPU and no real memory.

`trace_step` builds the transformers model from its config.json on torch FakeTensors (shapes and dtypes, no data),
wraps it as the installed TRL does (PEFT, from TRL 1.15 the fused LM head, checkpointing) and runs the step's phases
through the installed transformers and TRL code (the GRPOTrainer's own scoring and loss, vram_planner.tracing.trainer)
while a dispatch mode counts every live tensor storage. The phases and their peaks follow
../shared/design/grpo-memory.md; the torch side lives in `vram_planner.tracing` (imported only when a trace runs).

What the trace measures is what `torch.cuda.memory_allocated` would report on one CUDA device (blocks rounded to
512 bytes), not the CUDA context, cuBLAS workspaces or the caching allocator's reserve; it also records every
allocation and free in order (`TraceResult.events`), which `vram_planner.tracing.reserve` replays through the
allocator model for the reserve. Fake tensors cannot sit on a
fake "cuda" device in a CPU-only torch (autograd aborts), so CPU kernels run; where that changes allocations,
`tracing.patches.cuda_like_behaviour` takes the CUDA path (TRL's compact fused LM head, its in-place Triton kernels,
cuBLAS fp32-output addmm; foreach optimizers, whose `step` scalars CUDA keeps on the host), and autograd's in-place
gradient sums are restored (`LiveBytes`). Left as the CPU does it: SDPA runs the CPU flash kernel where CUDA runs the
memory-efficient one (both keep the output and a float32 log-sum-exp; CUDA pads it to 32 queries), and CPU autocast
does not upcast exp/log/softmax as CUDA's does (no decoder forward feeds them bf16).
Generation runs the prefill and the last decoding step only (the KV cache only grows), with the cache grown in
between as the decoding steps grow it; values fake tensors lack (padding checks, EOS stops) are assumed and listed
in the result's notes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vram_planner.errors import VramPlanError, field_name, first_line
from vram_planner.extras import TRAIN_EXTRA, library_log_warnings_hidden, require_bitsandbytes, require_train_extra
from vram_planner.model import zero
from vram_planner.model.components import zero_heaviest_rank, zero_on_several_ranks, zero_optimizer_groups
from vram_planner.model.phases import TENSOR_COMPONENTS, Estimate
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.trl_releases import TrlRelease, installed_trl_version, installed_version, parse_version
from vram_planner.tracing.events import OPTIMIZER, Event, SteadyStream, steady_stream
from vram_planner.tracing.support import check_kernels_importable, check_supported_pair, pair_for, zero_problems
from vram_planner.units import format_gib


@dataclass(frozen=True)
class TracePhase:
    """The peak of live tensor bytes in one phase of the step, split by component."""

    name: str
    peak_bytes: int
    components: dict[str, int]  # names from vram_planner.model.phases.TENSOR_COMPONENTS
    moment: str  # where in the phase the peak happened
    seconds: float  # wall time of tracing this phase

    @property
    def tensor_bytes(self) -> int:
        return self.peak_bytes


@dataclass(frozen=True)
class TraceResult:
    """One traced GRPO step: its phases at steady state (optimizer states alive from step 2 on)."""

    phases: tuple[TracePhase, ...]
    params: int  # the model's parameters, LoRA adapters excluded (as Estimate.params)
    trainable_params: int
    seconds: float  # wall time of the whole trace, model building included
    notes: tuple[str, ...] = field(default=())
    # Every allocation and free in order: the models' loading, then step 1's phases (vram_planner.tracing.events)
    events: list[Event] = field(default_factory=list, repr=False)
    gradient_blocks: tuple[tuple[int, int], ...] = ()  # (block, bytes) of the gradients zero_grad frees after it
    zero_rank: int = 0  # under ZeRO on several GPUs, the rank of num_gpus traced

    def steady_stream(self) -> SteadyStream:
        """The events of step 1 and step 2, for the allocator model (`vram_planner.tracing.events.steady_stream`)."""
        return steady_stream(self.events, self.gradient_blocks)

    def phase(self, name: str) -> TracePhase:
        for p in self.phases:
            if p.name == name:
                return p
        raise KeyError(f"no phase {name!r} in this trace (phases: {', '.join(p.name for p in self.phases)})")

    @property
    def peak_phase(self) -> TracePhase:
        return max(self.phases, key=lambda p: p.peak_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.peak_phase.peak_bytes


@dataclass(frozen=True)
class PhaseComparison:
    """Trace against analytic estimate for one phase; relative error is (analytic - trace) / trace."""

    name: str
    trace_bytes: int
    analytic_bytes: float
    components: dict[str, tuple[int, float]]  # component -> (trace, analytic)

    @property
    def relative_error(self) -> float:
        return (self.analytic_bytes - self.trace_bytes) / self.trace_bytes if self.trace_bytes else 0.0


def trace_step(arch_config: dict[str, Any], train: TrainingConfig, release: TrlRelease | None = None,
               progress: Callable[[str], None] | None = None, zero_rank: int | None = None) -> TraceResult:
    """Trace one GRPO step of `train` on the model described by `arch_config` (a config.json dict).

    Args:
        arch_config: the model's config.json as a dict (multimodal configs are not supported).
        train: the training configuration.
        release: the TRL release to plan for; the trace runs the installed TRL, so it must behave the same.
        progress: called with what the trace is doing as it moves from one part to the next.
        zero_rank: under --zero-stage, the rank of num_gpus traced; None: the one whose loss phase the planner counts
            (`vram_planner.model.components.zero_heaviest_rank`).

    Returns:
        Per phase ("generation", "scoring" when old or reference log-probs are computed, "training", "optimizer")
        the peak live tensor bytes and their split by component; under --fsdp, those of rank 0 of num_gpus, the
        largest shard (vram_planner.tracing.sharded); under --zero-stage, those of `zero_rank` under DeepSpeed's own
        engine (vram_planner.tracing.zero).

    Raises:
        VramPlanError: for what the trace cannot run on the CPU (vLLM, DDP over several GPUs, ZeRO
            stage 0 or offload or without DeepSpeed, Liger kernels, FlashAttention-2, paged optimizers), a TRL release
            other than the installed one's behaviour, or sequences longer than the model's max_position_embeddings;
            before the model is built.
    """
    from vram_planner.model.architecture import ModelArchitecture

    arch = ModelArchitecture.from_config(arch_config)
    notes = check_traceable(train, release, arch.max_position_embeddings, arch_config.get("model_type"))
    if zero_rank is None:
        zero_rank = zero_heaviest_rank(arch, train, "training")
    if zero_rank:
        notes.append(f"rank {zero_rank} of {train.num_gpus} traced, whose ZeRO-{train.zero_stage} partition the "
                     "planner counts: it holds more than rank 0's")
    notes += _planned_on_another_rank(arch, train, zero_rank)
    start = time.perf_counter()
    with library_log_warnings_hidden():
        _import_engine()
    from vram_planner.tracing import phases as tp
    from vram_planner.tracing.counter import GRADS
    from vram_planner.tracing.patches import cuda_like_behaviour, head_tagging, layer_marking
    from vram_planner.tracing.session import build_session
    from vram_planner.tracing.sharded import sharded_rank
    from vram_planner.tracing.zero import earlier_loss, runs_earlier_loss
    from vram_planner.tracing.zero import zero_rank as zero_engine

    from vram_planner.tracing import trainer as own

    # The scoring passes and the loss are the installed GRPOTrainer's own methods (tracing.trainer)
    recipe = tp.optimizer_recipe(train)
    runs = [("generation", "generation", tp.run_generation),
            ("scoring", "old/reference log-probs", own.run_scoring),
            ("training", "loss forward and backward", own.run_training),
            (OPTIMIZER, "the optimizer step", functools.partial(tp.run_optimizer, recipe=recipe))]
    if not (train.computes_old_logps or train.computes_ref_logps) or train.release.step_structure == "loss_merged":
        del runs[1]  # TRL 0.14 scores inside compute_loss
    again = 0
    if train.release.generation_batch == "micro_batch" and train.gradient_accumulation_steps > 1:
        # TRL 0.14-0.16 generate (and score) each micro-batch inside the accumulation: from the second on with the
        # gradients of the earlier ones alive. They run again after the training phase, as the next micro-batch's;
        # their peaks count for their own phases, their events for the training phase (between its micro-batches).
        again = len(runs) - 2
        runs[-1:-1] = [(phase, f"{label} of the next micro-batch", run) for phase, label, run in runs[:again]]
    say = progress or (lambda what: None)
    with _quiet():
        say("building the model on fake tensors")
        with _explained("building the model"):
            session = build_session(arch_config, train)
            # the installed GRPOTrainer whose own loss runs, made outside the fake-tensor world
            session.trainer = own.build_trainer(session)
        # Under --fsdp, sharded_rank shards the models and replaces the counter (tracing.sharded): entered first.
        # Under --zero-stage, zero_rank builds DeepSpeed's engine around the model, counted (tracing.zero).
        with sharded_rank(session), session.fake_mode, session.tracker, zero_engine(session, recipe, zero_rank), \
                cuda_like_behaviour(session), head_tagging(session), layer_marking(session):
            if runs_earlier_loss(train):  # ZeRO-3's coordinator as every later step finds it (tracing.zero)
                say("tracing an earlier step's loss")
                with _explained("tracing an earlier step's loss"):
                    earlier_loss(session, own.run_training)
            peaks = []
            for i, (phase, label, run) in enumerate(runs):
                say(f"tracing {label}")
                repeated = len(runs) - 1 - again <= i < len(runs) - 1
                session.tracker.phase = "training" if repeated else phase
                session.tracker.moment = phase  # until the phase names its moments
                with _explained(f"tracing {label}"):
                    peaks.append(_timed(run, session))
                if repeated:
                    peaks[-1].moment += ", next micro-batch (gradients alive)"
    peaks = _largest_per_phase(peaks)
    trainable = sum(p.numel() for p in session.model.parameters() if p.requires_grad)
    # As Estimate.params counts them: the model's own parameters; with LoRA the adapters are the trainable ones.
    params = sum(p.numel() for p in session.model.parameters()) - (trainable if train.uses_lora else 0)
    # The phases before the first optimizer step run without optimizer states; every later step carries them, and
    # they neither grow nor interact with anything else, so adding them gives the steady state exactly.
    phases = [_phase(p, session.state_bytes) for p in peaks[:-1]] + [_phase(peaks[-1], 0)]
    notes += _assumption_notes(session.tracker.assumptions)
    # Taken away from the counter, which records the frees of the whole session when it is dropped.
    events, session.tracker.events = session.tracker.events, []
    return TraceResult(phases=tuple(phases), params=params, trainable_params=trainable,
                       seconds=time.perf_counter() - start, notes=tuple(notes), events=events,
                       gradient_blocks=tuple(session.tracker.live_blocks(GRADS)), zero_rank=zero_rank)


def trace_phases_on_their_ranks(arch_config: dict[str, Any], train: TrainingConfig,
                                release: TrlRelease | None = None) -> list[tuple[int, TracePhase]]:
    """Each phase of the step traced on the rank the planner counts there (under ZeRO-1/2 the ranks' partitions
    differ: `vram_planner.model.components.zero_heaviest_rank`), one `trace_step` per rank needed, in the order of
    the phases: (rank, phase). Without ZeRO on several GPUs, one trace of rank 0."""
    from vram_planner.model.architecture import ModelArchitecture

    arch = ModelArchitecture.from_config(arch_config)
    traced: dict[int, TraceResult] = {}

    def on(rank: int) -> TraceResult:
        if rank not in traced:
            traced[rank] = trace_step(arch_config, train, release, zero_rank=rank)
        return traced[rank]

    order = on(zero_heaviest_rank(arch, train, "generation")).phases
    ranks = [zero_heaviest_rank(arch, train, phase.name) for phase in order]
    return [(rank, on(rank).phase(phase.name)) for rank, phase in zip(ranks, order, strict=True)]


def _planned_on_another_rank(arch: Any, train: TrainingConfig, rank: int) -> list[str]:
    """A note where ZeRO-2's phases before the step are planned on a rank other than the traced one (the rank
    whose partition keeps the most whole gradients, `zero_heaviest_rank`): their analytic figures beside the trace
    count that rank's. The step's are compared for the traced rank (`compare_with_estimate`)."""
    if not zero_on_several_ranks(train) or train.zero_stage != 2:
        return []
    planned = zero_heaviest_rank(arch, train, "training")
    if planned == rank:
        return []
    groups = zero_optimizer_groups(arch, train)
    more = (zero.whole_gradient_elements(groups, train.num_gpus, planned)
            - zero.whole_gradient_elements(groups, train.num_gpus, rank)) * zero.REDUCE_BUCKET_ELEMENT_BYTES
    return [f"the phases before the optimizer step are planned on rank {planned}, whose ZeRO-2 partition keeps "
            f"{format_gib(more)} more whole gradients than rank {rank}'s: their analytic figures beside this trace "
            "count that rank's"]


def _largest_per_phase(peaks: list[Any]) -> list[Any]:
    """One peak per phase, in the order the phases first ran: the larger where a phase ran twice."""
    largest: dict[str, Any] = {}
    for peak in peaks:
        if peak.name not in largest or peak.peak_bytes > largest[peak.name].peak_bytes:
            largest[peak.name] = peak
    return list(largest.values())


def engine_versions() -> dict[str, str]:
    """The installed versions of what a trace (or a probe) runs, by package name: accelerate too, which prepares the
    model (autocast, the float32 copy of the outputs, FSDP's sharding) for TRL's trainer."""
    import importlib.metadata as md

    return {package: md.version(package) for package in ("torch", "transformers", "trl", "peft", "accelerate")}


def check_traceable(train: TrainingConfig, release: TrlRelease | None = None,
                    max_position_embeddings: int | None = None, model_type: str | None = None) -> list[str]:
    """Raise VramPlanError for what the CPU trace cannot run; return notes on what it approximates."""
    require_train_extra("the trace")
    problems = []
    if max_position_embeddings and train.sequence_length > max_position_embeddings:
        problems.append(f"prompt + completion ({train.sequence_length} tokens) is longer than the model's "
                        f"max_position_embeddings ({max_position_embeddings}), so it has no positions for them")
    if train.load_in_4bit:
        require_bitsandbytes(f"tracing 4-bit weights ({field_name('load_in_4bit')})")
        if train.zero_stage is not None or train.fsdp:  # DeepSpeed and FSDP flatten the packed weights apart
            problems.append(f"4-bit weights ({field_name('load_in_4bit')}) are traced on one GPU, not sharded under "
                            "DeepSpeed ZeRO or FSDP")
    if train.use_vllm:
        problems.append(f"vLLM generation ({field_name('use_vllm')}) runs outside torch")
    if train.zero_stage is not None:
        problems += zero_problems(train)
    elif train.num_gpus > 1 and not train.fsdp:
        problems.append(f"the trace covers one GPU, or one rank of FSDP2 ({field_name('fsdp')}), not DDP over "
                        "several GPUs")
    elif train.offloaded:
        problems.append(f"the trace runs FSDP2 without its CPU offload ({field_name('offload_param')} cpu): check plans it")
    if train.use_liger_kernel:
        problems.append(f"Liger kernels ({field_name('use_liger_kernel')}) are Triton kernels")
    if train.attn_implementation == "flash_attention_2":
        problems.append(f"FlashAttention-2 has no CPU kernel; trace with {field_name('attn_implementation')} sdpa")
    if train.optim.needs_bitsandbytes and not train.optim.is_paged:
        require_bitsandbytes(f"tracing {field_name('optim')} {train.optim.value}")
    if train.optim.is_paged:
        problems.append(f"paged optimizers ({field_name('optim')} {train.optim.value}) keep their states in CUDA "
                        "managed memory, "
                        "outside torch's allocator")
    installed = installed_version("transformers")
    installed_trl = installed_trl_version()
    if installed and installed_trl:  # without metadata (a source checkout) the installed code is trusted
        check_supported_pair(installed_trl, installed)
        check_kernels_importable(installed_trl)
    parsed = parse_version(installed) if installed else None
    if model_type in PREALLOCATED_CACHE_TYPES and parsed is not None and parsed[0] < PREALLOCATED_CACHE_BELOW:
        problems.append(f"transformers {installed} generates {model_type} into a preallocated HybridCache, which the "
                        "trace does not model (from transformers 4.53 that cache grows as the trace grows it)")
    if train.transformers_version is not None and (parsed is None or train.transformers.version != parsed[1]):
        problems.append(f"it runs the installed transformers {installed}, not {field_name('transformers_version')} "
                        f"{train.transformers.version}")
    notes = _release_notes(release, problems)
    if problems:
        raise VramPlanError("the trace cannot run this config: " + "; ".join(problems)
                            + " (`vram-plan check` gives the analytic estimate)")
    return notes


# Gemma 2 and 3 generate into a HybridCache allocated at the generation's full length before transformers 4.53
# (modeling_gemma2.py / modeling_gemma3.py of 4.52 import it; 4.53 generates them into DynamicCache layers).
PREALLOCATED_CACHE_TYPES = ("gemma2", "gemma3", "gemma3_text")
PREALLOCATED_CACHE_BELOW = (4, 53, 0)


def _release_notes(release: TrlRelease | None, problems: list[str]) -> list[str]:
    """The trace runs the installed TRL's code: another release (--trl-version) cannot be traced, only planned."""
    installed = installed_trl_version()
    if installed is None:  # require_train_extra found TRL importable: a source checkout without metadata
        return []
    parsed = parse_version(installed)
    if release is None or release.version in ("", installed) or (parsed and parsed[1] == release.version):
        return []
    if release.note:  # the installed TRL is outside the table and was read as the newest release: its code is traced
        return [f"traced with the installed TRL {installed}"]
    problems.append(f"it runs the installed TRL {installed}, not {field_name('trl_version')} {release.version} (to "
                    "trace that "
                    f"release, install it with a transformers it runs with: {pair_for(release.version)})")
    return []


def compare_with_estimate(result: TraceResult, estimate: Estimate,
                          rank_excess_bytes: dict[str, int] | None = None) -> list[PhaseComparison]:
    """Each traced phase next to the analytic phase of the same name (tensor bytes only). `rank_excess_bytes`: per
    phase, the gradient bytes the rank the estimate counts holds above the traced one (under ZeRO,
    `vram_planner.model.components.zero_rank_excess_bytes`), taken off the analytic side so that both are the
    traced rank's."""
    analytic = {p.name: p for p in estimate.phases}
    excess = rank_excess_bytes or {}
    rows = []
    for phase in result.phases:
        other = analytic.get(phase.name)
        if other is None:
            continue
        more = excess.get(phase.name, 0)
        components = {c: (phase.components.get(c, 0), other.components.get(c, 0.0) - (more if c == "gradients" else 0))
                      for c in TENSOR_COMPONENTS}
        rows.append(PhaseComparison(phase.name, phase.peak_bytes, other.tensor_bytes - more, components))
    return rows


def _timed(run: Callable[[Any], Any], session: Any) -> Any:
    start = time.perf_counter()
    peak = run(session)
    peak.seconds = time.perf_counter() - start
    return peak


def _phase(peak: Any, extra_states: int) -> TracePhase:
    components = {c: int(peak.split.get(c, 0)) for c in TENSOR_COMPONENTS}
    components["optimizer_states"] += extra_states
    return TracePhase(peak.name, int(peak.peak_bytes) + extra_states, components, peak.moment, peak.seconds)


def _assumption_notes(assumptions: Any) -> list[str]:
    """One note per assumption, with the places that needed it: 'what (at file:line, line; file:line)'."""
    sites: dict[str, dict[str, list[str]]] = {}
    for what, site in sorted(assumptions):
        file, _, line = site.rpartition(":")
        sites.setdefault(what, {}).setdefault(file, []).append(line)
    return [f"{what} (at " + "; ".join(f"{file}:{','.join(lines)}" for file, lines in files.items()) + ")"
            for what, files in sites.items()]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers and torch warn about things that do not matter on fake tensors (autocast on CPU, ...), and
    FakeTensorMode logs a traceback of every op that fails before raising it; the error itself is reported."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    fake_tensor_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_tensor_disabled = fake_tensor_log.disabled
    fake_tensor_log.disabled = True
    try:
        with warnings.catch_warnings(), library_log_warnings_hidden():
            warnings.simplefilter("ignore")
            yield
    finally:
        fake_tensor_log.disabled = fake_tensor_disabled
        transformers.logging.set_verbosity(verbosity)


def _import_engine() -> None:
    """The packages the trace runs, or one line saying how to install them."""
    try:
        # torch first: transformers without it only warns (on stderr) and fails later
        import torch  # noqa: F401
        import transformers  # noqa: F401
        import peft  # noqa: F401
        import trl  # noqa: F401
    except ImportError as exc:  # installed but broken: require_train_extra only finds the packages
        missing = exc.name or str(exc)
        raise VramPlanError(f"the trace needs torch, transformers, TRL and PEFT ({missing} cannot be imported): "
                            f"{TRAIN_EXTRA}") from exc

    def load() -> Any:
        from trl import GRPOTrainer  # TRL imports its trainers lazily: here, not halfway through the trace

        return GRPOTrainer

    require_grpo_trainer(installed_trl_version() or trl.__version__, load)


# Why a TRL release's GRPOTrainer import needs a module the release does not require, and what works instead (a run
# on that release fails the same way). weave: TRL 0.27.2 and 0.28.0 ask transformers' private `_is_package_available`
# (trl/import_utils.py:24 and :96), which from transformers 5.3 answers `(False, None)` for a missing package
# (transformers/utils/import_utils.py:78; 5.2's :77 answered False), a true tuple, so trl/trainer/callbacks.py:53-54
# imports weave; TRL 0.29 asks its own copy of the function.
UNREQUIRED_IMPORTS = {
    "weave": ("TRL 0.27.2 and 0.28.0 ask transformers whether weave is installed, and from transformers 5.3 on the "
              "answer is a tuple, true even when it is not, so TRL's callbacks import it (a run fails the same way)",
              "`pip install weave`, transformers 5.0 to 5.2, or TRL 0.29 or later"),
}


def require_grpo_trainer(version: str, load: Callable[[], Any]) -> None:
    """The installed GRPOTrainer, or one line naming the module its import needs: a release may import a package it
    does not require (`UNREQUIRED_IMPORTS` says why where it is known), and a run on that release fails the same
    way."""
    try:
        load()
    except (ImportError, RuntimeError) as exc:
        found = re.search(r"No module named '([\w.]+)'", str(exc))
        if found is None:
            raise
        module = found.group(1).split(".")[0]
        why, instead = UNREQUIRED_IMPORTS.get(module, ("", f"`pip install {module}`, or another TRL release"))
        raise VramPlanError(f"the trace cannot run TRL {version} (installed): importing its GRPOTrainer needs "
                            f"{module}, which is not installed{': ' + why if why else ''} ({instead}; "
                            "`vram-plan check` gives the analytic estimate)") from exc


@contextlib.contextmanager
def _explained(what: str) -> Iterator[None]:
    """A failure inside transformers, PEFT, TRL or torch as one line that says where the trace was (the whole
    traceback stays on the exception's cause, which `--debug` prints)."""
    try:
        yield
    except (VramPlanError, ImportError):
        raise
    except MemoryError as exc:
        raise VramPlanError(f"the trace ran out of host memory while {what} (fake tensors hold no data, so this "
                            "is the Python objects of the model); `vram-plan check` gives the analytic estimate"
                            ) from exc
    except Exception as exc:
        raise VramPlanError(f"the trace failed while {what}: {first_line(exc, 'an error without a message')}{_hint(exc)}; `vram-plan check` "
                            "gives the analytic estimate") from exc


def _hint(exc: BaseException) -> str:
    """Why the usual failures happen, in the user's words."""
    text = str(exc)
    if "overflowed" in text:
        return " (a tensor of this config would hold more than 2**63 bytes)"
    if "expanded size of the tensor" in text:  # learned position embeddings shorter than the sequence
        return " (are the prompt and completion longer than the model's max_position_embeddings?)"
    return ""
