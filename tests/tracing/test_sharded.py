"""One rank of FSDP2 on fake tensors: torch's own fully_shard on the fake process group, counted by the trace's counter,
held to PyTorch's FSDPMemTracker, to the shards' arithmetic and to the analytic per-rank model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from helpers import FIXTURES, family_fixture_files, json_of, one_line_error
from vram_planner import engine
from vram_planner.errors import VramPlanError
from vram_planner.model.phases import estimate
from vram_planner.model.spec import TrainingConfig
from vram_planner.tracing.step import check_traceable, trace_step

pytest.importorskip("torch")
pytest.importorskip("trl")

FIXTURE = FIXTURES / "tiny-llama-bias.json"  # untied embeddings and biases: every kind of FSDP unit
TINY = json.loads(FIXTURE.read_text())
SHORT = {"per_device_train_batch_size": 2, "num_generations": 2, "max_prompt_length": 16, "max_completion_length": 16,
         "dtype": "bfloat16"}
BLOCK = 512  # CUDA's allocation granule, which the counter (and FSDPMemTracker on CUDA) rounds each storage up to


def rounded(n_bytes: int) -> int:
    return -(-n_bytes // BLOCK) * BLOCK


def fsdp(gpus: int, **knobs) -> TrainingConfig:
    return TrainingConfig(**{**SHORT, **knobs}, num_gpus=gpus, fsdp=True)


@pytest.fixture(scope="module")
def ranks():
    return {gpus: trace_step(TINY, fsdp(gpus)) for gpus in (2, 4)}


def parameter_shapes() -> list[tuple[int, ...]]:
    from helpers import build_on_meta

    return [tuple(p.shape) for p in build_on_meta(TINY).parameters()]


def buffer_bytes() -> list[int]:
    from helpers import build_on_meta

    return [b.numel() * b.element_size() for b in build_on_meta(TINY).buffers()]


def shard_rows(shape: tuple[int, ...], gpus: int) -> int:
    """Rank 0's rows of a parameter: FSDP2 chunks dim 0 into N and pads every rank to the first, largest chunk."""
    return math.ceil(shape[0] / gpus) * math.prod(shape[1:])


def test_fsdp2_counts_agree_with_pytorchs_fsdp_mem_tracker(monkeypatch):
    import torch
    from torch.distributed._tools import mem_tracker
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from vram_planner.tracing.session import build_session
    from vram_planner.tracing.sharded import sharded_rank

    # FSDPMemTracker rounds to CUDA's granule on CUDA devices only; the fake tensors here are CPU tensors
    monkeypatch.setattr(mem_tracker._WeakRefInfo, "_calculate_mem_consumed",
                        lambda self: rounded(self.size * self.element_size))
    session = build_session(TINY, fsdp(2))
    with sharded_rank(session), session.fake_mode, session.tracker:
        tracker = session.tracker
        optimizer = torch.optim.AdamW(session.model.parameters(), foreach=True)
        tracker.assumed_number = 1  # the step count Adam reads on the host
        peaks = []
        for part in ("forward and backward", "optimizer step"):
            checker = FSDPMemTracker(session.model, optimizer)
            with checker:
                tracker.reset_peak()
                if part == "optimizer step":
                    optimizer.step()
                    optimizer.zero_grad()
                else:
                    ids = torch.zeros((2, 32), dtype=torch.long)
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = session.model(input_ids=ids, labels=ids).loss
                    loss.backward()
                    del loss, ids
            peaks.append((tracker.peak, checker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]))
    assert all(ours == theirs for ours, theirs in peaks), peaks
    assert peaks[0][0] != peaks[1][0]  # two different moments were compared


@pytest.mark.parametrize("gpus", [2, 4])
def test_each_rank_holds_float32_shards_of_every_parameter_and_adamws_states_for_them(ranks, gpus):
    shards = [rounded(shard_rows(shape, gpus) * 4) for shape in parameter_shapes()]  # fp32 masters (accelerate)
    optimizer = ranks[gpus].phase("optimizer")
    buffers = sum(rounded(shape_bytes) for shape_bytes in buffer_bytes())  # rotary's, replicated on every rank
    assert optimizer.components["weights"] == sum(shards) + buffers
    # fused AdamW: two moments per shard and a float32 step per parameter on the device
    assert optimizer.components["optimizer_states"] == 2 * sum(shards) + BLOCK * len(shards)


def test_generation_gathers_a_layer_at_a_time_whatever_the_number_of_ranks(ranks):
    gathered = {gpus: r.phase("generation").components["weights"] - r.phase("optimizer").components["weights"]
                for gpus, r in ranks.items()}
    whole_model_bf16 = ranks[2].params * 2
    assert gathered[2] == gathered[4]  # the tail and a layer, gathered whole on every rank
    assert 0 < gathered[2] < whole_model_bf16  # TRL's FSDP2 generation summons nothing


def test_micro_batches_before_the_last_keep_whole_unreduced_gradients(ranks):
    accumulating = trace_step(TINY, fsdp(4, gradient_accumulation_steps=2))
    whole_bf16 = accumulating.trainable_params * 2  # accelerate's no_sync: FSDP2 reduces nothing until the last
    assert accumulating.phase("training").components["gradients"] >= whole_bf16
    assert ranks[4].phase("training").components["gradients"] < whole_bf16


def test_the_trace_covers_fsdp_and_refuses_zero0_ddp_and_offload():
    check_traceable(fsdp(4))
    for config, why in ((TrainingConfig(num_gpus=2, zero_stage=0), "not stage 0"),
                        (TrainingConfig(num_gpus=2, zero_stage=3, offload_optimizer="cpu", offload_param="cpu"),
                         "without ZeRO-Offload"),
                        (TrainingConfig(num_gpus=2), "not DDP"),
                        (TrainingConfig(num_gpus=2, fsdp=True, offload_param="cpu"), "without its CPU offload")):
        with pytest.raises(VramPlanError, match=why):
            check_traceable(config)


def test_trace_command_answers_for_one_rank(capsys):
    args = ["trace", "--gpu", "24GiB", "--model", str(FIXTURE), "--per-device-train-batch-size", "2",
            "--num-generations", "2", "--max-prompt-length", "16", "--max-completion-length", "16",
            "--dtype", "bfloat16"]
    _, two = json_of(capsys, *args, "--num-gpus", "2", "--fsdp")
    _, four = json_of(capsys, *args, "--num-gpus", "4", "--fsdp")
    states = [{p["name"]: p for p in doc["phases"]}["optimizer"]["components"]["optimizer_states"]
              for doc in (two, four)]
    assert states[1] < states[0]  # each rank steps its own shards
    assert "DDP" in one_line_error(capsys, *args, "--num-gpus", "2")


@pytest.mark.parametrize("gpus", [2, 4])
@pytest.mark.parametrize("knobs", [{}, {"lora_r": 8}], ids=["full", "lora"])
def test_the_analytic_fsdp_model_holds_the_fixtures_rank_within_2_percent_never_under_but_for_blocks(gpus, knobs):
    # the fixture's kilobyte shards: every storage's rounding to whole blocks and every unit's gathers and
    # reductions count. Under the trace by no more than a decoding step's few one-block tensors (positions, a cache
    # position, the sampler's flags) that the analytic model leaves out
    context = engine.make_context(str(FIXTURE), "h100-80gb")
    train = engine.make_training(context, {**SHORT, **knobs, "num_gpus": gpus, "fsdp": True})
    traced = trace_step(TINY, train, context.release)
    analytic = {p.name: p for p in estimate(context.arch, train, context.release, context.calibration,
                                             context.capacity_bytes).phases}
    for phase in traced.phases:
        gap = analytic[phase.name].tensor_bytes - phase.peak_bytes
        assert -8 * BLOCK <= gap <= 0.02 * phase.peak_bytes, (phase.name, gap / phase.peak_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("gpus", [2, 8])
def test_the_analytic_fsdp_model_stays_within_1_percent_of_the_sharded_trace(gpus):
    model = Path(__file__).resolve().parents[2] / "profiles" / "models" / "Llama-3.2-1B.json"
    context = engine.make_context(str(model), "h100-80gb")
    train = engine.make_training(context, {**SHORT, "max_prompt_length": 32, "max_completion_length": 32,
                                        "num_gpus": gpus, "fsdp": True})
    traced = trace_step(json.loads(model.read_text()), train, context.release)
    analytic = {p.name: p for p in estimate(context.arch, train, context.release, context.calibration,
                                             context.capacity_bytes).phases}
    for phase in traced.phases:
        error = (analytic[phase.name].tensor_bytes - phase.peak_bytes) / phase.peak_bytes
        assert abs(error) < 0.01, (phase.name, error)


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [{}, {"lora_r": 16}], ids=["full", "lora"])
def test_the_old_log_probs_gather_as_a_decoding_step_with_the_tied_tail_kept_since_generation(knobs):
    # Qwen3-0.6B's widths at 4 layers on 8: the tied tail (embedding, final norm and head: most of the model) is
    # gathered once in the generation and stays, so each scoring forward gathers layers beside it and no all-gather
    # output of the tail; counting the prefill's first gathers there put the analytic scoring 39% above the trace
    qwen = json.loads((Path(__file__).resolve().parents[2] / "profiles" / "models" / "Qwen3-0.6B.json").read_text())
    shallow = qwen | {"num_hidden_layers": 4}
    context = engine.make_context(shallow, "h100-80gb")
    old_log_probs = {"steps_per_generation": 4, "gradient_accumulation_steps": 2}
    train = engine.make_training(context, {**SHORT, **knobs, **old_log_probs, "num_gpus": 8, "fsdp": True})
    traced = {p.name: p for p in trace_step(shallow, train, context.release).phases}
    analytic = {p.name: p for p in estimate(context.arch, train, context.release, context.calibration,
                                             context.capacity_bytes).phases}
    error = (analytic["scoring"].tensor_bytes - traced["scoring"].peak_bytes) / traced["scoring"].peak_bytes
    assert 0 <= error < 0.01, error


@pytest.mark.slow
@pytest.mark.parametrize("fixture", family_fixture_files(), ids=lambda path: path.stem)
def test_every_fixture_architecture_traces_one_fsdp2_rank_as_check_counts_it(fixture):
    # accelerate's wrapping finds each family's decoder layer and final norm; the tiny shards' 512-byte rounding keeps
    # the analytic model within a few percent of them
    context = engine.make_context(str(fixture), "h100-80gb")
    train = engine.make_training(context, {**SHORT, "num_gpus": 2, "fsdp": True})
    traced = trace_step(json.loads(fixture.read_text()), train, context.release)
    analytic = {p.name: p for p in estimate(context.arch, train, context.release, context.calibration,
                                             context.capacity_bytes).phases}
    for phase in traced.phases:
        assert abs(analytic[phase.name].tensor_bytes - phase.peak_bytes) < 0.05 * phase.peak_bytes, phase.name


def test_one_ranks_exact_need_holds_nccls_buffers_outside_the_allocator():
    from vram_planner.model.nccl import nccl_figure

    outcome = engine.trace(str(FIXTURE), "h100-80gb", {**SHORT, "num_gpus": 2, "fsdp": True})
    context = outcome.traced.context
    figure = nccl_figure(context.gpu, 2, "fsdp").bytes
    assert figure > 0
    assert {p.components["nccl_buffers"] for p in outcome.traced.estimate.phases} == {figure}
    assert {p.components["nccl_buffers"] for p in outcome.analytic.estimate.phases} == {figure}
    # the least card: what cudaMalloc must hand out, plus the CUDA context and NCCL's buffers beside it
    assert outcome.need_bytes == outcome.need.capacity_bytes + round(context.cuda_context.bytes) + figure
    assert outcome.held_bytes == outcome.need.held_bytes + round(context.cuda_context.bytes) + figure
