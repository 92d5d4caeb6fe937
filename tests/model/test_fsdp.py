"""The analytic FSDP2 rank (model/fsdp.py) in the planner's phases; tests/tracing/test_sharded.py holds it to the
trace."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from helpers import FIXTURES, build_on_meta
from vram_planner.model import blocks
from vram_planner.model import components as m
from vram_planner.model import fsdp as f
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.calibration import Calibration
from vram_planner.model.phases import estimate
from vram_planner.model.spec import training_config
from vram_planner.model.trl_releases import trl_release
from vram_planner.units import GiB

P = 1_235_814_400  # Llama-3.2-1B
V, H = 128256, 2048
TINY = json.loads((FIXTURES / "tiny-llama-bias.json").read_text())  # kilobyte tensors: every block shows


def rounded(n_bytes: int) -> int:
    return -(-n_bytes // 512) * 512


def unit_of(name: str) -> str:
    """The FSDP2 unit accelerate makes a parameter of the untied fixture part of (tracing/sharded.py)."""
    if ".layers." in name:
        return "layer " + name.split(".layers.")[1].split(".")[0]
    return "embedding" if "embed_tokens" in name else "tail"


def fsdp(gpus: int, **knobs):
    return training_config({"num_gpus": gpus, "fsdp": True, "dtype": "bfloat16", **knobs})


def phases(arch, train) -> dict:
    release = trl_release(None)
    return {p.name: p for p in estimate(arch, train, release, Calibration(), 80 * GiB).phases}


def test_bf16_weights_still_train_on_float32_master_shards(llama_1b):
    # accelerate upcasts trainable parameters to float32 before fully_shard under mixed precision
    for gpus in (2, 8):
        train = fsdp(gpus)
        # every shard of Llama-3.2-1B is whole blocks already; the rotary buffers are every rank's
        rotary = blocks.rotary_buffer_bytes(llama_1b, train)
        assert (m.weight_bytes(llama_1b, train), m.gradient_bytes(llama_1b, train)) == (4 * P / gpus + rotary,
                                                                                          4 * P / gpus)
        # each shard's exp_avg and exp_avg_sq a storage of its own, in whole 512-byte blocks, and fused AdamW's
        # step scalar per parameter, not sharded
        tensors = len(blocks.trainable_tensors(llama_1b, train))
        assert 8 * P / gpus + tensors * 512 <= m.optimizer_state_bytes(llama_1b, train) < 8 * P / gpus + tensors * 1536


def test_generation_gathers_the_tail_and_a_layer_on_every_rank_not_the_model(llama_1b):
    gathered = [m.generation_weight_bytes(llama_1b, fsdp(n)) - m.weight_bytes(llama_1b, fsdp(n)) for n in (2, 8)]
    assert gathered[0] == gathered[1] < 2 * P
    assert gathered[0] == 2 * 2 * (V * H + H + llama_1b.layer_params)  # each with its all-gather output


def test_micro_batches_before_the_last_hold_whole_bf16_gradients(llama_1b):
    single = phases(llama_1b, fsdp(8))["training"]
    accumulating = phases(llama_1b, fsdp(8, gradient_accumulation_steps=4))["training"]
    assert accumulating.components["gradients"] >= 2 * P > single.components["gradients"]


def test_the_reference_model_is_gathered_whole_while_it_scores(llama_1b):
    scoring = phases(llama_1b, fsdp(8, beta=0.04))["scoring"]
    # bf16 shards with the reference's own rotary buffers, gathered, all-gather output
    rotary = blocks.rotary_buffer_bytes(llama_1b, fsdp(8))
    assert scoring.components["reference_weights"] == 2 * P / 8 + rotary + 2 * 2 * P


@pytest.mark.parametrize("gpus", [2, 3, 8])
def test_every_shard_and_every_units_gather_and_reduction_are_storages_in_whole_blocks(gpus):
    arch, model, train = ModelArchitecture.from_config(TINY), build_on_meta(TINY), fsdp(gpus)
    # each parameter chunked on dim 0, every rank's chunk padded to the first: ceil(rows / N) rows, a storage of its
    # own (torch/distributed/fsdp/_fully_shard/_fsdp_param.py:298-316); float32 masters under mixed precision
    shards = {name: -(-p.shape[0] // gpus) * (p.numel() // p.shape[0]) for name, p in model.named_parameters()}
    buffers = sum(rounded(b.numel() * b.element_size()) for b in model.buffers())  # every rank's, whole
    assert m.weight_bytes(arch, train) == sum(rounded(4 * n) for n in shards.values()) + buffers
    # Adam's two moments of every shard, each its own storage
    steps = blocks.optimizer_step_scalars_bytes(arch, train)
    assert m.optimizer_state_bytes(arch, train) == 2 * sum(rounded(4 * n) for n in shards.values()) + steps
    # one flat reduced shard per unit, cast to float32 (_fsdp_collectives.py:689-713)
    units = Counter()
    for name, n in shards.items():
        units[unit_of(name)] += n
    assert m.gradient_bytes(arch, train) == sum(rounded(4 * n) for n in units.values())
    # a gathered layer: each parameter a storage of N padded shards in bf16 (_fsdp_param.py:621-628), and the one flat
    # all-gather output it is copied out of (_fsdp_collectives.py:349-353)
    layer = [n for name, n in shards.items() if unit_of(name) == "layer 0"]
    gathered, output = sum(rounded(2 * gpus * n) for n in layer), rounded(2 * gpus * sum(layer))
    assert (f.layer_unit_bytes(arch, train), f.layer_unit_bytes(arch, train, 3)) == (gathered,
                                                                                       gathered + 2 * output)
