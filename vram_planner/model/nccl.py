"""NCCL's own device memory on one rank of N: connection buffers, NVLS buffers and device-side structures, allocated by
NCCL outside PyTorch's caching allocator, as NCCL's defaults give them for the catalog's interconnect.

Each term and constant is cited in profiles/nccl.toml (NVIDIA/nccl v2.30.7, the release torch 2.14/2.15 ship; 2.29.7,
torch 2.13's, has the same values); a nccl.toml in $VRAM_PLAN_PROFILES replaces the shipped table (to match NCCL_*
settings a run exports). Like the CUDA context it adds to every phase's need and never to the allocator's pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from vram_planner.errors import ProfileError
from vram_planner.model.cuda_context import cuda_tuple
from vram_planner.profile_cache import cached
from vram_planner.profiles import GpuProfile, profile_dirs, read_toml, validated
from vram_planner.units import GiB, MiB
from vram_planner.validation import Rules

_CC = r"^\d+\.\d+$"
Strategy = Literal["single", "ddp", "zero0", "zero1", "zero2", "zero3", "fsdp"]
# The algorithms whose connections NCCL sets up at a communicator's first collective that picks them (runtime connect)
Algorithm = Literal["ring", "tree", "nvls"]
# NCCL doubles the searched channels at half speed only from this speed on (ncclTopoDupChannels, search.cc:1039)
_DUP_MIN_SPEED = 25.0


@dataclass(frozen=True, kw_only=True)
class SpeedRow:
    __pydantic_config__ = {"extra": "forbid"}

    min_compute_capability: Annotated[str, Rules(pattern=_CC)]
    speeds: Annotated[list[Annotated[float, Rules(gt=0)]], Rules(min_length=1)]


@dataclass(frozen=True, kw_only=True)
class LinkRow:
    __pydantic_config__ = {"extra": "forbid"}

    interconnect: str
    bandwidth: Annotated[float, Rules(gt=0)]  # NCCL's figure for the card's links, GB/s
    nvswitch: bool
    how: Annotated[str, Rules(min_length=1)]


@dataclass(frozen=True, kw_only=True)
class NcclTable:
    """profiles/nccl.toml."""

    __pydantic_config__ = {"extra": "forbid"}

    release: str
    steps: Annotated[int, Rules(gt=0)]
    ll_buffer_bytes: Annotated[int, Rules(ge=0)]
    ll128_buffer_bytes: Annotated[int, Rules(ge=0)]
    simple_buffer_bytes: Annotated[int, Rules(ge=0)]
    connection_struct_bytes: Annotated[int, Rules(ge=0)]
    ipc_align_bytes: Annotated[int, Rules(gt=0)]
    granularity_bytes: Annotated[int, Rules(gt=0)]
    device_allocs_per_comm: Annotated[int, Rules(ge=0)]
    device_allocs_per_channel: Annotated[int, Rules(ge=0)]
    max_channels: Annotated[int, Rules(gt=0, le=1024)]
    nvls_chunk_bytes: Annotated[int, Rules(ge=0)]
    nvls_channels_sm90: Annotated[int, Rules(ge=0)]
    nvls_channels_sm100: Annotated[int, Rules(ge=0)]
    shm_segments: list[str]
    unknown_interconnect: str
    # per strategy, one list per communicator of the algorithms its collectives connect
    communicators: dict[str, Annotated[list[list[Algorithm]], Rules(max_length=64)]]
    speeds: Annotated[list[SpeedRow], Rules(min_length=1)]
    link: Annotated[list[LinkRow], Rules(min_length=1)]

    def link_row(self, interconnect: str) -> LinkRow | None:
        return next((r for r in self.link if r.interconnect == interconnect), None)

    def link_of(self, gpu: GpuProfile) -> tuple[str, LinkRow]:
        """The card's interconnect (the unknown one's for a card the catalog gives none) and its row, the unknown
        interconnect's where the table has no row for it."""
        interconnect = gpu.interconnect or self.unknown_interconnect
        row = self.link_row(interconnect) or self.link_row(self.unknown_interconnect)
        assert row is not None  # _table checks the unknown interconnect's row
        return interconnect, row

    def speed_array(self, compute_capability: str) -> list[float]:
        cc = sm_tuple(compute_capability)
        rows = [r for r in self.speeds if cuda_tuple(r.min_compute_capability) <= cc]
        return max(rows or self.speeds, key=lambda r: cuda_tuple(r.min_compute_capability)).speeds


def sm_tuple(compute_capability: str) -> tuple[int, int]:
    """(major, minor) of a card's compute capability; (0, 0) where the catalog gives none."""
    return cuda_tuple(compute_capability) if compute_capability else (0, 0)


def nccl_table() -> NcclTable:
    """The shipped table; a nccl.toml in $VRAM_PLAN_PROFILES replaces it."""
    return _nccl_table(tuple(profile_dirs()))


@lru_cache(maxsize=4)  # keyed by the folders, so a user's folder set later is read; `plan` asks hundreds of times
def _nccl_table(dirs: tuple[Path, ...]) -> NcclTable:
    path = next(p for p in (d / "nccl.toml" for d in reversed(dirs)) if p.is_file())
    return cached(path, _table)


def _table(path: Path) -> NcclTable:
    table = validated(NcclTable, read_toml(path), str(path))
    if table.link_row(table.unknown_interconnect) is None:
        raise ProfileError(f"{path}: unknown_interconnect {table.unknown_interconnect!r} has no [[link]] row")
    return table


def align_up(n: int, to: int) -> int:
    """`n` rounded up to a multiple of `to`."""
    return -(-n // to) * to


def _pow2_up(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def coll_channels(bandwidth: float, compute_capability: str, table: NcclTable) -> int:
    """comm->nChannels: NCCL's ring search over `bandwidth` (its GB/s), condensed to one GPU's links (every ring edge
    of one node crosses them once per channel), then connect.cc's doubling."""
    speeds = table.speed_array(compute_capability)
    speed = next((s for s in speeds if s <= bandwidth), speeds[-1])
    search_max = table.max_channels // 2  # ringGraph->maxChannels, init.cc:1177
    n = max(min(int(bandwidth // speed), search_max), 1)
    sm = sm_tuple(compute_capability)
    if speed >= _DUP_MIN_SPEED and not (sm > (8, 0) and speed < 50.0 and n > 4):
        n = min(2 * n, search_max)
    # pass 2 (search.cc:1264-1269) only raises the speed of these channels, never their number
    return min(table.max_channels, 2 * n)


@dataclass(frozen=True)
class NcclFigure:
    """NCCL's device memory on one rank, its parts (bytes) and where the figure comes from (in words)."""

    bytes: int
    parts: dict[str, int]
    source: str
    summary: str = ""  # the source without its citations: what a verdict's note says


def transport_of(gpu: GpuProfile, table: NcclTable) -> Literal["p2p", "shm"]:
    """How NCCL connects two such cards: P2P, or host shared memory where the driver offers no P2P."""
    return "shm" if gpu.segment in table.shm_segments else "p2p"


def _nvls_channels(compute_capability: str, table: NcclTable) -> int:
    sm = sm_tuple(compute_capability)
    if sm >= (10, 0):
        return table.nvls_channels_sm100
    return table.nvls_channels_sm90 if sm >= (9, 0) else 0


def communicator_bytes(num_gpus: int, row: LinkRow, compute_capability: str, transport: str, table: NcclTable,
                       algorithms: Sequence[str]) -> dict[str, int]:
    """One communicator's device bytes on an inner rank of `num_gpus` on one node, by part: what init allocates, and
    the connections of each of `algorithms` (NCCL connects an algorithm only when a collective first picks it)."""
    channels = coll_channels(row.bandwidth, compute_capability, table)
    gran = table.granularity_bytes
    parts = {"init": gran * (table.device_allocs_per_comm + table.device_allocs_per_channel * _pow2_up(channels))}
    if transport == "p2p":
        buffers = table.ll_buffer_bytes + table.ll128_buffer_bytes + table.simple_buffer_bytes
        pair = (align_up(table.connection_struct_bytes + buffers, table.ipc_align_bytes)
                + align_up(table.connection_struct_bytes, table.ipc_align_bytes))
        if "ring" in algorithms:
            parts["ring"] = channels * pair
        if "tree" in algorithms:
            parts["tree"] = channels * pair if num_gpus >= 3 else 0
    nvls = _nvls_channels(compute_capability, table) if row.nvswitch and transport == "p2p" else 0
    if nvls:
        # ncclNvlsSetup runs at init even with runtime connect: the credits and the nvlsDevPeers; the buffers wait
        parts["nvls_init"] = gran + nvls * gran
        if "nvls" in algorithms:
            parts["nvls"] = align_up(nvls * 2 * table.nvls_chunk_bytes * table.steps * num_gpus, gran)
    return parts


def _connected(lists: list[list[Algorithm]], nvls: bool) -> str:
    """What each communicator connects, in words: "ring+NVLS and ring" (no NVLS where the board has none)."""
    return " and ".join("+".join("NVLS" if a == "nvls" else a for a in algorithms if nvls or a != "nvls") or "nothing"
                        for algorithms in lists)


def nccl_figure(gpu: GpuProfile, num_gpus: int, strategy: Strategy) -> NcclFigure:
    """NCCL's device memory on each rank of `num_gpus` cards like `gpu` under `strategy`: zero on one GPU."""
    table = nccl_table()
    lists = table.communicators.get(strategy, []) if num_gpus > 1 else []
    if not lists:
        return NcclFigure(0, {}, "one GPU: no NCCL communicator")
    interconnect, row = table.link_of(gpu)
    transport = transport_of(gpu, table)
    parts: dict[str, int] = {}
    for algorithms in lists:
        for part, n in communicator_bytes(num_gpus, row, gpu.compute_capability, transport, table,
                                          algorithms).items():
            parts[part] = parts.get(part, 0) + n
    total = sum(parts.values())
    channels = coll_channels(row.bandwidth, gpu.compute_capability, table)
    where = ("buffers in host memory (shm: no P2P between GeForce cards)" if transport == "shm" else
             "P2P buffers" + (" (cards under one PCIe switch; across CPU sockets NCCL takes shm, less on the card)"
                              if interconnect.startswith("pcie") else ""))
    card = interconnect if gpu.interconnect else f"card not in the catalog, taken as {interconnect}"
    comms = len(lists)
    connected = _connected(lists, "nvls_init" in parts)
    layout = (f": {channels} channels, {where}, {comms} communicator{'s' * (comms > 1)} ({strategy}) connecting "
              f"{connected} = {total / MiB:.0f} MiB per GPU; the topology "
              "NCCL detects and NCCL_* settings move it (profiles/nccl.toml)")
    return NcclFigure(total, parts, f"NCCL {table.release} defaults for {card} ({row.how})" + layout,
                      f"NCCL {table.release} defaults for {card}" + layout)


def nccl_note(figure: NcclFigure) -> str:
    """The one note line a multi-GPU verdict carries about NCCL's memory."""
    return f"NCCL buffers {figure.bytes / GiB:.2f} GiB per GPU: {figure.summary or figure.source}"
