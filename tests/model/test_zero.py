"""DeepSpeed ZeRO's model states per rank: never below DeepSpeed's own estimator (vram_planner/model/zero.py)."""

from __future__ import annotations

import itertools
import json

import pytest

from helpers import build_on_meta, family_fixture_files, one_line_error
from vram_planner.model import zero
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.calibration import Calibration
from vram_planner.model.phases import estimate
from vram_planner.model.resolve import catalog_architecture, resolve_model
from vram_planner.model.spec import training_config
from vram_planner.model.trl_releases import trl_release
from vram_planner.profiles import models
from vram_planner.units import GiB

MODEL_STATES = ("weights", "reference_weights", "gradients", "optimizer_states")
# DeepSpeed 0.19.8's estimate_zero2/3_model_states_mem_needs_all_cold (AdamW, bf16, no offload) as the issue that
# asked for this (issue 27) ran them: GiB per GPU
DEEPSPEED_REPORTED = [("Llama-3.2-1B", 2, 12.66, 11.34), ("Llama-3.2-1B", 8, 4.89, 3.57),
                      ("Qwen2.5-7B", 2, 78.02, 65.86), ("Qwen2.5-7B", 8, 30.14, 17.99)]


def _optimizer_model_states(arch: ModelArchitecture, stage: int, gpus: int, **knobs) -> float:
    train = training_config({"num_gpus": gpus, "zero_stage": stage, "dtype": "bfloat16",
                             "per_device_train_batch_size": 2, "num_generations": 2, **knobs})
    step = estimate(arch, train, trl_release(), Calibration(), 80 * GiB).phases[-1]
    assert step.name == "optimizer"
    return sum(step.components[c] for c in MODEL_STATES)


@pytest.mark.parametrize(("model", "gpus", "zero2_gib", "zero3_gib"), DEEPSPEED_REPORTED)
def test_our_copy_of_deepspeeds_estimator_gives_its_numbers(model, gpus, zero2_gib, zero3_gib):
    arch = resolve_model(model)
    largest = zero.largest_layer_params(arch)
    assert zero.deepspeed_estimate_bytes(arch.params, gpus, 2) / GiB == pytest.approx(zero2_gib, abs=0.005)
    assert zero.deepspeed_estimate_bytes(arch.params, gpus, 3, largest) / GiB == pytest.approx(zero3_gib, abs=0.005)


@pytest.mark.parametrize("entry", models(), ids=lambda e: e.name)
@pytest.mark.parametrize("gpus", [1, 2, 3, 8])
def test_model_states_are_never_below_deepspeeds_estimate(entry, gpus):
    arch = catalog_architecture(entry)
    largest = zero.largest_layer_params(arch)
    for optim in ("adamw_torch_fused", "adamw_torch"):
        zero2 = _optimizer_model_states(arch, 2, gpus, optim=optim)
        zero3 = _optimizer_model_states(arch, 3, gpus, optim=optim)
        estimate3 = zero.deepspeed_estimate_bytes(arch.params, gpus, 3, largest)
        assert zero3 >= estimate3
        # ZeRO-2's step holds a flat 16-bit copy of the partition beside its estimator's count (model/zero.py), less
        # the flat and fp32 copies of the norms and biases, the other group, converted apart
        matrices = sum(zero.base_groups(arch)[0])
        apart = arch.params - matrices
        assert zero2 >= zero.deepspeed_estimate_bytes(arch.params, gpus, 2) + (2 * arch.params - 6 * apart) / gpus
        if arch.params / gpus <= zero.SUB_GROUP_ELEMENTS:
            # ZeRO-3, one sub-group per group: the 16-bit parameter and gradient partitions, the master and moments
            # (16 bytes per parameter of the partition), the flat and fp32 copies of the matrices' sub-group and the
            # bucket; DeepSpeed's estimate where its largest layer outweighs them
            bucket = zero.REDUCE_BUCKET_ELEMENTS * 2
            held = (16 * arch.params + 6 * matrices) / gpus + bucket
            assert zero3 == pytest.approx(max(estimate3, held), rel=1e-6)


def test_the_fp32_gradients_exist_only_in_the_optimizer_step(llama_1b):
    train = training_config({"num_gpus": 4, "zero_stage": 2, "dtype": "bfloat16", "per_device_train_batch_size": 2})
    phases = {p.name: p for p in estimate(llama_1b, train, trl_release(), Calibration(), 80 * GiB).phases}
    share = 2 * llama_1b.params / 4
    # the 16-bit partition, its flat copy and their fp32 copy (stage_1_and_2.py:3114-3118); the bucket went with the
    # backward
    assert phases["optimizer"].components["gradients"] >= (1 + 1 + 2) * share
    assert phases["training"].components["gradients"] >= 10**9  # 5e8 16-bit elements
    assert phases["generation"].components["gradients"] == 0  # freed in the step (:3127-3131)


def test_zero12_step_holds_the_norms_fp64_copy_or_the_flat_and_fp32_copies_on_the_fullest_rank():
    # one group of three gradients, 70 elements a rank: rank 0's partition is a slice of the first, which it keeps
    # whole (200 bytes) beside the norm's fp64 copy of the slice (8 x 70) or, as the slice is the partition, its fp32
    # copy alone (4 x 70): 760; rank 1 keeps all three (280) beside the norm's copy of its largest piece (8 x 30) or
    # the flat (2 x 70) and fp32 copies (4 x 70): 700
    assert zero.step_gradient_bytes([[100, 20, 20]], 2, 2) == 760
    assert zero.step_gradient_bytes([[100, 20, 20]], 1, 1) == 280 + 2 * 140 + 4 * 140


def test_zero3_step_converts_one_sub_group_at_a_time():
    # sub-groups close at the first parameter reaching 1e9 elements (stage3.py:1210-1233): 1.2e9 and 0.6e9; the flat
    # and fp32 copies of the larger (6 bytes an element) outweigh the norm's fp64 copy of one partition (8 x 0.6e9)
    assert zero.step_gradient_bytes([[600_000_000] * 3], 1, 3) == 6 * 1_200_000_000
    assert zero.step_gradient_bytes([[600_000_000] * 3], 4, 3) == 6 * 450_000_000  # one sub-group per rank


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_reduction_bucket_lives_from_start_up_under_zero3_and_within_each_backward_below(llama_1b, stage):
    train = training_config({"num_gpus": 2, "zero_stage": stage, "dtype": "bfloat16",
                             "per_device_train_batch_size": 4})
    args = (llama_1b, train, trl_release(), Calibration(), 80 * GiB)
    for first_micro_batch in (False, True):
        gradients = {p.name: p.components["gradients"] for p in estimate(*args, first_micro_batch=first_micro_batch).phases}
        # ZeRO-3: the bucket (stage3.py:780-784) and the 16-bit gradient partition (:786-793) from start-up
        kept = 10**9 + 2 * llama_1b.params / 2 if stage == 3 else 0
        assert gradients["generation"] == pytest.approx(kept)
        assert gradients["training"] >= 10**9
    unsharded = {p.name: p.components["gradients"] for p in estimate(
        llama_1b, training_config({"num_gpus": 2, "zero_stage": 0, "dtype": "bfloat16",
                                   "per_device_train_batch_size": 4}), trl_release(), Calibration(), 80 * GiB).phases}
    assert unsharded["generation"] == 0  # stage 0: no bucket


def _training_phase(arch: ModelArchitecture, **knobs) -> dict[str, float]:
    train = training_config({"num_gpus": 8, "zero_stage": 3, "dtype": "bfloat16", "per_device_train_batch_size": 2,
                             "num_generations": 2, **knobs})
    return next(p for p in estimate(arch, train, trl_release(), Calibration(), 80 * GiB).phases
                if p.name == "training").components


def test_zero3s_later_micro_batches_hold_max_live_parameters_gathered(llama_1b):
    # Each step's first micro-batch records the coordinator's trace again (TRL's gathered generation invalidates it)
    # and gathers one layer at a time; the later ones prefetch up to stage3_max_live_parameters (1e9) and past it, of
    # Llama-3.2-1B's 1.24e9 (model/zero.py; the sharded trace holds 1.026e9)
    partitions = 2 * llama_1b.params / 8
    layer_by_layer = partitions + 2 * zero.largest_layer_params(llama_1b)
    # at most the largest layer and the decoder layer whose gradients reduce (the heaviest moment's)
    assert _training_phase(llama_1b)["weights"] <= layer_by_layer + 2 * llama_1b.layer_params
    # past the limit by two MLP matrices at most (a round's last parameter, the module fetched), under a default bucket
    mlp = llama_1b.hidden_size * llama_1b.intermediate_size
    assert _training_phase(llama_1b, gradient_accumulation_steps=2)["weights"] == pytest.approx(
        partitions + 2 * (zero.MAX_LIVE_PARAMETERS + 2 * mlp), rel=1e-3)
    # without the gather, the generation's forwards record a trace the first micro-batch's forward follows and its
    # backward invalidates (the second records the loss's, the third prefetches it): that forward holds them with the
    # round in use twice beside them (model/zero.py prefetching_forward_params)
    from vram_planner.model import components as m
    from vram_planner.model.phases import persistent_bytes, training_moments

    forward = 2 * zero.prefetching_forward_params(llama_1b, None, None)
    for steps in (1, 2):
        train = training_config({"num_gpus": 8, "zero_stage": 3, "dtype": "bfloat16", "per_device_train_batch_size": 2,
                                 "num_generations": 2, "gradient_accumulation_steps": steps,
                                 "ds3_gather_for_generation": False})
        moments = {p.moment: p for p in training_moments(llama_1b, train, trl_release(), Calibration(),
                                                          persistent_bytes(llama_1b, train),
                                                          m.gradient_bytes(llama_1b, train))}
        assert moments["forward: a prefetch round in use"].components["weights"] == pytest.approx(
            partitions + forward, rel=1e-3)
        assert moments["LM head backward"].components["weights"] == pytest.approx(layer_by_layer, rel=1e-3)
    later = estimate(llama_1b, training_config({"num_gpus": 8, "zero_stage": 3, "dtype": "bfloat16",
                                                "per_device_train_batch_size": 2, "num_generations": 2,
                                                "gradient_accumulation_steps": 3,
                                                "ds3_gather_for_generation": False}),
                     trl_release(), Calibration(), 80 * GiB)
    two = estimate(llama_1b, training_config({"num_gpus": 8, "zero_stage": 3, "dtype": "bfloat16",
                                              "per_device_train_batch_size": 2, "num_generations": 2,
                                              "gradient_accumulation_steps": 2, "ds3_gather_for_generation": False}),
                   trl_release(), Calibration(), 80 * GiB)
    # the backward holds them too only from the third micro-batch on
    assert later.phases[-2].tensor_bytes > two.phases[-2].tensor_bytes
    assert layer_by_layer < partitions + 2 * 1.05e9
    assert zero.prefetched_params(10**6, 10**5) == 10**6  # a small model whole
    assert zero.prefetched_params(10**10, 10**8) == zero.MAX_LIVE_PARAMETERS + zero.PREFETCH_BUCKET_ELEMENTS


def test_before_trl_1_5_every_later_steps_loss_holds_max_live_parameters(llama_1b):
    # TRL 1.4's add_hooks puts DeepSpeed's hooks back after the gathered generation and leaves the coordinator's
    # trace complete (1.5 on invalidates it: profiles/trl.toml zero3_trace_kept_across_generation), so every step
    # after the first prefetches in its loss, accumulating or not; its first micro-batch records the trace
    partitions = 2 * llama_1b.params / 8
    prefetched = zero.MAX_LIVE_PARAMETERS + 2 * llama_1b.hidden_size * llama_1b.intermediate_size
    train = training_config({"num_gpus": 8, "zero_stage": 3, "dtype": "bfloat16", "per_device_train_batch_size": 2})
    for version, kept in (("1.4.0", True), ("1.5.0", False), ("0.20.0", True)):
        release = trl_release(version)
        assert release.zero3_trace_kept_across_generation is kept
        weights = next(p for p in estimate(llama_1b, train, release, Calibration(), 80 * GiB).phases
                       if p.name == "training").components["weights"]
        assert (weights == pytest.approx(partitions + 2 * prefetched, rel=1e-3)) is kept
        first = estimate(llama_1b, train, release, Calibration(), 80 * GiB, first_micro_batch=True).phases
        assert next(p for p in first if p.name == "training").components["weights"] < partitions + 2 * 0.5e9


def test_zero2_keeps_the_whole_gradients_its_partition_touches_between_micro_batches():
    # grads_in_partition (stage_1_and_2.py:2184-2203): rank 0 of 2 touches the first parameter (100), rank 1 all three
    assert zero.accumulated_gradient_bytes([[100, 20, 20]], 2) == 2 * 140
    assert zero.accumulated_gradient_bytes([[100, 20, 20], [10]], 2) == 2 * 150


@pytest.mark.parametrize("entry", models(), ids=lambda e: e.name)
@pytest.mark.parametrize("gpus", [2, 3, 8])
def test_each_phase_is_planned_on_the_rank_that_holds_the_most_there(entry, gpus):
    # ZeRO-1/2 split each flat group into equal parts: the ranks' partitions touch different gradients, whole, and
    # different pieces; the planner counts, and the trace runs, the heaviest rank of the phase
    groups = zero.optimizer_groups(catalog_architecture(entry), None, None)
    whole = [zero.whole_gradient_elements(groups, gpus, rank) for rank in range(gpus)]
    steps = [zero.zero12_step_bytes(groups, gpus, rank) for rank in range(gpus)]
    accumulating, stepping = zero.accumulating_rank(groups, gpus), zero.stepping_rank(groups, gpus)
    assert whole[accumulating] == max(whole) and whole.index(max(whole)) == accumulating
    assert steps[stepping] == max(steps) and steps.index(max(steps)) == stepping
    assert zero.accumulated_gradient_bytes(groups, gpus) == 2 * max(whole)
    assert zero.step_gradient_bytes(groups, gpus, 2) == max(steps)
    for phase in ("generation", "scoring", "training"):
        assert zero.heaviest_rank(groups, gpus, 2, phase) == accumulating
        assert zero.heaviest_rank(groups, gpus, 1, phase) == zero.heaviest_rank(groups, gpus, 3, phase) == 0
    assert zero.heaviest_rank(groups, gpus, 1, "optimizer") == stepping
    assert zero.heaviest_rank(groups, gpus, 2, "optimizer") == stepping
    assert zero.heaviest_rank(groups, gpus, 3, "optimizer") == 0
    # beside a trace of another rank, what the counted rank holds more: ZeRO-1/2's step, by its gradients' bytes
    for rank in range(gpus):
        for stage in (1, 2, 3):
            assert zero.rank_excess_bytes(groups, gpus, stage, "training", rank) == 0
        assert zero.rank_excess_bytes(groups, gpus, 3, "optimizer", rank) == 0
        for stage in (1, 2):
            assert zero.rank_excess_bytes(groups, gpus, stage, "optimizer", rank) == max(steps) - steps[rank] >= 0


def test_a_1b_models_partitions_on_8_ranks_differ_by_a_fifth(llama_1b):
    # Llama-3.2-1B's two groups (its matrices, then its norms) on 8: rank 1's partition touches 323.5M gradients'
    # elements, rank 0's 262.7M, so rank 1 keeps 116 MiB more between micro-batches; rank 0's step holds the most
    groups = zero.optimizer_groups(llama_1b, None, None)
    assert (zero.accumulating_rank(groups, 8), zero.stepping_rank(groups, 8)) == (1, 0)
    assert zero.accumulated_gradient_bytes(groups, 8) - 2 * zero.whole_gradient_elements(groups, 8, 0) == 121_634_816


@pytest.mark.parametrize("path", family_fixture_files(), ids=lambda p: p.stem)
def test_the_largest_layer_is_the_one_deepspeed_counts(path):
    config = json.loads(path.read_text())
    model = build_on_meta(config)
    # DeepSpeed's model_to_params (deepspeed/runtime/zero/stage3.py:4059-4063), run on the module transformers builds
    deepspeed_largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert zero.largest_layer_params(ModelArchitecture.from_config(config)) == deepspeed_largest


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_deepspeeds_own_estimator_when_it_is_installed(gpus, llama_1b):
    stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    p, largest = llama_1b.params, zero.largest_layer_params(llama_1b)
    _, zero2 = stage_1_and_2.estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=gpus, cpu_offload=False)
    _, zero3, _ = stage3.estimate_zero3_model_states_mem_needs(p, largest, num_gpus_per_node=gpus, cpu_offload=False)
    assert zero.deepspeed_estimate_bytes(p, gpus, 2) == zero2
    assert zero.deepspeed_estimate_bytes(p, gpus, 3, largest) == zero3
    assert _optimizer_model_states(llama_1b, 2, gpus) >= zero2
    assert _optimizer_model_states(llama_1b, 3, gpus) >= zero3


def test_layer_by_layer_generation_without_zero3_is_one_line(capsys):
    err = one_line_error(capsys, "check", "--gpu", "h100-80gb", "--model", "Llama-3.2-1B", "--zero-stage", "2",
                         "--num-gpus", "2", "--no-ds3-gather-for-generation")
    assert "ds3-gather-for-generation off needs --zero-stage 3" in err


def test_zero3_gathers_the_differentiated_layer_with_its_lora_adapters():
    # TRL builds the adapters in the weights' dtype under ZeRO-3 and they are partitioned like the layer, so its
    # backward gathers them with it: the 16-bit layer and its r x (in + out) per adapted linear beside the partitions
    # (the sharded trace of Llama-3.2-1B r=16 on 8 ranks, whose reentrant checkpointing, TRL 1.9 on, peaks there)
    from vram_planner.model import components as m

    arch = catalog_architecture(next(e for e in models() if e.name == "Llama-3.2-1B"))
    train = training_config({"num_gpus": 8, "zero_stage": 3, "dtype": "bfloat16", "lora_r": 16,
                             "per_device_train_batch_size": 2, "num_generations": 2, "max_prompt_length": 32,
                             "max_completion_length": 32})
    training = next(p for p in estimate(arch, train, trl_release(), Calibration(), 80 * GiB).phases
                    if p.name == "training")
    adapters = sum(16 * (lin.in_features + lin.out_features) for lin in arch.layer_linears())
    # as it fetches its largest module (an MLP matrix), that module's all-gather buffer beside it (model/zero.py)
    assert training.moment == "backward: a module's fetch"
    mlp = arch.hidden_size * arch.intermediate_size
    assert training.components["weights"] - m.weight_bytes(arch, train) == (arch.layer_params + adapters + mlp) * 2


def _numels(path) -> tuple[ModelArchitecture, list[int]]:
    config = json.loads(path.read_text())
    return ModelArchitecture.from_config(config), [p.numel() for p in build_on_meta(config).parameters()]


@pytest.mark.parametrize("path", family_fixture_files(), ids=lambda p: p.stem)
def test_the_forward_order_holds_every_parameter_transformers_builds(path):
    # the parameters the prefetch rounds gather, one entry each, as the module transformers builds holds them (its
    # registration order is not the forward's: the norms come after the linears there)
    arch, numels = _numels(path)
    if arch.vision_params:  # its tower's parameters are not listed
        assert sum(zero.forward_params(arch, None, None)) == sum(numels) - arch.vision_params
    else:
        assert sorted(zero.forward_params(arch, None, None)) == sorted(numels)
    assert zero.forward_params(arch, None, None)[0] == arch.embedding_params
    lora = zero.forward_params(arch, 8, ["q_proj", "v_proj"])
    assert sum(lora) - sum(zero.forward_params(arch, None, None)) == arch.lora_params(8, ["q_proj", "v_proj"])


@pytest.mark.parametrize("entry", models(), ids=lambda e: e.name)
def test_every_catalog_models_forward_order_adds_up_to_its_parameters(entry):
    arch = catalog_architecture(entry)
    # DeepSpeed's default prefetch bucket, transformers' "auto" (0.9 x hidden_size^2) and one under a parameter
    for r, bucket in itertools.product((None, 16), (zero.PREFETCH_BUCKET_ELEMENTS,
                                                    int(0.9 * arch.hidden_size ** 2), 1000)):
        params = zero.forward_params(arch, r, None)
        assert sum(params) == arch.params - arch.vision_params + (arch.lora_params(r, None) if r else 0)
        peak = zero.prefetching_forward_params(arch, r, None, bucket)
        # every parameter up to max_live_parameters (and the last round's overshoot) with one round twice: at most a
        # bucket past the largest parameter a round can end on, or the embedding twice at the forward's first fetch
        window = min(sum(params), zero.MAX_LIVE_PARAMETERS + max(params[1:]))
        assert min(sum(params), zero.MAX_LIVE_PARAMETERS) < peak
        assert peak <= max(window + bucket + max(params[1:]), 2 * params[0])
        if sum(params[1:]) > 2 * bucket:
            assert peak >= window + min(bucket, max(params[1:]))
        # a smaller bucket holds less, never more
        assert peak <= zero.prefetching_forward_params(arch, r, None, 2 * bucket)


@pytest.mark.parametrize("path", family_fixture_files(), ids=lambda p: p.stem)
def test_persistent_parameters_are_deepspeeds(path):
    # DeepSpeed marks a parameter persistent when it holds at most stage3_param_persistence_threshold elements
    # (parameter_offload.py:325), on the module transformers builds
    arch, numels = _numels(path)
    if not arch.vision_params:  # a vision tower's are not counted
        assert zero.persistent_params(arch, None, None) == sum(n for n in numels if n <= 100_000)
    # r x 64 elements per adapter matrix here: every one persistent
    assert zero.persistent_params(arch, 8, None) - zero.persistent_params(arch, None, None) == arch.lora_params(8, None)
    # transformers' "auto" threshold (10 x hidden_size) and none
    auto = 10 * arch.hidden_size
    assert zero.persistent_params(arch, 8, None, auto) == sum(
        n for n in zero.forward_params(arch, 8, None) if n <= auto)
    assert zero.persistent_params(arch, 8, None, 0) == 0


def test_a_prefetching_forward_holds_the_round_in_use_twice(llama_1b):
    # Under a bucket (5e7 elements) beside its embedding, one round holds every parameter: the forward's first fetch
    # waits on it with nothing else gathered, the whole model twice (the sharded trace of a small Llama)
    small = ModelArchitecture.from_config({"model_type": "llama", "vocab_size": 1000, "hidden_size": 512,
                                          "intermediate_size": 1024, "num_hidden_layers": 3,
                                          "num_attention_heads": 8, "num_key_value_heads": 4,
                                          "tie_word_embeddings": True})
    assert zero.prefetching_forward_params(small, None, None) == 2 * small.params
    # Llama-3.2-1B: its embedding (2.6e8) a round of its own, then a decoder layer's worth a round (the bucket ends
    # at a layer's last MLP matrix) until max_live_parameters, passed by at most an MLP matrix; one round twice
    mlp = llama_1b.hidden_size * llama_1b.intermediate_size
    assert zero.prefetching_forward_params(llama_1b, None, None) == (
        zero.MAX_LIVE_PARAMETERS + mlp + llama_1b.layer_params)


@pytest.mark.parametrize("knobs", [{}, {"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3},
                                   {"zero_stage": 1, "gradient_accumulation_steps": 2},
                                   {"zero_stage": 3, "gradient_accumulation_steps": 2, "lora_r": 16}])
def test_the_micro_batch_moments_advise_reads_are_the_loss_phases(llama_1b, knobs):
    # advise reads the live bytes at the failing allocation's moment from these: the loss phase's own moment among
    # them, DeepSpeed's reduction bucket counted where it lives (ZeRO-1/2 in the backward, ZeRO-3 from start-up)
    from vram_planner.model.phases import micro_batch_moments

    train = training_config({"num_gpus": 8 if knobs else 1, "dtype": "bfloat16", "per_device_train_batch_size": 2,
                             "num_generations": 2, **knobs})
    for first in (False, True):
        loss = next(p for p in estimate(llama_1b, train, trl_release(), Calibration(), 80 * GiB,
                                        first_micro_batch=first).phases if p.name == "training")
        moment = next(p for p in micro_batch_moments(llama_1b, train, trl_release(), Calibration(), first)
                      if p.moment == loss.moment)
        assert moment.components == {k: loss.components[k] for k in moment.components}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_reduction_bucket_is_the_configs_size_and_overlap_doubles_it_below_stage_3(llama_1b, stage):
    def bucket(**knobs):
        return zero.reduce_bucket_bytes(llama_1b, training_config({"zero_stage": stage, "num_gpus": 2, **knobs}))

    assert bucket() == 500_000_000 * 2
    assert bucket(reduce_bucket_size="2e8") == bucket(reduce_bucket_size=2e8) == 200_000_000 * 2
    assert bucket(reduce_bucket_size="auto") == llama_1b.hidden_size ** 2 * 2  # transformers' fill
    if stage != 1:  # refused under ZeRO-1 (below)
        assert bucket(overlap_comm=True) == (1 if stage == 3 else 2) * bucket()
    assert bucket(overlap_comm=False) == bucket()
    # a smaller bucket never needs more in the loss, whose reductions it sets
    peaks = [{p.name: p.tensor_bytes for p in estimate(llama_1b, training_config(
        {"zero_stage": stage, "num_gpus": 2, "reduce_bucket_size": size}), trl_release(None), Calibration(),
        80 * GiB).phases}["training"] for size in (1_000_000, 200_000_000, 500_000_000)]
    assert peaks == sorted(peaks)


@pytest.mark.parametrize("knobs, said", [
    ({"reduce_bucket_size": "2e8"}, "--reduce-bucket-size / --overlap-comm need --zero-stage 1, 2 or 3"),
    ({"overlap_comm": True, "zero_stage": 0}, "--reduce-bucket-size / --overlap-comm need --zero-stage 1, 2 or 3"),
    ({"overlap_comm": True, "zero_stage": 1}, "--overlap-comm on under ZeRO-1 is not planned"),
    ({"reduce_bucket_size": "0", "zero_stage": 2}, "--reduce-bucket-size should be a number of elements"),
    ({"reduce_bucket_size": "5e8.5", "zero_stage": 2}, "--reduce-bucket-size should be a number of elements"),
])
def test_a_bucket_the_engines_do_not_have_is_one_clear_line(capsys, knobs, said):
    flags = [word for key, value in knobs.items() for word in (
        [f"--{key.replace('_', '-')}"] if value is True else [f"--{key.replace('_', '-')}", str(value)])]
    assert said in one_line_error(capsys, "check", "--gpu", "h100", "--model", "Llama-3.2-1B", "--num-gpus", "2",
                                  *flags)


def test_a_later_bucket_is_flattened_beside_the_partition_buffer_where_it_spans_partitions():
    # Qwen2.5-1.5B on 4, DeepSpeed's 5e8 bucket: rank 1's buffer comes after the second reduction; the embedding's
    # arrival then reduces the first layers, which belong to ranks 0 and 1, so average_tensor flattens them beside the
    # buffer and the embedding's gradient (the sharded trace: 624.8 + 766.6 + 445.1 MiB)
    arch = resolve_model("Qwen2.5-1.5B")
    order = zero.backward_order(arch)
    reductions = zero.bucket_reductions(order, zero.REDUCE_BUCKET_ELEMENTS)
    assert zero.partition_buffer_reduction(arch, 4, 1, zero.REDUCE_BUCKET_ELEMENTS) == 1
    (_, _, first), (_, _, second), (flat, arriving, third) = reductions[:3]
    assert zero._spans_partitions(arch, 4, [first, second, third])[2] and third == len(order) - 1
    buffer = 766 * 2**20
    held = zero.reducing_bucket_gradient_bytes(arch, arch.params, True, partition_buffer=buffer, ranks=4, rank=1)
    assert held == buffer + (flat + arriving) * zero.REDUCE_BUCKET_ELEMENT_BYTES
    # on one rank nothing spans, and without the rank the later reduction's copy is not placed
    assert not zero._spans_partitions(arch, 1, [first, second, third])[2]
    assert zero.reducing_bucket_gradient_bytes(arch, arch.params, True, partition_buffer=buffer, ranks=4) < held
