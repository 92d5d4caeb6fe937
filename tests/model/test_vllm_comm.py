"""Colocated vLLM's tensor-parallel communicators (vLLM 0.31 source, model/vllm_comm.py): what each rank holds, that it
sits outside --vllm-gpu-memory-utilization in every phase, and that vLLM's start-up free-memory check sees it."""

from __future__ import annotations

from helpers import json_of
from vram_planner.model import vllm
from vram_planner.model.architecture import ModelArchitecture
from vram_planner.model.nccl import communicator_bytes, nccl_table
from vram_planner.model.spec import training_config
from vram_planner.model.vllm_comm import vllm_comm_figure
from vram_planner.profiles import GpuProfile
from vram_planner.units import GiB, MiB

QWEN_7B_TP2 = ("--model", "Qwen2.5-7B", "--dtype", "bfloat16", "--num-gpus", "2", "--zero-stage", "3", "--use-vllm",
               "--vllm-mode", "colocate", "--vllm-tensor-parallel-size", "2")
CONTEXT = int(0.5 * GiB)


def test_h100_board_t2_holds_a_ring_communicator_the_all_reduce_buffers_and_trls_group():
    gpu = GpuProfile.from_name("h100-80gb")
    fig = vllm_comm_figure(gpu, 2)
    # NCCL on 24 channels: 2 MiB x (2 + 3 x 32) at init, 18 NVLS granules, 24 ring pairs of 12 MiB
    ring = (2 + 3 * 32) * 2 * MiB + 17 * 2 * MiB + 24 * 12 * MiB
    table = nccl_table()
    assert ring == sum(communicator_bytes(2, table.link_row("nvlink4"), "9.0", "p2p", table, ["ring"]).values())
    # custom all-reduce: meta (8 MiB + flags -> 10 MiB), IPC buffer max(8, 2, 16) MiB, rank_data 8 MiB;
    # symmetric memory 64 MiB (sm90, 2 ranks); multicast buffer 6 x max(8 MiB x 2, 16 MiB)
    assert fig.parts == {"pynccl": ring, "symm_mem": 64 * MiB, "custom_all_reduce": 34 * MiB,
                         "multicast_buffer": 96 * MiB, "trl_tp_group": ring}
    assert fig.at_start_bytes == ring + 194 * MiB and fig.bytes == 2 * ring + 194 * MiB


def test_custom_all_reduce_needs_p2p_and_nvlink_beyond_two_ranks():
    pcie = GpuProfile.from_name("h100-pcie")
    two, four = vllm_comm_figure(pcie, 2).parts, vllm_comm_figure(pcie, 4).parts
    assert two["custom_all_reduce"] == 34 * MiB and "multicast_buffer" not in two  # no NVSwitch, no multicast
    assert "custom_all_reduce" not in four and four["symm_mem"] == 32 * MiB  # more than two PCIe-only GPUs
    geforce = vllm_comm_figure(GpuProfile.from_name("rtx3090"), 2).parts
    assert set(geforce) == {"pynccl", "trl_tp_group"}  # no P2P (shm), sm 8.6 has no symmetric-memory size
    assert vllm_comm_figure(GpuProfile.from_name("h100-80gb"), 1).bytes == 0


def test_check_counts_them_beside_the_budget_and_in_the_start_up_check(capsys):
    gpu = GpuProfile.from_name("h100-80gb")
    fig = vllm_comm_figure(gpu, 2)
    _, doc = json_of(capsys, "check", "--gpu", "h100-80gb", *QWEN_7B_TP2, "--vllm-gpu-memory-utilization", "0.3")
    assert {p["components"]["vllm_communicators"] for p in doc["phases"]} == {fig.bytes}
    # beside vLLM's budget, which stays utilization x the card
    assert {p["components"]["vllm_reservation"] for p in doc["phases"]} == {doc["vllm"]["reservation_bytes"]}
    assert doc["assumptions"]["vllm_communicators"] == fig.source
    assert sum(note == fig.source for note in doc["notes"]) == 1
    # 0.885 asks for 70.08 GiB: the trainer's context and ZeRO-3 weights leave 70.32 GiB, and vLLM's communicators
    # (set up before its snapshot) take 0.70 GiB of that: vLLM refuses, as request_memory would
    _, doc = json_of(capsys, "check", "--gpu", "h100-80gb", *QWEN_7B_TP2, "--vllm-gpu-memory-utilization", "0.885")
    assert "only 69.63 GiB of the 79.18 GiB card are free" in doc["vllm"]["problem"]
    assert "vLLM's tensor-parallel communicators are there" in doc["vllm"]["problem"]
    _, server = json_of(capsys, "check", "--gpu", "h100-80gb", *QWEN_7B_TP2[:-4], "--vllm-mode", "server")
    assert {p["components"]["vllm_communicators"] for p in server["phases"]} == {0}
    assert server["assumptions"]["vllm_communicators"] is None


def test_the_servers_start_up_check_sees_its_communicators_too():
    # Llama-2-7B's shape (tests/model/test_vllm.py): what the server loads does not move its start-up check
    arch = ModelArchitecture.from_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                          "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                                          "num_hidden_layers": 32, "num_attention_heads": 32,
                                          "num_key_value_heads": 32, "max_position_embeddings": 4096})
    settings = {"use_vllm": True, "vllm_mode": "server", "vllm_server_gpu": "h100-80gb", "num_gpus": 2}
    one = vllm.server_budget(arch, training_config(settings), CONTEXT)
    two = vllm.server_budget(arch, training_config({**settings, "vllm_tensor_parallel_size": 2}), CONTEXT)
    at_start = vllm_comm_figure(GpuProfile.from_name("h100-80gb"), 2).at_start_bytes
    assert one.free_at_start_bytes == one.capacity_bytes - CONTEXT
    assert two.free_at_start_bytes == one.free_at_start_bytes - at_start  # no TRL group on the server


def test_sleep_mode_leaves_them_on_the_card(capsys):
    _, doc = json_of(capsys, "check", "--gpu", "h100-80gb", *QWEN_7B_TP2, "--vllm-gpu-memory-utilization", "0.3",
                     "--vllm-enable-sleep-mode")
    fig = vllm_comm_figure(GpuProfile.from_name("h100-80gb"), 2)
    assert {p["components"]["vllm_communicators"] for p in doc["phases"]} == {fig.bytes}
    assert min(p["components"]["vllm_reservation"] for p in doc["phases"]) < doc["vllm"]["reservation_bytes"]
