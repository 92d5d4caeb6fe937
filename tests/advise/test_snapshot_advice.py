"""`vram-plan advise SNAPSHOT`: out-of-memory snapshots in torch's format made by the allocator model (a step's
tensors from the plan, malloc'd until the capacity runs out), and the H100 recordings, explained at their failed
allocation or worst moment: every live block has a role, the roles add up to the allocated bytes, and the cached
bytes are the model's."""

from __future__ import annotations

import contextlib
import json
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from snapshot_builder import Recorder, expand, fragmented_until_oom

from helpers import h100_snapshot, one_line_error, run
from vram_planner import engine
from vram_planner.advise.roles import planned_tensors
from vram_planner.advise.snapshot import explain_snapshot
from vram_planner.allocator import parse_allocator_conf
from vram_planner.allocator.caching import OutOfMemory
from vram_planner.allocator.sizes import round_size
from vram_planner.allocator.snapshot import parse_snapshot
from vram_planner.allocator.snapshot_replay import replay_until

MiB = 2**20
SMOL = {"per_device_train_batch_size": 2, "num_generations": 2, "max_prompt_length": 64, "max_completion_length": 64}


def planned_bytes(sizes) -> int:  # sizes: a Counter of byte sizes
    return sum(size * count for size, count in sizes.items())


def blocks(recorder: Recorder, addresses) -> int:
    """The bytes of these live blocks as the allocator made them (torch.cuda.memory_allocated counts these)."""
    return sum(recorder.allocator.block_size(a) for a in addresses)


def explained(recorder: Recorder, verdict=None, with_blocks: bool = True):
    snapshot = parse_snapshot(recorder.snapshot(with_blocks))
    return explain_snapshot(snapshot, 0, verdict.context if verdict else None, verdict.train if verdict else None)


def loaded(recorder: Recorder, planned) -> list[int]:
    return [recorder.malloc(size) for size in expand(planned.weights)]


def test_an_oom_while_generating_is_the_kv_cache_by_role_and_the_phase_generation():
    """SmolLM2-135M with LoRA: the weights (base and adapters), then DynamicCache growing a position at a time, each
    layer's K and V made one position longer and the shorter ones freed, until a K of the card's last bytes fails."""
    knobs = {**SMOL, "per_device_train_batch_size": 16, "num_generations": 16, "max_completion_length": 1024,
             "lora_r": 16}
    verdict = engine.check("SmolLM2-135M", "1GiB", knobs)  # a card it does not fit: the plan has fixes
    planned = planned_tensors(verdict.context.arch, verdict.train)
    unit, layers = planned.kv_position_bytes[0], planned.num_layers
    probe = Recorder()
    loaded(probe, planned)
    capacity = probe.allocator.reserved_bytes + 2 * layers * unit * 150  # the cache outgrows it well before its end
    recorder = Recorder(capacity)
    weights = loaded(recorder, planned)
    kv: list[list[int]] = [[] for _ in range(layers)]
    with pytest.raises(OutOfMemory):
        for positions in range(64, verdict.train.sequence_length + 1):
            for layer in range(layers):
                grown = [recorder.malloc(unit * positions) for _ in range(2)]
                for address in kv[layer]:
                    recorder.free(address)
                kv[layer] = grown
            recorder.free(recorder.malloc(planned.vocab_size * 4 * 2))  # the last position's logits
    failed = recorder.events[-1]
    advice = explained(recorder, verdict)
    assert advice.moment == "out_of_memory" and advice.phase == "generation"
    assert advice.requested_bytes == failed["size"] and advice.device_free_bytes == failed["device_free"]
    assert advice.by_role["weights"] == blocks(recorder, weights)
    kept = [a for layer in kv for a in layer]  # and the failing layer's K or V made before its twin failed
    assert advice.by_role["kv_cache"] == blocks(recorder, [a for a, size in recorder.live.items()
                                                           if a in kept or size == failed["size"]])
    assert sum(advice.by_role.values()) == advice.allocated_bytes == recorder.allocator.allocated_bytes
    assert advice.reserved_bytes == recorder.allocator.reserved_bytes
    assert advice.largest_free_block_bytes == max((s for _, s in recorder.allocator.free_blocks()), default=0)
    assert advice.fixes and advice.fitting_config is not None  # ranked against the plan


def test_an_oom_at_the_first_optimizer_step_tells_states_from_gradients_of_the_same_size():
    """Full fine-tuning in float32: weights, gradients and Adam's states are the same sizes; the order tells them
    apart (weights at load, gradients in the backward, states at the first optimizer step)."""
    verdict = engine.check("SmolLM2-135M", "t4", SMOL)
    planned = planned_tensors(verdict.context.arch, verdict.train)
    assert set(planned.weights) == set(planned.gradients) == set(planned.optimizer_states)
    probe = Recorder()
    loaded(probe, planned)
    for size in expand(planned.gradients):
        probe.malloc(size)
    capacity = probe.allocator.reserved_bytes + sum(expand(planned.optimizer_states)) // 3
    recorder = Recorder(capacity)
    weights = loaded(recorder, planned)
    activation = recorder.malloc(64 * MiB)
    grads = [recorder.malloc(size) for size in expand(planned.gradients)]
    recorder.free(activation)
    states = []
    with pytest.raises(OutOfMemory):
        for size in expand(planned.optimizer_states):
            states.append(recorder.malloc(size))
    advice = explained(recorder, verdict, with_blocks=False)  # the cached blocks from the model's replay
    assert advice.phase == "optimizer" and advice.requested_bytes in planned.optimizer_states
    assert advice.by_role["weights"] == blocks(recorder, weights)
    assert advice.by_role["gradients"] == blocks(recorder, grads)
    assert advice.by_role["optimizer_states"] == blocks(recorder, states) > 0
    assert sum(advice.by_role.values()) == advice.allocated_bytes == recorder.allocator.allocated_bytes


def test_the_failed_request_is_named_against_the_plan_and_the_fixes_that_remove_it_come_first():
    """TRL 0.14 on Qwen2.5-0.5B: the weights (and the reference model's), a hidden state, then accelerate's float32
    copy of the logits over prompt and completion does not fit: advise names it, as for a log, and ranks first the
    fixes that remove it."""
    from vram_planner.advise.candidates import logits_candidates

    verdict = engine.check("Qwen2.5-0.5B", "8GiB", {"per_device_train_batch_size": 4, "num_generations": 4,
                                                  "max_prompt_length": 128, "max_completion_length": 256},
                        trl_version="0.14")
    arch, train = verdict.context.arch, verdict.train
    planned = planned_tensors(arch, train)
    logits = next(c.size for c in logits_candidates(arch, train, verdict.context.release) if "float32 copy" in c.name)
    hidden = train.micro_batch_completions * train.sequence_length * arch.hidden_size * 4
    recorder = Recorder(capacity_bytes=planned_bytes(planned.weights) + hidden + logits // 2)
    weights = loaded(recorder, planned)
    recorder.malloc(hidden)
    with pytest.raises(OutOfMemory):
        recorder.malloc(logits)
    advice = explained(recorder, verdict)
    assert advice.requested_bytes == logits and "float32 copy of the policy's logits" in advice.culprit
    assert advice.by_role["weights"] == blocks(recorder, weights) and advice.by_role["activations"] > 0
    assert advice.fixes[0].removes_culprit and advice.fitting_config is not None


def test_fragmentation_that_decided_the_crash_puts_expandable_segments_first():
    """4 MiB blocks packed five to a 20 MiB segment, every other one freed: 100 MiB cached in 4 MiB holes, none of
    which holds the 8 MiB asked for, and no whole segment to give back."""
    recorder = Recorder(capacity_bytes=10 * 20 * MiB + 10 * MiB)
    with pytest.raises(OutOfMemory):
        fragmented_until_oom(recorder, 4 * MiB, 50, 8 * MiB)
    advice = explained(recorder)
    assert advice.fragmentation_decided and advice.roles_from == "none"
    assert advice.reserved_unallocated_bytes == 25 * 4 * MiB and advice.largest_free_block_bytes == 4 * MiB
    assert advice.fragmentation == pytest.approx(1 - 1 / 25)
    assert advice.fixes[0].change == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert advice.by_role["other"] == advice.allocated_bytes == 25 * 4 * MiB


def trl_frames(*names: str) -> list[dict]:
    return [{"filename": "/venv/site-packages/trl/trainer/grpo_trainer.py", "line": 1, "name": n} for n in names]


@pytest.mark.parametrize(("names", "phase"), [
    (("_get_per_token_logps_and_entropies", "_compute_loss", "compute_loss", "training_step"), "training"),
    (("_get_per_token_logps_and_entropies", "_generate_and_score_completions", "_prepare_inputs"), "scoring"),
    (("_sample", "generate", "_generate_single_turn", "_generate"), "generation")])
def test_the_frames_of_the_failed_request_name_its_phase(names, phase):
    """TRL's loss takes its log-probabilities with the function scoring uses: the loss around it decides."""
    recorder = Recorder(capacity_bytes=10 * 20 * MiB + 10 * MiB)
    with pytest.raises(OutOfMemory):
        recorder.malloc(150 * MiB)
        recorder.malloc(150 * MiB, frames=trl_frames(*names))
    assert explained(recorder).phase == phase


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 24 * MiB)), min_size=1, max_size=60),
       st.integers(30 * MiB, 200 * MiB), st.booleans())
def test_any_recorded_sequence_adds_up(steps, capacity, with_blocks):
    """Random mallocs and frees until the capacity runs out (or not): the roles add up to the allocated bytes, which
    are the model's at that moment, and the cached bytes hold together."""
    recorder = Recorder(capacity)
    try:
        for free, size in steps:
            if free and recorder.live:
                recorder.free(next(iter(recorder.live)))
            else:
                recorder.malloc(size)
    except OutOfMemory:
        pass
    if not recorder.events:
        return
    advice = explained(recorder, with_blocks=with_blocks)
    snapshot = parse_snapshot(recorder.snapshot(with_blocks))
    at, _ = replay_until(snapshot, 0, recorder.conf, advice.event_index - 1)
    assert sum(advice.by_role.values()) == advice.allocated_bytes == at.allocated_bytes
    assert advice.reserved_bytes == at.reserved_bytes >= advice.allocated_bytes
    assert advice.largest_free_block_bytes <= advice.reserved_unallocated_bytes
    assert 0 <= advice.fragmentation <= 1
    assert (advice.moment == "out_of_memory") == any(e["action"] == "oom" for e in recorder.events)


def test_advise_reads_a_snapshot_file_and_prints_json(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    recorder = Recorder(capacity_bytes=10 * 20 * MiB + 10 * MiB)
    with pytest.raises(OutOfMemory):
        fragmented_until_oom(recorder, 4 * MiB, 50, 8 * MiB)
    path = tmp_path / "oom-snapshot.pickle"
    path.write_bytes(pickle.dumps(recorder.snapshot()))
    code, out, err = run(capsys, "advise", str(path), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["moment"] == "out_of_memory" and doc["requested_bytes"] == 8 * MiB
    assert sum(doc["by_role"].values()) == doc["allocated_bytes"]
    code, out, _ = run(capsys, "advise", str(path))
    assert code == 0 and "fragmentation decided this crash" in out and "expandable_segments:True" in out


def test_a_pickle_that_is_no_snapshot_is_refused_in_one_line(capsys, tmp_path):
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [[{"action": "alloc", "addr": 1, "size": 2}]],
                                   "segments": [], "x": pytest.approx(1)}))
    message = one_line_error(capsys, "advise", str(path))
    assert "holds a Python object of class" in message and "runs nothing" in message


def test_a_snapshot_over_the_size_bound_is_refused_unread(capsys, tmp_path, monkeypatch):
    from vram_planner.allocator import snapshot

    monkeypatch.setattr(snapshot, "MAX_SNAPSHOT_BYTES", 2**20)
    path = tmp_path / "big.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [], "segments": [], "pad": "x" * 2**21}))
    assert "holds more than 1 MiB, the most vram-plan reads" in one_line_error(capsys, "advise", str(path))


# The knobs each recording trained with (benchmarks/results/gpu/h100-trl-steps.json)
H100_RUNS = {"Qwen2.5-0.5B-full": ("Qwen2.5-0.5B", {"max_prompt_length": 58}),
             "Qwen2.5-0.5B-lora16": ("Qwen2.5-0.5B", {"max_prompt_length": 58, "lora_r": 16}),
             "Llama-3.2-1B-full": ("Llama-3.2-1B", {"max_prompt_length": 53}),
             "Llama-3.2-1B-lora16": ("Llama-3.2-1B", {"max_prompt_length": 53, "lora_r": 16}),
             "SmolLM2-135M-lora16": ("SmolLM2-135M", {"per_device_train_batch_size": 2, "num_generations": 2,
                                                      "max_completion_length": 32, "lora_r": 16})}


@pytest.mark.slow
@pytest.mark.parametrize("name", H100_RUNS)
def test_a_real_h100_step_at_its_worst_moment(name):
    """Two GRPO steps recorded on an H100: at the most bytes allocated every parameter is found as loaded, and in
    full fine-tuning every gradient and both Adam states of every parameter (the second step's backward, after the
    first optimizer step); the moment's allocated bytes are the allocator model's replaying the recording."""
    model, knobs = H100_RUNS[name]
    verdict = engine.check(model, "h100", {"per_device_train_batch_size": 4, "num_generations": 4,
                                        "gradient_accumulation_steps": 1, "max_completion_length": 128,
                                        "gradient_checkpointing": True, **knobs})
    planned = planned_tensors(verdict.context.arch, verdict.train)
    snapshot = h100_snapshot(f"{name}.pkl.gz")
    advice = explain_snapshot(snapshot, 0, verdict.context, verdict.train)
    at, _ = replay_until(snapshot, 0, parse_allocator_conf(snapshot.allocator_conf_text or ""),
                         advice.event_index - 1)
    assert advice.moment == "worst" and advice.roles_from == "plan"
    assert sum(advice.by_role.values()) == advice.allocated_bytes == at.allocated_bytes
    tensors = advice.requested_bytes_by_role
    assert tensors["weights"] == planned_bytes(planned.weights)
    assert tensors["optimizer_states"] == planned_bytes(planned.optimizer_states)
    if "full" in name:
        assert tensors["gradients"] == planned_bytes(planned.gradients)


def truncated(recorder: Recorder, kept: int) -> dict:
    """The snapshot with only its last `kept` trace events, as torch's ring of max_entries keeps them."""
    data = recorder.snapshot()
    data["device_traces"][0] = data["device_traces"][0][-kept:]
    return data


@pytest.mark.parametrize("fails", [True, False])
def test_a_history_that_lost_its_start_still_counts_the_weights_made_before_it(fails):
    """A ring that overflowed keeps no event of the weights' loading: the blocks the file lists alive with no alloc
    event, and one the trace frees without allocating it (alive at the worst moment, before its free), are given the
    plan's roles by size (weights first), added to the allocated bytes, and the report says the history is
    truncated."""
    verdict = engine.check("SmolLM2-135M", "t4", SMOL)
    planned = planned_tensors(verdict.context.arch, verdict.train)
    probe = Recorder()
    loaded(probe, planned)
    recorder = Recorder(probe.allocator.reserved_bytes + 40 * MiB if fails else None)
    weights = loaded(recorder, planned)
    buffer = recorder.malloc(3 * MiB + 5)  # made before the history too, freed within it
    start = len(recorder.events)
    recorder.malloc(16 * MiB)
    worst = recorder.malloc(16 * MiB)
    recorder.free(buffer)
    recorder.free(worst)
    with contextlib.suppress(OutOfMemory):
        recorder.malloc(64 * MiB if fails else 8 * MiB)  # fails in 40 MiB over the weights; else not the worst
    snapshot = parse_snapshot(truncated(recorder, len(recorder.events) - start))
    advice = explain_snapshot(snapshot, 0, verdict.context, verdict.train)
    assert advice.moment == ("out_of_memory" if fails else "worst") and advice.history_truncated
    assert advice.by_role["weights"] == advice.before_history_by_role["weights"] == blocks(recorder, weights)
    assert advice.requested_bytes_by_role["weights"] == planned_bytes(planned.weights)
    made_before = len(weights) + (0 if fails else 1)  # the buffer is freed before the failure, after the worst
    assert advice.before_history_blocks == made_before
    # a block freed after the moment is known by the tensor's bytes only: its block is the request rounded
    assert advice.requested_bytes_by_role["other"] == (0 if fails else 3 * MiB + 5)
    assert advice.by_role["other"] == (0 if fails else round_size(3 * MiB + 5, recorder.conf.roundup_power2_divisions))
    live = (blocks(recorder, recorder.live) if fails
            else blocks(recorder, weights) + 32 * MiB + advice.by_role["other"])
    assert sum(advice.by_role.values()) == advice.allocated_bytes == live
    note = next(n for n in advice.diagnosis if "truncated" in n)
    assert f"the last {len(snapshot.device_traces[0]):,} events" in note and f"{made_before} live block" in note
    assert f"by the plan's sizes): weights {blocks(recorder, weights) / 2**30:.2f} GiB" in note


H200_OOM = Path(__file__).parents[2] / "benchmarks" / "results" / "gpu" / "h200-runs" / "smollm2-oom"
# The run's plan (its stderr.txt): SmolLM2-135M in float32 under bf16 autocast, planned for an 8 GiB card
H200_OOM_KNOBS = ("--gpu", "8GiB", "--model", "SmolLM2-135M", "--per-device-train-batch-size", "32",
                  "--gradient-accumulation-steps", "2", "--max-completion-length", "1024", "--trl-version", "1.16.0")


@pytest.mark.slow
def test_the_h200_out_of_memory_run_whose_ring_overflowed(capsys):
    """The H200 run on an emulated 5.5 GiB card (benchmarks/device_session.sh): its 2,000,000-event ring lost the
    weights' loading. advise reads the gzip file, finds the float32 weights among the blocks made before the history,
    says the history is truncated, and names the 102 MiB request: an MLP activation of the micro-batch's 32
    sequences of 1077 positions, recomputed in the second micro-batch's backward (no optimizer step yet)."""
    code, out, err = run(capsys, "check", *H200_OOM_KNOBS, "--json")
    float32_weights = json.loads(out)["params"] * 4
    code, out, err = run(capsys, "advise", str(H200_OOM / "oom-snapshot.pickle.gz"), *H200_OOM_KNOBS, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["moment"] == "out_of_memory" and doc["requested_bytes"] == 32 * 1077 * 1536 * 2
    assert doc["requested_bytes_by_role"]["weights"] == pytest.approx(float32_weights, rel=0.02)
    assert doc["by_role"]["weights"] == doc["before_history_by_role"]["weights"]
    assert doc["history_truncated"] and doc["events"] == 2_000_000
    assert sum(doc["by_role"].values()) == doc["allocated_bytes"]
    assert doc["phase"] == "training" and doc["by_role"]["optimizer_states"] == 0
    assert doc["by_role"]["gradients"] >= float32_weights  # every gradient, and the next micro-batch's own
    attribution = doc["attribution"]
    assert "MLP activation" in attribution["culprit"] and "1077 positions" in attribution["culprit"]
    assert attribution["culprit_bytes"] == doc["requested_bytes"] and "53-token prompt" in attribution["assumption"]
    assert any("history is truncated: it holds the last 2,000,000 events" in note for note in doc["diagnosis"])
