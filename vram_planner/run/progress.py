"""What a run says as it goes: a JSON line per logged step in its folder, and the live line (or a line per step
off a terminal) on stderr."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from vram_planner.files import MAX_LOG_BYTES, read_text, write_atomically
from vram_planner.run.step_memory import StepMemory
from vram_planner.units import GiB

LOG_NAME = "vram-plan-log.jsonl"


class JsonlLog:
    """A TrainerCallback writing each logged step (with the step's own measured peak memory beside the predicted,
    and the measured seconds per optimizer step since the last line beside the predicted ones) as one JSON line,
    from the main process only."""

    def __init__(self, path: Path, predicted_peak_bytes: float, resumed_at_step: int | None = None,
                 predicted_step_seconds: float | None = None, predicted_reserved_bytes: float | None = None,
                 memory: StepMemory | None = None, predicted_allocated_bytes: float | None = None) -> None:
        self.path, self.predicted = path, predicted_peak_bytes
        self.predicted_reserved = predicted_peak_bytes if predicted_reserved_bytes is None else predicted_reserved_bytes
        self.predicted_allocated = predicted_allocated_bytes
        self.predicted_step_seconds = predicted_step_seconds
        self.memory = memory or StepMemory.start()
        self.started = time.perf_counter()
        self.last_logged: tuple[int, float] | None = None  # (step, time) of the last line
        if resumed_at_step is not None and path.is_file():
            self._drop_steps_after(resumed_at_step)

    def _drop_steps_after(self, step: int) -> None:
        """The steps an interrupted run logged after its last checkpoint are trained again: their lines go."""
        kept = [line for line in read_text(self.path, MAX_LOG_BYTES, "the run's log").splitlines(keepends=True)
                if (logged := _logged_step(line)) is None or logged <= step]
        write_atomically(self.path, "".join(kept))

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **_: Any) -> dict[str, Any] | None:
        """Write the step's line; return it (None off the main process)."""
        if not state.is_world_process_zero:
            return None
        now = time.perf_counter()
        record = {"step": state.global_step, "seconds": round(now - self.started, 3),
                  **(logs or {}), "predicted_peak_bytes": round(self.predicted),
                  "predicted_peak_reserved_bytes": round(self.predicted_reserved)}
        if self.predicted_allocated is not None:
            record["predicted_peak_allocated_bytes"] = round(self.predicted_allocated)
        if self.last_logged is not None and state.global_step > self.last_logged[0]:
            # the first line's steps include the model's loading and the trainer's start: no step time there
            steps = state.global_step - self.last_logged[0]
            record["measured_step_seconds"] = round((now - self.last_logged[1]) / steps, 3)
        if self.predicted_step_seconds is not None:
            record["predicted_step_seconds"] = round(self.predicted_step_seconds, 3)
        self.last_logged = (state.global_step, now)
        if "train_runtime" in (logs or {}):  # TRL's closing line: the run's maximum, not its last step's
            peaks, prefix = self.memory.run_peaks(), "measured_run_peak"
        else:
            peaks, prefix = self.memory.step_peaks(state.global_step), "measured_peak"
        if peaks is not None:
            record[f"{prefix}_allocated_bytes"], record[f"{prefix}_reserved_bytes"] = peaks
        with self.path.open("a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")
        return record


def _logged_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return None


class RichProgress:
    """The run's progress on stderr, one line from the main process: step, reward, step time, and the step's peak
    reserved memory against the plan's (less the CUDA context, which PyTorch does not see). A transient one (the
    smoke step's) leaves nothing behind."""

    def __init__(self, predicted_reserved_bytes: float, transient: bool = False,
                 memory: StepMemory | None = None) -> None:
        self.predicted, self.transient = predicted_reserved_bytes, transient
        self.memory = memory or StepMemory.start()
        self.progress: Any = None
        self.task: Any = None
        self.lines: Any = None  # the console that gets a line per step, off a terminal

    def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(stderr=True)
        if not state.is_world_process_zero or (self.transient and not console.is_terminal):
            return  # off a terminal, a transient display would leave only a blank line
        if not console.is_terminal:  # a file, nohup, a scheduler's log: a line per step, written as it comes
            self.lines = console
            return
        self.progress = Progress(TextColumn("GRPO"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.description}"), console=console, transient=self.transient)
        self.progress.start()
        self.task = self.progress.add_task("", total=state.max_steps or None, completed=state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               step_seconds: float | None = None, **_: Any) -> None:
        """`step_seconds`: the step's time as the log measured it, for TRL releases that log no step_time (before
        0.26); None for the first step, which includes loading the model."""
        if (self.progress is None and self.lines is None) or not logs or "reward" not in logs:
            return
        peaks = self.memory.step_peaks()
        measured = "-" if peaks is None else f"{peaks[1] / GiB:.2f}"
        seconds = logs.get("step_time", step_seconds)
        step_time = "-" if seconds is None else f"{float(seconds):.1f}"
        description = (f"reward {float(logs['reward']):.3f}  step {step_time} s  "
                       f"reserved {measured} / predicted {self.predicted / GiB:.2f} GiB")
        if self.lines is not None:
            steps = f"{state.global_step}/{state.max_steps}" if state.max_steps else str(state.global_step)
            self.lines.file.write(f"GRPO step {steps}  {description}\n")
            self.lines.file.flush()
            return
        self.progress.update(self.task, completed=state.global_step, description=description)

    def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.stop()

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
