"""NCCL's own device memory per rank (profiles/nccl.toml, model/nccl.py): the bytes NCCL 2.30.7's defaults allocate,
recomputed here from its source's constants, zero on one GPU, never less with more ranks, every card covered, and a
user's table honoured."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest

from helpers import benchmark_module
from vram_planner.errors import ProfileError
from vram_planner.model.nccl import coll_channels, nccl_figure, nccl_table
from vram_planner.profiles import GpuProfile, gpus, profile_dirs

MiB = 2**20
SHIPPED = profile_dirs()[0] / "nccl.toml"
STRATEGIES = ("ddp", "zero0", "zero1", "zero2", "zero3", "fsdp")

# NVIDIA/nccl v2.30.7-1, written out again from the source rather than read from the table
STEPS = 8  # NCCL_STEPS, src/include/device.h:26
LL = 8 * 512 * STEPS * 16  # NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS x sizeof(ncclLLFifoLine)
LL128 = 120 * 640 * STEPS * 8  # NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x NCCL_STEPS x sizeof(uint64_t)
SIMPLE = 1 << 22  # DEFAULT_BUFFSIZE
MEM_ALIGN, CUDA_IPC_MIN, GRANULE = 4096, 2 * MiB, 2 * MiB


def up(n: int, to: int) -> int:
    return math.ceil(n / to) * to


# p2pRecvSetup / p2pSendSetup: the receiver holds the three protocols' buffers, the sender its ncclSendMem
PAIR = up(MEM_ALIGN + LL + LL128 + SIMPLE, CUDA_IPC_MIN) + up(MEM_ALIGN, CUDA_IPC_MIN)
# with P2P read the SIMPLE buffer sits behind the sender's ncclSendMem instead: the pair costs the same
PAIR_READ = up(MEM_ALIGN + LL + LL128, CUDA_IPC_MIN) + up(MEM_ALIGN + SIMPLE, CUDA_IPC_MIN)


def test_a_connection_pair_is_12_mib_whether_or_not_p2p_reads():
    assert PAIR == PAIR_READ == 12 * MiB


def test_eight_h100s_hold_what_nccls_source_allocates():
    # 18 NVLink4 links x 20.6 GB/s = 370.8: 6 ring channels at 60 GB/s, doubled at 30 (60 >= 50), doubled again by
    # connect.cc: 24 channels; pow2Up(24) = 32 channels initialised with 3 allocations each, 2 per communicator
    channels = 24
    init = GRANULE * (2 + 3 * 32) + GRANULE + 16 * GRANULE  # ncclNvlsSetup at init: credits, 16 nvlsDevPeers
    ring = channels * PAIR
    nvls = up(16 * 2 * 128 * 1024 * STEPS * 8, GRANULE)  # 16 NVLS channels, 8 heads: at the first NVLS collective
    h100 = GpuProfile.from_name("h100-80gb")
    # runtime connect: the ring (small collectives, broadcast) and NVLS (large ones); the tree is never picked
    busy = init + ring + nvls
    assert nccl_figure(h100, 8, "ddp").bytes == busy == 774 * MiB
    assert nccl_figure(h100, 8, "fsdp").bytes == busy
    # DeepSpeed's clone of the world does ZeRO's collectives; the default group only small ones under ZeRO-1/2 and
    # ZeRO-3's parameter all-gathers too (zero.Init partitions over the world group)
    quiet = init + ring
    assert nccl_figure(h100, 8, "zero2").bytes == busy + quiet == 1292 * MiB
    assert nccl_figure(h100, 8, "zero3").bytes == 2 * busy == 1548 * MiB
    # two ranks: NVLS has two heads
    two = init + ring + up(16 * 2 * 128 * 1024 * STEPS * 2, GRANULE)
    assert nccl_figure(h100, 2, "ddp").bytes == two == 582 * MiB


def test_no_strategy_connects_the_tree_and_a_card_without_nvls_holds_rings_only():
    a100 = GpuProfile.from_name("a100-80gb")  # 24 channels, NVSwitch but sm80: no NVLS
    ring_only = GRANULE * (2 + 3 * 32) + 24 * PAIR
    assert nccl_figure(a100, 8, "ddp").bytes == nccl_figure(a100, 2, "ddp").bytes == ring_only
    assert nccl_figure(a100, 8, "zero1").bytes == 2 * ring_only
    assert all("tree" not in nccl_figure(a100, 8, s).parts for s in STRATEGIES)
    summary = nccl_figure(GpuProfile.from_name("h100-80gb"), 8, "zero1").summary
    assert "2 communicators (zero1) connecting ring+NVLS and ring" in summary


def test_a_table_that_connects_the_tree_counts_it_from_three_ranks(tmp_path, monkeypatch):
    h100 = GpuProfile.from_name("h100-80gb")
    before = {n: nccl_figure(h100, n, "ddp").bytes for n in (2, 8)}
    _override(tmp_path, monkeypatch, ddp='[["ring", "tree", "nvls"]]')
    assert nccl_figure(h100, 8, "ddp").bytes == before[8] + 24 * PAIR  # tree.up and tree.down: one more pair
    assert nccl_figure(h100, 2, "ddp").bytes == before[2]  # the tree's one peer is the ring's


@pytest.mark.parametrize("card, channels", [("h100-80gb", 24), ("h200", 24), ("a100-80gb", 24), ("b200", 32),
                                            ("v100-32gb", 12), ("h100-nvl", 16), ("h100-pcie", 4), ("l40s", 2),
                                            ("t4", 2)])
def test_channels_follow_nccls_ring_search(card, channels):
    gpu = GpuProfile.from_name(card)
    row = nccl_table().link_row(gpu.interconnect)
    assert coll_channels(row.bandwidth, gpu.compute_capability, nccl_table()) == channels


def test_geforce_cards_keep_the_buffers_in_host_memory():
    rtx4090 = GpuProfile.from_name("rtx4090")  # 2 channels over PCIe 4.0 -> pow2Up(2) = 2 initialised
    assert nccl_figure(rtx4090, 2, "ddp").bytes == nccl_figure(rtx4090, 8, "ddp").bytes == GRANULE * (2 + 3 * 2)
    assert "shm" in nccl_figure(rtx4090, 2, "ddp").source


@pytest.mark.parametrize("card", [g.name for g in gpus()] + ["24GiB"])
def test_every_card_has_a_figure_zero_on_one_gpu_and_never_less_with_more_ranks(card):
    gpu = GpuProfile.from_name(card)
    for strategy in (*STRATEGIES, "single"):
        assert nccl_figure(gpu, 1, strategy).bytes == 0
    for strategy in STRATEGIES:
        figures = [nccl_figure(gpu, n, strategy).bytes for n in range(1, 17)]
        assert figures == sorted(figures) and figures[1] > 0, (strategy, figures)
        assert "nccl.toml" in nccl_figure(gpu, 2, strategy).source


def test_a_card_the_catalog_does_not_know_is_taken_at_the_largest_nvlink_row_and_says_so():
    figure = nccl_figure(GpuProfile.from_name("24GiB"), 8, "ddp")
    assert "not in the catalog" in figure.source
    pcie = max(nccl_figure(g, 8, "ddp").bytes for g in gpus() if (g.interconnect or "").startswith("pcie"))
    assert figure.bytes > pcie


def _override(tmp_path, monkeypatch, **values) -> None:
    text = SHIPPED.read_text()
    for key, value in values.items():
        text = "\n".join(f"{key} = {value}" if line.split("=")[0].strip() == key else line
                         for line in text.splitlines())
    (tmp_path / "nccl.toml").write_text(text)
    monkeypatch.setenv("VRAM_PLAN_PROFILES", str(tmp_path))


def test_a_users_table_replaces_the_shipped_one(tmp_path, monkeypatch):
    h100 = GpuProfile.from_name("h100-80gb")
    before = nccl_figure(h100, 8, "ddp").bytes
    # NCCL_BUFFSIZE=16MiB, two communicators
    _override(tmp_path, monkeypatch, simple_buffer_bytes=16 * MiB, ddp='[["ring", "nvls"], ["ring", "nvls"]]')
    grown = up(MEM_ALIGN + LL + LL128 + 16 * MiB, CUDA_IPC_MIN) - up(MEM_ALIGN + LL + LL128 + SIMPLE, CUDA_IPC_MIN)
    assert nccl_figure(h100, 8, "ddp").bytes == 2 * (before + 24 * grown)  # one ring pair per channel


def test_nccl_nvls_enable_0_as_the_readme_matches_it_leaves_no_nvls_bytes(tmp_path, monkeypatch):
    _override(tmp_path, monkeypatch, nvls_channels_sm90=0)  # ncclNvlsSetup returns before it allocates anything
    h100 = GpuProfile.from_name("h100-80gb")
    assert nccl_figure(h100, 8, "ddp").bytes == GRANULE * (2 + 3 * 32) + 24 * PAIR == 484 * MiB
    assert "NVLS" not in nccl_figure(h100, 8, "ddp").summary


@pytest.mark.parametrize("communicators", ['[["ring", "collnet"]]', "2"])
def test_communicators_that_are_not_lists_of_known_algorithms_are_one_clear_error(tmp_path, monkeypatch, communicators):
    _override(tmp_path, monkeypatch, ddp=communicators)
    with pytest.raises(ProfileError, match="communicators"):
        nccl_figure(GpuProfile.from_name("h100-80gb"), 2, "ddp")


def test_a_broken_table_is_one_clear_error(tmp_path, monkeypatch):
    _override(tmp_path, monkeypatch, unknown_interconnect='"nvlink9"')
    with pytest.raises(ProfileError, match="nvlink9"):
        nccl_figure(GpuProfile.from_name("h100-80gb"), 2, "ddp")


def test_every_catalog_interconnect_has_a_row_and_every_row_says_how():
    raw = tomllib.loads(SHIPPED.read_text())
    rows = {r["interconnect"] for r in raw["link"]}
    assert {g.interconnect for g in gpus()} <= rows
    assert all(r["how"] and r["bandwidth"] > 0 for r in raw["link"])


def test_the_readme_says_what_is_counted_and_from_where():
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text[text.index("### NCCL's own memory"):]
    assert "profiles/nccl.toml" in section and "2.30.7" in section and "NVLS" in section


def test_the_two_gpu_measurement_script_sets_the_plans_figure_beside_and_refuses_without_cuda(tmp_path):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    planned = benchmark_module("nccl_memory").planned
    h100 = GpuProfile.from_name("h100-80gb")
    assert planned("h100-80gb", 8, 2)["bytes"] == nccl_figure(h100, 8, "zero3").bytes
    assert planned("h100-80gb", 2, 1)["parts"] == nccl_figure(h100, 2, "ddp").parts
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "nccl_memory.py"), "--gpu", "h100-80gb",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1 and done.stderr.strip() == "needs CUDA GPUs and torchrun --nproc-per-node N (N >= 2)"
