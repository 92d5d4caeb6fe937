"""The checks that run without pydantic agree with pydantic's: `release_config` (a release's defaults, no knob given)
and `with_changes` (the planner's derived configs) give what `training_config` gives, or refuse with its words."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vram_planner import engine
from vram_planner.errors import ConfigError
from vram_planner.model.search import ladder_runs, micro_batch_variants
from vram_planner.model.spec import (Optimizer, TrainingConfig, as_settings, release_config, training_config,
                                     with_changes)
from vram_planner.model.trl_releases import trl_release, trl_releases
from vram_planner.model.trl_semantics import release_defaults

RELEASES = [row.min_version for row in trl_releases()]
ALLOCATOR_TEXTS = ["", " expandable_segments:True ", "max_split_size_mb:128,expandable_segments:False",
                   "garbage", "expandable_segments:maybe", "max_split_size_mb:-1"]
QUICK = settings(derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def outcome(make) -> Any:
    try:
        return make()
    except ConfigError as exc:
        return ("refused", exc.problems)


@pytest.mark.parametrize("version", RELEASES)
def test_a_release_s_defaults_are_what_training_config_makes_of_them(version):
    release = trl_release(version)
    for use_vllm in (False, True):
        for conf in ALLOCATOR_TEXTS:
            values = {**release_defaults(release, use_vllm=use_vllm), "trl_version": release.version,
                      "allocator_conf": conf, **({"use_vllm": True} if use_vllm else {})}
            fast, checked = outcome(lambda: release_config(values)), outcome(lambda: training_config(values))
            assert fast == checked, (version, use_vllm, conf)
            if not isinstance(fast, tuple):
                assert type(fast.optim) is Optimizer and fast.allocator_conf == conf.strip()


NUMBERS = st.one_of(st.integers(-3, 70), st.sampled_from([0, 2**40, 2**40 + 1, 10**30, -(2**40)]),
                    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.5, 0.999, 1.0, math.inf]))
# what the planner changes, and to what: numbers anywhere (its arithmetic could go wrong), the allocator text and the
# LoRA targets through their own validators, and the choices it makes among valid ones
CHANGES = st.fixed_dictionaries({}, optional={
    "per_device_train_batch_size": NUMBERS, "gradient_accumulation_steps": NUMBERS,
    "steps_per_generation": st.one_of(st.none(), NUMBERS), "num_generations": NUMBERS,
    "max_completion_length": NUMBERS, "max_prompt_length": NUMBERS, "num_iterations": NUMBERS, "beta": NUMBERS,
    "lora_r": st.one_of(st.none(), NUMBERS), "lora_dropout": NUMBERS, "vllm_gpu_memory_utilization": NUMBERS,
    "allocator_conf": st.sampled_from(ALLOCATOR_TEXTS), "zero_stage": st.one_of(st.none(), NUMBERS),
    "lora_target_modules": st.sampled_from([None, ["q_proj", "v_proj"], ["all-linear"], [""], ["all-linear", "q"]]),
    "optim": st.sampled_from(list(Optimizer)), "gradient_checkpointing": st.booleans(),
    "dtype": st.sampled_from(["float32", "bfloat16", "float16"]), "load_in_4bit": st.booleans(),
    "trl_version": st.sampled_from(RELEASES)})
BASES = [TrainingConfig(), TrainingConfig(lora_r=16, dtype="bfloat16"),
         TrainingConfig(per_device_train_batch_size=6, num_generations=3, steps_per_generation=4,
                        trl_version="0.19.0")]


@settings(QUICK, max_examples=400)
@given(base=st.sampled_from(BASES), changes=CHANGES)
def test_with_changes_agrees_with_training_config(base, changes):
    derived = outcome(lambda: with_changes(base, **changes))
    assert derived == outcome(lambda: training_config({**as_settings(base), **changes}))


@pytest.mark.parametrize("base", BASES + [TrainingConfig(per_device_train_batch_size=1024, trl_version="0.14.0")])
def test_every_rung_of_the_ladder_is_a_config_training_config_accepts(base):
    for run in ladder_runs(base, gpu_bf16=False, arch=engine.make_context("Llama-3.2-1B", "24GiB").arch):
        for rung in run:
            for variant in [rung, *micro_batch_variants(rung)]:
                assert training_config(as_settings(variant)) == variant
