"""The analytic model's allocator reserve: fitted per phase and allocation pattern, per allocator setting; the run's
PYTORCH_CUDA_ALLOC_CONF as a knob; expandable segments as the plan's free first rung."""

from __future__ import annotations

import ast
from dataclasses import replace

import pytest

from helpers import benchmark_module
from vram_planner import engine
from vram_planner.errors import ConfigError
from vram_planner.model.calibration import (UNFITTED_RESERVE_FRACTION, Calibration, allocator_reserve_bytes,
                                            default_calibration)
from vram_planner.model.expandable_pages import EXPANDABLE_PATTERNS
from vram_planner.model.fragmentation import PATTERNS
from vram_planner.model.generation_patterns import GENERATION_PATTERNS
from vram_planner.model.grpo_config import python_snippet
from vram_planner.model.phases import TENSOR_COMPONENTS
from vram_planner.model.search import with_expandable_segments
from vram_planner.model.spec import training_config
from vram_planner.profiles import GpuProfile
from vram_planner.units import GiB
from vram_planner.validation import to_json

# A KV cache grown by concatenation fragments a cache without expandable segments (made-up figures, steep enough
# that generation sets the peak)
FITTED = Calibration(allocator_reserve={
    "default": {"generation": {"kv_cache": 3.0, "weights": 0.01}, "training": {"activations": 0.1}},
    "expandable_segments": {"generation": {"kv_cache": 0.1}, "training": {"activations": 0.1}}})
TENSORS = {"weights": 4 * GiB, "kv_cache": 2 * GiB, "activations": 1 * GiB}


@pytest.fixture
def fitted_file(tmp_path):
    path = tmp_path / "fitted.json"
    path.write_text(to_json(FITTED))
    return path


def test_the_fitted_function_weighs_each_component_of_the_phase():
    assert allocator_reserve_bytes(FITTED, "generation", TENSORS, expandable=False) == pytest.approx(
        3.0 * 2 * GiB + 0.01 * 4 * GiB)
    assert allocator_reserve_bytes(FITTED, "generation", TENSORS, expandable=True) == pytest.approx(0.1 * 2 * GiB)


def test_a_phase_the_fit_has_not_seen_takes_the_flat_fraction():
    assert allocator_reserve_bytes(FITTED, "optimizer", TENSORS, expandable=False) == pytest.approx(
        UNFITTED_RESERVE_FRACTION * 7 * GiB)


def test_a_probes_measured_fraction_replaces_the_fit():
    measured = replace(FITTED, allocator_overhead_fraction=0.2)
    assert allocator_reserve_bytes(measured, "generation", TENSORS, expandable=True) == pytest.approx(0.2 * 7 * GiB)


def test_the_shipped_fit_covers_every_phase_of_both_settings_with_non_negative_coefficients():
    """A share of the tensors under 2 bytes a byte; a pattern within the bound its fit searched (a generation pattern
    that stands for several segments' rests, like one KV block for the loss's segments that hold one, weighs more)."""
    fit = benchmark_module("reserve_fit")
    reserve = default_calibration().allocator_reserve
    patterns = {"default": {*PATTERNS, *GENERATION_PATTERNS}, "expandable_segments": set(EXPANDABLE_PATTERNS)}
    for setting in ("default", "expandable_segments"):
        assert {"generation", "training", "optimizer"} <= set(reserve[setting])
        for coefficients in reserve[setting].values():
            assert set(coefficients) <= set(TENSOR_COMPONENTS) | patterns[setting]
            for name, c in coefficients.items():
                bound = (2.0 if name in TENSOR_COMPONENTS else
                         fit.GENERATION_BOUNDS.get(name, fit.MAX_RESERVE_PER_BYTE))
                assert 0 <= c <= bound, name


def test_the_estimate_uses_the_setting_of_the_run(llama_1b_file, fitted_file):
    gpu = GpuProfile(name="card", total_memory_gib=80)
    settings = {"max_completion_length": 2048, "per_device_train_batch_size": 16, "num_generations": 16}
    default = engine.check(str(llama_1b_file), gpu, {**settings, "allocator_conf": ""}, calibration=fitted_file)
    expandable = engine.check(str(llama_1b_file), gpu, {**settings, "allocator_conf": "expandable_segments:True"},
                           calibration=fitted_file)
    # each phase's reserve is its setting's function of the phase's own components (the moment may differ: the one
    # that needs the most with its reserve)
    functions = {"default": {"generation": lambda c: 3.0 * c["kv_cache"] + 0.01 * c["weights"]},
                 "expandable_segments": {"generation": lambda c: 0.1 * c["kv_cache"]}}
    for setting, verdict in (("default", default), ("expandable_segments", expandable)):
        for p in verdict.estimate.phases:
            expected = functions[setting].get(p.name, lambda c: 0.1 * c["activations"] if p.name == "training" else
                                              UNFITTED_RESERVE_FRACTION * p.tensor_bytes)(p.components)
            assert p.components["allocator_overhead"] == pytest.approx(expected)
    generation = [v.estimate.phases[0] for v in (default, expandable)]
    assert generation[0].components["allocator_overhead"] > generation[1].components["allocator_overhead"]


def test_the_knob_takes_what_torch_accepts_and_refuses_the_rest_in_one_line():
    assert training_config({"allocator_conf": " expandable_segments:True "}).expandable_segments
    assert not training_config({"allocator_conf": "max_split_size_mb:128"}).expandable_segments
    for bad in ("expandable_segments:yes", "foo:1", "max_split_size_mb:10", "nonsense"):
        with pytest.raises(ConfigError) as raised:
            training_config({"allocator_conf": bad})
        assert "\n" not in str(raised.value) and "PYTORCH_CUDA_ALLOC_CONF" in str(raised.value)


def test_the_knob_defaults_to_the_environment_as_torch_reads_it(monkeypatch, llama_1b_file):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert engine.check(str(llama_1b_file), "24GiB").train.expandable_segments
    assert not engine.check(str(llama_1b_file), "24GiB", {"allocator_conf": ""}).train.expandable_segments
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:maybe")
    with pytest.raises(ConfigError, match="^PYTORCH_CUDA_ALLOC_CONF"):
        engine.check(str(llama_1b_file), "24GiB")


def test_the_device_generic_variable_counts_too_after_the_cuda_one(monkeypatch, llama_1b_file):
    # torch reads PYTORCH_CUDA_ALLOC_CONF, else PYTORCH_ALLOC_CONF (the name newer releases document)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert engine.check(str(llama_1b_file), "24GiB").train.expandable_segments
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    assert not engine.check(str(llama_1b_file), "24GiB").train.expandable_segments
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:maybe")
    with pytest.raises(ConfigError, match="^PYTORCH_ALLOC_CONF"):
        engine.check(str(llama_1b_file), "24GiB")


def test_expandable_segments_replace_any_earlier_setting_of_it():
    assert with_expandable_segments("") == "expandable_segments:True"
    assert with_expandable_segments("max_split_size_mb:128,expandable_segments:False") == (
        "max_split_size_mb:128,expandable_segments:True")


def test_the_pasted_code_sets_the_allocator_before_the_run_and_compiles():
    snippet = python_snippet(training_config({"allocator_conf": "expandable_segments:True"}), "org/model")
    ast.parse(snippet)
    assert 'os.environ["PYTORCH_CUDA_ALLOC_CONF"] = \'expandable_segments:True\'' in snippet
    assert snippet.index("PYTORCH_CUDA_ALLOC_CONF") < snippet.index("GRPOTrainer(")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in python_snippet(training_config({}), "org/model")


def test_expandable_segments_are_the_plans_first_rung_when_they_make_the_config_fit(llama_1b_file, fitted_file,
                                                                                     monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    # a generation batch of 16 long completions, trained two at a time: generation sets the peak
    settings = {"max_completion_length": 2048, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 8,
                "num_generations": 16, "gradient_checkpointing": True, "lora_r": 16, "dtype": "bfloat16"}
    probe = GpuProfile(name="card", total_memory_gib=1000)
    default = engine.check(str(llama_1b_file), probe, settings, calibration=fitted_file, safety_margin=0)
    expandable = engine.check(str(llama_1b_file), probe, {**settings, "allocator_conf": "expandable_segments:True"},
                           calibration=fitted_file, safety_margin=0)
    saved = default.estimate.peak_bytes - expandable.estimate.peak_bytes
    assert saved > 0.1 * GiB  # the generation's KV cache is what the fit weighs
    card = GpuProfile(name="card", total_memory_gib=(expandable.estimate.peak_bytes + saved / 2) / GiB)
    plan = engine.plan(str(llama_1b_file), card, settings, calibration=fitted_file, safety_margin=0)
    assert plan.fits and [c.knob for c in plan.changes] == ["allocator_conf"]
    assert plan.changes[0].saved_bytes == pytest.approx(saved)
    assert plan.chosen.train.allocator_conf == "expandable_segments:True"
    # already set: nothing to recommend
    assert not engine.plan(str(llama_1b_file), card, {**settings, "allocator_conf": "expandable_segments:True"},
                        calibration=fitted_file, safety_margin=0).changes


def test_the_shipped_coefficients_are_the_committed_fits():
    """profiles/calibrations/default.json holds what benchmarks/allocator_fit.py fitted (results/allocator_fit.json),
    the loss phase under torch's defaults, generation's patterns and the expandable segments' patterns what
    benchmarks/reserve_fit.py fitted on whole steps (reserve_fit.json)."""
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    per_phase = json.loads((results / "allocator_fit.json").read_text())["coefficients"]
    fitted = json.loads((results / "reserve_fit.json").read_text())
    whole_steps, generating = fitted["coefficients"], fitted["generation_coefficients"]
    shipped = default_calibration().allocator_reserve
    assert shipped["default"]["training"] == whole_steps
    assert set(whole_steps) & set(PATTERNS)
    assert set(generating) == set(GENERATION_PATTERNS)
    per_phase["default"]["training"] = whole_steps
    per_phase["default"]["generation"].update(generating)
    expandable = fitted["expandable_coefficients"]  # expandable_pages' patterns, on top of the per-phase shares
    assert expandable and set(expandable) <= set(EXPANDABLE_PATTERNS)
    per_phase["expandable_segments"]["training"].update(expandable)
    assert shipped == per_phase
