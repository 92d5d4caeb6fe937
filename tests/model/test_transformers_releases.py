"""profiles/transformers.toml: the rows of transformers releases, held to the installed transformers' own code."""

from __future__ import annotations

import json

import pytest

from vram_planner import engine
from vram_planner.model.architecture import FAMILIES, MODEL_TYPE_ALIASES
from vram_planner.model.spec import training_config
from vram_planner.model.transformers_releases import (known_transformers_version, transformers_release,
                                                      transformers_releases)
from vram_planner.model.trl_releases import installed_version, version_tuple

from helpers import one_line_error, run


def test_the_rows_cover_every_release_from_the_oldest_to_the_newest_without_a_gap_or_an_overlap():
    rows = sorted(transformers_releases(), key=lambda r: version_tuple(r.min_version))
    for row, following in zip(rows, rows[1:]):
        assert row.below_version == following.min_version, (row, following)
    assert all(version_tuple(r.min_version) < version_tuple(r.below_version) for r in rows)


def test_the_installed_transformers_has_a_row_and_it_names_the_model_types_without_sdpa():
    """Every family vram-plan plans, built as the installed transformers builds it: a wrong sdpa_unsupported list
    would let `check` plan SDPA for a model whose from_pretrained refuses it, or eager where SDPA runs."""
    pytest.importorskip("transformers")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import transformers

    row = transformers_release(None, int(installed_version("transformers").split(".")[0]))
    assert row.version == known_transformers_version(transformers.__version__)
    for model_type in [*FAMILIES, *MODEL_TYPE_ALIASES]:
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        if name is None:  # a multimodal alias (gemma3) whose text model is its own family
            continue
        supports = getattr(transformers, name)._supports_sdpa
        assert row.supports_sdpa(model_type) == supports, model_type


def test_the_installed_transformers_names_the_cache_as_its_row_says():
    pytest.importorskip("transformers")
    import inspect

    from transformers import GenerationMixin
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    row = transformers_release(None, int(installed_version("transformers").split(".")[0]))
    assert row.cache_argument in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    assert row.cache_argument in GenerateDecoderOnlyOutput.__dataclass_fields__


def test_a_trl_release_of_another_generation_is_planned_with_the_transformers_of_its_time():
    installed_major = int(installed_version("transformers").split(".")[0])
    other = 4 if installed_major == 5 else 5
    row = transformers_release(None, other)
    assert version_tuple(row.version)[0] == other
    newest_of_other = max(version_tuple(r.min_version) for r in transformers_releases()
                          if version_tuple(r.min_version)[0] == other)
    assert version_tuple(row.version) == newest_of_other
    assert training_config({"trl_version": "0.14.0"}).transformers.version == row.version


@pytest.mark.parametrize(("given", "expected"), [("5.24", "5.24.0"), ("4.48.3", "4.48.3"), ("5.23.0rc1", "5.23.0rc1")])
def test_a_given_release_is_planned_for(given, expected):
    assert training_config({"transformers_version": given}).transformers.version == expected


@pytest.mark.parametrize(("given", "message"), [
    ("7.0", "--transformers-version should be a transformers release vram-plan knows (4.0.0 up to 6.0.0, not "
            "included) (got '7.0')"),
    ("five", "--transformers-version should be a transformers version number like 5.24.0 (got 'five')"),
])
def test_an_unknown_release_is_one_line_and_exit_2(capsys, given, message):
    err = one_line_error(capsys, "check", "--gpu", "t4", "--model", "Llama-3.2-1B", "--transformers-version", given)
    assert err.strip() == f"error: {message}"


def test_gemma2_runs_eager_attention_where_transformers_has_no_sdpa_for_it(capsys):
    long = {"max_completion_length": 4096}  # where eager's attention probabilities weigh
    default = engine.check("gemma-2-2b", "a100-80gb", {**long, "transformers_version": "5.24.0"})
    assert default.train.attn_implementation == "eager"
    assert any("eager, as transformers 5.24.0 runs gemma2" in note for note in default.estimate.notes)
    before = engine.check("gemma-2-2b", "a100-80gb", {**long, "transformers_version": "5.20.0"})
    assert before.train.attn_implementation == "sdpa" and not any("eager" in n for n in before.estimate.notes)
    assert before.estimate.peak_bytes < default.estimate.peak_bytes  # eager keeps the attention probabilities
    err = one_line_error(capsys, "check", "--gpu", "a100-80gb", "--model", "gemma-2-2b", "--attn-implementation",
                         "sdpa", "--transformers-version", "5.21")
    assert "transformers 5.21.0 has no SDPA attention for gemma2" in err
    code, _, _ = run(capsys, "check", "--gpu", "a100-80gb", "--model", "gemma-2-2b", "--attn-implementation", "sdpa",
                     "--transformers-version", "5.20.0")
    assert code == 0


def _facts_script():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "transformers_releases.py"
    spec = importlib.util.spec_from_file_location("transformers_releases_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_logits_to_keep_rows_agree_with_every_wheel_read():
    """benchmarks/transformers_releases.py read each release's ...ForCausalLM.forward for every model type vram-plan
    counts (benchmarks/results/transformers_releases.json); the rows say the same."""
    script = _facts_script()
    facts = json.loads(script.RESULTS.read_text())
    assert script.disagreements(facts) == []
    releases = facts["releases"]
    # read by hand in models/llama/modeling_llama.py of each wheel
    assert releases["4.44.0"]["llama"] == []
    assert releases["4.48.2"]["llama"] == ["num_logits_to_keep"]  # forward(..., num_logits_to_keep: int = 0)
    assert releases["4.51.0"]["llama"] == ["num_logits_to_keep", "logits_to_keep"]  # @deprecate_kwarg renames it
    assert releases["4.52.0"]["llama"] == ["logits_to_keep"]  # the decorator is gone: the old name is dropped
    assert all(set(types) >= {"llama", "qwen2", "mistral", "gemma2", "phi3"} for types in releases.values())
    # a disagreement is reported
    broken = {"releases": {"4.52.0": {"llama": ["num_logits_to_keep", "logits_to_keep"]}}}
    assert script.disagreements(broken) == ["transformers 4.52.0 llama: logits_to_keep_names table ['logits_to_keep'], "
                                            "wheel ['num_logits_to_keep', 'logits_to_keep']"]


def test_the_installed_transformers_honours_what_its_row_says():
    pytest.importorskip("transformers")
    import inspect

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import transformers

    row = transformers_release(None, int(installed_version("transformers").split(".")[0]))
    script = _facts_script()
    for model_type in script.MODEL_TYPES:
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        if name is None:
            continue
        source = inspect.getsource(inspect.getmodule(getattr(transformers, name)))
        assert script.honoured_names(source) == sorted(row.logits_to_keep_names, key=script.NAMES.index), model_type


@pytest.mark.parametrize(("trl", "argument"), [
    # trl/trainer/grpo_trainer.py 0.14.0: model(input_ids, num_logits_to_keep=num_logits_to_keep + 1)
    ("0.14.0", "num_logits_to_keep"),
    # 0.15.0 _get_per_token_logps: model(input_ids=..., attention_mask=..., logits_to_keep=logits_to_keep + 1)
    ("0.15.0", "logits_to_keep"),
    # 0.17.0-0.19.0 the same call, in chunks of the batch
    ("0.17.0", "logits_to_keep"), ("0.19.0", "logits_to_keep"),
])
def test_each_trl_release_passes_the_keyword_its_row_names(trl, argument):
    from vram_planner.model.trl_releases import trl_release

    assert trl_release(trl).logits_to_keep_argument == argument
