"""Data files: the GPU catalog, the model catalog and where to find them.

Shipped profiles live in the package (`vram_planner.profile_data`, the repository's `profiles/` folder). A folder
named by $VRAM_PLAN_PROFILES may add or override entries with files of the same layout.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from dataclasses import dataclass, field
from typing import Annotated

from vram_planner.errors import ProfileError, UnknownNameError, closest_names, field_name, json_kind, short_repr
from vram_planner.profile_cache import cached
from vram_planner.units import GiB, MiB, binary_spelling, looks_like_size, parse_size_bytes
from vram_planner.validation import Rules, error_message, validate

PROFILES_ENV = "VRAM_PLAN_PROFILES"
HOME_ENV = "VRAM_PLAN_HOME"
# The CUDA runtime reports less than nvidia-smi's memory.total (the driver keeps some back); on cards we know
# the gap was 1-2%, so a card missing from the catalog is taken at 98% of what nvidia-smi reports.
UNKNOWN_CARD_USABLE_FRACTION = 0.98


@dataclass(frozen=True, kw_only=True)
class GpuProfile:
    """One CUDA card as the CUDA runtime sees it."""

    __pydantic_config__ = {"extra": "forbid"}

    name: str
    aliases: list[str] = field(default_factory=list)
    cuda_name: str = ""
    marketed_memory_gb: float | None = None
    total_memory_gib: Annotated[float, Rules(gt=0)]
    compute_capability: str = ""
    sm_count: Annotated[int | None, Rules(gt=0, le=10_000)] = None  # multiprocessors: they size the CUDA context
    bf16: bool = True
    flash_attention_2: bool = False
    segment: Literal["consumer", "laptop", "workstation", "datacenter", "custom"] = "custom"
    capacity_source: Literal["measured", "estimated", "user"] = "estimated"
    source: str = ""
    note: str = ""  # what a verdict on this card says of it (a size given in GB: how it was read)
    # Speed figures from the vendor's datasheet (profiles/gpus.toml); None where the catalog has none (a size given
    # on the command line): the step-time model then has nothing to predict with.
    memory_bandwidth_gb_s: Annotated[float | None, Rules(gt=0, le=10**6)] = None
    bf16_tflops: Annotated[float | None, Rules(gt=0, le=10**6)] = None  # dense, FP32 accumulate
    fp16_tflops: Annotated[float | None, Rules(gt=0, le=10**6)] = None  # dense, FP32 accumulate
    fp32_tflops: Annotated[float | None, Rules(gt=0, le=10**6)] = None  # without tensor cores
    interconnect: Literal["nvlink2", "nvlink3", "nvlink4", "nvlink5", "nvlink-bridge", "pcie3", "pcie4", "pcie4-x8",
                          "pcie5", "pcie5-x8"] | None = None
    interconnect_gb_s: Annotated[float | None, Rules(gt=0, le=10**6)] = None  # per direction

    @property
    def capacity_bytes(self) -> int:
        return round(self.total_memory_gib * GiB)

    @property
    def label(self) -> str:
        return self.cuda_name or self.name

    @classmethod
    def from_name(cls, name: str) -> GpuProfile:
        """A catalog name or alias, `auto` (the local CUDA device) or a size such as `24GiB`."""
        if not isinstance(name, str) or not name.strip():
            raise ProfileError(f"{field_name('gpu')} needs a catalog name (`vram-plan gpus` lists them), auto, or a "
                               "size like 24GiB")
        key = name.strip().lower()
        if key == "auto":
            return local_gpu_profile()
        if looks_like_size(key):
            size = parse_size_bytes(name)
            note = ""
            binary = binary_spelling(name)
            if binary is not None:
                note = (f"The card's size {name.strip()} is read in powers of 1000, {size:,} bytes ({size / GiB:.2f} "
                        f"GiB); a card sold with that memory has {binary} (CUDA reports a little less): give its "
                        f"catalog name (vram-plan gpus) or {binary}")
            return cls(name=name.strip(), total_memory_gib=size / GiB, bf16=True, flash_attention_2=True,
                       source="size given on the command line (assumed bf16 and FlashAttention-2 capable)",
                       capacity_source="user", note=note)
        catalog = gpu_catalog()
        if key in catalog:
            return catalog[key]
        spelled = gpu_spellings()
        cards = spelled.get(card_spelling(name), [])
        if len(cards) == 1:
            return cards[0]
        hint = "(`vram-plan gpus` lists them; a size like 24GiB works for any card)"
        if cards:  # nvidia-smi's name of a card sold with several memory sizes
            raise ProfileError(f"{short_repr(name.strip(), 60)} names {len(cards)} catalog cards of different memory: "
                               f"{', '.join(g.name for g in cards)}; name one {hint}")
        suggestions = [g.name for spelling in closest_names(card_spelling(name), spelled, limit=6)
                       for g in spelled[spelling]]
        raise UnknownNameError("GPU", name, sorted({g.name for g in catalog.values()}), hint=hint,
                               suggestions=list(dict.fromkeys(suggestions))[:3] if card_spelling(name) else None)


def local_gpu_profile() -> GpuProfile:
    """The first local CUDA device, matched to the catalog by name and memory size."""
    from vram_planner.local_gpu import detect_local_gpu

    name, total_mib = detect_local_gpu()
    total_bytes = float(total_mib) * MiB
    same_name = [g for g in gpus() if g.cuda_name.lower() == name.lower()]
    if same_name:
        return min(same_name, key=lambda g: abs(g.capacity_bytes - total_bytes))
    return GpuProfile(name=name, cuda_name=name, total_memory_gib=total_bytes * UNKNOWN_CARD_USABLE_FRACTION / GiB,
                      source=f"nvidia-smi memory.total {total_mib} MiB x {UNKNOWN_CARD_USABLE_FRACTION}",
                      capacity_source="estimated")


@dataclass(frozen=True, kw_only=True)
class ModelEntry:
    """One catalog model: where its config.json facts are and what it is called."""

    __pydantic_config__ = {"extra": "forbid"}

    name: str
    hub_id: str
    aliases: list[str] = field(default_factory=list)
    family: str = ""
    params_label: str = ""
    source: str = ""
    config_path: Path


def profile_dirs() -> list[Path]:
    """Shipped profiles first, then the user's folder (later entries override earlier ones)."""
    from vram_planner import profile_data  # the package's own folder (importlib.resources costs 9 ms of imports)

    dirs = [Path(next(iter(profile_data.__path__)))]
    user = os.environ.get(PROFILES_ENV)
    if user:
        dirs.append(Path(user).expanduser())
    return dirs


def data_home() -> Path:
    """Where vram-plan writes what it measures (calibrations)."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV]).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "vram-plan"


def read_toml(path: Path) -> dict[str, Any]:
    import tomllib  # profile_cache keeps what the loaders make of a file: this runs when a file is new or changed

    from vram_planner.files import MAX_SETTINGS_BYTES, read_text

    try:
        return tomllib.loads(read_text(path, MAX_SETTINGS_BYTES, kind="a TOML file"))
    except ValueError as exc:  # tomllib.TOMLDecodeError is a ValueError
        raise ProfileError(f"cannot read {path}: {exc}") from exc
    except RecursionError as exc:  # tomllib recurses into nested arrays and inline tables
        raise ProfileError(f"cannot read {path}: its arrays or tables nest too deeply to read") from exc


def read_json(path: Path) -> Any:
    """A JSON file's value; ProfileError in one line when it cannot be read or is not JSON."""
    from vram_planner.files import MAX_DATA_FILE_BYTES, load_json, read_text

    text = read_text(path, MAX_DATA_FILE_BYTES, kind="a JSON file")
    if not text.strip():
        raise ProfileError(f"{path} is empty; it should hold a JSON object")
    try:
        return load_json(text, str(path))
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path} is not valid JSON: {exc}") from exc


def validated(spec: type, data: Any, where: str) -> Any:
    """`data` as a `spec` (validated by pydantic), or one ProfileError line naming `where`, the field and the
    problem."""
    from pydantic import ValidationError

    try:
        return validate(spec, data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        got = first.get("input")
        shown = "" if isinstance(got, (dict, list)) and loc else f" (got {short_repr(got, 60)})"
        raise ProfileError(f"{where}: {loc + ': ' if loc else ''}{error_message(first)}{shown}") from exc


@lru_cache(maxsize=1)
def gpu_catalog() -> dict[str, GpuProfile]:
    """Every catalog GPU by lower-case name and alias."""
    by_key: dict[str, GpuProfile] = {}
    for folder in profile_dirs():
        path = folder / "gpus.toml"
        if not path.is_file():
            continue
        for gpu in cached(path, _catalog_gpus):
            for key in [gpu.name, *gpu.aliases]:
                by_key[key.lower()] = gpu
    return by_key


def card_spelling(name: str) -> str:
    """A card's name as any of its spellings reduces to: case, spaces and dashes, the 'NVIDIA'/'GeForce' prefixes and
    the 'GPU' suffix left out. Users paste nvidia-smi's 'NVIDIA GeForce RTX 4060 Laptop GPU' or type 'rtx-4060-laptop'
    and 'RTX 4090'."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    for prefix in ("nvidia", "geforce"):
        key = key.removeprefix(prefix)
    return key.removesuffix("gpu")


def gpu_spellings() -> dict[str, list[GpuProfile]]:
    """The catalog cards by the spelling (card_spelling) of each name and alias, then of each CUDA name no name or
    alias spells: the catalog's aliases choose the card a short name means ('rtx3080' the 10 GB one), and a CUDA name
    two cards share (a laptop chip sold with 8 and 16 GB) leads to both. Made on a miss of the exact names only, so
    not cached."""
    by_spelling: dict[str, dict[str, GpuProfile]] = {}
    for gpu in gpus():
        for spelled in {card_spelling(k) for k in [gpu.name, *gpu.aliases]}:
            by_spelling.setdefault(spelled, {})[gpu.name] = gpu
    by_cuda_name: dict[str, dict[str, GpuProfile]] = {}
    for gpu in gpus():
        if gpu.cuda_name and card_spelling(gpu.cuda_name) not in by_spelling:
            by_cuda_name.setdefault(card_spelling(gpu.cuda_name), {})[gpu.name] = gpu
    return {spelled: list(cards.values()) for spelled, cards in {**by_spelling, **by_cuda_name}.items()}


def _catalog_gpus(path: Path) -> list[GpuProfile]:
    return [validated(GpuProfile, row, f"{path} gpu #{i + 1}") for i, row in enumerate(read_toml(path).get("gpu", []))]


def gpus() -> list[GpuProfile]:
    """Distinct catalog GPUs, smallest capacity first."""
    unique = {g.name: g for g in gpu_catalog().values()}
    return sorted(unique.values(), key=lambda g: (g.capacity_bytes, g.name))


@lru_cache(maxsize=1)
def model_catalog() -> dict[str, ModelEntry]:
    """Every catalog model by lower-case name, alias and hub id."""
    by_key: dict[str, ModelEntry] = {}
    for folder in profile_dirs():
        path = folder / "models.toml"
        if not path.is_file():
            continue
        for entry in cached(path, _catalog_models):
            for key in [entry.name, entry.hub_id, *entry.aliases]:
                by_key[key.lower()] = entry
    return by_key


def _catalog_models(path: Path) -> list[ModelEntry]:
    return [validated(ModelEntry, {**row, "config_path": path.parent / "models" / f"{row.get('name')}.json"},
                      f"{path} model #{i + 1}") for i, row in enumerate(read_toml(path).get("model", []))]


def models() -> list[ModelEntry]:
    unique = {m.name: m for m in model_catalog().values()}
    return sorted(unique.values(), key=lambda m: m.name.lower())


def model_config(name: str) -> tuple[dict[str, Any], str, str]:
    """The config.json dict behind a model name, with the name to show and the hub id (as model.resolve reads)."""
    if not isinstance(name, str) or not name.strip():
        raise ProfileError(f"{field_name('model')} needs a catalog name, a config.json, a model folder or a hub id "
                           "(`vram-plan models` lists the catalog)")
    text = name.strip()
    entry = model_catalog().get(text.lower())
    if entry is not None:
        return _config_object(read_json(entry.config_path), entry.config_path), entry.name, entry.hub_id
    path = Path(text).expanduser()
    if _exists(path):
        config_file = path / "config.json" if path.is_dir() else path
        if path.is_dir() and not os.access(path, os.R_OK | os.X_OK):
            raise ProfileError(f"cannot read the model folder {path}: permission denied")
        if path.is_dir() and not config_file.is_file():  # anything else, a device too, read_json words
            raise ProfileError(f"{path} has no config.json")
        # what from_pretrained takes: the folder of a config.json (GRPOTrainer(model=...) and `run` load it)
        loadable = config_file.parent if config_file.name == "config.json" else path
        return _config_object(read_json(config_file), config_file), str(path), str(loadable)
    if text.count("/") == 1 and not text.startswith((".", "/")) and not text.endswith(".json"):
        from vram_planner.hub import fetch_hub_config

        return fetch_hub_config(text), text, text
    raise UnknownNameError("model", name, sorted({m.name for m in model_catalog().values()}),
                           hint="(`vram-plan models` lists them; a config.json, a model folder or a hub id works too)")


def _exists(path: Path) -> bool:
    """Whether a path exists; a name no file system can hold (too long, a NUL byte) does not."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def _config_object(config: Any, path: Path) -> dict[str, Any]:
    if not isinstance(config, dict):
        raise ProfileError(f"{path} is not a config.json: it holds a JSON {json_kind(config)}, not an object")
    return config
