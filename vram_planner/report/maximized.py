"""What `plan --maximize FIELD --json` prints: the plan at the value, plus the answer (its own module: `plan`
without --maximize does not build these classes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vram_planner.report.document import Report, plan_report
from vram_planner.validation import field_names


__all__ = ["MaximizedReport", "MaximizedPlanReport", "maximized_report"]


@dataclass(kw_only=True)
class MaximizedReport:
    """`plan --maximize`: the largest value of one knob that fits, and what one step more needs (bytes)."""

    field: str
    value: int | None  # null: even the smallest valid value does not fit
    peak_bytes: int | None
    next_value: int | None  # the next valid value above (the smallest valid one when nothing fits)
    next_peak_bytes: int | None  # the least it needs (with --allow-savers: the least the savers make it need)
    limited_by: str  # "memory", or why no larger value is valid
    allow_savers: bool


@dataclass(kw_only=True, repr=False)
class MaximizedPlanReport(Report):
    """What `vram-plan plan --maximize FIELD --json` prints: the plan at the value, plus the answer."""

    maximized: MaximizedReport

    def summary(self) -> list[tuple[str, str]]:
        m = self.maximized
        answer = "none fits" if m.value is None else f"{m.value} (limited by {m.limited_by})"
        return [(f"largest {m.field}", answer), *super().summary()]


def maximized_report(result: Any) -> MaximizedPlanReport:  # result: vram_planner.model.maximize.Maximized
    plan = plan_report(result.plan)
    plan.notes += list(result.notes)
    answer = MaximizedReport(field=result.field, value=result.value, peak_bytes=_rounded(result.peak_bytes),
                             next_value=result.next_value, next_peak_bytes=_rounded(result.next_peak_bytes),
                             limited_by=result.limited_by, allow_savers=result.allow_savers)
    return MaximizedPlanReport(**{f: getattr(plan, f) for f in field_names(Report)}, maximized=answer)


def _rounded(n_bytes: float | None) -> int | None:
    return None if n_bytes is None else round(n_bytes)
