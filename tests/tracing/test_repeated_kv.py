"""Eager attention copies grouped keys and values to every query head at each decoding step (transformers'
repeat_kv); SDPA's decoding packs the grouped queries instead (pack_gqa): the copy that
vram_planner.model.generation_patterns.decoding_repeated_kv_bytes counts, as the installed transformers makes it."""

from __future__ import annotations

import json

import pytest

from helpers import FIXTURES
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.spec import TrainingConfig

pytest.importorskip("torch")
pytest.importorskip("trl")

CONFIG = json.loads((FIXTURES / "tiny-qwen3.json").read_text())  # 4 query heads on 2 key-value heads


@pytest.mark.parametrize("attention, copies_a_layer", [("eager", 2), ("sdpa", 0)])
def test_the_last_decoding_step_copies_the_keys_and_values_to_every_head_under_eager_attention_only(attention,
                                                                                                    copies_a_layer):
    from vram_planner.tracing.step import trace_step

    arch = ModelArchitecture.from_config(CONFIG)
    train = TrainingConfig(dtype="bfloat16", lora_r=8, per_device_train_batch_size=4, num_generations=4,
                           max_prompt_length=16, max_completion_length=24, attn_implementation=attention)
    # one layer's keys (or values) of the 4 sequences at the last step, 16 + 23 tokens, and their copy
    block = 4 * arch.num_kv_heads * arch.head_dim * (16 + 24 - 1) * 2
    copy = arch.num_attention_heads // arch.num_kv_heads * block
    made = [e.size_bytes for e in trace_step(CONFIG, train).events
            if e.kind == "alloc" and e.phase == "generation" and e.moment.startswith("last decoding step")]
    assert made.count(block) == 2 * arch.num_layers  # the cache's keys and values, one token longer
    assert made.count(copy) == copies_a_layer * arch.num_layers
