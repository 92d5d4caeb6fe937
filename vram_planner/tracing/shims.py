"""Where the installed transformers or TRL release differs in name only: one small, named shim per difference.

Each shim answers from what the installed package has (an attribute, a parameter), not from a version number, so a
release that backports or renames late still gets the right answer; tests/tracing/test_shims.py holds each to the
release behaviours it names, on stand-ins of either shape.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from typing import Any


def model_dtype_keyword(transformers_version: str) -> str:
    """The keyword that sets a model's dtype in `from_config`: `dtype` from transformers 4.56, `torch_dtype` before
    (4.48 passes unknown keywords on to the model's __init__, which rejects `dtype`)."""
    from vram_planner.model.trl_releases import parse_version

    parsed = parse_version(transformers_version)
    return "dtype" if parsed is None or parsed[0] >= (4, 56, 0) else "torch_dtype"


class LegacyCacheLayer:
    """One layer of a transformers 4.x DynamicCache (parallel key_cache/value_cache lists) seen as a 5.x cache layer
    (`keys`, `values`), read at every access: `cache.update` replaces the tensors in the lists."""

    is_sliding = False

    def __init__(self, cache: Any, index: int) -> None:
        self._cache, self._index = cache, index

    @property
    def keys(self) -> Any:
        return _entry(self._cache.key_cache, self._index)

    @property
    def values(self) -> Any:
        return _entry(self._cache.value_cache, self._index)


def _entry(table: list[Any], index: int) -> Any:
    value = table[index] if index < len(table) else None
    return value if hasattr(value, "shape") else None  # 4.x keeps [] for a layer not yet filled


def cache_layers(cache: Any) -> list[Any]:
    """A KV cache's layers as objects with `keys` and `values`: transformers 5 (and 4.54+) `cache.layers`, or the
    4.x DynamicCache's key_cache/value_cache lists."""
    if hasattr(cache, "layers"):
        return list(cache.layers)
    return [LegacyCacheLayer(cache, i) for i in range(len(cache.key_cache))]


def cache_layer(cache: Any, index: int) -> Any:
    """Layer `index` of a KV cache (see `cache_layers`), or None where the cache keeps no such layer."""
    if hasattr(cache, "layers"):
        return cache.layers[index] if index < len(cache.layers) else None
    return LegacyCacheLayer(cache, index) if hasattr(cache, "key_cache") else None


def as_cache(returned: Any) -> Any:
    """The KV cache generate() returned as a Cache: transformers 4.48-4.5x hand back the legacy tuple of (keys,
    values) per layer when the caller passed no cache; `DynamicCache.from_legacy_cache` keeps those very tensors."""
    if isinstance(returned, tuple):
        from transformers.cache_utils import DynamicCache

        return DynamicCache.from_legacy_cache(returned)
    return returned


def one_step_generation(gen_utils: Any) -> tuple[Any, str, Callable[..., Any]]:
    """(owner, name, value) of the patch that stops generate() after the one step each call is asked for, where fake
    tensors cannot tell that every sequence hit EOS: transformers 5's StopCheck says "stop"; 4.x loops while
    `_has_unfinished_sequences`, whose flag is the Python False before the first step and a tensor after it."""
    if hasattr(gen_utils, "StopCheck"):
        return gen_utils.StopCheck, "__call__", lambda self, unfinished, tokens, length: True
    return (gen_utils.GenerationMixin, "_has_unfinished_sequences",
            lambda self, this_peer_finished, *args, **kwargs: this_peer_finished is False)


def per_token_logps(trainer: Any, model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int,
                    batch_size: int, token_type_ids: Any = None) -> Any:
    """The installed GRPOTrainer's own per-token log-probs of the completions: `_get_per_token_logps_and_entropies`
    (TRL 0.20 and later) or `_get_per_token_logps` (0.15 to 0.19); `batch_size` (chunks of the scoring pass) and
    `token_type_ids` (multimodal processors' output) where the release takes them."""
    method = getattr(trainer, "_get_per_token_logps_and_entropies", None) or trainer._get_per_token_logps
    accepted = inspect.signature(method).parameters
    kwargs = {"batch_size": batch_size} if "batch_size" in accepted else {}
    if token_type_ids is not None and "token_type_ids" in accepted:
        kwargs["token_type_ids"] = token_type_ids
    out = method(model, input_ids, attention_mask, logits_to_keep, **kwargs)
    return out[0] if isinstance(out, tuple) else out


class Metrics(defaultdict):  # type: ignore[type-arg]
    """GRPOTrainer._metrics of any release: `_metrics[key].append(x)` (TRL 0.14-0.15) and
    `_metrics[mode][key].append(x)` (later) both land here and are dropped: logging allocates nothing on the GPU."""

    def __init__(self) -> None:
        super().__init__(Metrics)

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


def passes_token_type_ids(model: Any) -> bool:
    """TRL passes the processor's token_type_ids (zeros for text) with the prompts: a multimodal model whose forward
    takes them (Gemma 3's processor marks image tokens there, and TRL hands them to generate and, extended by zeros
    over the completion, to the log-prob passes; transformers 5.3 and 5.4 refuse a Gemma 3 forward in training mode
    without them, 5.16 no longer)."""
    return getattr(model.config, "vision_config", None) is not None and (  # the class's: accelerate wraps the instance's
        "token_type_ids" in inspect.signature(type(model).forward).parameters)
