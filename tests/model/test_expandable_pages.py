"""The expandable segments' patterns (vram_planner/model/expandable_pages.py): the pages live tensors made among
transients keep mapped, replayed through the allocator model."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from helpers import benchmark_module, catalog_architecture
from vram_planner.allocator import CachingAllocator, parse_allocator_conf
from vram_planner.allocator.sizes import K_LARGE_BUFFER, K_SMALL_BUFFER, K_SMALL_SIZE
from vram_planner.model.calibration import default_calibration
from vram_planner.model.expandable_pages import (CHECKPOINTED_INPUT_RUNS, EXPANDABLE_PATTERNS, GRADIENT_PAGES,
                                                 KEPT_ACTIVATION_PAGES, decoding_cache_hole_bytes,
                                                 expandable_patterns, islands_bytes)
from vram_planner.model.fragmentation import reserve_patterns
from vram_planner.model.phases import estimate
from vram_planner.model.spec import TrainingConfig
from vram_planner.model.trl_releases import trl_release
from vram_planner.units import GiB, MiB

EXPANDABLE = parse_allocator_conf("expandable_segments:True", "--allocator-conf")


def islands_among_transients(layers: int, transient_bytes: int, kept_bytes: int) -> int:
    """Each layer's transient made, then a tensor kept beside it; the transients freed, and the whole free pages
    released (what an out-of-memory retry does): the bytes still mapped and free."""
    allocator = CachingAllocator(EXPANDABLE)
    transients = []
    for _ in range(layers):
        transients.append(allocator.malloc(transient_bytes))
        allocator.malloc(kept_bytes)
    for address in transients:
        allocator.free(address)
    allocator.empty_cache()
    return sum(size for _, size in allocator.free_blocks())


def test_each_run_between_islands_keeps_its_partial_pages_mapped():
    rng = random.Random(0)
    ratios = []
    for _ in range(40):
        transient, kept = (rng.randrange(2 * MiB, 60 * MiB, 512) for _ in range(2))
        stranded = islands_among_transients(30, transient, kept)
        # two partial pages a run at most, and never more than the run; the last page beyond the last island too
        assert stranded <= 30 * min(2 * K_LARGE_BUFFER, transient) + K_LARGE_BUFFER
        ratios.append(stranded / islands_bytes(30, transient))
    # a page a run on average: the ends fall anywhere in their pages
    assert 0.9 < sum(ratios) / len(ratios) < 1.1


def test_runs_shorter_than_a_page_stay_mapped_whole():
    # within the last page, partly used beyond the last island
    assert 0 <= islands_among_transients(30, 5 * MiB, 3 * MiB) - islands_bytes(30, 5 * MiB) < K_LARGE_BUFFER
    assert islands_bytes(30, 5 * MiB) == 30 * 5 * MiB
    # the small pool's 2 MiB pages: a 0.7 MiB run keeps itself mapped
    small = 700 * 1024
    assert 0 <= islands_among_transients(30, small, 800 * 1024) - islands_bytes(30, small) < K_SMALL_BUFFER
    assert islands_bytes(1, K_SMALL_SIZE) == K_SMALL_SIZE and islands_bytes(1, 60 * MiB) == K_LARGE_BUFFER


def test_the_islands_bytes_never_fall_as_the_runs_grow():
    sizes = [n * 64 * 1024 for n in range(1, 800)]
    values = [islands_bytes(24, size) for size in sizes]
    assert values == sorted(values) and max(values) == 24 * K_LARGE_BUFFER


def test_the_patterns_follow_the_knobs():
    arch = catalog_architecture("Qwen2.5-0.5B")  # 24 layers; 896 x 4,864 MLP weights: 16.6 MiB in float32
    full = TrainingConfig(allocator_conf="expandable_segments:True")
    patterns = expandable_patterns(arch, full, "training")
    assert set(patterns) == set(EXPANDABLE_PATTERNS)
    assert patterns[GRADIENT_PAGES] == 24 * 896 * 4864 * 4
    assert patterns[KEPT_ACTIVATION_PAGES] == 0  # TRL checkpoints by default
    assert patterns[CHECKPOINTED_INPUT_RUNS] == 24 * K_SMALL_BUFFER  # a few MiB a layer beside its kept input
    lora = replace(full, dtype="bfloat16", lora_r=16, gradient_checkpointing=False)
    patterns = expandable_patterns(arch, lora, "training")
    assert patterns[GRADIENT_PAGES] == 0
    assert patterns[CHECKPOINTED_INPUT_RUNS] == 0  # no kept input: kept activations
    tokens = lora.micro_batch_completions * lora.sequence_length  # 8 x 768: a 10.5 MiB residual stream
    assert patterns[KEPT_ACTIVATION_PAGES] == 24 * tokens * 896 * 2
    longer = replace(lora, max_completion_length=4096)  # 8 x 4,608 tokens: 63 MiB, a page each
    assert expandable_patterns(arch, longer, "training")[KEPT_ACTIVATION_PAGES] == 24 * K_LARGE_BUFFER
    bf16 = expandable_patterns(arch, replace(full, dtype="bfloat16"), "training")
    assert bf16[GRADIENT_PAGES] == 24 * 896 * 4864 * 2
    larger = expandable_patterns(catalog_architecture("gemma-3-1b-it"), full, "training")  # 30.4 MiB gradients: a page each
    assert larger[GRADIENT_PAGES] == 26 * K_LARGE_BUFFER
    assert expandable_patterns(arch, full, "generation") == {}
    # the default allocator's patterns are fragmentation's, none of these
    assert not set(reserve_patterns(arch, replace(full, allocator_conf=""), "training")) & set(EXPANDABLE_PATTERNS)


@pytest.mark.parametrize("settings", [{}, {"lora_r": 8, "gradient_checkpointing": False}])
def test_the_shipped_reserve_weighs_the_patterns_under_expandable_segments(settings):
    # the boundary grid's expandable points were short of their needs where the reserve was the tensors' shares alone
    arch = catalog_architecture("SmolLM2-135M")
    train = TrainingConfig(allocator_conf="expandable_segments:True", **settings)
    calibration = default_calibration()
    weighed = calibration.allocator_reserve["expandable_segments"]["training"]
    assert any(weighed.get(name, 0) > 0 for name in EXPANDABLE_PATTERNS)
    shares_only = replace(calibration, allocator_reserve={**calibration.allocator_reserve, "expandable_segments": {
        **calibration.allocator_reserve["expandable_segments"],
        "training": {k: v for k, v in weighed.items() if k not in EXPANDABLE_PATTERNS}}})
    training = {c: next(p for p in estimate(arch, train, trl_release(None), cal, 80 * GiB).phases
                        if p.name == "training").components["allocator_overhead"]
                for c, cal in (("with", calibration), ("without", shares_only))}
    assert training["with"] > training["without"]


def test_the_decoding_band_is_a_page_a_layer_of_the_generation_batch_cache():
    arch = catalog_architecture("SmolLM2-360M")  # 32 layers, 5 key-value heads of 64: 640 bytes a token in bfloat16
    # held-out QLoRA seed 1's h10: 8 x 8 sequences generated at once, 64 + 384 tokens
    train = TrainingConfig(dtype="bfloat16", lora_r=64, per_device_train_batch_size=8, num_generations=16,
                           gradient_accumulation_steps=4, steps_per_generation=8, max_prompt_length=64,
                           max_completion_length=384, allocator_conf="expandable_segments:True")
    block = 64 * (64 + 384 - 1) * 640  # 17.5 MiB: shorter than a page
    assert decoding_cache_hole_bytes(arch, train) == 32 * block
    longer = replace(train, max_completion_length=1024)  # 43 MiB blocks: a page each
    assert decoding_cache_hole_bytes(arch, longer) == 32 * K_LARGE_BUFFER
    assert decoding_cache_hole_bytes(arch, replace(train, allocator_conf="")) == 0  # generation_patterns' segments
    assert decoding_cache_hole_bytes(arch, replace(train, use_vllm=True)) == 0  # vLLM's cache is its reservation


@pytest.mark.slow  # two decodings bisected through the allocator model: a few seconds
@pytest.mark.parametrize("shape", [(32, 64, 640, 64, 384), (30, 64, 640, 64, 384)], ids=["h10", "30-layers"])
def test_what_the_decoding_strands_lies_within_its_band(shape):
    """The growing cache replayed alone (benchmarks/decoding_holes.py): what it needs beyond its live peak lies
    inside the band, and for the held-out point's shape most of it (the band is the mechanism's, not padding); one
    layer fewer strands a seventh of that, which is why the estimate cannot count it."""
    holes = benchmark_module("decoding_holes")
    stranded, bound = holes.stranded_bytes(*shape), holes.bound_bytes(*shape)
    assert 0 < stranded <= bound
    if shape[0] == 32:
        assert stranded > bound / 3, stranded / MiB
    else:
        assert stranded < bound / 10, stranded / MiB
