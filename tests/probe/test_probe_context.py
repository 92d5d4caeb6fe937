"""The probe's CUDA context is what the card holds once the steps have run: with lazy module loading a step's kernels
load on first use, so the context measured at start-up alone would undercount the GPU catalog's figure it replaces."""

from __future__ import annotations

from vram_planner.model.spec import TrainingConfig
from vram_planner.probe.fit import (PhaseMeasurement, PointMeasurement, ProbePoint, SimulatedMeasurer,
                                    fit_calibration, measure_points, record_path)

MiB = 2**20


class LazyLoadingDevice(SimulatedMeasurer):
    """A device whose context grows by 100 MiB of kernels during the first step, as under CUDA_MODULE_LOADING=LAZY."""

    def __init__(self) -> None:
        super().__init__("rtx4090", context_bytes=250 * MiB)

    def device(self) -> dict[str, str]:
        return {"gpu": "NVIDIA GeForce RTX 4090", "cuda": "12.8"}

    def measure(self, point: ProbePoint) -> PointMeasurement:
        self._context = 350 * MiB
        phase = PhaseMeasurement(name="training", allocated_bytes=1000 * MiB, reserved_bytes=1100 * MiB)
        return PointMeasurement(label=point.label, model=point.model, settings={}, phases=[phase], seconds=0.0)


def test_the_context_is_read_again_after_the_steps_have_loaded_their_kernels():
    points = [ProbePoint("Qwen2.5-0.5B", TrainingConfig(lora_r=r)) for r in (8, 16)]
    record = measure_points(LazyLoadingDevice(), points, record_path("rtx4090"))
    assert record.context_bytes == 350 * MiB
    again = measure_points(LazyLoadingDevice(), points, record_path("rtx4090"))  # resumed: nothing left to measure
    assert again.context_bytes == 350 * MiB
    assert fit_calibration(record, "rtx4090").cuda_context_bytes == 350 * MiB
