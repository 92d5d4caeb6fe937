"""TRL's model card in the run's folder, without replacing a README.md the user keeps there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vram_planner.files import write_atomically

# The line TRL's model card templates (trl/templates/*_model_card.md) all carry: a README.md with it is TRL's own.
TRL_CARD_LINE = "It has been trained using [TRL](https://github.com/huggingface/trl)."


MODEL_CARD_ASIDE = "MODEL_CARD.md"


def users_readme(folder: Path) -> bool:
    """Whether `folder` holds a README.md that is not a model card TRL wrote (an earlier run's is TRL's)."""
    readme = folder / "README.md"
    try:
        return readme.is_file() and TRL_CARD_LINE not in readme.read_text(errors="replace")
    except OSError:
        return True  # unreadable: not ours to replace


def place_model_card(trainer: Any, folder: Path, model_id: str, aside: bool) -> None:
    """GRPOTrainer writes its model card to output_dir/README.md at every checkpoint; where the user keeps a
    README.md there (`aside`), the card is written beside it as MODEL_CARD.md instead. A local model folder has no
    hub id, which the card would call "[None]": it names the folder. The run pushes nothing to the hub, so the card's
    quick start, which loads `hub_model_id` (None), loads the model the run saves in `folder`/final."""
    original = trainer.create_model_card
    target = folder / (MODEL_CARD_ASIDE if aside else "README.md")

    def create_model_card(*args: Any, **kwargs: Any) -> None:
        import tempfile

        with tempfile.TemporaryDirectory(dir=folder, prefix=".model-card-") as scratch:
            output_dir, trainer.args.output_dir = trainer.args.output_dir, scratch
            try:
                original(*args, **kwargs)
            finally:
                trainer.args.output_dir = output_dir
            card = Path(scratch) / "README.md"
            if card.is_file():
                text = (card.read_text().replace("[None](https://huggingface.co/None)", f"`{model_id}`")
                        .replace('model="None"', f"model={json.dumps(str(folder / 'final'))}"))
                write_atomically(target, text)

    trainer.create_model_card = create_model_card
