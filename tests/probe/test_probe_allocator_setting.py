"""The probe's fit reads each step under the allocator setting the probe ran with (PYTORCH_CUDA_ALLOC_CONF), whose
reserve it scales: a probe under expandable segments is compared with the expandable reserve, not the default one."""

from __future__ import annotations

from pathlib import Path

import pytest

from vram_planner.model.calibration import default_calibration
from vram_planner.model.phases import estimate
from vram_planner.model.resolve import resolve_model
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.stranding import loaded_weight_segment_bytes
from vram_planner.model.trl_releases import trl_release
from vram_planner.probe.fit import PhaseMeasurement, ProbeRecord, _reserve_scale, fit_calibration, fit_quality
from vram_planner.units import GiB

RECORD = Path(__file__).parents[2] / "benchmarks" / "results" / "gpu" / "h100-probe-record.json"
EXPANDABLE = "expandable_segments:True"
SCALE = 1.25


def record_measured_as(conf: str, scale: float) -> ProbeRecord:
    """The H100 record's points, each phase's reserved bytes made what the planner predicts under `conf` with the
    default reserve times `scale` (the loaded weights' rests, the allocator's rules, as they are)."""
    record = ProbeRecord.model_validate_json(RECORD.read_text())
    cal = default_calibration()
    points = []
    for point in record.points:
        train = TrainingConfig(**{**point.settings, "allocator_conf": conf})
        phases = estimate(resolve_model(point.model), train, trl_release(), cal, 80 * GiB,
                          compute_capability="9.0").phases
        exact = loaded_weight_segment_bytes(resolve_model(point.model), train)
        measured = [PhaseMeasurement(name=p.name, allocated_bytes=int(p.tensor_bytes),
                                     reserved_bytes=round(p.total_bytes - p.components["cuda_context"]
                                                          - (1 - scale) * (p.components["allocator_overhead"] - exact)))
                    for p in phases]
        points.append(point.model_copy(update={"phases": measured, "lora_generation_autocast": False}))
    return record.model_copy(update={"points": points, "device": {**record.device, "allocator_conf": conf}})


@pytest.mark.parametrize("conf", ["", EXPANDABLE])
def test_the_reserve_scale_is_found_under_the_setting_the_probe_ran_with(conf):
    assert _reserve_scale(record_measured_as(conf, SCALE), default_calibration(), "9.0") == pytest.approx(SCALE)


def test_the_setting_changes_what_is_compared():
    # the same measurements read under the other setting give another scale: the setting is not ignored
    measured = record_measured_as(EXPANDABLE, SCALE)
    as_default = measured.model_copy(update={"device": {**measured.device, "allocator_conf": ""}})
    assert _reserve_scale(as_default, default_calibration(), "9.0") != pytest.approx(SCALE, abs=0.01)


def test_fit_quality_predicts_each_step_under_the_probes_setting():
    record = record_measured_as(EXPANDABLE, 1.0)
    cal = fit_calibration(record, "h100-80gb")
    rows = fit_quality(record, cal)
    for point, row in zip(record.points, rows, strict=True):
        train = TrainingConfig(**{**point.settings, "allocator_conf": EXPANDABLE})
        expected = estimate(resolve_model(point.model), train, trl_release(), cal, 80 * GiB,
                            compute_capability="9.0").peak_bytes
        assert row.predicted_bytes == pytest.approx(expected)
