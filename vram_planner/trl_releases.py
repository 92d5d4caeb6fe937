"""What each TRL release does that decides memory, read from profiles/trl.toml."""

from __future__ import annotations

from functools import lru_cache
from importlib import metadata
from typing import Literal

from pydantic import BaseModel, ConfigDict

from vram_planner.errors import VramPlanError
from vram_planner.profiles import profile_dirs, read_toml

NEWEST_KNOWN = "1.16.0"


class TrlRelease(BaseModel):
    """The memory-relevant behaviour of a range of TRL releases."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_version: str
    below_version: str
    lm_head: Literal["fused_chunked", "full_logits"]
    lm_head_token_chunk: int = 4096
    lm_head_vocab_chunk: int = 32768
    liger: Literal["fused_loss", "chunked_logprobs", "layer_kernels"]
    default_beta: float
    default_max_completion_length: int
    default_vllm_mode: Literal["colocate", "server"]
    accepts_max_prompt_length: bool
    default_model_dtype: Literal["float32", "bfloat16", "float16"]
    version: str = ""  # the release asked for, filled in by `trl_release`


def version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@lru_cache(maxsize=1)
def trl_releases() -> list[TrlRelease]:
    rows = []
    for folder in profile_dirs():
        path = folder / "trl.toml"
        if path.is_file():
            rows.extend(TrlRelease.model_validate(r) for r in read_toml(path).get("release", []))
    return rows


def installed_trl_version() -> str | None:
    """The installed TRL's version, read from its metadata (TRL itself is not imported)."""
    try:
        return metadata.version("trl")
    except metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=8)
def trl_release(version: str | None = None) -> TrlRelease:
    """The behaviour of `version`, else of the installed TRL, else of the newest release we know."""
    wanted = version or installed_trl_version() or NEWEST_KNOWN
    key = version_tuple(wanted)
    for release in trl_releases():
        if version_tuple(release.min_version) <= key < version_tuple(release.below_version):
            return release.model_copy(update={"version": wanted})
    known = sorted(trl_releases(), key=lambda r: version_tuple(r.min_version))
    raise VramPlanError(f"TRL {wanted} is outside the releases vram-plan knows "
                        f"({known[0].min_version} to below {known[-1].below_version}); pass --trl-version")
