"""`--num-gpus auto`: the fewest GPUs of one card, and the strategy, on which a config fits.

Every count from 1 to a node's GPUs is tried with every strategy (DDP, ZeRO-2, ZeRO-3, FSDP2, then each with its CPU
offload), the user's knobs otherwise as given; the first count on which one fits wins, and of its strategies the
first in that order (the ones that move less data first: DDP all-reduces gradients only, ZeRO-3 and FSDP2 gather
parameters every layer, offload copies states over PCIe every step). A ZeRO stage or FSDP the user named is the only
strategy tried; an offload the user named is kept in every strategy, and a strategy that cannot take it, or the
DeepSpeed knobs named (buckets, overlap, ZeRO-3's gathering and coordinator sizes), is left out by the rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

from vram_planner.errors import ConfigError
from vram_planner.model.accelerate_config import strategy_label
from vram_planner.model.offload import MAX_GPUS_PER_NODE
from vram_planner.model.spec import TrainingConfig, with_changes
from vram_planner.model.verdict import Context, Verdict, judge

NO_OFFLOAD = {"offload_optimizer": "none", "offload_param": "none"}
# Each strategy's knobs, in the order a count's strategies are preferred.
STRATEGIES: tuple[dict[str, Any], ...] = (
    {"zero_stage": None, "fsdp": False, **NO_OFFLOAD},  # DDP (one plain GPU at a count of 1)
    {"zero_stage": 2, "fsdp": False, **NO_OFFLOAD},
    {"zero_stage": 3, "fsdp": False, **NO_OFFLOAD},
    {"zero_stage": None, "fsdp": True, **NO_OFFLOAD},
    {"zero_stage": 2, "fsdp": False, "offload_optimizer": "cpu", "offload_param": "none"},
    {"zero_stage": 3, "fsdp": False, "offload_optimizer": "cpu", "offload_param": "none"},
    {"zero_stage": None, "fsdp": True, "offload_optimizer": "none", "offload_param": "cpu"},
    {"zero_stage": 3, "fsdp": False, "offload_optimizer": "cpu", "offload_param": "cpu"},
)
STRATEGY_FIELDS = ("zero_stage", "fsdp", "offload_optimizer", "offload_param")


@dataclass(frozen=True)
class Fewest:
    """The answer of `--num-gpus auto`: the verdict chosen (None when no count and strategy fits), and every verdict
    judged on the way, in the order tried."""

    chosen: Verdict | None
    tried: tuple[Verdict, ...]

    @property
    def fits(self) -> bool:
        return self.chosen is not None

    @property
    def closest(self) -> Verdict:
        """The chosen verdict, else the one on the most GPUs that needs the least per GPU."""
        if self.chosen is not None:
            return self.chosen
        most = max(v.train.num_gpus for v in self.tried)
        return min((v for v in self.tried if v.train.num_gpus == most), key=lambda v: v.estimate.peak_bytes)

    def note(self, gpu_label: str) -> str:
        """What the search found, in words."""
        if self.chosen is None:
            return (f"--num-gpus auto: no strategy fits on up to {MAX_GPUS_PER_NODE} x {gpu_label} (one node); "
                    f"shown: {strategy_label(self.closest.train)}")
        count = self.chosen.train.num_gpus
        fewer = "" if count == 1 else f"; on {count - 1}, none of the {len(_strategies_on(self, count - 1))} " \
                                      f"strategies tried fits"
        return (f"--num-gpus auto: {strategy_label(self.chosen.train) or '1 GPU'}, the fewest {gpu_label} cards "
                f"that fit{fewer}")


def _strategies_on(fewest: Fewest, count: int) -> list[Verdict]:
    return [v for v in fewest.tried if v.train.num_gpus == count]


def strategies_named(settings: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The strategies to try for the knobs a user gave with `--num-gpus auto`: none but the user's own where they
    named a ZeRO stage or FSDP (an empty change); else each strategy with the offloads the user named, once each."""
    named = {field: settings[field] for field in STRATEGY_FIELDS if settings.get(field) is not None}
    if named.get("zero_stage") is not None or named.get("fsdp"):
        return [{}]
    unique: list[dict[str, Any]] = []
    for knobs in ({**strategy, **named} for strategy in STRATEGIES):
        if knobs not in unique:
            unique.append(knobs)
    return unique


def _strategies_of(user: TrainingConfig) -> list[dict[str, Any]]:
    """The strategies to try for a config given whole: as `strategies_named` takes the strategy it has (a ZeRO stage,
    FSDP or an offload), its fields at their defaults left unnamed."""
    unset = TrainingConfig()
    return strategies_named({field: getattr(user, field) for field in STRATEGY_FIELDS
                             if getattr(user, field) != getattr(unset, field)})


def candidates(user: TrainingConfig, count: int, strategies: list[dict[str, Any]]) -> list[TrainingConfig]:
    """The user's config on `count` GPUs under each strategy to try; those the rules refuse (a batch the number of
    generations does not divide, an offload or a DeepSpeed knob the strategy cannot take) are left out."""
    configs = []
    for knobs in strategies:
        try:
            configs.append(with_changes(user, num_gpus=count, **knobs))
        except ConfigError:
            continue
    return configs


def fewest_gpus(context: Context, user: TrainingConfig, most: int = MAX_GPUS_PER_NODE,
                strategies: list[dict[str, Any]] | None = None) -> Fewest:
    """The fewest GPUs of the context's card, up to `most`, and the strategy (of `strategies`, else those the config's
    own strategy fields name) on which `user` fits."""
    tried: list[Verdict] = []
    strategies = _strategies_of(user) if strategies is None else strategies
    for count in range(1, most + 1):
        for train in candidates(user, count, strategies):
            verdict = judge(context, train)
            tried.append(verdict)
            if verdict.fits:
                return Fewest(verdict, tuple(tried))
    if not tried:
        raise ConfigError([f"--num-gpus auto: no count of GPUs up to {most} and strategy can run this config"])
    return Fewest(None, tuple(tried))
