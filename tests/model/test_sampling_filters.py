"""generate()'s sampling knobs: the bytes model/sampling.py counts for each logits processor are those transformers'
own processors allocate under the trace's counter, in generate()'s order; each release's defaults; what GRPOConfig
is given."""

from __future__ import annotations

import itertools

import pytest

from vram_planner import engine
from vram_planner.errors import ConfigError
from vram_planner.model import sampling
from vram_planner.model.grpo_config import grpo_config_kwargs
from vram_planner.model.spec import TrainingConfig

ROWS, VOCAB = 16, 30_000
BLOCK = 512  # the trace rounds every storage up to the caching allocator's block

FILTERS = {"repetition_penalty": 1.1, "temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.05}


def _traced_sampling_bytes(train: TrainingConfig, tokens: int) -> int:
    """What transformers' processors (as generate() builds them), the softmax and torch.multinomial hold at once
    beside the float32 logits, under the trace's counter."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import GenerationConfig, PretrainedConfig
    from transformers.generation.utils import GenerationMixin

    class Decoder(GenerationMixin):  # what _get_logits_processor reads of a model
        config = PretrainedConfig()

    from vram_planner.tracing.counter import LiveBytes

    config = GenerationConfig(do_sample=True, temperature=train.sampling_temperature, top_p=train.top_p,
                              top_k=train.sampling_top_k, min_p=train.min_p,
                              repetition_penalty=train.repetition_penalty)
    processors = Decoder()._get_logits_processor(
        generation_config=config, input_ids_seq_length=tokens, encoder_input_ids=None,
        prefix_allowed_tokens_fn=None, logits_processor=None)
    tracker = LiveBytes()
    with FakeTensorMode(), tracker:
        ids = torch.zeros(ROWS, tokens, dtype=torch.long)
        logits = torch.empty(ROWS, VOCAB)
        tracker.reset_peak()
        before = tracker.peak
        scores = processors(ids, logits)
        torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1)
        return tracker.peak - before


COMBINATIONS = [dict(c) for n in range(len(FILTERS) + 1) for c in itertools.combinations(FILTERS.items(), n)]


@pytest.mark.parametrize("knobs", COMBINATIONS, ids=lambda k: "+".join(k) or "none")
def test_every_combination_of_filters_holds_what_transformers_processors_hold(knobs):
    train = TrainingConfig(**knobs)
    assert sampling.active_processors(train) == list(knobs)
    tokens = 200
    traced = _traced_sampling_bytes(train, tokens)
    # the block rounding of a few small tensors (top-k's values, the multinomial's samples) aside
    assert sampling.sampling_bytes(train, ROWS, VOCAB, tokens) == pytest.approx(traced, abs=6 * BLOCK)


@pytest.mark.parametrize(("knobs", "tokens"), [({"repetition_penalty": 1.3}, 60_000),
                                               ({"top_k": 20_000}, 8), ({"top_k": 10**6}, 8),
                                               ({"top_k": 29_999, "repetition_penalty": 0.9}, 40_000)])
def test_wide_filters_and_long_contexts_are_counted_where_they_decide(knobs, tokens):
    # the penalty's gathered ids outweigh the logits past about a vocabulary's worth of tokens; top-k's values and
    # indices past a third of it
    train = TrainingConfig(**knobs)
    traced = _traced_sampling_bytes(train, tokens)
    assert sampling.sampling_bytes(train, ROWS, VOCAB, tokens) == pytest.approx(traced, abs=6 * BLOCK)
    assert traced > _traced_sampling_bytes(TrainingConfig(), tokens)


def test_the_defaults_run_no_processor_and_every_filter_adds_memory():
    plain = sampling.sampling_bytes(TrainingConfig(), ROWS, VOCAB, 100)
    assert plain == 2 * ROWS * VOCAB * 4  # the probabilities and the noise
    for name, value in FILTERS.items():
        assert sampling.sampling_bytes(TrainingConfig(**{name: value}), ROWS, VOCAB, 100) > plain, name


def _train(trl_version: str, knobs: dict) -> TrainingConfig:
    context = engine.make_context("Qwen2.5-0.5B", "h100-80gb", trl_version=trl_version)
    return engine.make_training(context, knobs)


@pytest.mark.parametrize(("trl_version", "temperature", "top_k"), [
    ("0.14.0", 0.9, 50),  # GRPOConfig's temperature; transformers 4's GenerationConfig filters the top 50
    ("0.17.0", 0.9, 50),  # GRPOConfig's own top_k 50
    ("0.18.0", 1.0, 0),  # top_k None: no filter
    ("0.27.0", 1.0, 0), ("1.16.0", 1.0, 0)])
def test_each_release_samples_as_its_defaults_say(trl_version, temperature, top_k):
    train = _train(trl_version, {})
    assert (train.sampling_temperature, train.sampling_top_k, train.top_p, train.min_p, train.repetition_penalty) == (
        temperature, top_k, 1.0, None, 1.0)
    assert [k for k in grpo_config_kwargs(train) if k in FILTERS] == []  # the defaults are not written out
    filters = ["temperature", "top_k"] if temperature != 1.0 else []
    assert sampling.active_processors(train) == filters


def test_releases_before_0_16_refuse_the_filters_they_lack():
    assert grpo_config_kwargs(_train("0.15.0", {"temperature": 0.7}))["temperature"] == 0.7
    for name in ("top_p", "top_k", "min_p", "repetition_penalty"):
        with pytest.raises(ConfigError, match=f"{name} is not a GRPOConfig field in TRL 0.15"):
            _train("0.15.0", {name: FILTERS[name]})
    assert _train("0.15.0", {}).sampling_top_k == 50  # GRPOConfig has no top_k, generate() filters all the same


def test_a_recipes_sampling_is_written_into_the_config():
    knobs = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05}
    assert {k: v for k, v in grpo_config_kwargs(_train("1.16.0", knobs)).items() if k in knobs} == knobs


@pytest.mark.parametrize(("knob", "value"), [("temperature", 0), ("top_p", 0), ("top_p", 1.5), ("top_k", -1),
                                             ("min_p", 1.5), ("repetition_penalty", 0)])
def test_values_generate_refuses_are_refused(knob, value):
    with pytest.raises(ConfigError, match=f"{knob} should be"):
        _train("1.16.0", {knob: value})
