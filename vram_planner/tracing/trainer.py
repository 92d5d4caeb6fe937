"""The installed TRL's own loss step and scoring passes on fake tensors, for every release from TRL 0.14.

GRPOTrainer.__init__ loads models by name, builds datasets and an Accelerator; none of that fits fake tensors. The
trainer here is `object.__new__` of the installed GRPOTrainer with the attributes its loss reads set as __init__ sets
them (most are copies of GRPOConfig fields, read from a real GRPOConfig of the installed release), and an accelerator
with the one-process surface the loss touches. The models are prepared as accelerate prepares them under mixed
precision: the forward runs under autocast and its outputs are converted to float32 (accelerate's own
`convert_outputs_to_fp32`), which is where the full logits' float32 copy comes from (TRL 1.15 and later ask their
fused LM head for float32 log-probs instead, which that copy leaves as they are). Then the release's own
`compute_loss` (TRL 0.14: generation, both log-prob passes and the loss in one call) and `_get_per_token_logps`
or `_get_per_token_logps_and_entropies` (scoring) run unmodified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import tempfile
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

from vram_planner.model.spec import TrainingConfig
from vram_planner.tracing.counter import ACTS, PhasePeak
from vram_planner.tracing.session import Session
from vram_planner.tracing.shims import Metrics, passes_token_type_ids, per_token_logps


class OneProcessAccelerator:
    """What GRPOTrainer's loss and scoring read from accelerate's Accelerator, for one process on one device."""

    num_processes, process_index, is_main_process = 1, 0, True
    sync_gradients = True  # read by TRL 1.16's adaptive entropy bonus at the end of an accumulation window

    def __init__(self, session: Session) -> None:
        self.device = torch.device(session.device_type)
        self.state = SimpleNamespace(deepspeed_plugin=None)
        self.autocast = session.autocast  # TRL 1.15 and later call the model under accelerator.autocast() too

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True) -> Any:
        return model  # never wrapped in DDP here; accelerate keeps the fp32 wrapper by default too

    def gather_for_metrics(self, value: Any, **kwargs: Any) -> Any:
        return value

    def gather(self, value: Any) -> Any:
        return value

    def reduce(self, value: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return value


def _missing_attribute(self: Any, name: str) -> Any:
    """GRPOTrainer.__init__ copies most GRPOConfig fields to attributes of the same name: read them from args."""
    args = self.__dict__.get("args")
    if args is not None and not name.startswith("__") and hasattr(args, name):
        return getattr(args, name)
    raise AttributeError(f"the traced GRPOTrainer has no attribute {name!r} (a shim for this TRL release is missing)")


def grpo_config(train: TrainingConfig, output_dir: str) -> Any:
    """A GRPOConfig of the installed release with the knobs the loss reads; fields the release lacks are left out."""
    from trl import GRPOConfig

    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    wanted = {"per_device_train_batch_size": train.per_device_train_batch_size,
              "gradient_accumulation_steps": train.gradient_accumulation_steps,
              "num_generations": train.num_generations, "max_completion_length": train.max_completion_length,
              "max_prompt_length": train.max_prompt_length, "beta": train.beta,
              "num_iterations": train.num_iterations, "steps_per_generation": train.steps_per_generation,
              "report_to": [], "use_cpu": True, "logging_steps": 1}
    return GRPOConfig(output_dir=output_dir, **{k: v for k, v in wanted.items() if k in fields and v is not None})


def build_trainer(session: Session) -> Any:
    """The installed GRPOTrainer as __init__ leaves it, for the loss: call outside the fake-tensor world."""
    from transformers import GenerationConfig
    from trl import GRPOTrainer

    train = session.train
    with tempfile.TemporaryDirectory() as tmp:
        args = grpo_config(train, tmp)
    args.device  # noqa: B018 - accelerate's state is set up here, outside fake tensors, not inside the loss
    cls = type("TracedGRPOTrainer", (GRPOTrainer,), {"__getattr__": _missing_attribute})
    trainer = object.__new__(cls)
    base = session.base_model
    text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    eos = getattr(text, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) else eos
    signature_of = base.forward
    if train.gradient_checkpointing:  # TRL loads the models with use_cache=False under checkpointing (0.14 on)
        for config in {id(m.config): m.config for m in (base, session.ref_model) if m is not None}.values():
            config.use_cache = False
    epsilon = getattr(args, "epsilon", 0.2)
    trainer.__dict__.update(
        args=args, model=session.model, ref_model=session.ref_model, accelerator=OneProcessAccelerator(session),
        processing_class=FakeTokenizer(session, eos), _metrics=Metrics(), state=SimpleNamespace(global_step=0),
        control=SimpleNamespace(should_evaluate=False), tools=None,
        epsilon_low=epsilon, epsilon_high=getattr(args, "epsilon_high", None) or epsilon,
        model_kwarg_keys=inspect.signature(signature_of).parameters.keys(), aux_loss_enabled=False,
        _entropy_bonus_enabled=bool(getattr(args, "entropy_coef", 0.0)) or bool(getattr(args, "use_adaptive_entropy",
                                                                                        False)),
        current_gradient_accumulation_steps=train.gradient_accumulation_steps, is_fsdp_enabled=False,
        is_deepspeed_enabled=False, _past=None, reward_funcs=[_zero_reward], reward_processing_classes=[None],
        generation_config=GenerationConfig(max_new_tokens=train.max_completion_length, do_sample=True,
                                           pad_token_id=eos, eos_token_id=eos))
    return trainer


def _zero_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    return [0.0] * len(completions)


class FakeTokenizer:
    """The processing class TRL 0.14's compute_loss tokenizes prompts with and decodes completions with: prompts of
    `max_prompt_length` tokens, left-padded (`phases._prompt`); decoding reads no values (fake tensors have none)."""

    pad_token_id = None

    def __init__(self, session: Session, eos: int | None) -> None:
        self.session, self.eos_token_id = session, eos

    def __call__(self, texts: list[str], **kwargs: Any) -> dict[str, Any]:
        from vram_planner.tracing.phases import _prompt

        ids, mask = _prompt(self.session, len(texts), self.session.train.max_prompt_length)
        return {"input_ids": ids, "attention_mask": mask}

    def batch_decode(self, ids: Any, **kwargs: Any) -> list[str]:
        return [""] * len(ids)


@contextlib.contextmanager
def accelerate_prepared(session: Session) -> Iterator[None]:
    """The models' forwards as accelerate prepares them under mixed precision (Accelerator.prepare_model): autocast
    around the forward, its outputs converted to float32. Undone on exit."""
    from accelerate.utils import convert_outputs_to_fp32

    dtype = session.autocast_dtype
    models = [m for m in (session.model, session.ref_model) if m is not None] if dtype else []
    instance_forwards = [model.__dict__.get("forward") for model in models]  # TRL 1.15+'s fused LM head
    for model in models:
        original = model.forward

        def forward(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
            with session.autocast():
                return __original(*args, **kwargs)

        model.forward = convert_outputs_to_fp32(forward)
    try:
        yield
    finally:
        for model, forward in zip(models, instance_forwards, strict=True):
            if forward is None:
                del model.forward  # the class's forward again
            else:
                model.forward = forward


def run_scoring(session: Session) -> PhasePeak:
    """The no-grad log-prob passes over the generation batch, through the release's own `_get_per_token_logps` in
    chunks of B sequences, as `_generate_and_score_completions` runs them (old log-probs, then the reference's)."""
    train, tracker, trainer = session.train, session.tracker, session.trainer
    from vram_planner.tracing.phases import _processor_outputs, _prompt, _scoring_models
    from vram_planner.tracing.repeats import repeated_calls_replayed

    sequences = train.local_generation_batch_size
    tracker.reset_peak()
    with torch.no_grad(), tracker.tagged(ACTS, "scoring forward"), accelerate_prepared(session):
        kept = []  # every pass's log-probs stay until the whole batch is scored
        ids, mask = _prompt(session, sequences, train.sequence_length)
        types = _processor_outputs(session, ids).get("token_type_ids")
        _completions_selected(session, train.micro_batch_completions)
        for needed, model in _scoring_models(session):
            if needed:
                with model() as scorer, repeated_calls_replayed(tracker, scorer):
                    kept.append(per_token_logps(trainer, scorer, ids, mask, train.max_completion_length,
                                                train.micro_batch_completions, types))
        del kept, ids, mask, types
    return PhasePeak("scoring", tracker.peak, tracker.peak_split, tracker.peak_moment)


def _loss_inputs(session: Session) -> dict[str, Any]:
    """One micro-batch of what `_generate_and_score_completions` hands compute_loss (TRL 0.15 and later)."""
    from vram_planner.tracing.phases import _prompt

    train = session.train
    b, c = train.micro_batch_completions, train.max_completion_length
    prompt_ids, prompt_mask = _prompt(session, b, train.max_prompt_length)
    completion_ids, _ = _prompt(session, b, c)
    _completions_selected(session, b)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": torch.ones((b, c), dtype=torch.long, device=session.device_type),
              "advantages": torch.zeros(b, device=session.device_type),
              "num_items_in_batch": torch.tensor(float(b * c), device=session.device_type)}
    # None where the release skips the pass (it then reads the policy's own detached log-probs, or no KL term)
    if passes_token_type_ids(session.base_model):  # the processor's, which TRL extends over the completion
        inputs["token_type_ids"] = torch.zeros((b, train.sequence_length), dtype=torch.long,
                                               device=session.device_type)
    for key, computed in (("old_per_token_logps", train.computes_old_logps),
                          ("ref_per_token_logps", train.computes_ref_logps)):
        inputs[key] = torch.zeros((b, c), device=session.device_type) if computed else None
    return inputs


def _completions_selected(session: Session, sequences: int) -> None:
    """TRL 1.15 and later label only the completion tokens and their fused LM head keeps `labels[:, 1:] != -100`, a
    boolean index fake tensors cannot count: c positions per sequence when every completion runs to full length."""
    from vram_planner.tracing.session import uses_fused_lm_head

    train = session.train
    if uses_fused_lm_head(train):
        session.tracker.selected_tokens = (sequences * (train.sequence_length - 1),
                                           sequences * train.max_completion_length)


@contextlib.contextmanager
def _generation_traced_apart(session: Session) -> Iterator[None]:
    """TRL 0.14 generates inside compute_loss: its generation is the trace's generation phase, so here generate()
    returns the prompt and completion ids at once (the KV cache is gone by the time the log-prob passes start)."""
    from vram_planner.tracing.phases import _prompt

    train = session.train
    base = session.base_model

    def generate(*args: Any, **kwargs: Any) -> Any:
        ids, _ = _prompt(session, train.micro_batch_completions, train.sequence_length)
        return ids

    owners = [m for m in {id(session.model): session.model, id(base): base}.values()]
    for owner in owners:
        owner.generate = generate
    try:
        yield
    finally:
        for owner in owners:
            del owner.generate


def run_training(session: Session) -> PhasePeak:
    """The release's own compute_loss and its backward on one micro-batch (two when gradients accumulate, three where
    ZeRO-3's coordinator may first prefetch in the third: `zero.loss_micro_batches`)."""
    from vram_planner.tracing import zero
    from vram_planner.tracing.phases import loss_phase

    train, tracker, model, trainer = session.train, session.tracker, session.model, session.trainer
    merged = train.release.step_structure == "loss_merged"
    with loss_phase(session):
        with accelerate_prepared(session), _generation_traced_apart(session) if merged else contextlib.nullcontext():
            last = zero.loss_micro_batches(train)
            for micro_batch in range(1, last + 1):
                # The first micro-batch runs before any gradient exists (a run can die there, before its first
                # optimizer step); from the second on, every gradient exists before the forward starts.
                with tracker.tagged(ACTS, "forward" if micro_batch == 1 else f"forward, micro-batch {micro_batch}"):
                    if merged:  # TRL 0.14's inputs are the prompts of the micro-batch
                        inputs: Any = [{"prompt": ""}] * train.per_device_train_batch_size
                    else:
                        inputs = _loss_inputs(session)
                    loss = trainer.compute_loss(model, inputs)
                    del inputs
                with tracker.backward("LM head backward"):
                    if session.engine is not None:  # DeepSpeed's engine reduces the gradients it makes
                        zero.backward(session, loss, last=micro_batch == last)
                    else:
                        loss.backward()
                    del loss
    return PhasePeak("training", tracker.peak, tracker.peak_split, tracker.peak_moment)
