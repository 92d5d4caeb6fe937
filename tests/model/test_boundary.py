"""Where the verdict is decided: at small sizes, every fixture architecture's estimate against the exact need (the
traced step bisected through the allocator model; benchmarks/boundary.py does the same over a broad grid)."""

from __future__ import annotations

import pytest

from helpers import benchmark_module, family_fixture_files
from vram_planner import engine
from vram_planner.model.calibration import default_calibration
from vram_planner.model.verdict import (NEED_ABOVE_ESTIMATE_HEAD_BLOCK_UNCOUNTED,
                                       NEED_ABOVE_ESTIMATE_KERNEL_HEAD_BLOCK_UNCOUNTED, NEED_ABOVE_ESTIMATE_MERGED_LOSS,
                                       NEED_BELOW_ESTIMATE, need_above_estimate)
from vram_planner.units import GiB

pytestmark = pytest.mark.slow  # a trace and a bisection per point: seconds

CONFIGS = {
    "full beta": {"per_device_train_batch_size": 4, "num_generations": 4, "max_prompt_length": 32,
                  "max_completion_length": 128, "beta": 0.04},
    "lora B32": {"lora_r": 8, "per_device_train_batch_size": 32, "num_generations": 8, "max_prompt_length": 32,
                 "max_completion_length": 128},
    # 4-bit weights, traced as bitsandbytes quantizes and multiplies them on CUDA
    "qlora B16": {"lora_r": 8, "load_in_4bit": True, "dtype": "bfloat16", "per_device_train_batch_size": 16,
                  "num_generations": 8, "max_prompt_length": 32, "max_completion_length": 128},
}
# Cards around the need, none within the 2 MiB the bisection resolves
SHARES = (0.8, 0.9, 0.97, 1.03, 1.1, 1.25)
# The most a need may lie above the estimate where the target holds (the 5% margin is for the allocator
# model's own error against a GPU)
UNDER_TARGET = 0.01
# The grid's points the estimate is known to fall more than that short of, and why (not modelled yet); a point that
# joins or leaves this list is a change to say, not a drift
KNOWN_SHORT = {
    # a long prompt for a short completion, LoRA with 8-bit AdamW (added 2026-12-01 after held-out 24 GiB seed 2's
    # window, SmolLM2-1.7B's): the checkpointed inputs cut from the segments generation's prefill left, up to five to
    # a segment beside a rest too short for the backward's MLP block, which no pattern counts yet (one counted as the
    # MLP's pinned inputs are, per prefill segment, fits 0.32 a byte and takes Qwen3-0.6B's to 3.4% under only, the
    # grid's median to 3.2%)
    "Qwen3-0.6B lora p1024 c384 B8 8bit": "a window",
    "Llama-3.2-1B lora p1024 c384 B8 8bit": "3.2% under",
    "Qwen2.5-0.5B lora p1024 c384 B8 8bit": "1.4% under",
    # checkpointing off under torch's default allocator: the loss forward's kept tensors cut from its own freed
    # segments (two 22.5 MiB ones in a 60 MiB MLP segment beside 15 MiB, 149 in 24 MiB segments beside 1.5 MiB each:
    # 1.6 GiB cached at the need), which no pattern counts
    "SmolLM2-135M lora c1024 B16 nogc": "1.5% under",
    # 512 prompts generated at once, run out at the prefill's largest request (1.5 and 7 GiB, the largest cached
    # block 1.0 and 5.0 GiB), which the refit with the decoding's patterns of eager attention weighs 0.96 a byte
    "SmolLM2-135M lora p512 c128 B8 S64": "1.2% under",
    "Mistral-7B-v0.3 lora p256 c128 B8 S64 eager": "1.01% under",
    # the first step's 8-bit states cut from the free segment of the tied embedding's second gradient, 501 of its
    # 1,002 MiB beside them (benchmarks/reserve_fit.py), which no pattern counts: 0.98% under until the loaded weights'
    # rests joined the reserve as they are and the refit, which takes them off the other models' steps, gave the
    # layer gradients' and the embedding gradient's coefficients less
    "Llama-3.2-1B fp32 full adamw_8bit": "1.4% under",
    # the run's need is the step's at 243 prompt tokens (30.89 GiB against 28.46 at 256: four of the last step's
    # blocks to each of the prefill's 2 GiB scores segments beside nearly a fifth), which the estimate at 256 counts
    # since the prefill's pattern is counted at the prompt length that strands the most, but short of what the exact
    # engine needs there: a window (8.0% under) before it, when the longest prompt alone was judged
    "Qwen3-0.6B lora p256 c128 B8 S64 eager": "4.2% under",
}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("fixture", family_fixture_files(), ids=lambda path: path.stem)
def test_no_verdict_is_wrong_without_saying_it_is_near_the_boundary(fixture, config):
    """The need lies within the measured band around the estimate, so on every card a verdict that is not flagged
    near the boundary is what the exact engine says: "fits" where the step runs, "does not fit" where it does not."""
    pytest.importorskip("trl")
    settings = CONFIGS[config]
    outcome = engine.check(str(fixture), "24GiB", settings, exact=True)
    need, peak = outcome.need_bytes, outcome.analytic.estimate.peak_bytes
    train = outcome.analytic.train
    above = need_above_estimate(train)
    assert peak * (1 - NEED_BELOW_ESTIMATE) <= need <= peak * (1 + above), (need / peak - 1)
    assert need <= peak * (1 + UNDER_TARGET), (need / peak - 1)
    for share in SHARES:
        verdict = engine.check(str(fixture), f"{need * share / GiB:.6f}GiB", settings)
        if not verdict.near_boundary:
            assert verdict.fits == (need <= verdict.context.capacity_bytes), share


def test_the_measured_band_covers_every_point_of_the_committed_boundary_table():
    """NEED_ABOVE_ESTIMATE, its variant for steps whose kept tensors meet the decoding's segments, and
    NEED_BELOW_ESTIMATE are what benchmarks/boundary.py measured on its grid and benchmarks/boundary_heldout.py on
    configs off it: every committed point lies inside its band, and each bound is reached within two points (not
    padded)."""
    import json

    from vram_planner.model.spec import training_config

    boundary = benchmark_module("boundary")
    held_out = [t for t in sorted(boundary.RESULTS.glob("boundary-heldout*.json"))
                if not t.name.endswith("-needs.json") and "-qlora" not in t.name]  # QLoRA's: their own test
    assert len(held_out) >= 2  # seed 0's sweep, whose points patterns were read off, and a clean one
    settings = {label: knobs for label, _, knobs in boundary.points(list(boundary.MODELS), quick=False)}
    rows = [(row, settings[row["point"]]) for row in json.loads((boundary.RESULTS / "boundary.json").read_text())]
    rows += [(row, row["settings"]) for table in held_out for row in json.loads(table.read_text())]
    above: dict[float, list[float]] = {}
    for row, knobs in rows:
        ratio = row["need_bytes"] / row["analytic_bytes"] - 1
        band = need_above_estimate(training_config(knobs))
        assert -NEED_BELOW_ESTIMATE <= ratio <= band, row["point"]
        above.setdefault(band, []).append(ratio)
    assert len(above) == 2
    for band, ratios in above.items():
        assert band - max(ratios) < 0.02
    assert NEED_BELOW_ESTIMATE - max(-min(r for ratios in above.values() for r in ratios), 0) < 0.02


@pytest.mark.slow  # the estimate of every point of the grid: a few seconds
def test_the_estimates_against_the_committed_needs_are_the_committed_table_and_meet_the_targets():
    """benchmarks/boundary.py --from-needs: the analytic side recomputed against the committed needs is the committed
    table, with a median |estimate - need| under 2%, and no window and no point more than 1% under its need but those
    KNOWN_SHORT names (20 before the later micro-batch's and the layer gradients' patterns, 2 before eager attention's
    overflowing inputs and the refit that weighs a short reserve 60 times a long one; with TRL's plain defaults on the
    grid, SmolLM2-135M's and phi-2's, 3.9% and 1.9% under before the embedding's state in the LM head's tile segment
    and the refit at 33; the first step's states in the prefill's segments let the weight fall to 28, the median to
    1.86%; the prefill-bound points, 512 prompts for a micro-batch of 8, were up to 16.3% under, 13 of 20 windows,
    before the prefill's largest request beside the segment a smaller tensor pins; Qwen3-0.6B's eager LoRA, the last
    window, 6.3% under before eager attention's score segments in the prefill's pattern, 3.6% before its copies of
    the grouped keys and values; the loaded weights' rests, counted as they are, at 30 with eager attention's overflow
    held: 1.94%; the run's need, a shorter prompt's where the analytic model says one strands more: 2.00%; the
    sampling's noise (torch.multinomial's) traced and counted, the grid bisected again with it: 1.97%; the laptop
    steps with expandable segments, LoRA at 4 x 256 tokens, 3 of 10 from 1.0% to 2.6% under before the runs beside
    the checkpointed inputs: 1.89%)."""
    import json
    import statistics

    boundary = benchmark_module("boundary")
    data = json.loads((boundary.RESULTS / "boundary-needs.json").read_text())
    rows = [row for row, _ in boundary.rejudged(data["points"], boundary.traced_release(data["key"]))]
    committed = json.loads((boundary.RESULTS / "boundary.json").read_text())
    assert [(r["point"], r["analytic_bytes"]) for r in rows] == [(r["point"], r["analytic_bytes"]) for r in committed]
    assert {r["point"] for r in rows if r["window"]} == {p for p, what in KNOWN_SHORT.items() if what == "a window"}
    assert all(r["flagged"] for r in rows if r["window"])  # no silent window: check flags each near the boundary
    assert statistics.median(abs(r["error"]) for r in rows) < 0.02
    assert {r["point"] for r in rows if r["error"] < -UNDER_TARGET} == set(KNOWN_SHORT)


@pytest.mark.slow  # the estimate of 109 points: a few seconds
def test_the_kernelized_release_holds_at_the_boundary_too():
    """benchmarks/boundary.py --suffix transformers-5.25: the families whose layers the Hub's kernels replace (and the
    fixtures), traced under transformers 5.25, which kernelizes by default, and judged with the analytic model
    planned for that release against their committed needs: the committed table, no window, every point inside the
    measured band, and no more points more than 1% under their need than the tested release's table has."""
    import json
    import statistics

    from vram_planner.model.spec import training_config

    boundary = benchmark_module("boundary")
    data = json.loads((boundary.RESULTS / "boundary-needs-transformers-5.25.json").read_text())
    assert "transformers 5.25.0/" in data["key"]
    rows = boundary.rejudged(data["points"], boundary.traced_release(data["key"]))
    committed = json.loads((boundary.RESULTS / "boundary-transformers-5.25.json").read_text())
    # after a change to the analytic model: python benchmarks/boundary.py --from-needs --suffix transformers-5.25
    assert [(r["point"], r["analytic_bytes"]) for r, _ in rows] == [(r["point"], r["analytic_bytes"])
                                                                     for r in committed]
    assert len(rows) > 100 and not [r["point"] for r, _ in rows if r["window"]]
    for row, settings in rows:
        ratio = row["need_bytes"] / row["analytic_bytes"] - 1
        assert -NEED_BELOW_ESTIMATE <= ratio <= need_above_estimate(training_config(settings)), row["point"]
    assert statistics.median(abs(r["error"]) for r, _ in rows) < 0.02
    assert len([r for r, _ in rows if r["error"] < -UNDER_TARGET]) <= len(KNOWN_SHORT)


# The tables traced in old TRL releases' environments (benchmarks/boundary.py --suffix trl-X --configs ...): their
# windows, and how many points more than 1% under their need
OLD_RELEASE_TABLES = {
    # TRL 0.14 (PROMPT_BATCH_CONFIGS): six windows, twelve under, before the reference's logits in the policy's copy
    # segment were counted (stranding.reference_logits_stranded_bytes)
    "trl-0.14.0": ({"Qwen2.5-0.5B amp full gc B1 G8 c1024", "SmolLM2-135M amp lora B1 G2 c2048"}, 4),
    # TRL 0.19 and 1.0: 13 windows each before the logits block their LM head's backward strands was counted
    # (stranding.head_block_stranded_bytes); 1.0's left are LoRA with checkpointing, where it is not
    "trl-0.19.1": (set(), 3),
    "trl-1.0.0": ({"Qwen2.5-0.5B lora p512 c2048 G16 S2 beta", "SmolLM2-135M lora c256 B128",
                   "SmolLM2-135M lora p512 c2048 G16 S2 beta", "SmolLM2-135M fp32 lora c1024 eager",
                   "Llama-3.2-1B lora p1024 c384 B8 8bit"}, 8),
    # TRL 1.14, whose log-prob kernel's backward asks for blocks of the whole logits: its windows LoRA with
    # checkpointing too, further under (a band of their own)
    "trl-1.14.2": ({"SmolLM2-135M lora c256 B128", "SmolLM2-135M lora p512 c2048 G16 S2 beta",
                    "SmolLM2-135M fp32 lora c1024 eager", "Llama-3.2-1B lora p512 c2048 G16 S2 beta",
                    "Llama-3.2-1B lora p1024 c384 B8 8bit"}, 9),
}


@pytest.mark.slow  # the estimate of 90 points: a few seconds
def test_old_releases_steps_hold_at_the_boundary_in_their_own_band():
    """benchmarks/boundary.py --suffix trl-X: steps traced under TRL 0.14 (transformers 4.48), 0.19 (4.53), 1.0 (5.4)
    and 1.14 (5.19), judged with the analytic model planned for those releases: the committed tables, every need
    inside the band of its kind of step, the bands of their own reached (not padded), and the windows and the points
    under their need OLD_RELEASE_TABLES names: a window that joins or leaves is a change to say."""
    import json

    boundary = benchmark_module("boundary")
    ratios: dict[float, list[float]] = {}
    for suffix, (windows, under) in OLD_RELEASE_TABLES.items():
        data = json.loads((boundary.RESULTS / f"boundary-needs-{suffix}.json").read_text())
        trl_version = boundary.traced_trl(data["key"])
        assert suffix == f"trl-{trl_version}"
        rows = boundary.rejudged(data["points"], boundary.traced_release(data["key"]), trl_version)
        committed = json.loads((boundary.RESULTS / f"boundary-{suffix}.json").read_text())
        # after a change to the analytic model: python benchmarks/boundary.py --from-needs --suffix trl-X --configs ...
        assert sorted((r["point"], r["analytic_bytes"]) for r, _ in rows) == sorted(
            (r["point"], r["analytic_bytes"]) for r in committed)
        assert len(rows) == 30
        for row, settings in rows:
            train = engine.check(row["point"].split()[0], boundary.CARD, settings, trl_version=trl_version).train
            ratio = row["need_bytes"] / row["analytic_bytes"] - 1
            ratios.setdefault(need_above_estimate(train), []).append(ratio)
            assert -NEED_BELOW_ESTIMATE <= ratio <= need_above_estimate(train), row["point"]
        assert {r["point"] for r, _ in rows if r["window"]} == windows
        assert all(r["flagged"] for r, _ in rows if r["window"])
        assert len([r for r, _ in rows if r["error"] < -UNDER_TARGET]) == under
    for band in (NEED_ABOVE_ESTIMATE_MERGED_LOSS, NEED_ABOVE_ESTIMATE_HEAD_BLOCK_UNCOUNTED,
                 NEED_ABOVE_ESTIMATE_KERNEL_HEAD_BLOCK_UNCOUNTED):
        assert band - max(ratios[band]) < 0.02, band


# The QLoRA steps' table (benchmarks/boundary.py --suffix qlora): its window and how many points more than 1% under
# their need. The reserve's patterns were read off and fitted on 16-bit steps; refitted with these points the loss
# phase's median |error| rose from 2.7% to 3.8%, so they stay apart until a pattern of the 4-bit layers' own (PEFT's
# defensive clone of each base output, the dropout masks' segments the checkpointed inputs are cut from) is counted.
# The steps load their weights as transformers quantizes them on the card (each 16-bit checkpoint copy freed among
# the packed weights cut beside it): that moved the needs by -94 to +222 MiB, with no relation to what the loading
# leaves cached, and Qwen2.5-0.5B's long completions (+38 MiB) into a window of their own.
QLORA_WINDOWS = {"Qwen2.5-0.5B qlora p256 c256 B32 G16", "Qwen2.5-0.5B qlora c1024 B8"}
QLORA_UNDER = 8


@pytest.mark.slow  # the estimate of 20 points: a second
def test_qlora_steps_hold_at_the_boundary_in_the_band():
    """4-bit steps traced as bitsandbytes runs them on CUDA, judged with the analytic model against their committed
    needs: the committed table, every need inside the measured band (so a verdict near them says so and names
    --exact), and the windows and the points under their need that QLORA_WINDOWS and QLORA_UNDER name."""
    import json

    from vram_planner.model.spec import training_config

    boundary = benchmark_module("boundary")
    data = json.loads((boundary.RESULTS / "boundary-needs-qlora.json").read_text())
    rows = boundary.rejudged(data["points"], boundary.traced_release(data["key"]))
    committed = json.loads((boundary.RESULTS / "boundary-qlora.json").read_text())
    # after a change to the analytic model: python benchmarks/boundary.py --from-needs --suffix qlora --configs ...
    assert [(r["point"], r["analytic_bytes"]) for r, _ in rows] == [(r["point"], r["analytic_bytes"])
                                                                     for r in committed]
    assert len(rows) == 2 * len(boundary.MODELS)
    for row, settings in rows:
        ratio = row["need_bytes"] / row["analytic_bytes"] - 1
        assert -NEED_BELOW_ESTIMATE <= ratio <= need_above_estimate(training_config(settings)), row["point"]
    assert {r["point"] for r, _ in rows if r["window"]} == QLORA_WINDOWS
    assert all(r["flagged"] for r, _ in rows if r["window"])
    assert len([r for r, _ in rows if r["error"] < -UNDER_TARGET]) == QLORA_UNDER


@pytest.mark.slow  # the estimate of every held-out point: a few seconds
def test_the_committed_held_out_tables_are_the_analytic_model_as_it_is():
    """benchmarks/boundary_heldout.py --from-results: every committed sweep's points (16-bit and over 4-bit weights),
    judged with the analytic model as it is against their committed needs, are the committed tables, so the band
    above is held to the estimates `check` gives today, not to those of the code that drew the points; and each
    window among them is flagged near the boundary."""
    import json

    heldout = benchmark_module("boundary_heldout")
    for qlora in (False, True):
        sweeps, _ = heldout.rejudged_sweeps(qlora)
        assert len(sweeps) >= 2
        for (seed, largest_gib), rows in sweeps.items():
            stem = heldout.table_stem(seed, largest_gib, qlora)
            committed = json.loads((heldout.RESULTS / f"{stem}.json").read_text())
            assert [(r["point"], r["analytic_bytes"], r["need_bytes"]) for r in rows] == [
                (r["point"], r["analytic_bytes"], r["need_bytes"]) for r in committed], (seed, largest_gib)
            # no silent window: check flags each near the boundary, where --exact (or a kept copy) decides
            assert all(r["flagged"] for r in rows if r["window"]), (seed, largest_gib, qlora)


# The QLoRA held-out sweeps (benchmarks/boundary_heldout.py --held-out 16 --seed S --largest-gib 24 --qlora: every
# knob drawn, LoRA over 4-bit weights), by seed: their windows, and the points whose need lies outside the band of
# their kind of step (the share of the peak, or under expandable segments the generation phase with what its growing
# cache can strand, Verdict.generation_band_bytes). Found by seed 1, 2026-12-05: float32 weights in 4 bits keep the
# MLP's tensors in float32 (the estimate was up to 26.7% short, activations.mlp_activation_bytes); and under expandable
# segments the KV cache's growth by concatenation (generation's reserve is a share of its tensors there) strands what
# no closed form follows: SmolLM2-360M, 64 sequences of 448 tokens, 10.2% under its need, as with 16-bit weights
# (8.1%) and with SDPA (9.5%); the cache's growth replayed alone keeps 265 MiB mapped beside 1,118 MiB of keys and
# values, 35 MiB with 30 layers (benchmarks/decoding_holes.py), so its window is flagged near the boundary instead.
QLORA_HELD_OUT = {1: ({"h10 SmolLM2-360M"}, set()),
                  2: ({"h01 Qwen2.5-0.5B"}, set())}


@pytest.mark.slow  # the estimate of 32 points: a few seconds
@pytest.mark.parametrize("seed", QLORA_HELD_OUT)
def test_the_qlora_held_out_sweeps_are_the_analytic_model_as_it_is_and_in_the_band_but_what_they_name(seed):
    import json

    from vram_planner.model.spec import training_config

    heldout = benchmark_module("boundary_heldout")
    boundary = benchmark_module("boundary")
    data = json.loads(heldout.needs_path(qlora=True).read_text())
    committed = json.loads((heldout.RESULTS / f"{heldout.table_stem(seed, 24, qlora=True)}.json").read_text())
    release = boundary.traced_release(data["key"])  # planned for the transformers the needs were traced under
    rows = [heldout.judged(r["point"], r["model"], r["settings"], data["points"], trace=False, release=release)
            for r in committed]
    # after a change to the analytic model: the sweep's command again (its needs are cached)
    assert [(r["point"], r["analytic_bytes"], r["need_bytes"]) for r in rows] == [
        (r["point"], r["analytic_bytes"], r["need_bytes"]) for r in committed]
    assert len(rows) == 16 and all(r["settings"]["load_in_4bit"] and r["settings"]["lora_r"] for r in rows)
    windows, outside_band = QLORA_HELD_OUT[seed]
    assert {r["point"] for r in rows if r["window"]} == windows
    assert all(r["flagged"] for r in rows if r["window"])
    outside = set()
    for r in rows:
        verdict = engine.check(r["model"], boundary.CARD, {**r["settings"], **release},
                               calibration=default_calibration())
        assert verdict.estimate.peak_bytes == r["analytic_bytes"]
        assert need_above_estimate(verdict.train) == need_above_estimate(training_config(r["settings"]))
        if not r["analytic_bytes"] * (1 - NEED_BELOW_ESTIMATE) <= r["need_bytes"] <= verdict.need_bound_bytes:
            outside.add(r["point"])
    assert outside == outside_band
