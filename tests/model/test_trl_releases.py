"""TRL behaviour switches are data: each release range resolves to its row."""

from __future__ import annotations

import pytest

from vram_planner.errors import VramPlanError
from vram_planner.model.trl_releases import installed_trl_version, trl_release, trl_releases, version_tuple


@pytest.mark.parametrize("version,lm_head,beta,completion", [
    ("1.16.0", "fused_chunked", 0.0, 512), ("1.15.0", "fused_chunked", 0.0, 512),
    ("1.14.2", "full_logits", 0.0, 512), ("0.18.2", "full_logits", 0.04, 256), ("0.28.0", "full_logits", 0.0, 256),
])
def test_release_rows(version, lm_head, beta, completion):
    release = trl_release(version)
    assert (release.lm_head, release.default_beta, release.default_max_completion_length) == (
        lm_head, beta, completion)


def test_rows_do_not_overlap():
    rows = sorted(trl_releases(), key=lambda r: version_tuple(r.min_version))
    for lower, upper in zip(rows, rows[1:]):
        assert version_tuple(lower.below_version) == version_tuple(upper.min_version)


def test_unknown_release_is_a_clear_error():
    with pytest.raises(VramPlanError, match="outside the TRL releases vram-plan knows"):
        trl_release("0.1.0")


def test_installed_version_is_read_without_importing_trl():
    import subprocess
    import sys
    from importlib import metadata

    assert installed_trl_version() == metadata.version("trl")
    code = ("import sys\nfrom vram_planner.model.trl_releases import installed_trl_version\n"
            "assert installed_trl_version()\nassert 'trl' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_old_trl_plans_use_its_defaults(llama_1b_file):
    from vram_planner import engine
    from vram_planner.profiles import GpuProfile

    verdict = engine.check(str(llama_1b_file), GpuProfile(name="c", total_memory_gib=80), trl_version="0.18.0")
    assert verdict.train.beta == 0.04 and verdict.train.max_completion_length == 256
