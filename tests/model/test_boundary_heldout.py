"""benchmarks/boundary_heldout.py's sampler: the held-out configs are the same for a seed, valid, and off the grid the
reserve was fitted on (no test here traces or bisects)."""

from __future__ import annotations

import pytest

from helpers import benchmark_module
from vram_planner import engine
from vram_planner.model.spec import training_config
from vram_planner.units import GiB


@pytest.fixture(scope="module")
def heldout():
    return benchmark_module("boundary_heldout")


def test_the_sample_is_a_function_of_the_seed(heldout):
    card = heldout.largest_card()
    first = heldout.held_out(12, seed=3, largest_card_bytes=card)
    assert first == heldout.held_out(12, seed=3, largest_card_bytes=card)
    assert first != heldout.held_out(12, seed=4, largest_card_bytes=card)


def test_every_sampled_config_is_valid_runnable_on_a_card_and_off_the_grid(heldout):
    """TrainingConfig and the model's own rules accept each one, some catalog card holds its analytic peak, and no
    point of boundary.py's grid has the same model and validated config."""
    boundary = benchmark_module("boundary")
    grid = [(model, training_config(settings)) for _, model, settings in boundary.points(list(boundary.MODELS), False)]
    card = heldout.largest_card()
    sample = heldout.held_out(24, seed=0, largest_card_bytes=card)
    assert len({label for label, _, _ in sample}) == 24
    assert sum(model == heldout.LARGE for _, model, _ in sample) <= heldout.MAX_LARGE
    for label, model, settings in sample:
        config = training_config(settings)
        assert (model, config) not in grid, label
        assert engine.check(model, "h100-80gb", settings).estimate.peak_bytes <= card, label
        assert heldout.trace_seconds(model, settings) <= heldout.MAX_TRACE_SECONDS


def test_a_qlora_sweep_draws_lora_over_4bit_weights_into_tables_and_needs_of_its_own(heldout):
    """--qlora: every draw is LoRA over 4-bit weights, valid and within the bound, the other knobs drawn as before
    (both dtypes, with and without checkpointing); its table and needs are named apart from the 16-bit sweeps'."""
    from vram_planner.units import GiB

    sample = heldout.held_out(12, seed=1, largest_card_bytes=24 * GiB, qlora=True)
    assert all(s["load_in_4bit"] and s["lora_r"] in heldout.LORA_RANKS and "4bit" in label for label, _, s in sample)
    assert {s["dtype"] for _, _, s in sample} == {"float32", "bfloat16"}
    for label, model, settings in sample:
        assert engine.check(model, "24GiB", settings).estimate.peak_bytes <= 24 * GiB, label
    assert heldout.table_stem(1, 24, qlora=True) == "boundary-heldout-qlora-24gib-seed1"
    assert heldout.needs_path(qlora=True).name == "boundary-heldout-qlora-needs.json" != heldout.needs_path().name


def test_a_sweep_bounded_to_consumer_cards_draws_only_configs_under_its_bound(heldout):
    """--largest-gib: the sweep of the cards most users have keeps the draws whose analytic peak is within the bound,
    as the sampler judges it, and its tables are named by the bound beside the whole catalog's."""
    from vram_planner.model.calibration import default_calibration

    bound = 16 * GiB
    sample = heldout.held_out(24, seed=1, largest_card_bytes=bound)
    assert len({label for label, _, _ in sample}) == 24
    peaks = [engine.check(model, "h100-80gb", settings, calibration=default_calibration()).estimate.peak_bytes
             for _, model, settings in sample]
    assert max(peaks) <= bound
    assert sample != heldout.held_out(24, seed=1, largest_card_bytes=heldout.largest_card())
    assert heldout.table_stem(2, 16.0) == "boundary-heldout-16gib-seed2"
    assert heldout.table_stem(0, 24.0) != heldout.table_stem(0) == "boundary-heldout"


def test_a_draw_equal_to_a_grid_point_is_drawn_again(heldout, monkeypatch):
    boundary = benchmark_module("boundary")
    _, model, on_grid = next(p for p in boundary.points(["Qwen3-0.6B"], False) if p[0].endswith("fp32 full"))
    off_grid = {**on_grid, "max_completion_length": 640}
    full = {"dtype": "float32", "lora_r": None, "per_device_train_batch_size": 8, "num_generations": 8,
            "gradient_accumulation_steps": 1, "steps_per_generation": None, "max_prompt_length": 256,
            "max_completion_length": 512, "beta": 0.0, "optim": "adamw_torch_fused", "gradient_checkpointing": True,
            "attn_implementation": "sdpa", "allocator_conf": ""}  # TRL's defaults spelt out: the grid's "fp32 full"
    draws = iter([(model, full), (model, {**full, **off_grid})])
    monkeypatch.setattr(heldout, "draw", lambda rng, large_allowed, qlora=False: next(draws))
    assert heldout.held_out(1, seed=0) == [(f"{model} fp32 full B8 G8 A1 p256 c640", model, {**full, **off_grid})]
