"""`check` near the boundary with a kept copy: the copy's replay is the verdict, said as such in the headline, the
notes and `--json`'s `copy`; away from the boundary, or for other knobs, the estimate's (torch-free: a copy written
here, as `check --exact --keep-copy` writes one; tests/step_copy/test_kept_copy.py holds made copies to the exact
engine)."""

from __future__ import annotations

import json

import pytest

from helpers import json_of, run
from vram_planner import engine
from vram_planner.step_copy import store
from vram_planner.step_copy.document import StepCopy
from vram_planner.step_copy.lengths import lattice
from vram_planner.units import GiB

# transformers 5.24's loading, whose estimate the cards below were chosen by (5.25 kernelizes the RMSNorm by
# default, and the estimate moves off them)
KNOBS = {"dtype": "bfloat16", "lora_r": 16, "num_generations": 8, "per_device_train_batch_size": 8,
         "max_prompt_length": 1024, "max_completion_length": 384, "optim": "adamw_8bit", "transformers_version": "5.24"}


def flags_of(knobs: dict) -> list[str]:
    return ["--model", "Qwen3-0.6B", *(part for name, value in knobs.items()
                                       for part in (f"--{name.replace('_', '-')}", str(value)))]


FLAGS = flags_of(KNOBS)
NEAR, FAR = "3.66GiB", "8GiB"  # the estimate's peak is 3.48 GiB: it does not fit the first, by its safety margin
FITS_NEAR = "3.70GiB"  # the estimate fits it, near the boundary


def kept_copy(weights_gib: float, knobs: dict = KNOBS, completions: tuple[int, int] = (1, 512)) -> None:
    """A copy of the step whose weights take `weights_gib` (a step of 28 layers, as Qwen3-0.6B's), kept under the
    knobs' key, answering for `completions`."""
    names = ["loading", "weights", "optimizer", "step", "zero_grad(set_to_none=True)", "generation", "prefill"]
    events = [(True, 0, 0, 1, -1), (True, 1, 2, 3, -1), (False, 1, 2, 4, -1), (True, 2, 5, 6, 0), (False, 2, 5, 6, 0)]
    copy = StepCopy(windows=[None] * 28, unit=(1, 2), lattice=list(lattice(32, 64)), completion_range=completions,
                    names=names, events=events, next_block=3, growth_at=[], regions=[], denominator=1,
                    coefficients=[(round(weights_gib * GiB), 0, 0, 0, 0, 0), (1 << 20, 0, 0, 0, 0, 0),
                                  (0, 1 << 16, 0, 0, 0, 0)], per_added_token=[0, 0, 0])
    context = engine.make_context("Qwen3-0.6B", NEAR)
    store.keep(copy, store.copy_key(context.arch, engine.make_training(context, knobs), context.release))


@pytest.mark.parametrize(("weights_gib", "fits"), [(1.0, True), (3.6, False)])
def test_a_kept_copy_decides_check_near_the_boundary(capsys, weights_gib, fits):
    kept_copy(weights_gib)
    code, document = json_of(capsys, "check", "--gpu", NEAR, *FLAGS)
    assert document["fits"] is fits and code == (0 if fits else 1)
    assert document["copy"]["runs"] is fits and document["copy"]["requests"] > 5 and not document["near_boundary"]
    assert any("decided by the exact engine's copy" in note for note in document["notes"])
    _, out, _ = run(capsys, "check", "--gpu", NEAR, *FLAGS)
    said = " ".join(out.split())
    assert ("✔ fits: the exact engine's copy of this step runs on this card" if fits else
            "✘ does not fit: the exact engine's copy of this step runs out on this card") in said
    # away from the boundary, and for other knobs, the estimate decides
    assert json_of(capsys, "check", "--gpu", FAR, *FLAGS)[1]["copy"] is None
    assert json_of(capsys, "check", "--gpu", NEAR, *FLAGS, "--lora-r", "8")[1]["copy"] is None


@pytest.mark.parametrize(("gpu", "weights_gib"), [(NEAR, 1.0), (FITS_NEAR, 3.6), (FITS_NEAR, 1.0)])
def test_plan_follows_the_kept_copy_of_the_config_as_given(capsys, gpu, weights_gib):
    kept_copy(weights_gib)
    runs = weights_gib < 2
    _, document = json_of(capsys, "plan", "--gpu", gpu, *FLAGS)
    assert document["fits"]
    if runs:  # the config as given, as the copy runs it
        assert document["changes"] == [] and document["copy"]["runs"]
        assert document["config"]["per_device_train_batch_size"] == 8
    else:  # the copy runs it out where the estimate fits it: a smaller micro-batch, judged by the estimate
        assert [c["knob"] for c in document["changes"]] == ["per_device_train_batch_size"]
        assert document["config"]["per_device_train_batch_size"] < 8 and document["copy"] is None
        assert any(note.startswith("near the boundary, decided by the exact engine's copy of your config as given")
                   and "it runs out on this card" in note for note in document["notes"])
    _, out, _ = run(capsys, "plan", "--gpu", gpu, *FLAGS)
    assert ("Your config fits as it is" in out) is runs


@pytest.mark.parametrize("weights_gib", [1.0, 5.6])
def test_gpus_judges_the_cards_near_the_boundary_by_the_kept_copy(capsys, weights_gib):
    # 16 x (1,024 + 500) tokens: 5.43 GiB estimated, near the boundary of a 6 GB laptop card only
    knobs = {**KNOBS, "num_generations": 16, "per_device_train_batch_size": 16, "max_completion_length": 500}
    kept_copy(weights_gib, knobs, completions=(257, 512))
    _, out, _ = run(capsys, "gpus", *flags_of(knobs), "--json")
    cards = {card["name"]: card for card in json.loads(out)}
    assert cards["rtx3060-mobile-6gb"]["fits"] is (weights_gib < 5)
    # the cards far from it are the estimate's: all that run bfloat16 fit
    assert all(card["fits"] for card in cards.values() if card["capacity_bytes"] > 7 * GiB and not card["problem"])
