"""`vram-plan advise`: explain an out-of-memory error with the memory model and rank the fixes.

Without a config it reads the figures alone (fragmentation, other processes, memory outside PyTorch). With the run's
model, GPU and knobs it also names the tensor that most likely asked for the failed allocation, and takes the
fixes, with the bytes each saves, from the planner's ladder.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel

from vram_planner.advise.candidates import MATCH_TOLERANCE
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
    removes_culprit: bool = False  # the failed allocation's tensor is not made at all after it


class Attribution(BaseModel):
    """The tensor that asked for the failed allocation, to the byte, and its moment."""

    culprit: str
    culprit_bytes: int
    requested_bytes: int
    error: float  # culprit_bytes / requested_bytes - 1
    exact: bool  # the tensor is the request (its segment rounds to the message's figure, or a snapshot's bytes)
    assumption: str | None = None  # what had to differ from the config as given for it to be exact
    phase: str
    moment: str | None = None
    first_micro_batch: bool  # the moment comes in the first micro-batch of the run, before any optimizer state
    live_bytes: int | None = None  # tensors the model counts alive just before the request, at that moment
    transformers_version: str  # the transformers release the answer was worked out for


class Advice(BaseModel):
    error: OomError
    diagnosis: list[str]
    culprit: str | None = None  # the tensor that most likely asked for the failed allocation
    phase: str | None = None
    attribution: Attribution | None = None
    transformers_version: str | None = None  # the release planned for
    transformers_version_from: Literal["flag", "log", "installed", "assumed"] | None = None
    trl_version: str | None = None  # the TRL release planned for
    trl_version_from: Literal["flag", "log", "installed"] | None = None
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


def attribute(error: OomError, verdict: Any) -> Attribution | None:
    """The tensor of the planned step that asked for the failed allocation: one whose size is the request to the
    message's rounding, or within MATCH_TOLERANCE; else one made exact by another sequence length or transformers
    release, said as that assumption. None when no tensor comes near."""
    from vram_planner.advise.candidates import best_match, explain_positions, logits_candidates, other_candidates

    request = error.tried_to_allocate
    if not request:
        return None
    arch, train, release = verdict.context.arch, verdict.train, verdict.context.release
    logits = [] if _fused(train, release) else logits_candidates(arch, train, release)
    candidates = logits + other_candidates(arch, train, release)
    exact = error.tried_to_allocate_exact
    match = best_match(candidates, request, exact)
    if match is None:  # none within MATCH_TOLERANCE: one made exact by another sequence length or release, the
        # one that asks least first (prompts no longer than the config's, then the nearest length)
        solved = [m for m in (explain_positions(c, request, train, release, exact) for c in candidates
                              if c.per_position) if m]
        match = min(solved, key=lambda m: (m.positions > train.sequence_length,
                                           abs(m.positions - m.candidate.positions)), default=None)
    elif not match.exact and match.candidate.per_position:  # accepted, with what would make it exact
        solved = explain_positions(match.candidate, request, train, release, exact)
        match = replace(match, assumption=solved.assumption) if solved else match
    if match is None:
        return None
    return _attribution(match, request, verdict)


def _fused(train: Any, release: Any) -> bool:
    from vram_planner.model.lm_head import uses_fused_head

    return uses_fused_head(train, release)


def _attribution(match: Any, request: int, verdict: Any) -> Attribution:
    """The match with its moment: the live bytes the model counts just before it, and whether that moment comes in
    the first micro-batch of the run (before any optimizer state exists) or later."""
    from vram_planner.model.phases import PHASE_TITLES, micro_batch_moments
    from vram_planner.model.spec import with_changes
    from vram_planner.model.verdict import judge

    context, train, c = verdict.context, verdict.train, match.candidate
    if match.positions and match.positions > train.max_completion_length + 1:
        changes: dict[str, Any] = {"max_prompt_length": match.positions - train.max_completion_length}
        if not c.whole_sequence and train.transformers.honours(context.release.logits_to_keep_argument):
            changes["transformers_version"] = _dropping_release(train, context.release)
        try:
            train = with_changes(train, **changes)
        except Exception:  # noqa: BLE001 (an assumption the config cannot take: the plan's own figures stay)
            pass
    first = not judge(context, train).first_micro_batch_fits
    live = None
    if c.moment:
        moments = micro_batch_moments(context.arch, train, context.release, context.calibration, first)
        at = next((m for m in moments if m.moment == c.moment), None)
        live = round(at.tensor_bytes - c.size) if at is not None else None
    return Attribution(culprit=c.described(), culprit_bytes=c.size, requested_bytes=request,
                       error=round(match.error, 6), exact=match.exact, assumption=match.assumption or None,
                       phase=PHASE_TITLES.get(c.phase, c.phase), moment=c.moment or None,
                       first_micro_batch=first if c.phase in ("generation", "scoring", "training") else False,
                       live_bytes=live, transformers_version=train.transformers.version)


def _dropping_release(train: Any, release: Any) -> str | None:
    """The first transformers release of the run's generation that ignores the keyword this TRL release passes."""
    from vram_planner.model.transformers_releases import transformers_releases
    from vram_planner.model.trl_releases import version_tuple

    rows = sorted(transformers_releases(), key=lambda r: version_tuple(r.min_version))
    seen_honouring = False
    for row in rows:
        seen_honouring = seen_honouring or row.honours(release.logits_to_keep_argument)
        if seen_honouring and not row.honours(release.logits_to_keep_argument):
            return row.min_version
    return None


def advise(error: OomError, context: Any = None, train: Any = None,
           transformers_from: Literal["flag", "log", "installed", "assumed"] = "assumed",
           trl_from: Literal["flag", "log", "installed"] = "installed") -> Advice:
    """What the figures say, and with the run's config (`transformers_from`, `trl_from`: where its transformers and
    TRL releases came from) the tensor that asked for the failed allocation, its moment, and the fixes: those that
    remove that tensor first, then by the bytes they save."""
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
    advice.transformers_version, advice.transformers_version_from = train.transformers.version, transformers_from
    advice.trl_version, advice.trl_version_from = context.release.version, trl_from
    if trl_from == "log":
        advice.diagnosis.append(f"worked out for TRL {context.release.version} (as the log says)")
    found = attribute(error, verdict)
    if found is not None:
        advice.attribution, advice.culprit, advice.phase = found, found.culprit, found.phase
        advice.diagnosis.extend(_transformers_notes(found, train, context.release, transformers_from))
    elif error.tried_to_allocate:
        advice.diagnosis.append(f"no tensor of the planned step comes within {MATCH_TOLERANCE:.0%} of the "
                                f"{_gib(error.tried_to_allocate)} request")
    if not train.expandable_segments and not verdict.fits:
        advice.diagnosis.append(_expandable_rescue(context, train, verdict))
        # the plan's own change says what they save from the model; the message's unallocated bytes are only a bound
        fixes = [f for f in fixes if not f.change.startswith("PYTORCH_CUDA_ALLOC_CONF")]
    plan = best_plan(context, train)
    ranked = _plan_fixes(plan.changes)
    logits = found is not None and "logits" in found.culprit
    upgrade = _upgrade_fix(context, train, verdict)
    if upgrade is not None:
        ranked.append(upgrade.model_copy(update={"removes_culprit": logits and "never materialises" in upgrade.why}))
    pin = None
    if logits:  # the release the answer was worked out for, where the match needed one that ignores the keyword
        answered = train if found.transformers_version == train.transformers.version else with_changes(
            train, transformers_version=found.transformers_version)
        pin = _transformers_fix(context, answered, judge(context, answered))
    if pin is not None:
        ranked.append(pin)
    advice.fixes = sorted(fixes + ranked, key=lambda f: (not f.removes_culprit, -(f.saves_bytes or 0)))
    if plan.chosen is not None:
        advice.fitting_config = grpo_config_kwargs(plan.chosen.train)
    return advice


def _transformers_notes(found: Attribution, train: Any, release: Any, source: str) -> list[str]:
    """Where the transformers release decides the answer (the logits span the completion or the whole sequence by
    it), which release it was worked out for and where that came from."""
    if "logits" not in found.culprit and "log_softmax" not in found.culprit:
        return []
    where = {"flag": "as --transformers-version says", "log": "as the log says",
             "installed": "the one installed here; pass --transformers-version, or a log that names it, if the run "
                          "used another",
             "assumed": "assumed: the newest of its time vram-plan knows; pass --transformers-version, or a log that "
                        "names it, to decide"}[source]
    honours = train.transformers.honours(release.logits_to_keep_argument)
    return [f"the transformers release decides this answer: worked out for transformers {train.transformers.version} "
            f"({where}), which {'honours' if honours else 'ignores'} the {release.logits_to_keep_argument} TRL "
            f"{release.version} passes"]


def _transformers_fix(context: Any, train: Any, verdict: Any) -> Fix | None:
    """The newest transformers release of the run's generation that honours the keyword this TRL release passes,
    where the one planned for ignores it: the logits then cover the completion only."""
    from vram_planner.model.lm_head import drops_logits_to_keep
    from vram_planner.model.spec import with_changes
    from vram_planner.model.transformers_releases import transformers_releases
    from vram_planner.model.trl_releases import version_tuple
    from vram_planner.model.verdict import judge

    release = context.release
    if not drops_logits_to_keep(train, release):
        return None
    major = version_tuple(train.transformers.version)[0]
    honouring = [r for r in transformers_releases() if r.honours(release.logits_to_keep_argument)
                 and version_tuple(r.min_version)[0] == major]
    if not honouring:
        return None
    row = max(honouring, key=lambda r: version_tuple(r.min_version))
    pinned = with_changes(train, transformers_version=row.min_version)
    saved = verdict.estimate.peak_bytes - judge(context, pinned).estimate.peak_bytes
    if saved <= 0:  # the older release's attention keeps more (repeated k and v) than its shorter logits save
        return None
    return Fix(change=f"pip install 'transformers<{row.below_version}'", saves_bytes=round(saved),
               cost="none (same training, an older transformers)", removes_culprit=True,
               why=f"transformers {row.min_version} up to {row.below_version} honours the "
                   f"{release.logits_to_keep_argument} TRL {release.version} passes: the logits cover the "
                   f"completion's {train.max_completion_length + 1} positions, not all {train.sequence_length}")


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
