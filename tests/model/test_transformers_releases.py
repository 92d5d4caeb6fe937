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

from helpers import FIXTURES, benchmark_module, one_line_error, run


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
    return benchmark_module("transformers_releases")


def test_the_rows_agree_with_every_wheel_read():
    """benchmarks/transformers_releases.py read each release's modeling code for every model type vram-plan counts
    (benchmarks/results/transformers_releases.json): the logits_to_keep names, SDPA support and the attention mask;
    the rows say the same."""
    script = _facts_script()
    facts = json.loads(script.RESULTS.read_text())
    assert script.disagreements(facts) == []
    releases = facts["releases"]

    def read(version, model_type, column):
        return releases[version][model_type][column]

    # read by hand in models/llama/modeling_llama.py of each wheel
    assert read("4.44.0", "llama", "logits_to_keep_names") == []
    assert read("4.48.2", "llama", "logits_to_keep_names") == ["num_logits_to_keep"]  # forward(..., = 0)
    assert read("4.51.0", "llama", "logits_to_keep_names") == ["num_logits_to_keep", "logits_to_keep"]
    assert read("4.52.0", "llama", "logits_to_keep_names") == ["logits_to_keep"]  # the old name is dropped
    # _update_causal_mask in 4.52, masking_utils' create_causal_mask from 4.53; gemma2 without SDPA from 5.21
    assert read("4.52.0", "llama", "attention_mask") == "shared" and read("4.53.0", "llama", "attention_mask") == \
        "per_layer"
    assert read("5.20.0", "gemma2", "supports_sdpa") and not read("5.21.0", "gemma2", "supports_sdpa")
    assert not read("4.44.0", "phi3", "supports_sdpa") and read("4.45.0", "phi3", "supports_sdpa")
    # integrations/sdpa_attention.py: query = query.contiguous() (and key, value) up to 4.55, gone in 4.56
    assert read("4.55.0", "llama", "sdpa_contiguous_inputs") and not read("4.56.0", "llama", "sdpa_contiguous_inputs")
    # use_gqa_in_sdpa (k and v unrepeated when no mask is given) from 4.54
    assert not read("4.53.0", "llama", "sdpa_gqa_without_mask") and read("4.54.0", "llama", "sdpa_gqa_without_mask")
    # pack_gqa (a decoding step's single query on the key/value heads, no repeat_kv) from 5.23
    assert not read("5.22.0", "llama", "sdpa_decoding_gqa") and read("5.23.0", "llama", "sdpa_decoding_gqa")
    # self.original_inv_freq = self.inv_freq up to 4.57; register_buffer("original_inv_freq", inv_freq.clone()) in 5.0
    assert read("4.57.6", "llama", "rotary_buffers") == 1 and read("5.0.0", "llama", "rotary_buffers") == 2
    # modeling_utils.py from_pretrained: use_kernels = kwargs.pop("use_kernels", False) up to 5.24; from 5.25 None,
    # made True unless USE_HUB_KERNELS says no. What the Hub's kernels then replace is the decorated code:
    # use_kernel_forward_from_hub("RMSNorm") on llama's RMSNorm but not Gemma's; "rotary_pos_emb" on every
    # apply_rotary_pos_emb but phi3's
    assert not read("5.24.0", "llama", "kernelized_rms_norm") and read("5.25.0", "llama", "kernelized_rms_norm")
    assert read("5.25.0", "gemma2", "kernelized_rotary") and not read("5.25.0", "gemma2", "kernelized_rms_norm")
    assert read("5.25.0", "phi3", "kernelized_rms_norm") and not read("5.25.0", "phi3", "kernelized_rotary")
    assert all(set(types) >= {"llama", "qwen2", "mistral", "gemma2", "phi3"} for types in releases.values())
    # training_args.py: TrainingArguments' activation_checkpointing field from 5.23 (gradient_checkpointing its alias)
    arguments = facts["training_arguments"]
    assert arguments["5.22.0"]["checkpointing_argument"] == "gradient_checkpointing"
    assert arguments["5.23.0"]["checkpointing_argument"] == "activation_checkpointing"
    # a disagreement is reported, one line per column
    broken = {"releases": {"4.52.0": {"llama": {"logits_to_keep_names": ["num_logits_to_keep", "logits_to_keep"],
                                                "supports_sdpa": True, "attention_mask": "per_layer",
                                                "sdpa_contiguous_inputs": True, "sdpa_gqa_without_mask": False}}}}
    assert script.disagreements(broken) == [
        "transformers 4.52.0 llama: logits_to_keep_names table ['logits_to_keep'], wheel ['num_logits_to_keep', "
        "'logits_to_keep']", "transformers 4.52.0 llama: attention_mask table shared, wheel per_layer"]


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
        assert script.attention_mask(source) == row.attention_mask, model_type


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


@pytest.mark.parametrize(("model", "copies"), ids=["Llama-3.2-1B", "one-kv-head"], argvalues=[
    # Llama-3.2-1B: 8 key/value heads, repeat_kv copies already; the o_proj input's copy, a query wide
    ("Llama-3.2-1B", lambda q, kv: q),
    # one key/value head: repeat_kv's views of k and v become query-wide copies too
    (str(FIXTURES / "tiny-llama-headdim.json"), lambda q, kv: q + 2 * (q - kv)),
])
def test_sdpa_inputs_made_contiguous_before_4_56_keep_copies(model, copies):
    knobs = {"gradient_checkpointing": False, "per_device_train_batch_size": 4, "num_generations": 4,
             "max_prompt_length": 256, "max_completion_length": 256, "dtype": "bfloat16", "mixed_precision": "bf16",
             "attn_implementation": "sdpa"}
    before, after = (engine.check(model, "a100-80gb", {**knobs, "transformers_version": v}, trl_version="0.23.1")
                     for v in ("4.55.0", "4.56.0"))
    arch = before.context.arch
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    training = [{p.name: p for p in r.estimate.phases}["training"].components["activations"] for r in (before, after)]
    assert training[0] - training[1] == arch.num_layers * 4 * 512 * 2 * copies(q, kv)


def test_a_masked_decoding_step_copies_a_layer_of_the_cache_to_every_query_head_until_pack_gqa():
    # A padded batch passes generate()'s mask, so SDPA's use_gqa_in_sdpa is False and repeat_kv copies the layer's
    # whole cached k and v to Llama-3.2-1B's 32 query heads (8 key/value heads); from 5.23 a single query is packed
    # onto the key/value heads instead (integrations/sdpa_attention.py pack_gqa), and no copy is made.
    knobs = {"per_device_train_batch_size": 4, "num_generations": 4, "max_prompt_length": 208,
             "max_completion_length": 786, "dtype": "bfloat16", "mixed_precision": "bf16", "attn_implementation": "sdpa"}
    before, after = ({p.name: p for p in engine.check("Llama-3.2-1B-Instruct", "a100-80gb",
                                                      {**knobs, "transformers_version": v}).estimate.phases}
                     for v in ("5.22.0", "5.23.0"))
    layer = 4 * 993 * 8 * 64 * 2 * 2  # 4 sequences x 993 cached tokens x 8 heads x 64 x bf16 keys and values
    assert before["generation"].moment == "last decoding step: attention"
    assert before["generation"].components["activations"] == 32 // 8 * layer
    assert before["generation"].components["kv_cache"] == 16 * layer
    assert after["generation"].moment != "last decoding step: attention"
    assert after["generation"].components["activations"] == 0
    # FlashAttention-2 reads the cache as it is, in every release
    flash = engine.check("Llama-3.2-1B-Instruct", "a100-80gb", {**knobs, "transformers_version": "5.22.0",
                                                                "attn_implementation": "flash_attention_2"})
    assert {p.name: p for p in flash.estimate.phases}["generation"].components["activations"] == 0


@pytest.mark.parametrize(("source", "kernelizes"), [
    ('def from_pretrained(**kwargs):\n    use_kernels = kwargs.pop("use_kernels", False)\n', False),
    ('def from_pretrained(**kwargs):\n    use_kernels = kwargs.pop("use_kernels", None)\n'
     '    if not enabled():\n        use_kernels = False\n'
     '    elif use_kernels is None:\n        use_kernels = True\n', True),
    ('def from_pretrained(**kwargs):\n    use_kernels = kwargs.pop("use_kernels", None)\n', False),
    ('def from_pretrained(**kwargs):\n    pass\n', False),
])
def test_the_wheel_reader_finds_whether_from_pretrained_kernelizes_by_default(source, kernelizes):
    assert _facts_script().kernelizes_by_default(source) is kernelizes


def test_the_wheel_reader_finds_what_the_hub_kernels_replace():
    script = _facts_script()
    source = ('@use_kernel_forward_from_hub("RMSNorm")\nclass LlamaRMSNorm(nn.Module):\n    pass\n\n'
              '@use_kernel_forward_from_hub("rotary_pos_emb")\ndef apply_rotary_pos_emb(q, k, cos, sin):\n    pass\n')
    assert script.hub_decorated(source, "RMSNorm") and script.hub_decorated(source, "rotary_pos_emb")
    assert not script.hub_decorated("class GemmaRMSNorm(nn.Module):\n    pass\n", "RMSNorm")
