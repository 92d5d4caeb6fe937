"""PYTORCH_CUDA_ALLOC_CONF read as torch 2.13 reads it: ConfigTokenizer (c10/core/AllocatorConfig.h),
AcceleratorAllocatorConfig::parseArgs (c10/core/AllocatorConfig.cpp) and CUDAAllocatorConfig::parseArgs
(c10/cuda/CUDAAllocatorConfig.cpp), with torch's own limits; and the keys torch 2.15 added."""

from __future__ import annotations

import pytest

from vram_planner.allocator import AllocatorConf, parse_allocator_conf
from vram_planner.allocator.conf import KNOWN_KEYS
from vram_planner.allocator.sizes import SIZE_MAX
from vram_planner.errors import ConfigError

MiB = 1024**2


@pytest.mark.parametrize("text", [None, "", "   "])
def test_no_text_gives_torchs_defaults(text):
    """parseArgs' defaults: max_split_size SIZE_MAX, max_non_split_rounding = large_segment_size = 20 MiB, no
    power-of-2 rounding, no garbage collection, no expandable segments, fraction 1."""
    conf = parse_allocator_conf(text)
    assert conf == AllocatorConf(text=text or "")
    assert (conf.max_split_size_bytes, conf.max_non_split_rounding_bytes, conf.large_segment_size_bytes) == (
        SIZE_MAX, 20 * MiB, 20 * MiB)
    assert conf.roundup_power2_divisions == (0,) * 16 and not conf.expandable_segments


def test_keys_values_and_whitespace_are_read_like_configtokenizer():
    """ConfigTokenizer drops whitespace and splits at , : [ ]; a trailing comma ends the list (parseArgs only
    checks for a comma between pairs)."""
    conf = parse_allocator_conf(" max_split_size_mb : 128 , expandable_segments:True,"
                                "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9,")
    assert conf.max_split_size_bytes == 128 * MiB and conf.expandable_segments
    assert conf.garbage_collection_threshold == 0.6 and conf.per_process_memory_fraction == 0.9


def test_roundup_power2_divisions_list_fills_the_intervals():
    """parseRoundUpPower2Divisions: interval_mb:divisions sets the interval from log2(interval_mb) (1 MiB is index
    0); the first value also fills every interval below it; `>` fills every interval after the last one named."""
    conf = parse_allocator_conf("roundup_power2_divisions:[256:1,512:2,>:4]")
    assert conf.roundup_power2_divisions == (1,) * 9 + (2,) + (4,) * 6
    assert parse_allocator_conf("roundup_power2_divisions:8").roundup_power2_divisions == (8,) * 16


def test_large_segment_size_is_read_first_and_bounds_the_other_sizes():
    """parseArgs reads large_segment_size_mb before the rest; max_split_size_mb and max_non_split_rounding_mb must
    be at least it, and max_non_split_rounding defaults to it."""
    conf = parse_allocator_conf("max_split_size_mb:11,large_segment_size_mb:11")
    assert conf.large_segment_size_bytes == conf.max_non_split_rounding_bytes == conf.max_split_size_bytes == 11 * MiB
    with pytest.raises(ConfigError, match="max_split_size_mb must be at least 30 MiB"):
        parse_allocator_conf("max_split_size_mb:25,large_segment_size_mb:30")


def test_keys_that_leave_device_memory_alone_are_accepted_and_named():
    """CUDAAllocatorConfig's pinned-memory, locking and graph-capture keys are valid but do not change what the
    device allocator reserves."""
    conf = parse_allocator_conf("pinned_use_cuda_host_register:True,pinned_num_register_threads:8,"
                                "release_lock_on_cudamalloc:True,backend:native")
    assert conf == AllocatorConf(text=conf.text, ignored_keys=conf.ignored_keys)
    assert conf.ignored_keys == ("pinned_use_cuda_host_register", "pinned_num_register_threads",
                                 "release_lock_on_cudamalloc")
    assert any("ignored" in note for note in conf.notes())


@pytest.mark.parametrize("text,fraction,reserve_bytes", [
    ("expandable_segments_reserve:0.5", 0.5, 0),
    ("expandable_segments_reserve:+.25", 0.25, 0),
    ("expandable_segments_reserve:2.5e-1", 0.25, 0),
    ("expandable_segments_reserve:40G", 0.0, 40 * 1024**3),
    ("expandable_segments_reserve:0.5g", 0.0, 512 * MiB),
    ("expandable_segments_reserve:1e20G", 0.0, SIZE_MAX),
])
def test_torch_215_reserve_is_a_fraction_of_the_device_or_gib(text, fraction, reserve_bytes):
    """parseReserveSpec: a trailing G (or g) means GiB, else a fraction of the device's memory; resolveBytes
    saturates at SIZE_MAX; clamp_reserve_bytes caps the reserve at the historical 9/8 of the device."""
    conf = parse_allocator_conf("expandable_segments:True," + text)
    assert (conf.expandable_segments_reserve_fraction, conf.expandable_segments_reserve_bytes) == (
        fraction, reserve_bytes)
    device = 80 * 1024**3
    expected = int(fraction * device) if fraction else reserve_bytes
    assert conf.expandable_segment_address_bytes(device) == min(expected, device + device // 8)
    assert any("torch 2.15 and later" in note for note in conf.notes())


def test_without_a_reserve_a_segment_reserves_nine_eighths_of_the_device():
    conf = parse_allocator_conf("expandable_segments:True")
    assert conf.expandable_segment_address_bytes(16 * 1024**3) == 18 * 1024**3
    assert parse_allocator_conf("expandable_segments_reserve:0.5").notes()[0].endswith(
        "it acts only with expandable_segments:True")


def test_reserves_by_class_are_checked_and_ignored():
    """Only streams tagged with setExpandableSegmentReserveClassForStream take a class's reserve; a TRL step's
    streams carry no tag."""
    conf = parse_allocator_conf("expandable_segments:True,expandable_segments_reserve_by_class:[serving:0.25,"
                                "ads_sparse:8G]")
    assert conf.ignored_keys == ("expandable_segments_reserve_by_class",)
    assert conf.expandable_segment_address_bytes(1024**3) == 1024**3 + 1024**3 // 8
    assert any("tags none" in note for note in conf.notes())
    assert not any("change device memory" in note for note in conf.notes())


def test_check_passes_the_settings_notes_on():
    """A plan pasted with torch 2.15's keys fails under an older torch: `check` says so beside its verdict, and names
    the keys it ignores (one key: "does")."""
    from vram_planner import engine

    notes = engine.check("Qwen2.5-0.5B", "rtx4090", {"allocator_conf": "expandable_segments:True,"
                         "expandable_segments_reserve:0.25,pinned_use_background_threads:True"}).estimate.notes
    assert any(n.startswith("allocator: expandable_segments_reserve is read by torch 2.15") for n in notes)
    assert "allocator: pinned_use_background_threads does not change device memory and is ignored" in notes
    assert not any(n.startswith("allocator:") for n in engine.check("Qwen2.5-0.5B", "rtx4090", {}).estimate.notes)


@pytest.mark.parametrize("text,message", [
    ("max_split_size_mb:19", "max_split_size_mb must be at least 20 MiB"),
    ("max_split_size_mb:-5", "max_split_size_mb takes a whole number of MiB, got '-5'"),
    ("max_split_size_mb:1.5e3", "max_split_size_mb takes a whole number of MiB"),
    ("max_non_split_rounding_mb:10", "max_non_split_rounding_mb must be at least 20 MiB"),
    ("large_segment_size_mb:10", "large_segment_size_mb must be more than 10"),
    ("garbage_collection_threshold:1", "garbage_collection_threshold must be a number between 0 and 1, both excl"),
    ("garbage_collection_threshold:0", "garbage_collection_threshold must be a number between 0 and 1"),
    ("per_process_memory_fraction:1.5", "per_process_memory_fraction must be a number between 0 and 1"),
    ("roundup_power2_divisions:3", "roundup_power2_divisions must be a power of 2"),
    ("roundup_power2_divisions:[256:3]", "divisions must be a power of 2 or 0"),
    ("roundup_power2_divisions:[300:2]", "intervals must be powers of 2"),
    ("expandable_segments:true", "expandable_segments takes True or False (capitalised"),
    ("pinned_num_register_threads:3", "pinned_num_register_threads must be a power of 2 no larger than 128"),
    ("backend:cudaMallocAsync", "backend:cudaMallocAsync is a different allocator"),
    ("backend:magic", "backend must be native or cudaMallocAsync"),
    ("max_splt_size_mb:128", "unknown key 'max_splt_size_mb'; did you mean max_split_size_mb"),
    ("colour:blue", "unknown key 'colour'; the keys torch knows are max_split_size_mb"),
    ("max_split_size_mb", "is not a list of key:value pairs separated by commas"),
    ("max_split_size_mb:128,,", "is not a list of key:value pairs"),
    ("expandable_segments:True:False", "is not a list of key:value pairs"),
    ("roundup_power2_divisions:[256:1", "is not a list of key:value pairs"),
    ("max_split_size_mb:[1:2]", "max_split_size_mb takes a single value"),
    ("expandable_segments_reserve:0", "expandable_segments_reserve takes a positive fraction"),
    ("expandable_segments_reserve:-1", "expandable_segments_reserve takes a positive fraction"),
    ("expandable_segments_reserve:G", "got 'G'"),
    ("expandable_segments_reserve:inf", "got 'inf'"),
    ("expandable_segments_reserve:nan", "got 'nan'"),
    ("expandable_segments_reserve:1e400", "got '1e400'"),
    ("expandable_segments_reserve:0.5GiB", "got '0.5GiB'"),
    ("expandable_segments_reserve:[a:0.5]", "expandable_segments_reserve takes a single value"),
    ("expandable_segments_reserve_by_class:0.5", "takes a list like [name:0.5,other:40G]"),
    ("expandable_segments_reserve_by_class:[serving:0]", "expandable_segments_reserve_by_class serving takes a"),
    ("expandable_segments_reserv:0.5", "did you mean expandable_segments_reserve"),
])
def test_bad_text_is_one_line_naming_the_key_and_what_is_allowed(text, message):
    """torch refuses each of these (or, for -5 and 1.5e3, reads them by accident); the error names the source."""
    with pytest.raises(ConfigError) as caught:
        parse_allocator_conf(text, source="--allocator-conf")
    assert message in str(caught.value) and str(caught.value).startswith("--allocator-conf")
    assert "\n" not in str(caught.value)


def test_every_key_torch_213_knows_is_known():
    """The keys of AcceleratorAllocatorConfig::getMutableKeys (read from torch 2.13's libc10) and
    CUDAAllocatorConfig::getKeys (its installed header), and the two torch 2.15 added (its libc10_cuda; torch 2.14.1
    has none new)."""
    accelerator = {"large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb",
                   "garbage_collection_threshold", "roundup_power2_divisions", "expandable_segments",
                   "pinned_use_background_threads", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"}
    cuda = {"backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "release_lock_on_hipmalloc",
            "pinned_use_hip_host_register", "graph_capture_record_stream_reuse", "pinned_reserve_segment_size_mb",
            "pinned_num_register_threads", "per_process_memory_fraction", "pinned_free_catch_all",
            "throw_on_cudamalloc_oom"}
    torch_215 = {"expandable_segments_reserve", "expandable_segments_reserve_by_class"}
    assert set(KNOWN_KEYS) == accelerator | cuda | torch_215


@pytest.mark.parametrize("text", [
    "max_split_size_mb:20", "max_split_size_mb:19", "max_split_size_mb:4096", "max_non_split_rounding_mb:19",
    "max_non_split_rounding_mb:64", "large_segment_size_mb:10", "large_segment_size_mb:32",
    "garbage_collection_threshold:0.5", "garbage_collection_threshold:1.0", "garbage_collection_threshold:0",
    "roundup_power2_divisions:4", "roundup_power2_divisions:3", "roundup_power2_divisions:[256:1,512:2,>:4]",
    "roundup_power2_divisions:[256:3]", "roundup_power2_divisions:[3:2]", "roundup_power2_divisions:[256:1,]",
    "expandable_segments:True", "expandable_segments:False", "expandable_segments:true",
    "max_split_size_mb:128,expandable_segments:True", "max_split_size_mb:128,", "max_split_size_mb:abc",
])
def test_accepts_and_refuses_what_torchs_own_parser_does(text):
    """The same verdict as torch 2.13's AcceleratorAllocatorConfig::parseArgs, run here through
    torch._C._accelerator_setAllocatorSettings (the CPU build carries it, without the CUDA keys)."""
    torch = pytest.importorskip("torch")
    setter, before = torch._C._accelerator_setAllocatorSettings, torch._C._accelerator_getAllocatorSettings()
    try:
        setter("large_segment_size_mb:20")  # torch keeps this one between calls
        try:
            setter(text)
            torch_accepts = True
        except (ValueError, RuntimeError):
            torch_accepts = False
    finally:
        setter("large_segment_size_mb:20")
        setter(before)
    try:
        parse_allocator_conf(text)
        accepts = True
    except ConfigError:
        accepts = False
    assert accepts == torch_accepts
