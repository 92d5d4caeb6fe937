"""PYTORCH_CUDA_ALLOC_CONF, read the way torch 2.13 reads it, with the keys torch 2.15 added.

torch splits the text into tokens at `,` `:` `[` `]`, drops whitespace (ConfigTokenizer, c10/core/AllocatorConfig.h),
and hands it to two parsers: AcceleratorAllocatorConfig::parseArgs (c10/core/AllocatorConfig.cpp: the device
allocator's keys) and CUDAAllocatorConfig::parseArgs (c10/cuda/CUDAAllocatorConfig.cpp: backend, pinned-memory and
locking keys); a key neither knows is refused. The limits below are torch's own checks. Where torch is lenient by
accident (std::stoull reads "-5" or "25.9" as a number) this parser asks for a plain whole number instead.

torch 2.15 added `expandable_segments_reserve` and `expandable_segments_reserve_by_class` (the address space each
expandable segment reserves: c10/cuda/CUDAAllocatorConfig.h of torch 2.15, ExpandableSegmentReserveSpec and
clamp_reserve_bytes; the key names from its libc10_cuda). torch 2.14 and earlier refuse them; torch 2.15 ignores a
malformed reserve with a warning, which this parser refuses instead, so that the plan is made for the setting meant.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from vram_planner.allocator.sizes import K_LARGE_BUFFER, K_MIN_LARGE_ALLOC, MiB, ROUNDUP_INTERVALS, SIZE_MAX
from vram_planner.errors import ConfigError, closest_names, short_repr

ENV_VAR = "PYTORCH_CUDA_ALLOC_CONF"
# The order torch 2.13 reads them in (with both set, torch._C._accelerator_getAllocatorSettings() shows the first);
# the second is the device-generic name newer releases document.
ENV_VARS = (ENV_VAR, "PYTORCH_ALLOC_CONF")

# Keys that change what the device allocator reserves: modeled.
MODELED_KEYS = ("max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb",
                "garbage_collection_threshold", "roundup_power2_divisions", "expandable_segments",
                "per_process_memory_fraction", "backend", "expandable_segments_reserve")
# Keys torch accepts that leave device memory as it is (pinned host memory, locking, CUDA-graph capture, when an
# out-of-memory error is raised): checked like torch checks them, then ignored.
IGNORED_KEYS = ("pinned_use_background_threads", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
                "release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
                "pinned_use_hip_host_register", "graph_capture_record_stream_reuse", "pinned_reserve_segment_size_mb",
                "pinned_num_register_threads", "pinned_free_catch_all", "throw_on_cudamalloc_oom",
                "expandable_segments_reserve_by_class")
# Read by torch 2.15 and later only.
TORCH_215_KEYS = ("expandable_segments_reserve", "expandable_segments_reserve_by_class")
KNOWN_KEYS = MODELED_KEYS + IGNORED_KEYS
_BOOL_KEYS = {"expandable_segments", "pinned_use_background_threads", "release_lock_on_cudamalloc",
              "release_lock_on_hipmalloc", "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
              "graph_capture_record_stream_reuse", "pinned_free_catch_all", "throw_on_cudamalloc_oom"}
_EXAMPLE = "e.g. expandable_segments:True,max_split_size_mb:128"
_PUNCTUATION = (",", ":", "[", "]")
_FIELDS = {"max_split_size_mb": "max_split_size_bytes", "max_non_split_rounding_mb": "max_non_split_rounding_bytes"}
# parseReserveSpec: a positive, finite fraction of the device's memory (0.5), or GiB with a G suffix (40G)
_RESERVE = re.compile(r"[+]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?([gG]?)")


@dataclass(frozen=True)
class AllocatorConf:
    """The settings of the native caching allocator that decide what it reserves, in bytes."""

    max_split_size_bytes: int = SIZE_MAX  # blocks this large or larger are never split ("oversize")
    max_non_split_rounding_bytes: int = K_LARGE_BUFFER  # how much larger an oversize block may be than its request
    large_segment_size_bytes: int = K_LARGE_BUFFER  # the segment for requests of 1-10 MiB
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS  # per interval 1 MiB..64 GiB; 0 = off
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    # torch 2.15's expandable_segments_reserve, a fraction of the device's memory or bytes (0: the whole 9/8)
    expandable_segments_reserve_fraction: float = 0.0
    expandable_segments_reserve_bytes: int = 0
    per_process_memory_fraction: float = 1.0
    text: str = ""  # the text it was read from
    ignored_keys: tuple[str, ...] = field(default=())

    def notes(self) -> list[str]:
        """What a reader of this configuration should know about how it acts."""
        notes = []
        if self.garbage_collection_threshold > 0 and self.per_process_memory_fraction >= 1.0:
            notes.append("garbage_collection_threshold acts only under a per-process memory fraction below 1 "
                         "(per_process_memory_fraction or torch.cuda.set_per_process_memory_fraction); "
                         "without one torch never runs it")
        if self.has_expandable_segments_reserve:
            notes.append("expandable_segments_reserve is read by torch 2.15 and later (earlier releases refuse the "
                         "key); no single tensor can be larger than the address space it gives each segment" +
                         ("" if self.expandable_segments else ", and it acts only with expandable_segments:True"))
        if "expandable_segments_reserve_by_class" in self.ignored_keys:
            notes.append("expandable_segments_reserve_by_class (torch 2.15 and later) sizes the segments of CUDA "
                         "streams that code tags with a class; a TRL step tags none, so it is ignored")
        other = [key for key in self.ignored_keys if key != "expandable_segments_reserve_by_class"]
        if other:
            one = len(other) == 1
            notes.append(f"{', '.join(other)} {'does' if one else 'do'} not change device memory and "
                         f"{'is' if one else 'are'} ignored")
        return notes

    @property
    def has_expandable_segments_reserve(self) -> bool:
        return bool(self.expandable_segments_reserve_fraction or self.expandable_segments_reserve_bytes)

    def torch_215_keys(self) -> tuple[str, ...]:
        """The keys of this setting that torch 2.14 and earlier refuse."""
        given = {"expandable_segments_reserve": self.has_expandable_segments_reserve,
                 "expandable_segments_reserve_by_class": "expandable_segments_reserve_by_class" in self.ignored_keys}
        return tuple(key for key in TORCH_215_KEYS if given[key])

    def expandable_segment_address_bytes(self, device_bytes: int) -> int:
        """The address space one expandable segment reserves (before rounding to its pages): 9/8 of the device's
        memory, or torch 2.15's expandable_segments_reserve where it is less (clamp_reserve_bytes)."""
        full = device_bytes + device_bytes // 8
        if self.expandable_segments_reserve_fraction:
            return min(int(self.expandable_segments_reserve_fraction * device_bytes), full)
        if self.expandable_segments_reserve_bytes:
            return min(self.expandable_segments_reserve_bytes, full)
        return full


def environment_conf() -> tuple[str, str | None]:
    """The allocator conf a torch process started now would read, and the variable it comes from (None: unset)."""
    for name in ENV_VARS:
        if os.environ.get(name) is not None:
            return os.environ[name], name
    return "", None


def parse_allocator_conf(text: str | None, source: str = ENV_VAR) -> AllocatorConf:
    """The allocator settings of a PYTORCH_CUDA_ALLOC_CONF text (None or "" gives torch's defaults); a ConfigError
    naming `source` (the flag or variable the text came from) for a text torch would refuse or a different
    allocator."""
    if not text or not text.strip():
        return AllocatorConf(text=text or "")
    tokens = _tokens(text)
    pairs = _pairs(tokens, text, source)
    values: dict[str, object] = {}
    problems: list[str] = []
    large_segment = K_LARGE_BUFFER
    for key, value in pairs:  # torch reads large_segment_size_mb first: the other sizes are checked against it
        if key == "large_segment_size_mb" and isinstance(value, str):
            size_mb = _whole(key, value, problems, above=K_MIN_LARGE_ALLOC // MiB)
            large_segment = size_mb * MiB if size_mb > K_MIN_LARGE_ALLOC // MiB else large_segment
    for key, value in pairs:
        _read_key(key, value, large_segment, values, problems)
    if problems:
        raise ConfigError([f"{source} {short_repr(text, 60)}: {problem}" for problem in problems])
    ignored = tuple(dict.fromkeys(key for key, _ in pairs if key in IGNORED_KEYS))
    return AllocatorConf(large_segment_size_bytes=large_segment,
                         max_non_split_rounding_bytes=values.pop("max_non_split_rounding_bytes", large_segment),
                         text=text, ignored_keys=ignored, **values)


def _tokens(text: str) -> list[str]:
    """ConfigTokenizer: `,` `:` `[` `]` are tokens of their own, whitespace is dropped, the rest are words."""
    return [token for token in re.split(r"([,:\[\]])", re.sub(r"\s+", "", text)) if token]


def _pairs(tokens: list[str], text: str, source: str) -> list[tuple[str, str | list[tuple[str, str]]]]:
    """The key:value pairs in order (a trailing comma is allowed, as torch allows it); a value in brackets is the
    list of its own key:value pairs."""
    pairs: list[tuple[str, str | list[tuple[str, str]]]] = []
    i = 0
    while i < len(tokens):
        if i + 2 >= len(tokens) or tokens[i] in _PUNCTUATION or tokens[i + 1] != ":":
            raise _shape_error(text, source)
        key = tokens[i]
        _check_known(key, source)
        value: str | list[tuple[str, str]]
        if tokens[i + 2] == "[":
            if "]" not in tokens[i + 3:]:
                raise _shape_error(text, source)
            close = tokens.index("]", i + 3)
            value = _bracket_pairs(tokens[i + 3:close], text, source)
            i = close + 1
        elif tokens[i + 2] in _PUNCTUATION:
            raise _shape_error(text, source)
        else:
            value = tokens[i + 2]
            i += 3
        pairs.append((key, value))
        if i < len(tokens) and tokens[i] != ",":
            raise _shape_error(text, source)
        i += 1
    return pairs


def _check_known(key: str, source: str) -> None:
    if key not in KNOWN_KEYS:
        suggestions = closest_names(key, KNOWN_KEYS)
        hint = (f"did you mean {' or '.join(suggestions)}?" if suggestions else
                f"the keys torch knows are {', '.join(KNOWN_KEYS)}")
        raise ConfigError([f"{source}: unknown key {short_repr(key)}; {hint}"])


def _bracket_pairs(tokens: list[str], text: str, source: str) -> list[tuple[str, str]]:
    """The `interval:divisions` pairs of a `[256:1,512:2,>:4]` list (a trailing comma allowed)."""
    pairs = []
    i = 0
    while i < len(tokens):
        if i + 2 >= len(tokens) or tokens[i + 1] != ":" or tokens[i] in _PUNCTUATION or tokens[i + 2] in _PUNCTUATION:
            raise _shape_error(text, source)
        pairs.append((tokens[i], tokens[i + 2]))
        if i + 3 < len(tokens) and tokens[i + 3] != ",":
            raise _shape_error(text, source)
        i += 4
    return pairs


def _shape_error(text: str, source: str) -> ConfigError:
    return ConfigError([f"{source} {short_repr(text, 60)} is not a list of key:value pairs separated by commas "
                        f"({_EXAMPLE})"])


def _read_key(key: str, value, large_segment: int, values: dict, problems: list[str]) -> None:
    """Check one key's value as torch does and keep what the model uses."""
    if isinstance(value, list) and key not in ("roundup_power2_divisions", "expandable_segments_reserve_by_class"):
        problems.append(f"{key} takes a single value, not a [...] list")
    elif key == "expandable_segments_reserve":
        values.update(_reserve(key, value, problems))
    elif key == "expandable_segments_reserve_by_class":
        if not isinstance(value, list):
            problems.append(f"{key} takes a list like [name:0.5,other:40G], got {short_repr(value)}")
        for name, reserve in value if isinstance(value, list) else ():
            _reserve(f"{key} {name}", reserve, problems)
    elif key in _BOOL_KEYS:
        if value not in ("True", "False"):
            problems.append(f"{key} takes True or False (capitalised: torch refuses anything else), got "
                            f"{short_repr(value)}")
        elif key == "expandable_segments":
            values["expandable_segments"] = value == "True"
    elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        least = large_segment // MiB
        size_mb = _whole(key, value, problems, at_least=least, why=f"(large_segment_size_mb, {least} MiB)")
        values[_FIELDS[key]] = min(size_mb, SIZE_MAX // MiB) * MiB
    elif key == "garbage_collection_threshold":
        values[key] = _fraction(key, value, problems, open_interval=True)
    elif key == "per_process_memory_fraction":
        values[key] = _fraction(key, value, problems, open_interval=False)
    elif key == "roundup_power2_divisions":
        values[key] = _divisions(value, problems)
    elif key == "backend":
        _backend(value, problems)
    elif key == "pinned_num_register_threads":
        threads = _whole(key, value, problems, at_least=1)
        if threads & (threads - 1) or threads > 128:
            problems.append(f"{key} must be a power of 2 no larger than 128, got {short_repr(value)}")
    elif key in ("pinned_reserve_segment_size_mb", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"):
        _whole(key, value, problems, at_least=1 if key == "pinned_reserve_segment_size_mb" else 0)
    # large_segment_size_mb was read before the others


def _whole(key: str, value, problems: list[str], at_least: int = 0, above: int | None = None, why: str = "") -> int:
    """A whole number, checked against torch's bound for the key; 0 after recording a problem."""
    if not isinstance(value, str) or not (value.isascii() and value.isdigit()):
        problems.append(f"{key} takes a whole number{' of MiB' if key.endswith('_mb') else ''}, got "
                        f"{short_repr(value)}")
        return 0
    number = int(value)
    if above is not None and number <= above:
        problems.append(f"{key} must be more than {above} (MiB), as torch requires; got {number}")
    elif number < at_least:
        problems.append(f"{key} must be at least {at_least}{' MiB' if key.endswith('_mb') else ''} {why}".rstrip()
                        + f", as torch requires; got {number}")
    return number


def _reserve(key: str, value: str, problems: list[str]) -> dict[str, float | int]:
    """parseReserveSpec: a fraction of the device's memory, or GiB with a trailing G; positive and finite. The
    AllocatorConf fields it sets."""
    match = _RESERVE.fullmatch(value)
    number = float(match.group(1) + (match.group(2) or "")) if match else 0.0
    if not 0 < number < math.inf:
        problems.append(f"{key} takes a positive fraction of the GPU's memory (0.5) or GiB with a G (40G), as "
                        f"torch 2.15 requires; got {short_repr(value)}")
        return {}
    if match.group(3):  # resolveBytes saturates where the double reaches size_t's largest
        reserve = number * (1 << 30)
        return {"expandable_segments_reserve_bytes": SIZE_MAX if reserve >= float(SIZE_MAX) else int(reserve)}
    return {"expandable_segments_reserve_fraction": number}


def _fraction(key: str, value, problems: list[str], open_interval: bool) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    inside = 0 < number < 1 if open_interval else 0 <= number <= 1
    if not inside:
        bounds = "between 0 and 1, both excluded" if open_interval else "between 0 and 1"
        problems.append(f"{key} must be a number {bounds}, as torch requires; got {short_repr(value)}")
        return 0.0 if open_interval else 1.0
    return number


def _divisions(value, problems: list[str]) -> tuple[int, ...]:
    """AcceleratorAllocatorConfig::parseRoundUpPower2Divisions: one power of 2 for every size, or a list of
    `interval_mb:divisions` (intervals powers of 2; `>` for all larger sizes; divisions powers of 2 or 0)."""
    key = "roundup_power2_divisions"
    table = [0] * ROUNDUP_INTERVALS
    if isinstance(value, str):
        number = _whole(key, value, problems)
        if number & (number - 1) or number == 0:
            problems.append(f"{key} must be a power of 2 (or a list like [256:1,512:2,>:4]), got {short_repr(value)}")
        return (number,) * ROUNDUP_INTERVALS
    first, last_index = True, 0
    for interval, divisions_text in value:
        divisions = _whole(key, divisions_text, problems)
        if divisions & (divisions - 1):
            problems.append(f"{key}: divisions must be a power of 2 or 0, got {short_repr(divisions_text)}")
        if interval == ">":
            table[last_index + 1:] = [divisions] * (ROUNDUP_INTERVALS - last_index - 1)
            continue
        boundary = _whole(key, interval, problems)
        if boundary == 0 or boundary & (boundary - 1):
            problems.append(f"{key}: intervals must be powers of 2 (MiB) or >, got {short_repr(interval)}")
            continue
        index = min(boundary.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:
            table[:index] = [divisions] * index
            first = False
        table[index] = divisions
        last_index = index
    return tuple(table)


def _backend(value, problems: list[str]) -> None:
    if value == "cudaMallocAsync":
        problems.append("backend:cudaMallocAsync is a different allocator (CUDA's own stream-ordered pool), which "
                        "vram-plan does not model; use backend:native or leave backend out")
    elif value != "native":
        problems.append(f"backend must be native or cudaMallocAsync, got {short_repr(value)}")
