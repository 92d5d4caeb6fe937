"""ZeRO-Offload and FSDP2's CPU offload (vram_planner/model/offload.py): what leaves each GPU, what one node's RAM
holds, never below DeepSpeed's own estimators, and refused with both numbers where the host cannot hold it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vram_planner.errors import ConfigError
from vram_planner.model import offload, zero
from vram_planner.model.calibration import Calibration
from vram_planner.model.phases import estimate
from vram_planner.model.resolve import catalog_architecture
from vram_planner.model.spec import TrainingConfig, training_config, with_changes
from vram_planner.model.trl_releases import trl_release
from vram_planner.profiles import models
from vram_planner.units import GiB

MODEL_STATES = ("weights", "reference_weights", "gradients", "optimizer_states")
OFFLOADS = [{"zero_stage": 2, "offload_optimizer": "cpu"}, {"zero_stage": 3, "offload_optimizer": "cpu"},
            {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
            {"fsdp": True, "offload_param": "cpu"}]
CATALOG = [catalog_architecture(entry) for entry in models()]


def _config(strategy: dict, gpus: int, **knobs) -> TrainingConfig:
    return training_config({"num_gpus": gpus, "dtype": "bfloat16", "per_device_train_batch_size": 2,
                            "num_generations": 2, **strategy, **knobs})


def _phases(arch, train: TrainingConfig) -> dict[str, float]:
    return {p.name: p.total_bytes for p in estimate(arch, train, trl_release(), Calibration(), 80 * GiB).phases}


def _optimizer_states(arch, train: TrainingConfig) -> float:
    step = estimate(arch, train, trl_release(), Calibration(), 80 * GiB).phases[-1]
    assert step.name == "optimizer"
    return sum(step.components[c] for c in MODEL_STATES)


@settings(max_examples=120, deadline=None, derandomize=True, database=None)
@given(arch=st.sampled_from(CATALOG), gpus=st.integers(1, 8), strategy=st.sampled_from(OFFLOADS),
       accumulation=st.sampled_from([1, 4]), lora=st.sampled_from([None, 16]))
def test_offload_never_raises_a_gpus_bytes_and_never_goes_below_deepspeeds_estimate(arch, gpus, strategy,
                                                                                   accumulation, lora):
    knobs = {"gradient_accumulation_steps": accumulation, "lora_r": lora}
    offloaded = _config(strategy, gpus, **knobs)
    kept = with_changes(offloaded, offload_optimizer="none", offload_param="none")
    on_gpu, without = _phases(arch, offloaded), _phases(arch, kept)
    assert on_gpu.keys() == without.keys()
    for phase, total in on_gpu.items():
        assert 0 < total <= without[phase], phase
    assert _optimizer_states(arch, offloaded) < _optimizer_states(arch, kept)
    host = offload.host_bytes(arch, offloaded)
    buffers = offload.host_buffers(arch, offloaded)
    assert host >= min(gpus, offload.MAX_GPUS_PER_NODE) * sum(b.held_bytes for b in buffers) > 0
    estimated = offload.deepspeed_estimate(arch, offloaded)
    if estimated is not None and lora is None:  # DeepSpeed's estimators know full fine-tuning only
        cpu, gpu = estimated
        assert host >= cpu
        assert _optimizer_states(arch, offloaded) >= gpu
    assert offload.host_bytes(arch, kept) == 0 and offload.host_buffers(arch, kept) == []


@pytest.mark.parametrize("strategy", OFFLOADS[:3], ids=["zero2-optimizer", "zero3-optimizer", "zero3-both"])
def test_deepspeeds_own_offload_estimators_when_installed(strategy):
    stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    for arch in CATALOG:
        p, largest = arch.params, zero.largest_layer_params(arch)
        for gpus in (1, 2, 3, 8):
            train = _config(strategy, gpus)
            if train.zero_stage == 2:
                cpu, gpu = stage_1_and_2.estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=gpus,
                                                                               cpu_offload=True)
            else:
                cpu, gpu, _ = stage3.estimate_zero3_model_states_mem_needs(
                    p, largest, num_gpus_per_node=gpus, cpu_offload=True,
                    cpu_offload_params=train.offload_param == "cpu", zero_init=True)
            assert offload.deepspeed_estimate(arch, train) == (cpu, gpu), (arch.name, gpus)
            assert offload.host_bytes(arch, train) >= cpu
            assert _optimizer_states(arch, train) >= gpu


def test_pinned_buffers_are_held_as_the_caching_host_allocator_rounds_them():
    assert offload.pinned_bytes(1) == 1 and offload.pinned_bytes(4096) == 4096
    assert offload.pinned_bytes(3.1 * GiB) == 4 * GiB and offload.pinned_bytes(4 * GiB + 1) == 8 * GiB
    assert offload.pinned_bytes(0) == 0


def test_the_zero2_host_buffers_are_each_of_their_partition(llama_1b):
    train = _config(OFFLOADS[0], 4, gradient_accumulation_steps=2)
    part = -(-llama_1b.params // 4)
    held = {b.name: b for b in offload.host_buffers(llama_1b, train)}
    # one flat partition per optimizer group (the matrices' and the norms'), each a power of two
    norms = llama_1b.hidden_size * (2 * llama_1b.num_layers + 1)
    matrices = -(-(llama_1b.params - norms) // 4)
    for name in ("fp32 master partition", "fp32 gradient partition"):
        assert held[name].tensor_bytes == 4 * (matrices + -(-norms // 4))
        assert held[name].held_bytes == offload.pinned_bytes(4 * matrices) + offload.pinned_bytes(4 * -(-norms // 4))
    assert held["DeepSpeedCPUAdam's moments"].held_bytes == 8 * part and not held["DeepSpeedCPUAdam's moments"].pinned
    # a pinned tensor per parameter with a piece in the partition, the two it shares with its neighbours whole
    accumulated = held["gradients accumulated on the host"]
    largest = zero.largest_layer_params(llama_1b)
    assert 2 * part < accumulated.tensor_bytes <= 2 * (part + 2 * largest)
    assert accumulated.tensor_bytes < accumulated.held_bytes  # a power of two each
    # one micro-batch per step: nothing accumulates on the host
    names = {b.name for b in offload.host_buffers(llama_1b, with_changes(train, gradient_accumulation_steps=1))}
    assert "gradients accumulated on the host" not in names


def test_zero2_offload_keeps_the_16_bit_weights_and_a_staging_buffer_on_the_gpu(llama_1b):
    train = _config(OFFLOADS[0], 2)
    step = estimate(llama_1b, train, trl_release(), Calibration(), 80 * GiB).phases[-1].components
    assert step["optimizer_states"] == 0
    assert step["weights"] == 2 * llama_1b.params
    staging = zero.largest_layer_params(llama_1b) * 2
    # the reduction bucket went with the backward (_release_ipg_buffers, stage_1_and_2.py:924-931; offload makes the
    # gradients contiguous, :300)
    assert step["gradients"] == staging
    training = estimate(llama_1b, train, trl_release(), Calibration(), 80 * GiB).phases[-2].components
    assert training["gradients"] >= zero.REDUCE_BUCKET_ELEMENTS * zero.REDUCE_BUCKET_ELEMENT_BYTES


@pytest.mark.parametrize(("knobs", "flag"), [({"offload_optimizer": "cpu"}, "--offload-optimizer cpu needs"),
                                             ({"offload_optimizer": "cpu", "zero_stage": 1}, "--zero-stage 2 or 3"),
                                             ({"offload_param": "cpu", "zero_stage": 2, "offload_optimizer": "cpu"},
                                              "--offload-param cpu needs"),
                                             ({"offload_param": "cpu", "zero_stage": 3}, "goes with"),
                                             ({"offload_optimizer": "cpu", "fsdp": True}, "use --offload-param cpu"),
                                             ({"offload_optimizer": "gpu", "zero_stage": 2}, "'gpu' is not known"),
                                             ({"host_memory": "lots"}, "--host-memory should be")])
def test_offload_settings_the_engines_do_not_take_are_refused(knobs, flag):
    from vram_planner.errors import flag as cli_flag

    with pytest.raises(ConfigError) as error:
        training_config({"num_gpus": 2, **knobs})
    assert flag in error.value.worded(cli_flag)  # as the command line words it


def test_this_machines_ram_is_read_without_psutil():
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        pytest.skip("no /proc/meminfo to hold it to")
    total_kib = next(int(line.split()[1]) for line in meminfo.read_text().splitlines() if line.startswith("MemTotal"))
    assert offload.machine_memory_bytes() == pytest.approx(total_kib * 1024, rel=0.01)
    assert offload.host_memory_bytes(TrainingConfig()) == offload.machine_memory_bytes()
    assert offload.host_memory_bytes(TrainingConfig(host_memory="512GiB")) == 512 * GiB
    assert os.sysconf("SC_PAGE_SIZE") > 0


@pytest.mark.parametrize("gpus", [1, 2, 8])
@pytest.mark.parametrize("lora", [None, 16])
def test_fsdp2_offload_moves_the_shards_the_sharded_trace_counts_on_the_gpu_to_the_host(llama_1b, gpus, lora):
    # without offload the shards, their gradients and the optimizer's states are what each GPU holds (model/fsdp.py,
    # held to torch's own fully_shard by the sharded trace); with it, the host holds those bytes and the GPU one unit's
    from vram_planner.model import components as m

    offloaded = _config({"fsdp": True, "offload_param": "cpu"}, gpus, lora_r=lora)
    kept = with_changes(offloaded, offload_param="none")
    on_gpu = (m.weight_bytes(llama_1b, kept) + m.gradient_bytes(llama_1b, kept)
              + m.optimizer_state_bytes(llama_1b, kept) + m.optimizer_step_temporary_bytes(llama_1b, kept))
    host = sum(b.tensor_bytes for b in offload.host_buffers(llama_1b, offloaded))
    assert host == pytest.approx(on_gpu, rel=1e-3)
    assert m.gradient_bytes(llama_1b, offloaded) == m.optimizer_state_bytes(llama_1b, offloaded) == 0
    # one unit's shard copied in for its all-gather, not every shard
    assert 0 < m.weight_bytes(llama_1b, offloaded) < m.weight_bytes(llama_1b, kept)
