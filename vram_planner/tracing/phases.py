"""The four phases of a traced GRPO step, run through the installed transformers and TRL code."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vram_planner.model.spec import Optimizer, TrainingConfig
from vram_planner.tracing.cache_growth import CacheLayer, additions, growth
from vram_planner.tracing.counter import ACTS, GRADS, HEAD, STEP, PhasePeak
from vram_planner.tracing.optimizer_peak import step_peak
from vram_planner.tracing.session import Session, input_grads, set_checkpointing
from vram_planner.tracing.shims import as_cache


def _prompt(session: Session, sequences: int, length: int) -> tuple[Any, Any]:
    """Token ids and a left-padded attention mask, as GRPO batches are: only shapes matter on fake tensors, but on a
    real device a mask without padding would let transformers skip building it."""
    ids = torch.zeros((sequences, length), dtype=torch.long, device=session.device_type)
    mask = torch.ones((sequences, length), dtype=torch.long, device=session.device_type)
    mask[0, 0] = 0
    return ids, mask


def _processor_outputs(session: Session, ids: Any) -> dict[str, Any]:
    """What a multimodal model's processor adds to the prompts TRL generates from (shims.passes_token_type_ids)."""
    from vram_planner.tracing.shims import passes_token_type_ids

    return {"token_type_ids": torch.zeros_like(ids)} if passes_token_type_ids(session.base_model) else {}


def _generation_config(model: Any, train: TrainingConfig, max_new_tokens: int, returns_cache: bool = False) -> Any:
    """GRPOTrainer's generation settings with the run's sampling knobs (the release's defaults where unset), for
    `max_new_tokens` steps; with `returns_cache`, generate() returns its KV cache."""
    from transformers import GenerationConfig

    # A multimodal config (Gemma 3's) keeps the token ids in its text config, as the tokenizer TRL pads with does
    text = model.config.get_text_config()
    eos = getattr(text, "eos_token_id", None)
    pad = getattr(text, "pad_token_id", None)
    pad = eos if pad is None else pad
    pad = pad[0] if isinstance(pad, list) else pad  # TRL pads with the tokenizer's pad token, often the first EOS
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, pad_token_id=pad, eos_token_id=eos,
                            bos_token_id=getattr(text, "bos_token_id", None), disable_compile=True,
                            return_dict_in_generate=returns_cache, temperature=train.sampling_temperature,
                            top_p=train.top_p, top_k=train.sampling_top_k, min_p=train.min_p,
                            repetition_penalty=train.repetition_penalty)


def run_generation(session: Session) -> PhasePeak:
    """model.generate on the B x S generation batch: the prefill, the cache's growth, the last decoding step.

    Running every decoding step would take c forward passes for the same tensor peak: the KV cache only grows, so
    the last step (cache of p + c - 1 tokens, growing by concatenation) is the largest decoding moment. It runs as
    generate() resumed from the prefill's cache, grown in between as the decoding steps grow it (`_grow_cache`):
    the allocator model sees the concatenations that fragment its cache.
    """
    from vram_planner.tracing.zero import generating

    with generating(session):
        return _generate(session)


def _generate(session: Session) -> PhasePeak:
    train, tracker, model = session.train, session.tracker, session.model
    sequences, p, c = train.local_generation_batch_size, train.max_prompt_length, train.max_completion_length
    config = _generation_config(session.base_model, train, 1)
    tracker.reset_peak()
    with torch.no_grad(), session.generation_autocast(), tracker.tagged(ACTS, "prefill"):
        ids, mask = _prompt(session, sequences, p)
        cache_argument = train.transformers.cache_argument  # the installed transformers' (check_traceable)
        returning = _generation_config(session.base_model, train, 1, returns_cache=True)
        cache = as_cache(getattr(model.generate(input_ids=ids, attention_mask=mask, generation_config=returning,
                                                **_processor_outputs(session, ids)), cache_argument))
        del ids, mask
    prefill = PhasePeak("generation", tracker.peak, tracker.peak_split, tracker.peak_moment)
    if c < 2:
        return prefill
    with torch.no_grad(), tracker.tagged(ACTS, "decoding steps"):
        _grow_cache(session, cache, c - 2)
        ids, mask = _prompt(session, sequences, p + c - 1)
        tracker.reset_peak()
        # What generate() prepares before the step's forward belongs with the previous step's sampling, which
        # head_tagging tags lm_head_buffers from the decoder's output to the next forward.
        tracker.tag, tracker.moment = HEAD, "last decoding step"
        with session.generation_autocast():
            model.generate(input_ids=ids, attention_mask=mask, generation_config=config, **{cache_argument: cache},
                           **_processor_outputs(session, ids))
        del cache
    last = PhasePeak("generation", tracker.peak, tracker.peak_split, tracker.peak_moment)
    return max(prefill, last, key=lambda phase: phase.peak_bytes)


def _grow_cache(session: Session, cache: Any, tokens: int) -> None:
    """Grow every layer of the cache by `tokens`, as the decoding steps do: one concatenation per layer and step.

    On fake tensors the steps before the last run as two concatenations, unrecorded, and the counter records the
    allocations and frees of each step in their place (`LiveBytes.record_growth`); past MAX_CACHE_UPDATES as fewer
    steps of several tokens each (the cache passes the same sizes in fewer, larger steps). A decoding step's other
    allocations (one token's activations, its logits and sampling) are those of the last step, which the trace runs
    whole. A real device runs every step.
    """
    from vram_planner.tracing.shims import cache_layers

    layers = [(i, layer) for i, layer in enumerate(cache_layers(cache)) if getattr(layer, "keys", None) is not None]
    if not layers or tokens <= 0:
        return
    tracker = session.tracker
    recorded = hasattr(tracker, "record_growth")
    added = additions(tokens, len(layers), recorded)
    if recorded:
        before = [tracker.block_of(t) for t in _cache_tensors(layers)]
        steps = growth([_as_cache_layer(i, layer) for i, layer in layers], added[:-1])
        # The step before the last runs as itself: a sliding-window layer's storage is then what it is in a real run.
        with tracker.unrecorded(before):
            for count in (sum(added[:-2]), *added[-2:-1]):
                _update(cache, layers, count, tracker)
        tracker.record_growth(_cache_tensors(layers), before, steps, [i for i, _ in layers for _ in (0, 1)])
        added = added[-1:]
    for count in added:
        _update(cache, layers, count, tracker)


def _cache_tensors(layers: list[tuple[int, Any]]) -> list[Any]:
    return [t for _, layer in layers for t in (layer.keys, layer.values)]


def _update(cache: Any, layers: list[tuple[int, Any]], count: int, tracker: Any) -> None:
    """Every layer's cache update with `count` new tokens (no-op for none), each counted in its layer."""
    outside = tracker.layer
    for i, layer in layers if count else ():
        tracker.layer = i
        # No reference to the old keys and values beyond the cache's: the concatenation frees them, as in a forward.
        cache.update(_new_tokens(layer.keys, count), _new_tokens(layer.values, count), i)
    tracker.layer = outside


def _new_tokens(t: Any, count: int) -> Any:
    """States of `count` new tokens for a [batch, heads, tokens, head_dim] cache tensor: zeros, which a real device's
    attention reads without NaNs (uninitialised memory may hold them, and sampling refuses NaN probabilities)."""
    return t.new_zeros((*t.shape[:-2], count, t.shape[-1]))


def _as_cache_layer(i: int, layer: Any) -> CacheLayer:
    window = getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
    return CacheLayer(i, _bytes_per_token(layer.keys), _bytes_per_token(layer.values), layer.keys.shape[-2], window)


def _bytes_per_token(t: Any) -> int:
    """Bytes of one token of a [batch, heads, tokens, head_dim] cache tensor."""
    return t.element_size() * t.numel() // max(t.shape[-2], 1)


def _scoring_models(session: Session) -> list[tuple[bool, Callable[[], Any]]]:
    train = session.train

    def policy() -> Any:
        return contextlib.nullcontext(session.model)

    @contextlib.contextmanager
    def reference() -> Iterator[Any]:
        if session.ref_model is not None:
            yield session.ref_model
        else:  # with LoRA the reference is the base model with the adapter disabled
            with session.model.disable_adapter():
                yield session.model

    return [(train.computes_old_logps, policy), (train.computes_ref_logps, reference)]


@contextlib.contextmanager
def loss_phase(session: Session) -> Iterator[None]:
    """The loss phase's bookkeeping around its micro-batches: checkpointing as the run sets it, each gradient tagged
    as it accumulates, the peak counted from here; the hooks and checkpointing undone after."""
    tracker, model, train = session.tracker, session.model, session.train
    set_checkpointing(model, train.gradient_checkpointing, reentrant=train.reentrant_checkpointing)
    params = [p for p in model.parameters() if p.requires_grad]
    handles = [p.register_post_accumulate_grad_hook(lambda q: tracker.track(q.grad, GRADS)) for p in params]
    tracker.reset_peak()
    try:
        with input_grads(session):
            yield
    finally:
        for handle in handles:
            handle.remove()
        set_checkpointing(model, False)


def optimizer_recipe(train: TrainingConfig) -> tuple[type, dict[str, Any]]:
    """transformers' optimizer class and arguments for `optim` (Trainer.get_optimizer_cls_and_kwargs).

    Call it outside the fake-tensor world: TrainingArguments sets up accelerate's state.
    """
    import tempfile

    from transformers import Trainer, TrainingArguments

    optim = train.optim
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, optim=optim.value, report_to=[], use_cpu=True)
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    if optim in (Optimizer.adamw_torch, Optimizer.rmsprop, Optimizer.adagrad, Optimizer.sgd):
        # torch picks foreach kernels for CUDA parameters and a per-parameter loop for CPU ones: plan for CUDA.
        kwargs = {**kwargs, "foreach": True}
    return cls, kwargs


def run_optimizer(session: Session, recipe: tuple[type, dict[str, Any]]) -> PhasePeak:
    """The first optimizer step, which creates the states (their bytes go to `session.state_bytes`)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if session.engine is not None:  # DeepSpeed's engine steps its own optimizer (vram_planner.tracing.zero)
        from vram_planner.tracing.zero import run_step

        return run_step(session)
    tracker = session.tracker
    cls, kwargs = recipe
    # Built outside the fake world: bitsandbytes' 8-bit optimizers make their quantization maps from Python lists
    # when built (a kilobyte, shared by every parameter); their states and their update run on the fake parameters.
    with unset_fake_temporarily():
        optimizer = session.optimizer = cls([p for p in session.model.parameters() if p.requires_grad], **kwargs)
    tracker.moment, tracker.assumed_number = "optimizer step", 1  # the step count, read for bias corrections
    tracker.reset_peak()
    with tracker.tagged(STEP):
        optimizer.step()
    tracker.assumed_number = 0
    return step_peak(session, optimizer)
