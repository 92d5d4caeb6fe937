"""The version shims of the trace engine, each on stand-ins of the release shapes it names (no other venv needed)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from vram_planner.tracing.shims import (Metrics, as_cache, cache_layer, cache_layers, model_dtype_keyword,
                                        one_step_generation, per_token_logps)

torch = pytest.importorskip("torch")


@pytest.mark.parametrize(("version", "keyword"), [("4.48.2", "torch_dtype"), ("4.55.4", "torch_dtype"),
                                                  ("4.56.0", "dtype"), ("5.24.0", "dtype"), ("4.57.0rc1", "dtype")])
def test_the_dtype_keyword_follows_the_transformers_release(version, keyword):
    assert model_dtype_keyword(version) == keyword


def legacy_cache(layers: int) -> types.SimpleNamespace:
    """A transformers 4.48 DynamicCache's shape: parallel lists, [] for a layer not yet filled."""
    keys = [torch.zeros(1, 2, 3 + i, 4) for i in range(layers)] + [[]]
    values = [torch.ones(1, 2, 3 + i, 4) for i in range(layers)] + [[]]
    return types.SimpleNamespace(key_cache=keys, value_cache=values)


def test_a_legacy_cache_reads_as_cache_layers_and_follows_updates():
    cache = legacy_cache(2)
    layers = cache_layers(cache)
    assert len(layers) == 3 and layers[2].keys is None and layers[2].values is None
    assert layers[1].keys is cache.key_cache[1] and layers[1].values is cache.value_cache[1]
    grown = torch.zeros(1, 2, 9, 4)
    cache.key_cache[1] = grown  # DynamicCache.update replaces the list entry
    assert layers[1].keys is grown and cache_layer(cache, 1).keys is grown
    assert not layers[0].is_sliding


def test_a_transformers_5_cache_is_read_through_its_layers():
    layer = types.SimpleNamespace(keys=torch.zeros(1), values=torch.zeros(1))
    cache = types.SimpleNamespace(layers=[layer])
    assert cache_layers(cache) == [layer] and cache_layer(cache, 0) is layer and cache_layer(cache, 1) is None


def test_a_legacy_tuple_becomes_a_dynamic_cache_with_the_same_tensors():
    from transformers.cache_utils import DynamicCache

    keys, values = torch.zeros(1, 2, 5, 4), torch.ones(1, 2, 5, 4)
    if not hasattr(DynamicCache, "from_legacy_cache"):  # transformers 5 dropped the legacy format
        pytest.skip("this transformers has no legacy cache format")
    cache = as_cache(((keys, values),))
    assert isinstance(cache, DynamicCache)
    assert cache_layer(cache, 0).keys.shape == keys.shape
    already = object()
    assert as_cache(already) is already


def test_generation_stops_after_one_step_in_either_loop():
    # transformers 5: StopCheck says stop; 4.x: _has_unfinished_sequences is True only before the first step, when
    # its flag is still the Python False (after a step it is a tensor, which fake tensors cannot read).
    five = types.SimpleNamespace(StopCheck=type("StopCheck", (), {}), GenerationMixin=object)
    owner, name, value = one_step_generation(five)
    assert (owner, name) == (five.StopCheck, "__call__") and value(None, None, None, None) is True
    four = types.SimpleNamespace(GenerationMixin=type("GenerationMixin", (), {}))
    owner, name, value = one_step_generation(four)
    assert (owner, name) == (four.GenerationMixin, "_has_unfinished_sequences")
    assert value(None, False, False, device="cpu") is True
    assert value(None, torch.tensor(False), False, device="cpu") is False


class Release019:
    """TRL 0.17-0.19: _get_per_token_logps(model, ids, mask, logits_to_keep, batch_size=None)."""

    def _get_per_token_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None):
        return ["logps", batch_size]  # a tensor in TRL; not a tuple, which the newer method returns


class Release015:
    """TRL 0.15-0.16: no batch_size; scoring ran per micro-batch."""

    def _get_per_token_logps(self, model, input_ids, attention_mask, logits_to_keep):
        return ["logps", None]


class Release114:
    """TRL 0.20 and later: _get_per_token_logps_and_entropies(model, *args, batch_size=None, ...) -> (logps, ...)."""

    def _get_per_token_logps_and_entropies(self, model, *args, batch_size=None, compute_entropy=False, **kwargs):
        return ["logps", batch_size], None

    def _get_per_token_logps(self, *args, **kwargs):
        raise AssertionError("the newer method is the one TRL's loss calls")


@pytest.mark.parametrize(("release", "batch_size"), [(Release019(), 4), (Release015(), None), (Release114(), 4)])
def test_the_releases_own_log_prob_method_is_called_with_the_arguments_it_takes(release, batch_size):
    assert per_token_logps(release, None, None, None, 8, 4) == ["logps", batch_size]


def test_metrics_take_either_releases_logging():
    metrics = Metrics()
    metrics["kl"].append(1.0)  # TRL 0.14-0.15
    metrics["train"]["kl"].append(1.0)  # later
    metrics["train"]["rewards"].extend([1.0])


def kernel_allocations(name: str) -> list[str]:
    """The allocating calls (torch.empty, torch.empty_like) in TRL's Triton log-prob kernel's `name` method."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("trl.kernels")
    if spec is None or spec.submodule_search_locations is None:
        pytest.skip("this TRL has no kernels")
    source = Path(next(iter(spec.submodule_search_locations))) / "logprob_entropy.py"
    if not source.exists():
        pytest.skip("this TRL has no Triton log-prob kernel")
    tree = ast.parse(source.read_text())
    method = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    return sorted(ast.unparse(c.func) for c in ast.walk(method) if isinstance(c, ast.Call)
                  and ast.unparse(c.func) in ("torch.empty", "torch.empty_like"))


def test_the_log_prob_kernels_stand_in_allocates_what_the_kernel_does():
    # TRL 1.14's Triton kernel (its source ships with later releases too) makes four float32 values per row in
    # forward and keeps the logits; backward makes one gradient of the logits' shape. The stand-in the trace runs
    # in its place allocates the same, counted on fake tensors.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vram_planner.tracing.counter import LiveBytes
    from vram_planner.tracing.patches import LogProbEntropyKernel

    assert kernel_allocations("forward") == ["torch.empty", "torch.empty_like", "torch.empty_like",
                                             "torch.empty_like"]
    assert kernel_allocations("backward") == ["torch.empty_like"]
    rows, vocab = 3 * 5, 1000
    tracker = LiveBytes()
    with FakeTensorMode(), tracker:
        logits = torch.empty(3, 5, vocab, requires_grad=True)
        index = torch.zeros(3, 5, dtype=torch.long)
        before = tracker.total
        logprobs, entropy = LogProbEntropyKernel.select(logits, index, 1.0, None)
        assert tracker.total - before == 4 * 512 * -(-rows * 4 // 512)  # four fp32 values per row, 512-byte blocks
        logprobs.sum().backward()
        assert logits.grad.shape == logits.shape and logits.grad.dtype == torch.float32
        assert tracker.bytes_of([logits.grad]) == 512 * -(-rows * vocab * 4 // 512)  # the one gradient it makes


def test_token_type_ids_go_with_a_multimodal_models_prompts_as_trl_passes_them(monkeypatch):
    """Gemma 3's processor returns token_type_ids (zeros for text), and TRL hands them to generate, to the log-prob
    passes and, extended over the completion, to the loss; transformers 5.3 and 5.4 refuse Gemma 3's forward in training
    mode without them. The trace passes them to every forward of the step, a text-only model gets none."""
    import functools
    import json

    from transformers.models.gemma3.modeling_gemma3 import Gemma3Model

    from helpers import FIXTURES
    from vram_planner.model.spec import TrainingConfig
    from vram_planner.tracing.shims import passes_token_type_ids
    from vram_planner.tracing.step import trace_step

    seen = []
    forward = Gemma3Model.forward  # under the LM head TRL 1.15 and later fuse into the forward

    @functools.wraps(forward)  # generate() checks its keywords against the forward's signature
    def spying(self, *args, token_type_ids=None, **kwargs):
        seen.append(None if token_type_ids is None else tuple(token_type_ids.shape))
        return forward(self, *args, token_type_ids=token_type_ids, **kwargs)

    monkeypatch.setattr(Gemma3Model, "forward", spying)
    config = json.loads((FIXTURES / "tiny-gemma3-vision.json").read_text())
    trace_step(config, TrainingConfig(per_device_train_batch_size=2, num_generations=2, max_prompt_length=8,
                                      max_completion_length=6, beta=0.04))
    assert seen and None not in seen
    assert {(2, 8), (2, 14)} <= set(seen)  # the prompts generated from, and prompt and completion scored
    text_only = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=None))
    assert not passes_token_type_ids(text_only)
