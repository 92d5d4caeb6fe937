"""The first micro-batch of the run judged on its own: its phases run before any optimizer state exists, so a run can
die there, before its first optimizer step (the seeds' laptop run did)."""

from __future__ import annotations

import json

from helpers import run
from vram_planner import engine
from vram_planner.model import components as m

GiB = 2**30
SEEDS = dict(per_device_train_batch_size=1, gradient_accumulation_steps=4, num_generations=4, max_prompt_length=256,
             max_completion_length=786, dtype="bfloat16", mixed_precision="bf16",
             attn_implementation="flash_attention_2", gradient_checkpointing=False)
SEEDS_FLAGS = ["--trl-version", "0.14.0", "--per-device-train-batch-size", "1", "--gradient-accumulation-steps", "4",
               "--num-generations", "4", "--max-prompt-length", "256", "--max-completion-length", "786", "--dtype",
               "bfloat16", "--mixed-precision", "bf16", "--attn-implementation", "flash_attention_2",
               "--no-gradient-checkpointing"]


def test_its_phases_hold_no_optimizer_state_and_no_gradient_from_an_earlier_micro_batch():
    knobs = {"gradient_accumulation_steps": 4, "dtype": "bfloat16"}
    verdict = engine.check("Llama-3.2-1B", "a100-80gb", knobs)
    arch, train = verdict.context.arch, verdict.train
    first = {p.name: p for p in verdict.first_micro_batch.phases}
    steady = {p.name: p for p in verdict.estimate.phases}
    assert "optimizer" not in first and set(first) == set(steady) - {"optimizer"}
    states = m.optimizer_state_bytes(arch, train)
    assert states > 0 and all(p.components["optimizer_states"] == 0 for p in first.values())
    assert all(p.components["optimizer_states"] == states for p in steady.values())
    # generation differs by the optimizer states alone (and what the allocator reserves for them)
    tensors = {c: first["generation"].components[c] for c in ("weights", "kv_cache", "activations")}
    assert tensors == {c: steady["generation"].components[c] for c in tensors}


def test_the_seeds_run_dies_in_its_first_micro_batch():
    verdict = engine.check("Llama-3.2-1B-Instruct", "rtx3080-mobile", {**SEEDS, "transformers_version": "4.52"},
                        trl_version="0.14.0")
    assert not verdict.fits and not verdict.first_micro_batch_fits
    first = verdict.first_micro_batch
    assert first.peak_phase.name == "training" and first.peak_bytes > verdict.context.budget_bytes
    assert first.peak_bytes < verdict.estimate.peak_bytes  # the steady step needs more still


def test_a_run_that_gets_past_its_first_micro_batch_is_told_so(capsys):
    code, out, _ = run(capsys, "check", "--gpu", "rtx3080-mobile", "--model", "Llama-3.2-1B", "--json")
    report = json.loads(out)
    first = report["first_micro_batch"]
    assert code == 1 and not report["fits"] and first["fits"]
    assert isinstance(first["peak_bytes"], int) and first["peak_bytes"] < report["peak_bytes"]
    assert [p["name"] for p in first["phases"]] == ["generation", "training"]
    assert all(p["components"]["optimizer_states"] == 0 for p in first["phases"])
    code, out, _ = run(capsys, "check", "--gpu", "rtx3080-mobile", "--model", "Llama-3.2-1B")
    assert "The first micro-batch fits (" in " ".join(out.split())


def test_check_and_plan_say_when_the_run_dies_before_its_first_optimizer_step(capsys):
    code, out, _ = run(capsys, "check", "--gpu", "rtx3080-mobile", "--model", "Llama-3.2-1B-Instruct", *SEEDS_FLAGS,
                       "--transformers-version", "4.52")
    text = " ".join(out.split())
    assert code == 1 and "Dies before its first optimizer step: the first micro-batch alone, with no optimizer state" \
        " yet, needs" in text
    code, out, _ = run(capsys, "check", "--gpu", "rtx3080-mobile", "--model", "Llama-3.2-1B-Instruct", *SEEDS_FLAGS,
                       "--transformers-version", "4.52", "--json")
    first = json.loads(out)["first_micro_batch"]
    assert not first["fits"] and first["peak_phase"] == "training" and first["peak_bytes"] > 14 * GiB
    # plan reports the first micro-batch of the config it shows, in --json
    code, out, _ = run(capsys, "plan", "--gpu", "rtx3080-mobile", "--model", "Llama-3.2-1B-Instruct", *SEEDS_FLAGS,
                       "--json")
    report = json.loads(out)
    assert report["fits"] and report["first_micro_batch"]["fits"]
    assert report["first_micro_batch"]["peak_bytes"] <= report["peak_bytes"]
