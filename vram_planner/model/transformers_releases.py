"""What each transformers release does that decides memory, read from profiles/transformers.toml.

The trace runs the installed transformers; the analytic model reads the row of the same release, so the two agree
whichever release a user (or CI) installed, and a new release is a row of the table, not a red test suite.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from vram_planner.errors import ProfileError
from vram_planner.model.trl_releases import installed_version, parse_version, version_tuple
from vram_planner.profile_cache import cached
from vram_planner.profiles import profile_dirs, read_toml, validated
from vram_planner.validation import Rules

_RELEASE = r"^\d+\.\d+\.\d+$"


@dataclass(frozen=True, kw_only=True)
class TransformersRelease:
    """The memory-relevant behaviour of a range of transformers releases."""

    __pydantic_config__ = {"extra": "forbid"}

    min_version: Annotated[str, Rules(pattern=_RELEASE)]
    below_version: Annotated[str, Rules(pattern=_RELEASE)]
    kv_values_dtype: Literal["keys", "values"]
    cache_argument: Literal["past_key_values", "cache"]
    sdpa_unsupported: tuple[str, ...] = ()
    # the names ...ForCausalLM.forward honours to project only the last positions; another is dropped silently
    logits_to_keep_names: tuple[Literal["num_logits_to_keep", "logits_to_keep"], ...]
    # "shared": one float mask for every layer; "per_layer": a boolean mask SDPA copies to a float one in each layer
    attention_mask: Literal["shared", "per_layer"]
    sdpa_contiguous_inputs: bool  # SDPA's query, key and value made contiguous first (before 4.56)
    sdpa_gqa_without_mask: bool  # no mask: k and v reach SDPA unrepeated, with enable_gqa (4.54 on)
    # a decoding step's single query runs on the key/value heads (pack_gqa, 5.23 on) even with a mask; before, SDPA's
    # repeat_kv copies the layer's whole cache to every query head at each step
    sdpa_decoding_gqa: bool
    rotary_buffers: int  # float32 frequency buffers per rotary embedding: inv_freq, and from 5.0 a clone of it
    # what a sliding-window layer's cache holds once the prefill has run: "window" tokens, or the whole "prompt"
    # (4.56 on: DynamicSlidingWindowLayer keeps a view of the prompt's concatenated keys and values until the first
    # decoding step replaces it)
    sliding_prefill_storage: Literal["window", "prompt"] = "window"
    # from_pretrained kernelizes by default (5.25 on): on CUDA the Hub's RMSNorm and rotary kernels replace the
    # torch code where the modeling code is decorated for them (Family.hub_rms_norm, Family.hub_rotary)
    hub_kernels: bool = False
    # what kernelizing (by default, or use_kernels=True) replaces in training on CUDA, read from the release's
    # integrations/hub_kernels.py; empty where it was not read, so use_kernels=True is not planned there
    hub_training_kernels: tuple[Literal["RMSNorm", "rotary_pos_emb"], ...] = ()
    # what TrainingArguments (so GRPOConfig) calls gradient checkpointing and its kwargs: "activation_checkpointing"
    # from 5.23, where "gradient_checkpointing" became an alias that warns and goes in 6.0
    checkpointing_argument: Literal["gradient_checkpointing", "activation_checkpointing"] = "gradient_checkpointing"
    version: str = ""  # the release planned for, filled in by `transformers_release`

    def supports_sdpa(self, model_type: str) -> bool:
        return model_type not in self.sdpa_unsupported

    def honours(self, argument: str) -> bool:
        """Whether the model's forward projects only the last positions when TRL passes `argument`."""
        return argument in self.logits_to_keep_names


@lru_cache(maxsize=1)
def transformers_releases() -> list[TransformersRelease]:
    rows = []
    for folder in profile_dirs():
        path = folder / "transformers.toml"
        if path.is_file():
            rows.extend(cached(path, _release_rows))
    return rows


def _release_rows(path: Path) -> list[TransformersRelease]:
    return [validated(TransformersRelease, row, f"{path} release #{i + 1}")
            for i, row in enumerate(read_toml(path).get("release", []))]


def known_transformers_version(version: str) -> str:
    """`version` normalised ('5.24' -> '5.24.0'); ValueError, worded to follow "should be", when it is not a
    version the table covers."""
    parsed = parse_version(version)
    if parsed is None:
        raise ValueError("a transformers version number like 5.24.0")
    if _row(parsed[0]) is None:
        raise ValueError(f"a transformers release vram-plan knows ({_known_range()})")
    return parsed[1]


@lru_cache(maxsize=16)
def transformers_release(version: str | None, major: int) -> TransformersRelease:
    """The behaviour of `version` (--transformers-version), else of the installed transformers when it is of the TRL
    release's generation (`major`, the transformers of its time), else of the newest release of that generation the
    table knows (a TRL release planned for its own time, or no transformers installed: `plan` does not need it)."""
    if version is None:
        installed = installed_version("transformers")
        parsed = parse_version(installed) if installed else None
        if parsed is not None and parsed[0][0] == major and _row(parsed[0]) is not None:
            version = parsed[1]
    if version is not None:
        normalised = known_transformers_version(version)
        return replace(_row(version_tuple(normalised)), version=normalised)  # type: ignore[arg-type]
    of_major = [r for r in transformers_releases() if version_tuple(r.min_version)[0] == major]
    if not of_major:
        raise ProfileError(f"no row of transformers.toml covers transformers {major}.x")
    newest = max(of_major, key=lambda r: version_tuple(r.min_version))
    return replace(newest, version=newest.min_version)


def _row(release: tuple[int, int, int]) -> TransformersRelease | None:
    for row in reversed(transformers_releases()):  # a user's rows (read last) override the shipped ones
        if version_tuple(row.min_version) <= release < version_tuple(row.below_version):
            return row
    return None


def _known_range() -> str:
    rows = transformers_releases()
    oldest = min(rows, key=lambda r: version_tuple(r.min_version)).min_version
    below = max(rows, key=lambda r: version_tuple(r.below_version)).below_version
    return f"{oldest} up to {below}, not included"
