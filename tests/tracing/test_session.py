"""The traced models set up as TRL sets them up: LoRA's input gradients and reentrant checkpointing per release."""

from __future__ import annotations

import inspect
import json

import pytest

from helpers import FIXTURES
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.trl_releases import trl_release

pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

TINY = json.loads((FIXTURES / "tiny-qwen2.json").read_text())
SHORT = {"per_device_train_batch_size": 2, "num_generations": 2, "max_prompt_length": 16, "max_completion_length": 16}


def _embedding_output(session):
    import torch

    with session.fake_mode, torch.enable_grad():
        ids = torch.zeros((1, 4), dtype=torch.long)
        return session.base_model.get_input_embeddings()(ids)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_lora_under_checkpointing_gets_trls_hook_on_the_embedding_for_the_loss_only(checkpointing):
    from vram_planner.tracing.session import build_session, input_grads

    session = build_session(TINY, TrainingConfig(**SHORT, lora_r=8, gradient_checkpointing=checkpointing))
    assert not _embedding_output(session).requires_grad  # LoRA freezes the embedding
    with input_grads(session):
        # TRL 1.16's grpo_trainer.py:529-530: enable_input_require_grads for a PEFT model under checkpointing only
        assert _embedding_output(session).requires_grad is checkpointing
    assert not _embedding_output(session).requires_grad


def test_the_traced_loss_feeds_the_first_layer_an_input_that_needs_a_gradient(monkeypatch):
    # transformers 4's gradient_checkpointing_enable adds no hook to a PeftModel's base (5's adds one for any text
    # model, trl 1.16 says it cannot count on it: transformers#42489): only the trace's own call, as TRL's, may add it
    import torch
    import transformers

    from vram_planner.tracing.step import trace_step

    enable = transformers.PreTrainedModel.enable_input_require_grads

    def as_transformers_4(self):
        if not any(frame.function == "_activation_checkpointing_enable" for frame in inspect.stack()[1:4]):
            enable(self)

    monkeypatch.setattr(transformers.PreTrainedModel, "enable_input_require_grads", as_transformers_4)
    seen = []
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    original = Qwen2DecoderLayer.forward

    def forward(self, *args, **kwargs):
        if self.self_attn.layer_idx == 0 and torch.is_grad_enabled():
            seen.append((args[0] if args else kwargs["hidden_states"]).requires_grad)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Qwen2DecoderLayer, "forward", forward)
    trace_step(TINY, TrainingConfig(**SHORT, lora_r=8, gradient_checkpointing=True))
    # the loss forward and its checkpoint's recomputation in the backward, each with an input needing a gradient
    assert seen and all(seen)


def test_reentrant_checkpointing_follows_the_release():
    lora = {**SHORT, "lora_r": 8, "gradient_checkpointing": True}
    assert TrainingConfig(**lora, trl_version="0.26.2").reentrant_checkpointing  # transformers 4's default
    assert not TrainingConfig(**lora, trl_version="0.27.0").reentrant_checkpointing
    assert not TrainingConfig(**lora, trl_version="1.16.0", num_gpus=2, zero_stage=2).reentrant_checkpointing
    assert TrainingConfig(**lora, trl_version="1.16.0", num_gpus=2, zero_stage=3).reentrant_checkpointing
    assert not TrainingConfig(**lora, trl_version="1.8.0", num_gpus=2, zero_stage=3).reentrant_checkpointing
    assert not TrainingConfig(**{**lora, "lora_r": None}, trl_version="1.16.0", num_gpus=2,
                              zero_stage=3).reentrant_checkpointing
    assert trl_release("1.9.0").peft_zero3_reentrant and not trl_release("0.15.2").checkpointing_input_grads


def test_lora_with_checkpointing_is_refused_where_trl_crashes_at_the_first_backward():
    from vram_planner.errors import ConfigError
    from vram_planner.model.spec import training_config

    with pytest.raises(ConfigError, match="fails at the first backward in TRL 0.15.2"):
        training_config({**SHORT, "lora_r": 8, "gradient_checkpointing": True, "trl_version": "0.15.2"})
    training_config({**SHORT, "lora_r": 8, "gradient_checkpointing": True, "trl_version": "0.16.0"})
    training_config({**SHORT, "lora_r": 8, "gradient_checkpointing": False, "trl_version": "0.15.2"})
