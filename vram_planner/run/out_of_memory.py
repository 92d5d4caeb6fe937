"""What `vram-plan run` says when the GPU's memory runs out: torch's words, where the plan put the peak, the
checkpoint kept, and the `vram-plan advise` command that explains the snapshot, each on a line of its own."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from vram_planner.errors import VramPlanError, first_line
from vram_planner.units import GiB


class RunOutOfMemory(VramPlanError):
    """Training ran out of GPU memory; what was trained is saved in `checkpoint`. Its text is several lines (torch's
    words, the plan's peak, the checkpoint, the command that explains the snapshot): the command line prints them as
    they are, so the advise command can be pasted. `setup` is the run's RunSetup (launch.py, which imports this
    module)."""

    def __init__(self, setup: Any, error: BaseException, checkpoint: Path | None,
                 snapshot: Path | None = None) -> None:
        estimate = setup.verdict.estimate
        peak = estimate.peak_phase
        parts = sorted(peak.components.items(), key=lambda kv: -kv[1])[:3]
        biggest = ", ".join(f"{name.replace('_', ' ')} {size / GiB:.2f} GiB" for name, size in parts)
        lines = [f"out of GPU memory: {whole_sentences(first_line(error, limit=2000), OOM_WORDS_LIMIT)}",
                 f"The plan put the peak at {estimate.peak_bytes / GiB:.2f} GiB in {peak.name}: {biggest}."]
        if checkpoint:
            lines.append(f"Training so far is saved in {checkpoint}.")
        if snapshot:
            lines += ["What was on the card, read against the plan:", shlex.join(advise_command(setup, snapshot))]
        super().__init__("\n".join(lines))
        self.setup, self.checkpoint, self.snapshot = setup, checkpoint, snapshot


# torch's out-of-memory text runs to ~600 characters; its first sentences say the request, the card and the process
OOM_WORDS_LIMIT = 240


def whole_sentences(text: str, limit: int) -> str:
    """The sentences of `text` that fit in `limit` characters (at least the first), none cut in the middle."""
    kept = ""
    for sentence in re.split(r"(?<=\.)\s+", text.strip()):
        if kept and len(kept) + 1 + len(sentence) > limit:
            break
        kept = f"{kept} {sentence}" if kept else sentence
    return kept


def advise_command(setup: Any, snapshot: Path) -> list[str]:
    """`vram-plan advise` of the snapshot with the run's card, model and knobs, so it is read against its plan."""
    from vram_planner.model.spec import changed_settings, command_line_flags

    knobs = shlex.split(command_line_flags(changed_settings(setup.train)))
    return ["vram-plan", "advise", str(snapshot), "--gpu", setup.verdict.context.gpu.name, "--model",
            setup.model_id, *knobs]
