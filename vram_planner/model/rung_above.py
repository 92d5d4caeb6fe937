"""The config one rank above a plan's choice: what `plan --exact` traces beside the choice, since the analytic
verdict's safety margin may have turned down a config that runs."""

from __future__ import annotations

from vram_planner.model.search import (Plan, describe_changes, ladder_runs, micro_batch_sizes, smallest_micro_batch,
                                       vllm_tuned, with_micro_batch)
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.verdict import Context, judge


def ladder(context: Context, user: TrainingConfig) -> list[TrainingConfig]:
    """Every rung as best_plan judges it (with vLLM's share tuned), indexed as a plan's rank counts them."""
    return [vllm_tuned(context, rung) for run in ladder_runs(user, context.gpu.bf16, context.arch) for rung in run]


def config_above(rungs: list[TrainingConfig], rank: tuple[int, int]) -> tuple[int, TrainingConfig] | None:
    """The rung index and config ranked just above `rank` (rung, -micro-batch): the same rung at the next larger
    micro-batch, else the rung before at its smallest; None for the user's own config at its own micro-batch."""
    index, micro_batch = rank[0], -rank[1]
    larger = [size for size in micro_batch_sizes(rungs[index]) if size > micro_batch]
    if larger:
        return index, with_micro_batch(rungs[index], min(larger))
    if index == 0:
        return None
    rung = rungs[index - 1]
    return index - 1, with_micro_batch(rung, smallest_micro_batch(rung))


def plan_choosing(context: Context, user: TrainingConfig, plan: Plan, rung: TrainingConfig, index: int,
                  chosen: TrainingConfig) -> Plan:
    """`plan` with `chosen` (a config of `rung`, the index-th) as its choice, the changes to it measured as
    best_plan measures them."""
    return Plan(plan.requested, judge(context, chosen), describe_changes(context, user, rung, chosen), plan.smallest,
                (index, -chosen.per_device_train_batch_size))
