"""`check --exact` and `plan --exact`: the step traced and judged by its need (the least card on which the allocator
model replays it), check's and plan's documents with an `exact` block, and one-line refusals."""

from __future__ import annotations

import pytest

from helpers import FIXTURES, cli_in_a_subprocess, json_of, one_line_error, run
from vram_planner.allocator import replay_events
from vram_planner.units import MiB

pytest.importorskip("trl")

TINY = str(FIXTURES / "tiny-llama-headdim.json")
SHORT = ["--per-device-train-batch-size", "2", "--num-generations", "2", "--max-prompt-length", "16",
         "--max-completion-length", "16"]
# Four 512-token completions in micro-batches of four, LoRA: the plan's ladder halves the micro-batch
LADDER = ["--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "1", "--num-generations", "4",
          "--max-prompt-length", "16", "--max-completion-length", "512", "--lora-r", "8"]


@pytest.fixture(scope="module")
def exact_24gib():
    """`check --exact --json` of the short step on a 24 GiB card, and the same without --exact."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        from vram_planner import engine

        outcome = engine.check(TINY, "24GiB", {"per_device_train_batch_size": 2, "num_generations": 2,
                                            "max_prompt_length": 16, "max_completion_length": 16}, exact=True)
    return outcome


def test_check_exact_json_is_checks_document_with_the_need(capsys, no_alloc_conf):
    code, plain = json_of(capsys, "check", "--gpu", "24GiB", "--model", TINY, *SHORT)
    code, doc = json_of(capsys, "check", "--exact", "--gpu", "24GiB", "--model", TINY, *SHORT)
    assert code == 0 and doc["fits"] and doc["command"] == "check"
    exact = doc["exact"]
    assert set(exact) == {"need_bytes", "tensor_peak_bytes", "reserved_peak_bytes", "seconds"} and exact["seconds"] > 0
    context = doc["phases"][0]["components"]["cuda_context"]
    # the need holds the CUDA context, the tensors and the cuBLAS workspaces, in the allocator's 2 MiB segments
    assert exact["need_bytes"] >= context + exact["tensor_peak_bytes"]
    assert (exact["need_bytes"] - context) % (2 * MiB) == 0
    assert exact["reserved_peak_bytes"] + context >= exact["need_bytes"]
    # the analytic figures stay the estimate's; only the verdict moves to the need
    assert {k: v for k, v in doc.items() if k not in ("exact", "notes")} == {
        k: v for k, v in plain.items() if k not in ("exact", "notes")} and plain["exact"] is None


def test_check_exact_agrees_with_the_traces_need(capsys, no_alloc_conf):
    _, check = json_of(capsys, "check", "--exact", "--gpu", "24GiB", "--model", TINY, *SHORT)
    _, trace = json_of(capsys, "trace", "--gpu", "24GiB", "--model", TINY, *SHORT)
    assert trace["exact"]["need_bytes"] == check["exact"]["need_bytes"]
    assert trace["exact"]["tensor_peak_bytes"] == check["exact"]["tensor_peak_bytes"]


@pytest.fixture
def no_alloc_conf(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)


def test_the_exact_verdict_keeps_no_safety_margin(capsys, no_alloc_conf, exact_24gib):
    # A card of exactly the need: the estimate keeps 5% of it free and says no; the traced step runs on it.
    card = f"{exact_24gib.need_bytes // MiB}MiB"
    code, plain = json_of(capsys, "check", "--gpu", card, "--model", TINY, *SHORT)
    assert code == 1 and not plain["fits"]
    code, exact = json_of(capsys, "check", "--exact", "--gpu", card, "--model", TINY, *SHORT)
    assert code == 0 and exact["fits"] and exact["exact"]["need_bytes"] <= exact["capacity_bytes"]


def test_a_card_below_the_need_does_not_fit_and_the_replay_runs_out_there(capsys, no_alloc_conf, exact_24gib):
    card = exact_24gib.need_bytes - 2 * MiB
    code, doc = json_of(capsys, "check", "--exact", "--gpu", f"{card // MiB}MiB", "--model", TINY, *SHORT)
    assert code == 1 and not doc["fits"] and doc["exact"]["need_bytes"] > doc["capacity_bytes"]
    assert any("could not find memory after freeing its cache" in note for note in doc["notes"])
    # what the verdict rests on: the allocator model runs out of the memory the CUDA context leaves of this card
    context = doc["phases"][0]["components"]["cuda_context"]
    from vram_planner.model.cublas import workspace_bytes
    from vram_planner.tracing.events import with_workspaces

    stream = with_workspaces(exact_24gib.result.steady_stream(),
                             workspace_bytes(exact_24gib.traced.context.gpu.compute_capability))
    events = [(e.kind, e.block, e.size_bytes) for e in stream.events]
    assert replay_events(events, capacity_bytes=card - context).out_of_memory is not None
    assert replay_events(events, capacity_bytes=exact_24gib.need_bytes - context).out_of_memory is None


def test_check_exact_says_what_the_run_needs_and_what_the_allocator_holds(capsys, no_alloc_conf):
    code, out, _ = run(capsys, "check", "--exact", "--gpu", "24GiB", "--model", TINY, *LADDER)
    assert code == 0
    lines = " ".join(out.split())  # as rich wrapped them to the terminal
    assert "✔ fits: the step needs" in lines and "no safety margin" in lines and "without --exact" in lines
    assert "It needs" in lines and "what nvidia-smi shows" in lines and "cudaMalloc fails" in lines


def test_trace_judges_by_the_need_too(capsys, no_alloc_conf, exact_24gib):
    # On a card of the need, the allocator holds the card's worth less a few MiB: the held figure with a 5% margin
    # said "does not fit"; the need says it runs.
    card = f"{exact_24gib.need_bytes // MiB}MiB"
    code, doc = json_of(capsys, "trace", "--gpu", card, "--model", TINY, *SHORT)
    assert code == 0 and doc["fits"] and doc["exact"]["need_bytes"] <= doc["capacity_bytes"]
    code, out, _ = run(capsys, "trace", "--gpu", card, "--model", TINY, *SHORT)
    assert "✔ fits: the step needs" in out and "what nvidia-smi shows" in " ".join(out.split())


@pytest.fixture(scope="module")
def ladder_need():
    """The need of the LADDER config (micro-batch 4) on a card with room, and of its micro-batch 2."""
    from vram_planner import engine

    settings = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "num_generations": 4,
                "max_prompt_length": 16, "max_completion_length": 512, "lora_r": 8}
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        own = engine.check(TINY, "24GiB", settings, exact=True)
        half = engine.check(TINY, "24GiB", settings | {"per_device_train_batch_size": 2,
                                                     "gradient_accumulation_steps": 2}, exact=True)
    assert half.need_bytes < own.need_bytes  # the ladder's next config needs less
    return own, half


def test_plan_exact_takes_the_config_above_the_estimates_choice_when_it_runs(capsys, no_alloc_conf, ladder_need):
    own, _ = ladder_need
    card = f"{-(-own.need_bytes // MiB)}MiB"  # the user's config runs here; the estimate's 5% margin turns it down
    code, plain = json_of(capsys, "plan", "--gpu", card, "--model", TINY, *LADDER)
    assert code == 0 and plain["config"]["per_device_train_batch_size"] == 2
    code, doc = json_of(capsys, "plan", "--exact", "--gpu", card, "--model", TINY, *LADDER)
    assert code == 0 and doc["fits"] and doc["config"]["per_device_train_batch_size"] == 4 and doc["changes"] == []
    above = doc["exact_rung_above"]
    assert above["settings"] == {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1}
    assert above["fits"] and above["need_bytes"] == doc["exact"]["need_bytes"] <= doc["capacity_bytes"]
    code, out, _ = run(capsys, "plan", "--exact", "--gpu", card, "--model", TINY, *LADDER)
    assert "it runs, so it is the choice" in " ".join(out.split())


def test_plan_exact_keeps_the_choice_when_the_config_above_does_not_run(capsys, no_alloc_conf, ladder_need):
    own, half = ladder_need
    card = f"{(own.need_bytes + half.need_bytes) // 2 // MiB}MiB"
    code, doc = json_of(capsys, "plan", "--exact", "--gpu", card, "--model", TINY, *LADDER, "--safety-margin", "0")
    above = doc["exact_rung_above"]
    assert above["settings"]["per_device_train_batch_size"] == 4 and above["fits"] is False
    assert above["need_bytes"] > doc["capacity_bytes"]
    assert code == 0 and doc["fits"] and doc["config"]["per_device_train_batch_size"] == 2
    assert doc["exact"]["need_bytes"] <= doc["capacity_bytes"]


def test_plan_exact_traces_the_smallest_config_where_nothing_fits_by_the_estimate(capsys, no_alloc_conf):
    # The smallest config is QLoRA, traced with its 4-bit weights: it does not run by its need either
    code, doc = json_of(capsys, "plan", "--exact", "--gpu", "300MiB", "--model", TINY, *LADDER)
    assert code == 1 and not doc["fits"]
    assert doc["exact"]["need_bytes"] > doc["capacity_bytes"]
    assert not any("could not be traced" in n for n in doc["notes"])


def test_plan_exact_keeps_the_estimate_where_the_trace_cannot_run_the_config(capsys, no_alloc_conf):
    # Paged optimizers keep their states outside torch's allocator, which the CPU trace cannot count
    code, doc = json_of(capsys, "plan", "--exact", "--gpu", "300MiB", "--model", TINY, *LADDER, "--optim",
                        "paged_adamw_8bit")
    assert code == 1 and not doc["fits"] and doc["exact"] is None
    assert any("the smallest config could not be traced" in n and "managed memory" in n for n in doc["notes"])


def test_exact_with_maximize_is_one_line(capsys):
    err = one_line_error(capsys, "plan", "--exact", "--maximize", "max_completion_length", "--gpu", "24GiB",
                         "--model", TINY)
    assert "--exact" in err and "--maximize" in err


def test_check_exact_of_what_the_cpu_cannot_trace_is_one_line(capsys):
    err = one_line_error(capsys, "check", "--exact", "--gpu", "24GiB", "--model", TINY, "--optim", "paged_adamw_8bit")
    assert "cannot run this config" in err and "managed memory" in err


@pytest.mark.parametrize("command", ["check", "plan"])
def test_without_the_train_extra_it_says_how_to_install_it(command):
    done = cli_in_a_subprocess(command, "--exact", "--gpu", "24GiB", "--model", TINY, *SHORT,
                               setup="sys.modules['torch'] = None")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "pip install 'vram-plan[train]'" in done.stderr
    assert "--exact" in done.stderr and "(torch cannot be imported)" in done.stderr


@pytest.mark.slow  # two steps of 512 sequences traced: about a minute
def test_the_exact_need_is_the_runs_where_a_batch_of_shorter_prompts_needs_more(no_alloc_conf, tmp_path):
    # SmolLM2-135M's full fine-tuning generating 512 sequences of 128 + 192 tokens, with an 8,192-word vocabulary: a
    # batch whose longest prompt is 113 tokens needs more (the prefill's segments hold a block fewer beside nearly a
    # block), and a run meets it. (With its own 49,152 words the sampling's float32 probabilities and multinomial's
    # noise, 96 MiB each per decoding step, decide the need at both lengths alike: the grid's needs, 5.50 GiB each.)
    import json
    import re

    from vram_planner import engine
    from vram_planner.units import format_gib

    model = tmp_path / "SmolLM2-135M-8k.json"
    catalog = FIXTURES.parents[1] / "profiles" / "models"
    model.write_text(json.dumps(json.loads((catalog / "SmolLM2-135M.json").read_text()) | {"vocab_size": 8192}))
    settings = {"dtype": "bfloat16", "num_generations": 8, "per_device_train_batch_size": 64,
                "gradient_accumulation_steps": 2, "steps_per_generation": 8, "max_prompt_length": 128,
                "max_completion_length": 192}
    context = engine.make_context(str(model), "h100-80gb")
    assert engine.heavier_prompt_length(context, engine.make_training(context, settings)) == 113
    outcome = engine.check(str(model), "h100-80gb", settings, exact=True)
    said = [note for note in outcome.traced.estimate.notes if "longest prompt is 113 tokens" in note]
    found = re.search(r"needs ([0-9.]+) GiB, more than ([0-9.]+) GiB with 128", said[0]) if said else None
    assert found and float(found[1]) > float(found[2])
    assert format_gib(outcome.need_bytes) == f"{found[1]} GiB" and outcome.traced.train.max_prompt_length == 128
    # the estimate counts that batch too
    shorter = engine.check(str(model), "h100-80gb", {**settings, "max_prompt_length": 113})
    assert outcome.analytic.estimate.peak_bytes >= shorter.estimate.peak_bytes
