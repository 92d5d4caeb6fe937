"""The probe's real device: GRPO phases with random weights on the local CUDA GPU, measured by torch.cuda.

The phases are the trace engine's (vram_planner.tracing.phases), run on real tensors: TRL's fused LM head with its
Triton kernels, transformers' generate, the trainer's optimizer. Each point runs the step twice and measures the
second, so the optimizer states exist as they do from step 2 on. Imported only by `vram-plan probe`.
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import subprocess
import time
from typing import Any

import torch

# Imported before any model exists: on its first import bitsandbytes (which TRL's utilities import through PEFT) logs
# an exception it caught, and a logging handler that keeps its records (pytest's, a notebook's) keeps that exception's
# traceback, whose frames would hold the first point's model, on the card through every later point.
import trl.trainer.utils  # noqa: F401
from vram_planner.allocator.conf import environment_conf
from vram_planner.errors import VramPlanError
from vram_planner.probe.fit import PhaseMeasurement, PointMeasurement, ProbePoint, _config_json, _settings
from vram_planner.tracing.counter import PhaseState
from vram_planner.tracing.step import engine_versions


class CudaMeter(PhaseState):
    """The meter the phases use, answered by the CUDA caching allocator's statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.reserved_peak = 0

    @property
    def peak(self) -> int:
        torch.cuda.synchronize()
        self.reserved_peak = max(self.reserved_peak, torch.cuda.max_memory_reserved())
        return torch.cuda.max_memory_allocated()

    def reset_peak(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.peak_moment = self.moment

    def track(self, tensor: Any, tag: str | None = None) -> None:
        """The allocator sees every tensor by itself."""

    def bytes_of(self, tensors: list[Any], tag: str | None = None) -> int:
        """The bytes of `tensors`' storages. CUDA keeps no tags, so `tag` selects nothing: the probe's optimizer step
        is the run's first, which makes every state it counts (tracing.optimizer_peak.step_peak asks by tag)."""
        return sum(t.untyped_storage().nbytes() for t in {id(t): t for t in tensors}.values())


class CudaMeasurer:
    simulated = False
    device_type = "cuda"  # the tests run the same steps on the CPU

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise VramPlanError("vram-plan probe needs a CUDA GPU and none is visible to torch "
                                f"(torch {torch.__version__}); `vram-plan probe --simulate` runs the same pipeline "
                                "on the trace engine")
        self._used_before_init = _nvidia_smi("memory.used")  # MiB, before this process creates its context
        torch.cuda.init()
        torch.empty(1, device="cuda")

    def device(self) -> dict[str, str]:
        free, total = torch.cuda.mem_get_info()
        return {"gpu": torch.cuda.get_device_name(), "capacity_bytes": str(total),
                "driver": _nvidia_smi("driver_version") or "unknown", "cuda": str(torch.version.cuda),
                # the allocator setting the steps ran under: the fit scales that setting's reserve
                "allocator_conf": environment_conf()[0], **engine_versions()}

    def context_bytes(self) -> int:
        """What this process holds on the card outside torch's allocator (mem_get_info after initialisation, less
        what other processes held before and what torch reserved)."""
        free, total = torch.cuda.mem_get_info()
        before = float(self._used_before_init or 0) * 2**20
        return max(int(total - free - before - torch.cuda.memory_reserved()), 0)

    def measure(self, point: ProbePoint) -> PointMeasurement:
        start = time.perf_counter()
        try:
            phases, (decode_seconds, decode_tokens) = self._steady_step(point, time_decoding=True)
        finally:
            self._release()
        return PointMeasurement(label=point.label, model=point.model, settings=_settings(point.train),
                                lora_generation_autocast=False, phases=phases, seconds=time.perf_counter() - start,
                                decode_seconds=decode_seconds, decode_tokens=decode_tokens)

    def run_within(self, point: ProbePoint, capacity_bytes: int) -> tuple[bool, int]:
        """Two steps with the process limited to `capacity_bytes` of the card (less the context)."""
        free, total = torch.cuda.mem_get_info()
        context = self.context_bytes()
        torch.cuda.set_per_process_memory_fraction(min(max(capacity_bytes - context, 0) / total, 1.0))
        try:
            phases, _ = self._steady_step(point)
            return True, max(p.reserved_bytes for p in phases) + context
        except torch.cuda.OutOfMemoryError:
            return False, capacity_bytes
        finally:
            self._release()
            torch.cuda.set_per_process_memory_fraction(1.0)

    def _steady_step(self, point: ProbePoint,
                     time_decoding: bool = False) -> tuple[list[PhaseMeasurement], tuple[float | None, int]]:
        """The phases of step 2: step 1 creates the optimizer states, step 2 runs with them (its optimizer phase
        is step 1's, whose peak already holds the states it creates); with `time_decoding`, then generate()'s time
        for a few tokens (seconds, tokens)."""
        from vram_planner.tracing import phases as tp
        from vram_planner.tracing import trainer as own
        from vram_planner.tracing.session import Session, _add_lora, _build_model, add_fused_heads, cast_heads

        train = point.train
        config = _config_json(point.model)
        meter = CudaMeter()
        session = Session(train=train, fake_mode=contextlib.nullcontext(), tracker=meter,
                          device_type=self.device_type)
        self._release()  # whatever an earlier step left is not this one's

        def measured(run: Any) -> PhaseMeasurement:
            meter.reserved_peak = 0
            torch.cuda.synchronize()
            start = time.perf_counter()
            peak = run(session)
            torch.cuda.synchronize()
            return PhaseMeasurement(name=peak.name, allocated_bytes=int(peak.peak_bytes),
                                    reserved_bytes=int(max(meter.reserved_peak, torch.cuda.max_memory_reserved())),
                                    seconds=time.perf_counter() - start)

        try:
            with torch.device(self.device_type):
                model = _build_model(config, train)
                session.model = _add_lora(model, train) if train.uses_lora else model
                if train.computes_ref_logps and not train.uses_lora:
                    session.ref_model = _build_model(config, train)
                cast_heads(session.model, session.ref_model, train)
                add_fused_heads(session)
                recipe = tp.optimizer_recipe(train)
                session.trainer = own.build_trainer(session)  # the installed GRPOTrainer's own scoring and loss
                runs = [tp.run_generation, own.run_scoring, own.run_training]
                if not (train.computes_old_logps or train.computes_ref_logps):
                    runs.remove(own.run_scoring)
                for run in runs:
                    run(session)
                optimizer = measured(lambda s: tp.run_optimizer(s, recipe))
                session.optimizer.zero_grad(set_to_none=True)
                phases = [*(measured(run) for run in runs), optimizer]
                return phases, (timed_decoding(session) if time_decoding else (None, 0))
        finally:
            session.model = session.ref_model = session.optimizer = session.trainer = None

    @staticmethod
    def _release() -> None:
        """Free what the last step held. Called by the step's callers, once its frame is gone: a model is a reference
        cycle (its patched forward holds it), so while a local still names it, gc cannot free it, and it would stay
        on the card, uncollected, through the next point's measurement."""
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# Tokens the probe decodes for real to time generation: enough that the decoding steps outweigh the prefill, few
# enough to keep each point to a second or two.
DECODE_TOKENS = 32


def timed_decoding(session: Any) -> tuple[float, int]:
    """Seconds of generate() on the point's generation batch for DECODE_TOKENS new tokens (fewer when completions
    are shorter), with TRL's sampling settings and no end-of-sequence token, so that every sequence runs them all."""
    from vram_planner.tracing.phases import _generation_config, _prompt

    train = session.train
    tokens = min(DECODE_TOKENS, train.max_completion_length)
    config = _generation_config(session.base_model, train, tokens)
    config.eos_token_id = None  # random weights may sample it at any step
    ids, mask = _prompt(session, train.local_generation_batch_size, train.max_prompt_length)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad(), session.generation_autocast():
        session.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def _nvidia_smi(field: str) -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, f"--query-gpu={field}", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0].strip() if out.strip() else None
