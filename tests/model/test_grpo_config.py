"""The printed config is what the installed trl.GRPOConfig accepts, and our mirror of its rules agrees."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vram_planner import engine
from vram_planner.model.grpo_config import (CHECKPOINTING_SPELLINGS, grpo_config_kwargs, grpo_config_problems,
                                            python_snippet)
from vram_planner.model.spec import TrainingConfig, training_config
from vram_planner.model.transformers_releases import transformers_releases
from vram_planner.profiles import GpuProfile

pytestmark = pytest.mark.slow


def build_real(kwargs, tmp_path):
    from trl import GRPOConfig

    # use_cpu: transformers refuses bf16 on a machine without a GPU otherwise
    return GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kwargs)


@pytest.mark.parametrize("gib", [4, 8, 12, 15.73, 24, 80])
@pytest.mark.parametrize("settings_", [{}, {"gradient_accumulation_steps": 4}, {"beta": 0.04, "num_generations": 4},
                                       {"max_completion_length": 2048, "num_generations": 16,
                                        "gradient_accumulation_steps": 2},
                                       {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0,
                                        "repetition_penalty": 1.05},
                                       {"use_reentrant": True}, {"use_kernels": False}])
def test_every_plan_builds_a_real_grpo_config(tmp_path, llama_1b_file, gib, settings_):
    gpu = GpuProfile(name="card", total_memory_gib=gib, bf16=True, flash_attention_2=True)
    result = engine.plan(str(llama_1b_file), gpu, settings_)
    verdict = result.chosen or result.smallest
    kwargs = grpo_config_kwargs(verdict.train)
    assert grpo_config_problems(kwargs) == []
    config = build_real(kwargs, tmp_path)
    assert config.generation_batch_size % config.num_generations == 0
    assert config.per_device_train_batch_size == verdict.train.per_device_train_batch_size
    sampling = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # no plan changes them
    assert all(getattr(config, knob) == value for knob, value in settings_.items() if knob in sampling)
    if "use_reentrant" in settings_ and verdict.train.gradient_checkpointing:
        assert config.gradient_checkpointing_kwargs == {"use_reentrant": True}
    # from_pretrained's keyword, which TRL passes on: left out where unset (the release's default)
    assert config.model_init_kwargs.get("use_kernels") == settings_.get("use_kernels")


def test_the_config_names_checkpointing_as_each_transformers_release_does():
    # transformers 5.23 renamed TrainingArguments' gradient_checkpointing(_kwargs) activation_checkpointing(_kwargs);
    # the old names warn until 6.0 drops them (benchmarks/transformers_releases.py reads each wheel's fields)
    rows = transformers_releases()
    assert {row.checkpointing_argument for row in rows} == {"gradient_checkpointing", "activation_checkpointing"}
    for row in rows:
        kwargs = grpo_config_kwargs(TrainingConfig(transformers_version=row.min_version, use_reentrant=True))
        name = row.checkpointing_argument
        assert kwargs[name] is True and kwargs[f"{name}_kwargs"] == {"use_reentrant": True}, row.min_version
        assert not (set(CHECKPOINTING_SPELLINGS) - {name, f"{name}_kwargs"}) & set(kwargs), row.min_version


def test_the_printed_config_builds_without_a_deprecation_warning(tmp_path, llama_1b_file):
    gpu = GpuProfile(name="card", total_memory_gib=24, bf16=True, flash_attention_2=True)
    kwargs = grpo_config_kwargs(engine.plan(str(llama_1b_file), gpu, {"use_reentrant": False}).chosen.train)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = build_real(kwargs, tmp_path)
    assert [str(w.message) for w in caught if "checkpointing" in str(w.message)] == []
    assert config.gradient_checkpointing and config.gradient_checkpointing_kwargs == {"use_reentrant": False}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(b=st.integers(1, 8), ga=st.integers(1, 6), s=st.one_of(st.none(), st.integers(1, 6)),
       g=st.integers(1, 9))
def test_mirror_agrees_with_grpo_config(tmp_path, b, ga, s, g):
    kwargs = {"per_device_train_batch_size": b, "gradient_accumulation_steps": ga, "num_generations": g}
    if s is not None:
        kwargs["steps_per_generation"] = s
    try:
        build_real(kwargs, tmp_path)
        accepted = True
    except ValueError:
        accepted = False
    assert accepted == (grpo_config_problems(kwargs) == [])


def test_snippet_is_python_that_builds_the_config(tmp_path, llama_1b_file):
    gpu = GpuProfile(name="card", total_memory_gib=3.2, bf16=True, flash_attention_2=True)
    chosen = engine.plan(str(llama_1b_file), gpu).chosen
    assert chosen is not None and chosen.train.load_in_4bit  # QLoRA on 3.2 GiB
    code = python_snippet(chosen.train, "meta-llama/Llama-3.2-1B")
    code = code.replace('output_dir="grpo-Llama-3.2-1B"', f"output_dir={str(tmp_path)!r}, use_cpu=True, "
                        "report_to='none'")
    setup, _, trainer_call = code.partition("trainer = GRPOTrainer(")
    namespace: dict = {}
    exec(setup, namespace)
    assert namespace["args"].optim.value == chosen.train.optim.value
    # the trainer call's peft and quantisation configs are real objects too
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    lora_line = next(line for line in trainer_call.splitlines() if "LoraConfig(" in line)
    quant_line = next(line for line in trainer_call.splitlines() if "BitsAndBytesConfig(" in line)
    lora = eval(lora_line.strip().removeprefix("peft_config=").rstrip(","), {"LoraConfig": LoraConfig})
    quant = eval(quant_line.strip().removeprefix("quantization_config=").rstrip(","),
                 {"BitsAndBytesConfig": BitsAndBytesConfig})
    assert lora.r == 16 and quant.load_in_4bit


def test_config_for_a_card_without_bf16_uses_fp16(tmp_path, llama_1b_file):
    t4 = GpuProfile(name="t4", total_memory_gib=14.75, bf16=False, flash_attention_2=False)
    verdict = engine.plan(str(llama_1b_file), t4).chosen
    kwargs = grpo_config_kwargs(verdict.train)
    assert kwargs["fp16"] and not kwargs["bf16"]
    build_real(kwargs, tmp_path)


def test_generation_batch_rule_is_reported_with_field_names_which_the_cli_spells_as_flags():
    with pytest.raises(Exception, match="num_generations 8") as refused:
        training_config({"per_device_train_batch_size": 3})
    assert "--num-generations 8" in refused.value.worded(lambda name: "--" + name.replace("_", "-"))


def test_smallest_config_on_a_card_without_bf16_loads_float16(llama_1b_file):
    rtx2060 = GpuProfile(name="rtx2060", total_memory_gib=0.5, bf16=False, flash_attention_2=False)
    result = engine.plan(str(llama_1b_file), rtx2060)
    assert not result.fits
    kwargs = grpo_config_kwargs(result.smallest.train)
    assert kwargs["model_init_kwargs"]["dtype"] == "float16" and kwargs["fp16"]
