"""What `vram-plan gpus --model M --json` prints: every catalog card's verdict for one config (or its largest value of
a knob), the smallest fitting card first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vram_planner.report.document import Document


__all__ = ["CardsReport", "card_row", "card_strategy", "strategy"]


@dataclass(kw_only=True, repr=False)
class CardsReport(Document):
    """The cards as vram_planner.engine.fitting_gpus orders them; `to_dict()` is the document's list of rows."""

    cards: list[Any]  # vram_planner.engine.CardFit

    def to_dict(self) -> list[dict[str, Any]]:  # type: ignore[override]
        label = strategy(self.cards)
        return [card_row(card, card_strategy(card) if card.fewest else label) for card in self.cards]

    def to_json(self, indent: int | None = 2) -> str:
        import json

        return json.dumps(self.to_dict(), indent=indent)

    @property
    def fits(self) -> bool:
        """Whether some card fits."""
        return any(card.fits for card in self.cards)

    def summary(self) -> list[tuple[str, str]]:
        from vram_planner.units import GiB

        rows = []
        for card in self.cards:
            if card.problem:
                rows.append((card.name, f"cannot run it: {card.problem}"))
            elif card.maximized is not None:
                m = card.maximized
                rows.append((card.name, f"largest {m.field}: {m.value if m.fits else 'none'}"))
            else:
                rows.append((card.name, f"{'fits' if card.fits else 'does not fit'}, peak "
                                        f"{card.peak_bytes / GiB:.2f} GiB"))
        return rows


def strategy(cards: list[Any]) -> str | None:
    """'2 x ZeRO-3' where the bytes are per GPU of several (None on one plain GPU)."""
    from vram_planner.model.accelerate_config import strategy_label

    judged = next((card.verdict for card in cards if card.verdict is not None), None)
    return None if judged is None else strategy_label(judged.train)


def card_strategy(card: Any) -> str | None:
    """The count and strategy `--num-gpus auto` chose for this card ('1 GPU' where one plain GPU fits)."""
    from vram_planner.model.accelerate_config import strategy_label

    return None if card.verdict is None else strategy_label(card.verdict.train) or "1 GPU"


def card_row(card: Any, per_gpu: str | None) -> dict[str, Any]:  # card: vram_planner.engine.CardFit
    row = {"name": card.name, "capacity_bytes": card.capacity_bytes, "fits": card.fits,
           "peak_bytes": _whole(card.peak_bytes), "spare_bytes": _whole(card.spare_bytes), "problem": card.problem,
           "per_gpu": per_gpu}
    if card.fewest is not None and card.verdict is not None:  # --num-gpus auto: the count and strategy chosen
        train = card.verdict.train
        row.update(num_gpus=train.num_gpus, strategy=train.distributed, offload_optimizer=train.offload_optimizer,
                   offload_param=train.offload_param)
    m = card.maximized
    if m is not None:
        row["maximized"] = {"field": m.field, "value": m.value, "peak_bytes": _whole(m.peak_bytes),
                            "next_value": m.next_value, "next_peak_bytes": _whole(m.next_peak_bytes),
                            "limited_by": m.limited_by}
    return row


def _whole(n_bytes: float | None) -> int | None:
    return None if n_bytes is None else round(n_bytes)
