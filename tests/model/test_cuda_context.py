"""The CUDA context per GPU generation and CUDA version (profiles/cuda_context.toml): every card resolves to a sourced
figure, the figures reproduce the public measurements they cite, and a probe's measured context replaces them."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from vram_planner.errors import ProfileError
from vram_planner.model.calibration import Calibration, default_calibration, load_calibration_file
from vram_planner.model.cuda_context import catalog_figure, context_figure, context_table
from vram_planner.model.resolve import resolve_model
from vram_planner.model.spec import training_config
from vram_planner.model.trl_releases import trl_release
from vram_planner.model.verdict import Context, judge
from vram_planner.profiles import GpuProfile, gpus, profile_dirs

MiB = 2**20
DATA = profile_dirs()[0] / "cuda_context.toml"
ROOT = Path(__file__).parents[2]
README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_catalog_card_resolves_to_a_positive_sourced_figure():
    for gpu in gpus():
        assert gpu.sm_count and gpu.compute_capability, gpu.name
        figure = catalog_figure(gpu)
        assert 100 * MiB < figure.bytes < 1024 * MiB, (gpu.name, figure)
        assert "cuda_context.toml" in figure.source and gpu.compute_capability in figure.source


def test_the_data_file_is_well_formed():
    raw = tomllib.loads(DATA.read_text())
    ids = [m["id"] for m in raw["measurement"]]
    assert len(ids) == len(set(ids)) >= 10
    for m in raw["measurement"]:
        assert m["how"] and m["quote"] and m["bytes"] > 0, m["id"]
        assert m["url"].startswith("https://") or (ROOT / m["url"]).is_file(), m["id"]  # public, or measured here
        if not m["url"].startswith("https://"):
            assert m["quote"].strip('"').split('": ')[-1] in (ROOT / m["url"]).read_text(), m["id"]
        assert m["gpu"] == "" or GpuProfile.from_name(m["gpu"]).compute_capability == m["compute_capability"]
    for row in raw["context"]:
        assert row["how"] and row["confidence"] in {"high", "medium", "low"}, row
        assert set(row["measurements"]) <= set(ids), row
        assert bool(row["measurements"]) == (row["basis"] == "measured"), row
    assert len({m["compute_capability"] for m in raw["measurement"] if m["kind"] != "unattributed"}) >= 6


def test_no_two_rows_claim_the_same_card_and_cuda():
    table = context_table()
    for cc in {cc for row in table.context for cc in row.compute_capabilities}:
        for cuda in ("11.0", "11.3", "11.6", "11.7", "11.8", "12.1", "12.8", "12.9", "13.0", "14.2"):
            assert len([r for r in table.context if cc in r.compute_capabilities and r.covers(cuda)]) <= 1


@pytest.mark.parametrize("measurement", [m for m in context_table().measurement if m.kind != "unattributed"],
                         ids=lambda m: m.id)
def test_the_figures_reproduce_the_measurements_they_cite(measurement):
    """Bare contexts within 10% of the per-thread term, working processes' OOM figures within 25% of the whole."""
    row = context_table().row_for(measurement.compute_capability, measurement.cuda)
    assert measurement.id in row.measurements
    bare = row.bytes_per_resident_thread * measurement.sm_count * row.resident_threads_per_sm
    whole = bare + row.kernels_bytes
    if measurement.kind == "bare_context":
        assert bare == pytest.approx(measurement.bytes, rel=0.10)
    elif measurement.kind in ("working_oom", "eager_process"):
        assert whole == pytest.approx(measurement.bytes, rel=0.25)
    elif measurement.kind == "working_step":  # measured by the probe itself: the figure is the measurement
        assert whole == pytest.approx(measurement.bytes, rel=0.001)
    elif measurement.kind == "loading_oom":  # a process still loading its model has not loaded its step's kernels
        assert bare <= measurement.bytes <= whole
    else:
        assert row.kernels_bytes / 2 <= measurement.bytes <= row.kernels_bytes * 2


@pytest.mark.parametrize(("name", "expected"), [
    # hand-checked: 2 KiB x SMs x resident threads per SM + 100 MiB of kernels (CUDA 12.8, lazy loading)
    ("rtx4090", 2048 * 128 * 1536 + 100 * MiB),  # 484 MiB; public OOMs show 479 and 495 MiB
    ("rtx3080-mobile", 2048 * 48 * 1536 + 100 * MiB),  # 244 MiB; the seeds' GRPO OOM shows 205 MiB
    ("t4", 2048 * 40 * 1024 + 100 * MiB),  # 180 MiB
    ("h100", 2048 * 132 * 2048 + 100 * MiB),  # 628 MiB
])
def test_hand_checked_figures(name, expected):
    assert catalog_figure(GpuProfile.from_name(name)).bytes == expected


def test_eager_loading_before_cuda_11_7_loads_every_kernel():
    v100 = GpuProfile.from_name("v100")
    assert catalog_figure(v100, "11.2").bytes == 2048 * 80 * 2048 + 1024 * MiB  # 1.3 GiB, as the HF docs measured
    assert catalog_figure(v100, "12.4").bytes == 2048 * 80 * 2048 + 100 * MiB
    assert "eager" in catalog_figure(v100, "11.2").source


def test_a_card_too_new_for_the_cuda_asked_is_refused_in_one_line():
    with pytest.raises(ProfileError, match=r"B200.*10\.0.*CUDA 11\.8.*12\.8"):
        catalog_figure(GpuProfile.from_name("b200"), "11.8")


def test_a_card_the_catalog_does_not_know_gets_the_stated_fallback():
    figure = catalog_figure(GpuProfile.from_name("24GiB"))
    assert figure.bytes == context_table().unknown_card_bytes
    assert "not in the GPU catalog" in figure.source


def test_a_generation_the_table_lacks_gets_the_fallback_rather_than_an_error():
    jetson = GpuProfile(name="agx-orin", total_memory_gib=30, compute_capability="8.7", sm_count=16)
    figure = catalog_figure(jetson)
    assert figure.bytes == context_table().unknown_card_bytes and "8.7" in figure.source


def test_the_default_calibration_leaves_the_context_to_the_catalog():
    assert default_calibration().cuda_context_bytes is None
    figure = context_figure(default_calibration(), GpuProfile.from_name("rtx4090"))
    assert figure == catalog_figure(GpuProfile.from_name("rtx4090"))


def _peak_context(calibration: Calibration, gpu: str) -> set[float]:
    context = Context(resolve_model("Qwen2.5-0.5B"), GpuProfile.from_name(gpu), trl_release(), calibration)
    verdict = judge(context, training_config({}))
    return {p.components["cuda_context"] for p in verdict.estimate.phases}


def test_the_verdict_adds_the_cards_figure():
    assert _peak_context(default_calibration(), "t4") == {2048 * 40 * 1024 + 100 * MiB}
    assert _peak_context(default_calibration(), "h100") == {2048 * 132 * 2048 + 100 * MiB}


def test_a_probe_calibrations_number_wins_over_the_catalog():
    probe = Calibration(name="probe", gpu="rtx4090", measured={"gpu": "NVIDIA GeForce RTX 4090"},
                        cuda_context_bytes=300 * MiB)
    assert _peak_context(probe, "rtx4090") == {300 * MiB}
    figure = context_figure(probe, GpuProfile.from_name("rtx4090"))
    assert figure.bytes == 300 * MiB and "probe" in figure.source and "measured" in figure.source


def test_an_old_calibration_file_with_a_number_still_loads_and_counts(tmp_path):
    old = tmp_path / "old.json"
    shipped = json.loads((profile_dirs()[0] / "calibrations" / "default.json").read_text())
    old.write_text(json.dumps({**shipped, "name": "old", "cuda_context_bytes": 536870912}))
    calibration = load_calibration_file(old)
    assert calibration.cuda_context_bytes == 512 * MiB
    assert _peak_context(calibration, "t4") == {512 * MiB}


def test_the_readme_says_where_the_context_figure_comes_from():
    text = README.read_text()
    assert "profiles/cuda_context.toml" in text and "probe" in text
