"""What each TRL release does that decides memory, read from profiles/trl.toml."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from vram_planner.errors import ConfigError, ProfileError, field_name
from vram_planner.profile_cache import cached, remembered
from vram_planner.profiles import profile_dirs, read_toml, validated
from vram_planner.validation import Rules

# The newest TRL release the rows of profiles/trl.toml were checked against: its whole 1.16.x series is supported.
NEWEST_KNOWN = "1.16.0"
# PEP 440's public versions: a release of one to three numbers, then optional pre-, post- and dev-release tags and a
# local label (1.16.0rc1, 1.16.0.dev0, 1.16.0+cu121). Nothing else names a TRL release.
_VERSION = re.compile(r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?"
                      r"((?:[-_.]?(?:a|b|rc|alpha|beta|c|pre|preview)[-_.]?\d*)?"
                      r"(?:[-_.]?(?:post|rev|r)[-_.]?\d*)?(?:[-_.]?dev[-_.]?\d*)?(?:\+[a-z0-9]+(?:[-_.][a-z0-9]+)*)?)"
                      r"\s*$", re.IGNORECASE)
_RELEASE = r"^\d+\.\d+\.\d+$"  # the table's bounds: plain releases


@dataclass(frozen=True, kw_only=True)
class TrlRelease:
    """The memory-relevant behaviour of a range of TRL releases."""

    __pydantic_config__ = {"extra": "forbid"}

    min_version: Annotated[str, Rules(pattern=_RELEASE)]
    below_version: Annotated[str, Rules(pattern=_RELEASE)]
    default_per_device_train_batch_size: Annotated[int, Rules(gt=0)]
    default_gradient_accumulation_steps: Annotated[int, Rules(gt=0)]
    default_gradient_checkpointing: bool
    default_mixed_precision: Literal["bf16", "no"]
    default_beta: Annotated[float, Rules(ge=0)]
    default_max_prompt_length: Annotated[int | None, Rules(gt=0)] = None
    default_max_completion_length: Annotated[int, Rules(gt=0)]
    default_vllm_mode: Literal["colocate", "server"]
    default_vllm_gpu_memory_utilization: Annotated[float | None, Rules(gt=0, lt=1)] = None
    default_optim: str
    # generate()'s sampling when the knobs are unset (GRPOConfig's, or GenerationConfig's top_k where it has none);
    # top_k 0: no filter
    default_temperature: Annotated[float, Rules(gt=0)] = 1.0
    default_top_k: Annotated[int, Rules(ge=0)] = 0
    accepts_sampling_filters: bool = True  # GRPOConfig's top_p, top_k, min_p and repetition_penalty (0.16 on)
    default_model_dtype: Literal["float32", "bfloat16", "float16"]
    accepts_max_prompt_length: bool
    truncates_prompts: bool
    accepts_steps_per_generation: bool
    accepts_vllm_mode: bool
    batch_counts: Literal["prompts", "completions"]
    generation_batch: Literal["micro_batch", "accumulation"]
    num_generations_rule: Literal["none", "global_batch", "effective_batch", "generation_batch"]
    old_logps_when: Literal["never", "num_iterations", "num_iterations_or_more_steps", "off_policy",
                            "off_policy_or_vllm"]
    reference_when: Literal["always", "beta_nonzero"]
    step_structure: Literal["loss_merged", "phased"]
    transformers_major: Literal[4, 5]
    lm_head: Literal["fused_chunked", "full_logits"]
    logits_to_keep_argument: Literal["num_logits_to_keep", "logits_to_keep"] = "logits_to_keep"
    full_logits_log_probs: Literal["rows", "scaled_copy", "scaled_copy_beside_output", "scaled_in_place",
                                   "kernel"] = "scaled_copy"
    lm_head_token_chunk: int = 4096
    lm_head_vocab_chunk: int = 32768
    liger: Literal["fused_loss", "chunked_logprobs", "layer_kernels"]
    log_prob_forward_cache: Literal["model_default", "off"] = "off"
    log_prob_attention_mask: Literal["passed", "none"] = "passed"
    # how the loss pass computes the completion's entropies beside its log-probs (full logits, under no_grad):
    # "per_sequence" (entropy_from_logits over the batch in chunks of 1), "flat_rows" (over the logits reshaped to
    # rows, 128 at a time), "none" (not computed, or inside the log-prob kernel or the fused head)
    training_entropy: Literal["none", "per_sequence", "flat_rows"] = "none"
    # whether ZeRO-3's parameter coordinator keeps its module trace across TRL's gathered generation (before 1.5): then
    # every step's loss after the first prefetches up to stage3_max_live_parameters (model/zero.py)
    zero3_trace_kept_across_generation: bool = False
    # LoRA under gradient checkpointing: whether TRL makes the embedding's output require grad
    # (`model.enable_input_require_grads()`, 0.16 on), whether the checkpointing is reentrant (transformers 4's
    # default, which TRL left alone before 0.27), and whether TRL forces it reentrant under ZeRO-3 (1.9 on)
    checkpointing_input_grads: bool = True
    checkpointing_reentrant: bool = False
    peft_zero3_reentrant: bool = False
    # how the trainer sets a 4-bit model up for LoRA: PEFT's float32 adapters as get_peft_model makes them (before
    # 0.22), PEFT's prepare_model_for_kbit_training first (0.22-0.25: the unquantized weights to float32, under bf16
    # the embedding and LM head back to bfloat16, the norms left float32), or the trainable parameters cast to
    # bfloat16 (0.26 on)
    qlora_setup: Literal["peft_default", "prepare_kbit_training", "bf16_adapters"] = "bf16_adapters"
    version: str = ""  # the release asked for, filled in by `trl_release`
    note: str = ""  # why this row was chosen when it is not the installed TRL's own (for the verdict's notes)


def version_tuple(version: str) -> tuple[int, int, int]:
    """The release numbers of a version, padded to three: '0.14' is (0, 14, 0), '1.16.0rc1' is (1, 16, 0)."""
    parsed = parse_version(version)
    if parsed is None:
        raise ProfileError(f"{version!r} is not a TRL version number; write it like {NEWEST_KNOWN}")
    return parsed[0]


def parse_version(text: str) -> tuple[tuple[int, int, int], str] | None:
    """The release numbers and the normalised version ('0.14' -> '0.14.0'; tags kept: '1.16.0.dev0'), or None.

    A pre-release, release candidate or dev build is planned as the release it leads to: it runs that release's
    code, give or take the fixes still to come.
    """
    match = _VERSION.match(text) if isinstance(text, str) else None
    if match is None:
        return None
    numbers = tuple(int(n or 0) for n in match.group(1, 2, 3))
    return numbers, ".".join(map(str, numbers)) + match.group(4)  # type: ignore[return-value]


@lru_cache(maxsize=1)
def trl_releases() -> list[TrlRelease]:
    rows = []
    for folder in profile_dirs():
        path = folder / "trl.toml"
        if path.is_file():
            rows.extend(cached(path, _release_rows))
    return rows


def _release_rows(path: Path) -> list[TrlRelease]:
    return [validated(TrlRelease, row, f"{path} release #{i + 1}")
            for i, row in enumerate(read_toml(path).get("release", []))]


def installed_trl_version() -> str | None:
    """The installed TRL's version, read from its metadata (TRL itself is not imported)."""
    return installed_version("trl")


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution (trl, transformers), read from its metadata, or None.

    Kept for as long as the import path's folders stay as they are (installing, upgrading or removing a package
    changes its folder's modification time, as Python's own import system counts on): importlib.metadata, with the
    email package it reads metadata with, was a sixth of `plan`'s start-up. Each import path keeps its own entry (the
    `vram-plan` script and `python -m vram_planner` see different ones).
    """
    return remembered(("installed version", distribution, *sys.path), _import_path_state(),
                      lambda: _read_installed_version(distribution))


def _import_path_state() -> tuple[int | None, ...]:
    """The modification time of each folder of the import path (None where there is none)."""
    state = []
    for entry in sys.path:
        try:
            state.append(os.stat(entry or ".").st_mtime_ns)
        except OSError:
            state.append(None)
    return tuple(state)


def _read_installed_version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def supported_range() -> str:
    """The TRL releases vram-plan plans for, in words: the table's oldest row up to the newest release it knows."""
    oldest, newest = _bounds()
    return f"{'.'.join(map(str, oldest))} to {newest[0]}.{newest[1]}.x"


def _bounds() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The oldest release of the table, and the newest release known: NEWEST_KNOWN, or a newer row a user added."""
    starts = [version_tuple(r.min_version) for r in trl_releases()]
    return min(starts), max([version_tuple(NEWEST_KNOWN), *starts])


def _supported(release: tuple[int, int, int]) -> bool:
    """From the oldest row to the newest known release's whole minor series (1.16.x)."""
    oldest, newest = _bounds()
    return oldest <= release and release[:2] <= newest[:2]


@lru_cache(maxsize=8)
def trl_release(version: str | None = None) -> TrlRelease:
    """The behaviour of `version` (--trl-version), else of the installed TRL, else of the newest release we know.

    An explicit version outside the supported range is refused. An installed TRL outside it is planned as the
    newest release vram-plan knows, with a note: plan and check do not run TRL, a TRL newer than the table most
    likely keeps the newest row's behaviour, and one older than 0.14 has no GRPOTrainer, so the run will need an
    upgrade anyway; refusing would leave the planner unusable until the user changes a package it does not need.
    """
    if version is not None:
        parsed = parse_version(version)
        if parsed is None:
            raise ConfigError([f"{field_name('trl_version')} {version!r} is not a version number; write it like "
                               f"{NEWEST_KNOWN} "
                               f"(vram-plan knows TRL {supported_range()})"])
        if not _supported(parsed[0]):
            raise ConfigError([f"{field_name('trl_version')} {parsed[1]} is outside the TRL releases vram-plan knows "
                               f"({supported_range()}); choose one of those"])
        return replace(_row(parsed[0]), version=parsed[1])
    installed = installed_trl_version()
    parsed = parse_version(installed) if installed else None
    if parsed is not None and _supported(parsed[0]):
        return replace(_row(parsed[0]), version=parsed[1])
    newest = _bounds()[1]
    newest_text = ".".join(map(str, newest))
    note = ""
    if installed is not None:
        note = (f"the installed TRL {installed} is outside the releases vram-plan knows ({supported_range()}): "
                f"planned for TRL {newest_text}, the newest it knows; pass --trl-version to plan for another")
    return replace(_row(newest), version=newest_text, note=note)


def _row(release: tuple[int, int, int]) -> TrlRelease:
    for row in reversed(trl_releases()):  # a user's rows (read last) override the shipped ones they overlap
        if version_tuple(row.min_version) <= release < version_tuple(row.below_version):
            return row
    raise ProfileError(f"no row of trl.toml covers TRL {'.'.join(map(str, release))}: the table has a gap")
