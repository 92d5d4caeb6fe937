"""Fitting the step-time model's efficiency factors to timed probe phases, and the probe timing its phases."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import FIXTURES
from vram_planner.model.calibration import default_calibration
from vram_planner.model.resolve import resolve_model
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.step_time import Efficiency, efficiency_from
from vram_planner.probe import cuda
from vram_planner.probe.fit import PhaseMeasurement, PointMeasurement, ProbePoint, ProbeRecord, fit_calibration
from vram_planner.probe.step_fit import (GRID, TimedPhase, fit_step_time, log_errors, predicted_seconds,
                                         timed_phases)
from vram_planner.profiles import GpuProfile

H100 = GpuProfile.from_name("h100-80gb")
STEP = GRID[1] / GRID[0]  # the grid's relative spacing


def grid_configs():
    for batch, completion, gc, lora in ((1, 64, True, None), (4, 128, True, None), (16, 512, False, None),
                                        (64, 512, True, 16), (8, 256, False, 16), (2, 1024, True, None),
                                        (512, 2048, True, 16)):
        yield TrainingConfig(per_device_train_batch_size=batch, num_generations=2, max_completion_length=completion,
                             gradient_checkpointing=gc, lora_r=lora, beta=0.04)


def samples_under(eff: Efficiency, arch) -> list[TimedPhase]:
    """What a card with these factors would measure for the probe's phases (the model's own prediction)."""
    out = []
    for train in grid_configs():
        for phase, tokens in (("training", 0), ("scoring", 0), ("optimizer", 0), ("decoding", 32)):
            sample = TimedPhase(arch, train, phase, 1.0, tokens)
            out.append(replace(sample, seconds=predicted_seconds(sample, H100, eff)))
    return out


def test_the_fit_recovers_the_factors_that_made_the_times(llama_1b):
    prior = Efficiency()
    truth = Efficiency(matmul=prior.matmul * STEP ** -6, bandwidth=prior.bandwidth * STEP ** -4,
                       decode_bandwidth=prior.decode_bandwidth * STEP ** -3, op_seconds=prior.op_seconds * STEP ** -40,
                       train_op_seconds=prior.train_op_seconds * STEP ** -20, tensor_seconds=prior.tensor_seconds
                       * STEP ** -12, optimizer_bandwidth=prior.optimizer_bandwidth * STEP ** -8)
    fitted = fit_step_time(samples_under(truth, llama_1b), H100)
    assert set(fitted) == {"matmul", "bandwidth", "decode_bandwidth", "op_seconds", "train_op_seconds",
                           "tensor_seconds", "optimizer_bandwidth"}
    for name, value in fitted.items():
        assert value == pytest.approx(getattr(truth, name), rel=STEP - 1), name
    assert max(abs(e) for e in log_errors(samples_under(truth, llama_1b), H100, efficiency_from(fitted))) < 0.05


def test_a_factor_no_sample_reaches_keeps_its_prior(llama_1b):
    """Without a timed decoding, nothing says how fast the card decodes: the prior stays."""
    truth = Efficiency(decode_bandwidth=0.2, matmul=0.3)
    undecoded = [s for s in samples_under(truth, llama_1b) if s.phase != "decoding"]
    fitted = fit_step_time(undecoded, H100)
    assert "decode_bandwidth" not in fitted and fitted["matmul"] == pytest.approx(0.3, rel=STEP - 1)
    assert efficiency_from(fitted).decode_bandwidth == Efficiency().decode_bandwidth


def test_only_factors_the_samples_depend_on_are_fitted(llama_1b):
    """optimizer.step() is its bytes (full fine-tuning) or its Python loop over LoRA's many small tensors."""
    truth = Efficiency(optimizer_bandwidth=0.5, tensor_seconds=3e-6)
    optimizer_only = [s for s in samples_under(truth, llama_1b) if s.phase == "optimizer"]
    assert set(fit_step_time(optimizer_only, H100)) == {"optimizer_bandwidth", "tensor_seconds"}
    assert fit_step_time([], H100) == {}


def test_phases_where_timed_fit_and_whole_steps_do_not_move_them(llama_1b):
    """A whole step cannot say which phase is off: with phases timed, a step timed slower moves no factor."""
    phases = samples_under(Efficiency(), llama_1b)
    step = TimedPhase(llama_1b, next(grid_configs()), "step", 1.0)
    slow_step = replace(step, seconds=3 * predicted_seconds(step, H100, Efficiency()))
    assert fit_step_time([*phases, slow_step], H100) == fit_step_time(phases, H100)
    assert fit_step_time([slow_step], H100)  # alone, it fits


def small_decodings(arch) -> list[TimedPhase]:
    return [TimedPhase(arch, TrainingConfig(per_device_train_batch_size=b, num_generations=b,
                                            max_completion_length=c), "decoding", 1.0, c) for b, c in ((4, 128), (8, 256))]


def test_a_factor_that_binds_no_sample_is_not_pushed_to_the_grids_edge(llama_1b):
    """Launch-bound decodings timed slower than any host time explains (the H200's case): the host's time per op
    takes it all; the bandwidth and matmul shares, which bound nothing there, keep their priors."""
    slow = [replace(s, seconds=1.3 * predicted_seconds(s, H100, Efficiency())) for s in small_decodings(llama_1b)]
    fitted = fit_step_time(slow, H100)
    assert set(fitted) == {"op_seconds"}
    assert fitted["op_seconds"] == pytest.approx(1.3 * Efficiency().op_seconds, rel=STEP - 1)


def test_the_longer_phase_weighs_more(llama_1b):
    """A step's time is what is predicted: two decodings that disagree are fitted closer to the longer one."""
    short, long_ = small_decodings(llama_1b)
    short = replace(short, new_tokens=4)
    samples = [replace(short, seconds=2 * predicted_seconds(short, H100, Efficiency())),
               replace(long_, seconds=predicted_seconds(long_, H100, Efficiency()))]
    assert predicted_seconds(samples[1], H100, Efficiency()) > 20 * samples[0].seconds
    fitted = fit_step_time(samples, H100)
    assert 1 <= fitted["op_seconds"] / Efficiency().op_seconds < 1.1


def test_shares_of_a_peak_stay_at_most_one(llama_1b):
    """Times faster than the datasheet allows (a wrong card name, say) cannot fit an efficiency above 1."""
    fast = [replace(s, seconds=s.seconds / 10) for s in samples_under(Efficiency(matmul=0.5, bandwidth=0.5),
                                                                       llama_1b)]
    fitted = fit_step_time(fast, H100)
    assert fitted["matmul"] <= 1 and fitted["bandwidth"] <= 1


def record_of(points) -> ProbeRecord:
    return ProbeRecord(device={"gpu": "NVIDIA H100 80GB HBM3"}, context_bytes=800 * 2**20, points=points)


def timed_point(seconds: float | None, decode: float | None) -> PointMeasurement:
    phases = [PhaseMeasurement(name=n, allocated_bytes=8 * 2**30, reserved_bytes=9 * 2**30, seconds=seconds)
              for n in ("generation", "training", "optimizer")]
    return PointMeasurement(label="x", model="Qwen2.5-0.5B", settings={"per_device_train_batch_size": 4,
                                                                        "num_generations": 4},
                            phases=phases, seconds=3.0, lora_generation_autocast=False, decode_seconds=decode,
                            decode_tokens=32 if decode else 0)


def test_records_give_their_timed_phases_and_older_records_none():
    samples = timed_phases(record_of([timed_point(0.2, 0.5)]))
    assert [(s.phase, s.seconds) for s in samples] == [("training", 0.2), ("optimizer", 0.2), ("decoding", 0.5)]
    assert samples[-1].new_tokens == 32 and samples[0].arch == resolve_model("Qwen2.5-0.5B")
    assert timed_phases(record_of([timed_point(None, None)])) == []


def test_the_calibration_keeps_the_fitted_factors():
    cal = fit_calibration(record_of([timed_point(0.2, 0.5), timed_point(0.25, 0.6)]), "h100-80gb")
    # the probe's small decoding is launch-bound: it sets the host's time per op, not the decoding bandwidth; its
    # optimizer step streams full fine-tuning's states
    assert set(cal.step_time) >= {"optimizer_bandwidth", "op_seconds"} and "decode_bandwidth" not in cal.step_time
    untimed = fit_calibration(record_of([timed_point(None, None)]), "h100-80gb")
    assert untimed.step_time == default_calibration().step_time == {}


@pytest.mark.slow
def test_the_probe_times_every_phase_and_a_real_decoding(monkeypatch):
    """The CUDA measurer's steps on the CPU (torch.cuda's statistics answered by nothing): each phase has its time
    and generate() decodes every token asked for."""
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    for name in ("max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda: 0)
    generated = []
    measurer = object.__new__(cuda.CudaMeasurer)
    measurer.device_type = "cpu"
    train = TrainingConfig(per_device_train_batch_size=2, num_generations=2, max_prompt_length=8,
                           max_completion_length=6, mixed_precision="no")
    from transformers import GenerationMixin

    generate = GenerationMixin.generate

    def counting(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        generated.append(out.shape[-1] - kwargs["input_ids"].shape[-1] if hasattr(out, "shape") else None)
        return out

    monkeypatch.setattr(GenerationMixin, "generate", counting)
    measured = measurer.measure(ProbePoint(str(FIXTURES / "tiny-llama-headdim.json"), train))
    assert all(p.seconds is not None and p.seconds > 0 for p in measured.phases)
    assert measured.decode_seconds > 0 and measured.decode_tokens == 6 and generated[-1] == 6
