"""`vram-plan advise`: explain an out-of-memory error with the memory model and rank the fixes.

Without a config it reads the figures alone (fragmentation, other processes, memory outside PyTorch). With the run's
model, GPU and knobs it also names the tensor that most likely asked for the failed allocation, and takes the
fixes, with the bytes each saves, from the planner's ladder.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel

from vram_planner.advise.oom_log import OomError
from vram_planner.units import GiB

# Reserved-but-unallocated memory this large, and larger than the failed request, points at fragmentation.
FRAGMENTATION_BYTES = int(0.5 * GiB)
OTHER_PROCESS_BYTES = int(0.25 * GiB)


class Fix(BaseModel):
    change: str  # a knob and its new value, an environment variable, an upgrade
    saves_bytes: int | None
    cost: str  # what it costs in quality or speed
    why: str


class Advice(BaseModel):
    error: OomError
    diagnosis: list[str]
    culprit: str | None = None  # the tensor that most likely asked for the failed allocation
    phase: str | None = None
    fixes: list[Fix] = []
    fitting_config: dict[str, Any] | None = None


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def diagnose(error: OomError) -> tuple[list[str], list[Fix]]:
    """What the figures alone say, and the fixes that follow from them."""
    notes, fixes = [], []
    if error.kind == "vllm_kv_cache":
        notes.append("vLLM could not fit the KV cache for max_model_len in its share of the card")
        fixes.append(Fix(change="--vllm-gpu-memory-utilization higher, or a shorter --max-completion-length",
                         saves_bytes=None, cost="less memory left for training", why="vLLM's share holds the cache"))
    elif error.kind == "vllm_gpu_memory_utilization":
        notes.append("vLLM asked for a fraction of the whole card while training already holds part of it")
        fixes.append(Fix(change="--vllm-gpu-memory-utilization lower (colocate) or --vllm-enable-sleep-mode",
                         saves_bytes=None, cost="a smaller KV cache for generation", why="the fraction is of the card"))
    elif error.kind in ("cublas", "cudnn"):
        notes.append(f"{error.kind} could not allocate its workspace: the card was already full")
    elif error.kind == "bitsandbytes":
        notes.append("bitsandbytes ran out of memory (its 8-bit optimizer or 4-bit kernels)")
    unallocated = error.reserved_unallocated or 0
    if unallocated >= FRAGMENTATION_BYTES and (error.tried_to_allocate or 0) <= unallocated:
        notes.append(f"fragmentation: {_gib(unallocated)} is reserved by PyTorch but unallocated, more than the "
                     f"{_gib(error.tried_to_allocate or 0)} that failed")
        if not error.expandable_segments:
            fixes.append(Fix(change="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", saves_bytes=unallocated,
                             cost="none", why="segments grow in place instead of leaving holes"))
    others = sum(error.other_processes.values())
    if others >= OTHER_PROCESS_BYTES:
        pids = ", ".join(f"{pid} ({_gib(n)})" for pid, n in error.other_processes.items())
        notes.append(f"other processes hold {_gib(others)} of the card: {pids}")
        fixes.append(Fix(change="stop the other processes on this GPU", saves_bytes=others, cost="none",
                         why="their memory is not this run's"))
    if error.process_in_use and error.allocated_by_pytorch is not None:
        outside = error.process_in_use - error.allocated_by_pytorch - unallocated
        if outside > 0:
            notes.append(f"{_gib(outside)} of this process is outside PyTorch's allocator (CUDA context, cuBLAS "
                         "workspaces, vLLM)")
    return notes, fixes


def attribute(error: OomError, verdict: Any) -> tuple[str | None, str | None]:
    """The component or buffer of the plan whose size is nearest the failed allocation, and its phase."""
    if not error.tried_to_allocate:
        return None, None
    from vram_planner.model.components import sizes

    arch, train = verdict.context.arch, verdict.train
    s = sizes(train)
    b, c, v, h = train.micro_batch_completions, train.max_completion_length, arch.vocab_size, arch.hidden_size
    if verdict.context.release.lm_head == "fused_chunked":
        candidates = {"a logits tile of the fused LM head": (min(b * c, 4096) * 32768 * s.compute,
                                                             "loss forward/backward")}
    else:
        candidates = _full_logits_candidates(train, verdict.context.release.version, v)
    candidates |= {
        "the LM head's fp32 weight gradient (V x h)": (v * h * 4, "loss forward/backward"),
        "one fp32 Adam state of the embedding (created at the first optimizer step)": (v * h * 4, "optimizer step"),
        "the KV cache of one layer for the generation batch": (
            train.local_generation_batch_size * train.sequence_length * arch.num_kv_heads * arch.head_dim * 2
            * s.residual, "generation"),
        "an MLP activation of one layer": (b * train.sequence_length * arch.intermediate_size * s.compute,
                                           "loss forward/backward"),
    }
    if train.distributed == "ddp":
        candidates["a DDP gradient bucket (25 MiB by default)"] = (25 * 2**20, "loss forward/backward")
    frames = " ".join(error.frames).lower()
    hints = {"optimizer": "optimizer step", "step": "optimizer step", "generate": "generation",
             "backward": "loss forward/backward", "logp": "loss forward/backward"}
    hinted = {phase for word, phase in hints.items() if word in frames}

    def distance(item: tuple[str, tuple[int, str]]) -> float:
        size, phase = item[1]
        return abs(math.log(max(size, 1) / error.tried_to_allocate)) - (0.5 if phase in hinted else 0)

    name, (size, phase) = min(candidates.items(), key=distance)
    if abs(math.log(max(size, 1) / error.tried_to_allocate)) > math.log(1.5):
        return None, next(iter(hinted), None)
    return name, phase


def _full_logits_candidates(train: Any, version: str, vocab: int) -> dict[str, tuple[int, str]]:
    """The logits of a micro-batch as a release without the fused head makes them: float32 under mixed precision
    (accelerate's copy of the model's output); without autocast in the weights' dtype, and a float32 match then
    says the run had mixed precision on."""
    from vram_planner.model.components import sizes

    b, c = train.micro_batch_completions, train.max_completion_length
    shape = f"{b} completion{'s' * (b != 1)} x {c + 1} positions x {vocab} vocabulary entries"
    fp32 = f"the fp32 logits of a micro-batch: {shape} (TRL {version} materialises them)"
    logits, phase = b * (c + 1) * vocab, "loss forward/backward"
    compute = sizes(train).compute
    if train.mixed_precision != "no" or compute == 4:
        return {fp32: (logits * 4, phase)}
    return {fp32 + "; they are float32 only under mixed precision, so the run most likely had bf16=True":
            (logits * 4, phase),
            f"the {train.dtype} logits of a micro-batch: {shape} (TRL {version} materialises them)":
            (logits * compute, phase)}


def advise(error: OomError, context: Any = None, train: Any = None) -> Advice:
    notes, fixes = diagnose(error)
    advice = Advice(error=error, diagnosis=notes, fixes=fixes)
    if context is None or train is None:
        return advice
    from vram_planner.model.grpo_config import grpo_config_kwargs
    from vram_planner.model.search import best_plan, with_expandable_segments
    from vram_planner.model.spec import with_changes
    from vram_planner.model.verdict import judge

    if error.expandable_segments and not train.expandable_segments:  # the message shows the run had them on
        train = with_changes(train, allocator_conf=with_expandable_segments(train.allocator_conf))
    verdict = judge(context, train)
    advice.culprit, advice.phase = attribute(error, verdict)
    if not train.expandable_segments and not verdict.fits:
        advice.diagnosis.append(_expandable_rescue(context, train, verdict))
        # the plan's own change says what they save from the model; the message's unallocated bytes are only a bound
        fixes = [f for f in fixes if not f.change.startswith("PYTORCH_CUDA_ALLOC_CONF")]
    plan = best_plan(context, train)
    ranked = _plan_fixes(plan.changes)
    upgrade = _upgrade_fix(context, train, verdict)
    if upgrade is not None:
        ranked.append(upgrade)
    advice.fixes = sorted(fixes + ranked, key=lambda f: -(f.saves_bytes or 0))
    if plan.chosen is not None:
        advice.fitting_config = grpo_config_kwargs(plan.chosen.train)
    return advice


def _expandable_rescue(context: Any, train: Any, verdict: Any) -> str:
    """Whether PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True alone would have let the run fit, by the allocator
    reserve fitted over replays of traced steps through the caching allocator model."""
    from vram_planner.model.search import with_expandable_segments
    from vram_planner.model.spec import with_changes
    from vram_planner.model.verdict import judge

    expandable = judge(context, with_changes(train, allocator_conf=with_expandable_segments(train.allocator_conf)))
    verb = "would have" if expandable.fits else "would not have"
    return (f"expandable_segments:True alone {verb} rescued this run: with them the model's peak is "
            f"{_gib(expandable.estimate.peak_bytes)} against {_gib(verdict.estimate.peak_bytes)} without (the "
            f"allocator's reserve as fitted over replays of the caching allocator model), on "
            f"{_gib(context.budget_bytes)} usable")


def _upgrade_fix(context: Any, train: Any, verdict: Any) -> Fix | None:
    """The same training on the installed (or newest known) TRL, when that release needs less memory: the knobs
    translated to its meaning (completions per micro-batch, the same generation batch), every other value kept."""
    from dataclasses import replace

    from vram_planner.errors import ConfigError
    from vram_planner.model.spec import with_changes
    from vram_planner.model.trl_releases import trl_release
    from vram_planner.model.verdict import judge

    current = trl_release()
    if current.version == context.release.version:
        return None
    generates_per_micro_batch = train.steps_per_generation_resolved < train.gradient_accumulation_steps
    try:
        same = with_changes(train, trl_version=current.version,
                            per_device_train_batch_size=train.micro_batch_completions,
                            steps_per_generation=train.steps_per_generation_resolved if generates_per_micro_batch
                            else train.steps_per_generation)
    except ConfigError:
        return None
    saved = verdict.estimate.peak_bytes - judge(replace(context, release=current), same).estimate.peak_bytes
    if saved <= 0:  # an upgrade that needs more memory for this config is no fix
        return None
    why = "the same training with less memory"
    if current.lm_head == "fused_chunked" and context.release.lm_head != "fused_chunked":
        why = "its fused LM head never materialises the logits"
    return Fix(change=f"pip install 'trl>={current.version}'", saves_bytes=round(saved),
               cost="none (same training, a newer TRL)", why=why)


def _plan_fixes(changes: Any) -> list[Fix]:
    """The plan's steps as fixes that stand alone: each applies every step up to it (a step is measured after the
    ones before it, so alone it may not even be valid), and saves what they save together. Steps that save nothing
    together yet (a larger vLLM share comes first, and costs) are no fix on their own: they join the next one."""
    from vram_planner.model.spec import command_line_flags

    fixes, settings, saved, knobs, reasons = [], {}, 0.0, [], []
    for change in changes:
        settings, saved = {**settings, **change.settings}, saved + change.net_saved_bytes
        knobs, reasons = knobs + [change.knob], reasons + [change.reason]
        if saved > 0:
            fixes.append(Fix(change=command_line_flags(settings), saves_bytes=round(saved),
                             cost=_cost(" + ".join(knobs)), why="; ".join(reasons)))
    return fixes


def _cost(knob: str) -> str:
    """What a change costs; a joined change (`lora_r + load_in_4bit`) costs what its parts cost."""
    if " + " in knob:
        return "; ".join(dict.fromkeys(_cost(part) for part in knob.split(" + ")))
    return {"allocator_conf": "none (an environment variable for the run)",
            "per_device_train_batch_size": "slower steps, same training",
            "gradient_accumulation_steps": "slower steps, same training",
            "gradient_checkpointing": "about 30% slower backward",
            "optim": "8-bit optimizer states (negligible quality loss)",
            "dtype": "bf16 weights (small quality risk)",
            "lora_r": "LoRA instead of full fine-tuning",
            "load_in_4bit": "4-bit base weights (QLoRA)",
            "vllm_max_model_length": "none (vLLM's context: the longest prompt + completion)",
            "vllm_gpu_memory_utilization": "none in quality or speed (vLLM's share of the card)"}.get(
                knob, "changes the training itself")
