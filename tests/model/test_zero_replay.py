"""DeepSpeed ZeRO-1/2's and ZeRO-3's large buffers replayed through the allocator model: what they strand at the
optimizer step (vram_planner/model/zero_replay.py). tests/test_launcher.py holds the estimate it makes to the needs of
benchmarks/deepspeed_configs.py's traces, DeepSpeed's own engine run on one rank."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vram_planner.allocator.need import least_capacity, live_peak_bytes
from vram_planner.allocator.replay import replay_events
from vram_planner.allocator.sizes import K_LARGE_BUFFER, allocation_size
from vram_planner.model import components as m
from vram_planner.model import zero
from vram_planner.model.calibration import default_calibration
from vram_planner.model.phases import estimate
from vram_planner.model.resolve import catalog_architecture, resolve_model
from vram_planner.model.spec import training_config
from vram_planner.model.trl_releases import trl_release
from vram_planner.model.zero_replay import (_partitioned_segments, _replay_arguments, _state_tensors, _without_repeats,
                                           _zero3_stranding,
                                           step_events, zero3_step_events,
                                           zero3_step_stranded_bytes, zero12_loss_stranded_bytes,
                                           zero12_step_stranded_bytes)
from vram_planner.profiles import models
from vram_planner.units import GiB

BASE = {"dtype": "bfloat16", "per_device_train_batch_size": 4, "num_generations": 4}


def _train(**knobs):
    return training_config({**BASE, **knobs})


@pytest.mark.parametrize("knobs", [
    {},  # one GPU
    {"num_gpus": 2, "zero_stage": 0},
    {"num_gpus": 2, "zero_stage": 3},
    {"num_gpus": 2, "fsdp": True},
    {"num_gpus": 2, "zero_stage": 2, "offload_optimizer": "cpu"},  # the partitions step on the host
    {"num_gpus": 2, "zero_stage": 2, "allocator_conf": "expandable_segments:True"},  # mapped page by page
], ids=str)
def test_nothing_strands_where_no_zero12_step_runs_on_the_gpu_in_whole_segments(knobs):
    arch = resolve_model("Qwen2.5-0.5B")
    assert zero12_step_stranded_bytes(arch, _train(**knobs)) == zero12_loss_stranded_bytes(arch, _train(**knobs)) == 0


def test_the_flat_copy_lands_in_the_previous_steps_fp32_segment_where_the_norms_copy_fits_there():
    # Llama-3.2-1B on 2: the norm's fp64 copy of the embedding's share (2,004 MiB) is cut from the previous step's
    # 2,358 MiB fp32 gradient segment, and the flat 16-bit copy after it; the gradient partition buffer lies in the
    # start-up's zeroed fp32 segment of the same size. The sharded trace held 1,179 + 1,161 MiB beside them
    arch, train = resolve_model("Llama-3.2-1B"), _train(num_gpus=2, zero_stage=2)
    groups = m.zero_optimizer_groups(arch, train)
    share = -(-sum(groups[0]) // 2)
    fp32_segment = allocation_size(share * 4, K_LARGE_BUFFER)
    pieces = [p for group in groups for p in zero.partition_pieces(group, 2, 0)[0]]
    assert max(pieces) * zero.NORM_COPY_BYTES <= fp32_segment
    flat, kept = share * 2, m.zero2_accumulated_gradient_bytes(arch, train)
    beside = (fp32_segment - flat) + (fp32_segment - kept)
    stranded = zero12_step_stranded_bytes(arch, train)
    # besides those two, what 2 MiB segments leave beside the large buffers that live in them whole
    assert beside <= stranded <= beside + 16 * 2**20


@pytest.mark.parametrize("entry", models(), ids=lambda e: e.name)
def test_every_catalog_model_replays_on_any_layout(entry):
    arch = catalog_architecture(entry)
    for knobs in ({"num_gpus": 2, "zero_stage": 1}, {"num_gpus": 8, "zero_stage": 2, "reduce_bucket_size": "auto"},
                  {"num_gpus": 4, "zero_stage": 2, "overlap_comm": True, "gradient_accumulation_steps": 2},
                  {"num_gpus": 2, "zero_stage": 2, "lora_r": 16}):
        train = _train(**knobs)
        stranded = zero12_step_stranded_bytes(arch, train)
        step = estimate(arch, train, trl_release(), default_calibration(), 80 * GiB).phases[-1]
        # no more than the step's own fp32 and flat copies and the buffers they are cut beside could leave; the
        # reserve counts it, beside what the fit weighs
        shares = [-(-sum(group) // train.num_gpus) for group in m.zero_optimizer_groups(arch, train)]
        assert 0 <= stranded <= 3 * sum(shares) * 4 + step.components["gradients"], (entry.name, knobs)
        assert step.components["allocator_overhead"] >= stranded
        # the runs of requests freed at once, replayed without those that change nothing, decide the same need
        events = step_events(*_replay_arguments(arch, train))
        full, compact = least_capacity(events), least_capacity(_without_repeats(events))
        assert (full.capacity_bytes, full.tensor_peak_bytes) == (compact.capacity_bytes, compact.tensor_peak_bytes)


def test_the_next_backwards_bucket_finds_the_first_steps_moments_in_the_last_ones_segment():
    # Qwen2.5-0.5B's LoRA on 2 with two 2e8 buckets (overlap_comm): the first step's 16.8 MiB moments are cut from a
    # freed 382 MiB bucket segment, and the next backward's second bucket cannot use what they leave (the sharded
    # trace ran out there with 348 MiB of it free)
    arch = resolve_model("Qwen2.5-0.5B")
    train = _train(num_gpus=2, zero_stage=2, reduce_bucket_size=200_000_000, overlap_comm=True, lora_r=16)
    share = -(-sum(m.zero_optimizer_groups(arch, train)[0]) // 2)
    bucket_segment = allocation_size(200_000_000 * 2, K_LARGE_BUFFER)
    beside_moments = bucket_segment - 2 * share * 4
    assert beside_moments <= zero12_loss_stranded_bytes(arch, train) <= beside_moments + 8 * 2**20
    # buckets smaller than the moments ("auto": 896^2 elements, 1.5 MiB) hold none of them: nothing of the kind
    small = _train(num_gpus=2, zero_stage=2, reduce_bucket_size="auto", overlap_comm=True, lora_r=16)
    assert zero12_loss_stranded_bytes(arch, small) < beside_moments / 4
    # the loss's reserve counts it from the second step on; the first micro-batch runs before any moment exists
    stranded = zero12_loss_stranded_bytes(arch, train)
    steady, first = (next(p for p in estimate(arch, train, trl_release(), default_calibration(), 80 * GiB,
                                              first_micro_batch=first).phases if p.name == "training")
                     for first in (False, True))
    assert steady.components["allocator_overhead"] >= stranded
    assert first.components["allocator_overhead"] < stranded


@pytest.mark.parametrize("knobs", [
    {},  # one GPU
    {"num_gpus": 2, "zero_stage": 2},
    {"num_gpus": 2, "fsdp": True},
    {"num_gpus": 2, "zero_stage": 3, "offload_optimizer": "cpu"},
    {"num_gpus": 2, "zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    {"num_gpus": 2, "zero_stage": 3, "allocator_conf": "expandable_segments:True"},
], ids=str)
def test_nothing_strands_where_no_zero3_step_runs_on_the_gpu_in_whole_segments(knobs):
    assert zero3_step_stranded_bytes(resolve_model("Llama-3.2-1B"), _train(**knobs)) == 0


def test_zero3s_flat_copy_lands_in_the_previous_steps_fp32_segment_beside_a_large_bucket():
    # Llama-3.2-1B on 2 with DeepSpeed's 5e8-element bucket: the start-up cuts the bucket (954 MiB) and the gradient
    # partition's buffer (1,179 MiB) from the zeroed fp32 gradient's freed 2,358 MiB segment, 226 MiB beside them;
    # the step's flat 16-bit copy finds no room there and is cut from the previous step's fp32 segment, 1,179 MiB
    # beside it, so the fp32 copy takes a segment of its own. The sharded trace held those two rests at its need
    arch = resolve_model("Llama-3.2-1B")
    train = _train(num_gpus=2, zero_stage=3, reduce_bucket_size=500_000_000)
    share = sum(-(-numel // 2) for group in zero.optimizer_groups(arch, None, None) for numel in group)
    fp32_segment = allocation_size(share * 4, K_LARGE_BUFFER)
    beside = (fp32_segment - share * 2) + (fp32_segment - 500_000_000 * 2 - share * 2)
    stranded = zero3_step_stranded_bytes(arch, train)
    assert beside <= stranded <= beside + 16 * 2**20
    # transformers' "auto" bucket (hidden^2 elements, 8 MiB) leaves room for the flat copy beside the buffer
    assert zero3_step_stranded_bytes(arch, _train(num_gpus=2, zero_stage=3, reduce_bucket_size="auto")) < 32 * 2**20
    step = estimate(arch, train, trl_release(), default_calibration(), 80 * GiB).phases[-1]
    assert step.name == "optimizer" and step.components["allocator_overhead"] >= stranded


@pytest.mark.parametrize("entry", models(), ids=lambda e: e.name)
def test_every_catalog_model_replays_zero3s_step_on_the_segments_of_deepspeeds_own_start_up(entry):
    arch = catalog_architecture(entry)
    for knobs in ({"num_gpus": 2, "zero_stage": 3}, {"num_gpus": 8, "zero_stage": 3, "reduce_bucket_size": "auto"},
                  {"num_gpus": 4, "zero_stage": 3, "lora_r": 16, "reduce_bucket_size": 200_000_000}):
        train = _train(**knobs)
        groups = tuple(map(tuple, zero.optimizer_groups(arch, train.lora_r, None)))
        layout = (groups, train.num_gpus, zero.reduce_bucket_elements(arch, train), _state_tensors(train))
        # the start-up made again from the segments it leaves needs what DeepSpeed's requests themselves need
        per_request = least_capacity(_without_repeats(zero3_step_events(*layout, per_request=True)))
        remade = least_capacity(_without_repeats(zero3_step_events(*layout)))
        assert remade.capacity_bytes == per_request.capacity_bytes, (entry.name, knobs)
        stranded = zero3_step_stranded_bytes(arch, train)
        assert stranded == max(0, per_request.capacity_bytes - per_request.tensor_peak_bytes)
        # no more than a sub-group's fp32 and flat copies and the start-up's fp32 gradient could leave beside them
        ranks = train.num_gpus
        largest = max(sum(sub) for group in groups
                      for sub in zero.sub_group_partitions([-(-n // ranks) for n in group]))
        assert 0 <= stranded <= largest * (4 + 2 + 4) + 64 * 2**20, (entry.name, knobs)


NUMELS = st.one_of(st.integers(1, 4096), st.integers(4096, 3_000_000), st.integers(3_000_000, 300_000_000))


@settings(max_examples=60, deadline=None)
@given(groups=st.lists(st.lists(NUMELS, min_size=1, max_size=12), min_size=1, max_size=3),
       ranks=st.integers(1, 8), bucket=st.sampled_from([1_000, 4_000_000, 200_000_000, 500_000_000]),
       states=st.sampled_from([(4, 4), (1, 1), ()]), workspace=st.sampled_from([0, 32 * 2**20]))
# both run on 192 MiB and from 208 on, and out on 206 MiB: an island the bisections settle on either side of
@example(groups=[[1, 12582907], [15728635, 22020097], [7340033, 22020097]], ranks=6, bucket=4_000_000,
         states=(1, 1), workspace=0)
def test_zero3s_start_up_remade_from_its_segments_runs_out_where_its_requests_do(groups, ranks, bucket, states,
                                                                                 workspace):
    # any layout of parameters, small ones (the small pool's 2 MiB segments) and large, on any number of ranks. On a
    # capacity the start-up runs short on (it holds all it reserves: its segments), its own requests release segments
    # the remade one holds, so _zero3_stranding bisects those; from there up the two run out on the same capacities.
    # least_capacity tries the capacities above its answer at a spacing, so two bisections of the same behaviour
    # that take different paths (the two start-ups reserve different peaks) may settle on either side of an island
    # narrower than it: the streams are held to running out alike at each need and below it
    layout = (tuple(map(tuple, groups)), ranks, bucket, states, workspace)
    as_requested = _without_repeats(zero3_step_events(*layout, per_request=True))
    remade = _without_repeats(zero3_step_events(*layout))
    start_up = sum(size for segment in _partitioned_segments(*layout[:2]) for size, _ in segment)
    needs = {least_capacity(as_requested).capacity_bytes, least_capacity(remade).capacity_bytes}
    for capacity in {need - below for need in needs for below in (0, 2 * 2**20) if need - below > start_up}:
        runs = [replay_events(events, capacity_bytes=capacity, series=False).out_of_memory is None
                for events in (as_requested, remade)]
        assert runs[0] == runs[1], capacity
    assert _zero3_stranding(*layout) in {max(0, need - live_peak_bytes(as_requested)) for need in needs}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_layouts_replay_is_kept_for_the_next_process_and_made_again_when_its_code_changes(tmp_path, monkeypatch,
                                                                                          stage):
    # `--num-gpus auto` asks for a bisection on every count it tries: a later process reads the answer back, and a
    # change to the allocator model or the streams' makers (their files' sizes or times) replays it anew
    import vram_planner.allocator.need as need_module
    from vram_planner import profile_cache
    from vram_planner.model import zero_replay

    monkeypatch.setenv("VRAM_PLAN_CACHE", str(tmp_path / "cache"))
    arch, train = resolve_model("Qwen2.5-0.5B"), _train(num_gpus=2, zero_stage=stage)
    stranded = zero12_step_stranded_bytes if stage == 2 else zero3_step_stranded_bytes

    def new_process() -> None:
        zero_replay._stranding.cache_clear()
        zero_replay._zero3_stranding.cache_clear()
        profile_cache.sources_version.cache_clear()

    new_process()
    first = stranded(arch, train)
    assert first > 0  # the layout strands: a bisection worth keeping
    bisected = []
    monkeypatch.setattr(need_module, "least_capacity",
                        lambda *args, **kwargs: bisected.append(1) or least_capacity(*args, **kwargs))
    new_process()
    assert stranded(arch, train) == first and not bisected
    source = tmp_path / "zero_replay.py"
    source.write_text("# a changed copy of the code\n")
    monkeypatch.setattr(zero_replay, "_REPLAY_SOURCES", (*zero_replay._REPLAY_SOURCES, source))
    new_process()
    assert stranded(arch, train) == first and bisected
