"""`vram-plan trace --num-gpus N --zero-stage S`: one rank of N under DeepSpeed's own engine (vram_planner/tracing/zero.py),
its buffers held to DeepSpeed 0.19.8's source."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from helpers import FIXTURES
from vram_planner.cli import main
from vram_planner.model import zero
from vram_planner.tracing.step_need import forget_traces

pytest.importorskip("trl")
pytest.importorskip("deepspeed", reason="the ZeRO trace runs DeepSpeed's own engine: pip install 'vram-plan[deepspeed]'")

TINY = FIXTURES / "tiny-llama-bias.json"
PARAMS = 268_512  # tiny-llama-bias, untied, with biases
GPUS = 4
SHORT = ["--per-device-train-batch-size", "2", "--num-generations", "2", "--max-prompt-length", "16",
         "--max-completion-length", "16", "--dtype", "bfloat16", "--num-gpus", str(GPUS)]
# DeepSpeed's default reduce_bucket_size (deepspeed/runtime/zero/config.py:113) in 16-bit elements
BUCKET = zero.REDUCE_BUCKET_ELEMENTS * zero.REDUCE_BUCKET_ELEMENT_BYTES


# Qwen2.5-0.5B's widths and vocabulary at 4 of its 24 layers: DeepSpeed's partitions, buckets and prefetch rounds as a
# real model makes them (the embedding a large part of the flat buffer), in a fifth of the full model's trace
QWEN = json.loads((FIXTURES.parent.parent / "profiles" / "models" / "Qwen2.5-0.5B.json").read_text())
SHALLOW_QWEN = QWEN | {"num_hidden_layers": 4}
SHALLOW_QWEN_STEP = {"per_device_train_batch_size": 2, "num_generations": 2, "max_prompt_length": 32,
                     "max_completion_length": 32, "dtype": "bfloat16"}


def _trace(*flags: str) -> dict:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["trace", "--gpu", "24GiB", "--model", str(TINY), *SHORT, *flags, "--json"])
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def traced() -> dict[str, dict]:
    runs = {"1": ["--zero-stage", "1"], "2": ["--zero-stage", "2"], "3": ["--zero-stage", "3"],
            "3-layer-by-layer": ["--zero-stage", "3", "--no-ds3-gather-for-generation"]}
    return {name: _trace(*flags) for name, flags in runs.items()}


def _component(doc: dict, phase: str, component: str) -> int:
    return next(p for p in doc["phases"] if p["name"] == phase)["components"][component]


@pytest.mark.slow
@pytest.mark.parametrize("run", ["1", "2", "3", "3-layer-by-layer"])
def test_trace_answers_with_one_ranks_phases(traced, run):
    doc = traced[run]
    assert doc["engine"] == "trace" and doc["params"] == PARAMS
    assert [p["name"] for p in doc["phases"]] == ["generation", "training", "optimizer"]
    assert doc["config"].get("ds3_gather_for_generation", True) == (run != "3-layer-by-layer")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["1", "2"])
def test_zero12_keep_the_16bit_model_and_partition_the_optimizer(traced, stage):
    doc = traced[stage]
    # bit16_groups_flat: every 16-bit parameter on every rank (stage_1_and_2.py), padded to the ranks' alignment
    assert 2 * PARAMS <= _component(doc, "optimizer", "weights") <= 1.01 * 2 * PARAMS
    # single_partition_of_fp32_groups (4 bytes) and Adam's two moments (8) of 1/N of the parameters
    assert _component(doc, "generation", "optimizer_states") == pytest.approx(12 * PARAMS / GPUS, rel=0.01)


@pytest.mark.slow
def test_zero3_partitions_the_16bit_parameters_too(traced):
    import torch

    doc = traced["3"]
    # its engine swapped in its own F.linear while it ran; the traces after it run torch's
    assert torch.nn.functional.linear is torch._C._nn.linear
    assert _component(doc, "generation", "optimizer_states") == pytest.approx(12 * PARAMS / GPUS, rel=0.01)
    # the step's peak: after the update ZeRO-3 gathers its persistent parameters again (stage3.py:2840-2841), here
    # every one (each under stage3_param_persistence_threshold, 1e5 elements), beside the partitions
    step = next(p for p in doc["phases"] if p["name"] == "optimizer")
    assert step["peak_moment"] == "optimizer step: persistent parameters gathered"
    assert _component(doc, "optimizer", "weights") == pytest.approx(2 * PARAMS / GPUS + 2 * PARAMS, rel=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["1", "2"])
def test_the_step_is_a_steady_one_with_the_moments_alive_beside_the_gradients_copies(traced, stage):
    # The step's peak comes before the update, while Adam's moments of the earlier steps are alive: the 16-bit
    # gradients the partition touches beside the norm's fp64 copy of one (stage_1_and_2.py:2684, here the peak) or a
    # flat copy and its fp32 copy (:3114-3118), 8 bytes per parameter of the partition at least; the first step makes
    # the moments after them, 8 bytes less at that moment, which is all a trace of the first step would see
    from vram_planner.model.architecture import ModelArchitecture

    doc = traced[stage]
    step = next(p for p in doc["phases"] if p["name"] == "optimizer")
    assert step["peak_moment"] in ("optimizer step: the gradient norm", "optimizer step: the fp32 gradient partition")
    assert _component(doc, "optimizer", "optimizer_states") == _component(doc, "generation", "optimizer_states")
    assert _component(doc, "optimizer", "gradients") - _component(doc, "generation", "gradients") >= 8 * PARAMS / GPUS
    # the trace runs the rank the planner counts where the step peaks (the loss phase here: ZeRO-2's that touches the
    # most gradients, ZeRO-1's rank 0); the plan's step is the rank whose step holds the most, and beside the trace
    # the analytic step is counted for the traced rank: the plan's less what that rank holds more
    groups = zero.optimizer_groups(ModelArchitecture.from_config(json.loads(TINY.read_text())), None, None)
    rank = zero.accumulating_rank(groups, GPUS) if stage == "2" else 0
    assert any(f"rank {rank} of {GPUS} traced" in note for note in doc["notes"]) == (rank != 0)
    assert zero.rank_excess_bytes(groups, GPUS, int(stage), "optimizer", rank) == (
        zero.step_gradient_bytes(groups, GPUS, int(stage)) - zero.zero12_step_bytes(groups, GPUS, rank))
    assert step["analytic_tensor_bytes"] == pytest.approx(step["tensor_bytes"], rel=0.01)


@pytest.mark.slow
def test_a_rank_other_than_the_one_planned_is_compared_as_that_rank():
    # On 4 ranks the tiny model's ZeRO-2 partition 2 keeps the most whole gradients (the loss phase's planned rank),
    # partition 3's step holds the most (the step's): traced as rank 2, the step beside it is counted for rank 2 (the
    # plan's rank-3 figure reads 4.9% above it); traced as rank 3, the phases before the step say they count rank 2's
    # gradients, 9,472 bytes more
    from vram_planner import engine
    from vram_planner.model.architecture import ModelArchitecture
    from vram_planner.model.components import zero_rank_excess_bytes
    from vram_planner.tracing.step import compare_with_estimate, trace_step

    config = json.loads(TINY.read_text())
    arch = ModelArchitecture.from_config(config)
    groups = zero.optimizer_groups(arch, None, None)
    assert (zero.accumulating_rank(groups, GPUS), zero.stepping_rank(groups, GPUS)) == (2, 3)
    context = engine.make_context(str(TINY), "h100-80gb")
    train = engine.make_training(context, {"per_device_train_batch_size": 2, "num_generations": 2,
                                           "max_prompt_length": 16, "max_completion_length": 16,
                                           "dtype": "bfloat16", "num_gpus": GPUS, "zero_stage": 2})
    plan = engine.judge(context, train).estimate
    planned_step = next(p for p in plan.phases if p.name == "optimizer").tensor_bytes
    for rank in (2, 3):
        result = trace_step(config, train, zero_rank=rank)
        assert result.zero_rank == rank
        excess = {p.name: zero_rank_excess_bytes(arch, train, p.name, rank) for p in result.phases}
        assert (excess["optimizer"] > 0) == (rank == 2) and excess["training"] == excess["generation"] == 0
        step = next(r for r in compare_with_estimate(result, plan, excess) if r.name == "optimizer")
        assert step.analytic_bytes == planned_step - excess["optimizer"]
        assert abs(step.relative_error) < 0.01
        assert ((planned_step - step.trace_bytes) / step.trace_bytes > 0.04) == (rank == 2)  # the plan's own figure
        said = [n for n in result.notes if n.startswith("the phases before the optimizer step are planned on rank 2")]
        assert len(said) == (rank == 3)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_the_reference_model_is_prepared_as_trl_prepares_it_and_held_to_the_plan(stage):
    # GRPOTrainer hands a full fine-tune's reference model to TRL's own prepare_deepspeed (trl/models/utils.py): an
    # inference engine of the run's DeepSpeed config, ZeRO-3 partitioned (but for the parameters under TRL's
    # persistence threshold of 10 x hidden, here the norms and the key and value biases, kept whole), else stage 0,
    # whole on every rank; each tensor's block rounded up to 512 bytes. Rank 0 of ZeRO-1's stage-0 engine prints
    # its memory use (DeepSpeed's see_memory_usage), which must not reach --json's stdout.
    doc = _trace("--zero-stage", stage, "--beta", "0.04")  # parses stdout as JSON
    reference = _component(doc, "generation", "reference_weights")
    if stage == "3":
        assert 2 * PARAMS / GPUS <= reference < 2 * PARAMS / GPUS * 1.15
    else:
        assert 2 * PARAMS <= reference < 2 * PARAMS * 1.03
    for phase in doc["phases"]:
        assert abs(phase["analytic_relative_error"]) < 0.02, phase["name"]


@pytest.mark.slow
def test_the_reduce_bucket_lives_from_start_up_under_zero3_and_within_the_backward_below(traced):
    # ZeRO-3 allocates its ipg bucket in __init__ (stage3.py:780-784) and keeps it
    assert all(p["components"]["gradients"] >= BUCKET for p in traced["3"]["phases"])
    for stage in ("1", "2"):  # ZeRO-1/2: setup_buckets at the first gradient, cleared when the backward ends
        assert _component(traced[stage], "training", "gradients") >= BUCKET
        assert _component(traced[stage], "generation", "gradients") < BUCKET


@pytest.mark.slow
def test_zero3_generation_gathers_the_whole_model_or_layer_by_layer(traced):
    # GatheredParameters(model.parameters()) (trl/models/utils.py): every 16-bit parameter at once, beside the rank's
    # partition
    assert _component(traced["3"], "generation", "weights") >= 2 * PARAMS
    # without it each layer's forward hook gathers it (partitioned_param_coordinator.py fetch_sub_module), counted as
    # weights beside the partition (DeepSpeed keeps a gathered layer while its reuse distance is under
    # stage3_max_reuse_distance, 1e9 by default: in this small model every one)
    layered = traced["3-layer-by-layer"]
    assert _component(layered, "generation", "weights") > _component(layered, "optimizer", "weights") + PARAMS


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "optim"), [(1, "adamw_torch_fused"), (2, "adamw_torch_fused"),
                                              (3, "adamw_torch_fused"), (3, "adamw_torch")])
def test_the_trace_is_deepspeeds_own_run_on_cpu_ranks(stage, optim):
    # benchmarks/deepspeed_cpu.py ran DeepSpeed 0.19.8 for real on 2 gloo CPU ranks, a 28M-parameter model, each rank's
    # tensors counted by PyTorch's MemTracker (benchmarks/results/deepspeed_cpu.json), the loss and the optimizer step
    # apart, with the optimizer the Trainer hands DeepSpeed: the fake-tensor rank's step is that run's to a few
    # kilobytes (the 512-byte rounding of each block), its loss too less what the run holds on gloo only (ZeRO-3's
    # reduce-scatter copies its input there, NCCL does not: `gloo_only_bytes`), and never below it
    from helpers import benchmark_module

    from vram_planner.model.spec import training_config
    from vram_planner.tracing.step import trace_step

    root = FIXTURES.parent.parent
    benchmark = benchmark_module("deepspeed_cpu")

    rows = json.loads((root / "benchmarks/results/deepspeed_cpu.json").read_text())
    measured = next(r for r in rows if (r["stage"], r["optim"]) == (stage, optim))
    train = training_config({"num_gpus": 2, "zero_stage": stage, "dtype": "float32", "per_device_train_batch_size": 2,
                             "num_generations": 2, "max_prompt_length": 16, "max_completion_length": 16,
                             "optim": optim})
    traced = trace_step(benchmark.CONFIG, train, zero_rank=0)  # the run's rank 0 printed its bytes
    assert traced.phase("optimizer").peak_bytes == pytest.approx(measured["optimizer_step_peak_bytes"][-1], abs=2**16)
    loss = max(measured["loss_peak_bytes"]) - benchmark.gloo_only_bytes(stage, measured["planned"]["params"])
    # ZeRO-3: the trace's peak comes as the backward has gathered the embedding beside the untied head (16 MB), the
    # real run's at its reduce-scatter with one of them
    assert loss - 2**16 <= traced.phase("training").peak_bytes <= loss * (1.02 if stage == 3 else 1) + 2**16
    # the analytic model, computed there for the run's config, never below the trace
    assert measured["planned"]["loss_phase_bytes"] >= traced.phase("training").peak_bytes - 2**16
    # beside what the run keeps, the KV cache and logits; under ZeRO-3 every parameter gathered in 16 bits (TRL's
    # ds3_gather_for_generation)
    gathered = 2 * measured["planned"]["params"] if stage == 3 else 0
    assert 0 <= traced.phase("generation").peak_bytes - measured["kept_bytes"] - gathered < 2**20


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "gather"), [(1, True), (2, True), (3, True), (3, False)],
                         ids=["1", "2", "3", "3-layer-by-layer"])
def test_the_analytic_model_is_held_to_the_trace(stage, gather):
    # benchmarks/sharded.py --zero over more models and N, layer by layer under ZeRO-3 too: every phase within 2%
    # above the trace; here ZeRO-1/2's partition lies inside the embedding, whose whole gradient their step keeps
    # beside the norm's fp64 copy of it, and ZeRO-2's one reduction after the backward (1.96e8 parameters under a
    # bucket) is lighter than the embedding's backward beside the tied head's waiting gradient; layer by layer, the
    # coordinator's prefetch of the whole model and the round in use twice, but the first round, the embedding alone,
    # once (model/zero.py prefetching_forward_params: counted twice, 2.9% above the trace); each phase on the rank
    # the planner counts there
    from vram_planner import engine
    from vram_planner.model.phases import estimate
    from vram_planner.tracing.step import trace_phases_on_their_ranks

    context = engine.make_context(SHALLOW_QWEN, "h100-80gb")
    train = engine.make_training(context, {**SHALLOW_QWEN_STEP, "num_gpus": 8, "zero_stage": stage,
                                           **({} if gather else {"ds3_gather_for_generation": False})})
    traced = {phase.name: phase for _, phase in trace_phases_on_their_ranks(SHALLOW_QWEN, train)}
    analytic = {p.name: p for p in estimate(context.arch, train, context.release, context.calibration,
                                            context.capacity_bytes).phases}
    for phase in ("generation", "training", "optimizer"):
        # never below the trace but for its 512-byte rounding of each block, within 2% above it
        assert traced[phase].peak_bytes - 2**18 <= analytic[phase].tensor_bytes
        assert analytic[phase].tensor_bytes <= traced[phase].peak_bytes * 1.02


# A small Llama whose linears are over ZeRO-3's persistence threshold (1e5 elements) and whose adapters are under it:
# the coordinator fetches and prefetches its layers as a large model's, in one round (under a 5e7 bucket)
WIDE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 512,
        "intermediate_size": 1024, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4,
        "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [
    # the second micro-batch's forward waits on the one round of the whole model, twice (model/zero.py); the
    # optimizer step ends by gathering the persistent adapters again
    {"lora_r": 8, "gradient_accumulation_steps": 2},
    # without the generation's gather its forwards leave a trace the loss's forward follows, the whole model again;
    # the first backward invalidates it
    {"ds3_gather_for_generation": False},
    # layer by layer: a module's fetch holds it twice inside a layer's backward (under PEFT also in generation, whose
    # trace never completes)
    {"lora_r": 8},
    {"lora_r": 8, "ds3_gather_for_generation": False},
    # transformers' "auto" prefetch bucket (0.9 x 512^2, under a linear: a round a linear) and no parameter persistent:
    # the sizes reach DeepSpeed as the plan counts them
    {"lora_r": 8, "gradient_accumulation_steps": 2, "stage3_prefetch_bucket_size": "auto",
     "stage3_param_persistence_threshold": 0},
], ids=["lora-2-micro-batches", "layer-by-layer-generation", "lora", "lora-layer-by-layer-generation",
        "lora-2-micro-batches-auto-rounds-nothing-persistent"])
def test_zero3s_gathers_are_held_to_the_trace(knobs, tmp_path):
    from vram_planner import engine
    from vram_planner.model.phases import estimate
    from vram_planner.tracing.step import trace_step

    model = tmp_path / "wide-llama.json"
    model.write_text(json.dumps(WIDE))
    context = engine.make_context(str(model), "h100-80gb")
    train = engine.make_training(context, {"per_device_train_batch_size": 2, "num_generations": 2,
                                           "max_prompt_length": 16, "max_completion_length": 16,
                                           "dtype": "bfloat16", "num_gpus": GPUS, "zero_stage": 3, **knobs})
    traced = trace_step(WIDE, train)
    analytic = {p.name: p for p in estimate(context.arch, train, context.release, context.calibration,
                                            context.capacity_bytes).phases}
    for phase in ("generation", "training", "optimizer"):
        # never below the trace but for its 512-byte rounding of each block, within 0.2% above it
        assert traced.phase(phase).peak_bytes - 2**16 <= analytic[phase].tensor_bytes
        assert analytic[phase].tensor_bytes <= traced.phase(phase).peak_bytes * 1.002
    if knobs.get("gradient_accumulation_steps") == 2 and "stage3_prefetch_bucket_size" not in knobs:
        assert traced.phase("training").moment == "forward, micro-batch 2"
        assert analytic["training"].moment == "forward: a prefetch round in use"
        assert analytic["optimizer"].moment == "after the step: persistent parameters gathered"
    if knobs.get("stage3_param_persistence_threshold") == 0:
        assert analytic["optimizer"].moment != "after the step: persistent parameters gathered"


def _add_hooks_keeping_the_trace(add_hooks):
    """TRL before 1.5's `add_hooks` (trl/models/utils.py): the hooks back after a gathered generation, DeepSpeed's
    coordinator left with the module trace it recorded."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    def run(model):
        invalidate = PartitionedParameterCoordinator._invalidate_trace
        PartitionedParameterCoordinator._invalidate_trace = lambda self: None
        try:
            add_hooks(model)
        finally:
            PartitionedParameterCoordinator._invalidate_trace = invalidate
    return run


@pytest.mark.slow
def test_the_loss_finds_zero3s_coordinator_as_an_earlier_step_left_it(monkeypatch):
    # The coordinator records the modules' order in the first forward and backward and, from the next forward on,
    # keeps every parameter used again within stage3_max_reuse_distance (1e9) gathered and prefetches up to
    # stage3_max_live_parameters (1e9): in this small model every one (partitioned_param_coordinator.py:251-280,
    # :452-484, :634-666). TRL 1.16 invalidates that trace after its gathered generation, each step's loss records
    # it again and gathers layer by layer; where TRL keeps it (before 1.5), every step after the first holds the whole
    # model in its loss, which the trace runs its earlier step's loss for (tracing.zero.earlier_loss)
    import trl.models.utils

    layered = _component(_trace("--zero-stage", "3"), "training", "weights")
    assert layered < 2 * PARAMS / GPUS + PARAMS
    monkeypatch.setattr(trl.models.utils, "add_hooks", _add_hooks_keeping_the_trace(trl.models.utils.add_hooks))
    forget_traces()  # the same step, traced again under the patch
    kept = _component(_trace("--zero-stage", "3"), "training", "weights")
    assert kept >= 2 * PARAMS / GPUS + 2 * PARAMS


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_later_micro_batches_are_held_to_the_trace(stage):
    # Under accumulation the second micro-batch's forward finds ZeRO-3's trace the first recorded complete: the
    # coordinator prefetches until max_live_parameters (1e9) are gathered, here the whole model, which the
    # analytic loss phase holds too (model/zero.py prefetched_params); its one bucket reduction comes after the
    # backward, when the coordinator has released them (model/phases.py `_reducing_moments`; the analytic model had
    # reduced it beside them, 4.5% above the trace). ZeRO-2 keeps the gradients its partition touches, whole, from the
    # first micro-batch on, and allocates its bucket at the first gradient, not in the LM head's backward
    # (`_with_zero12_bucket`); ZeRO-1 releases its bucket only at the accumulation boundary, so the second
    # micro-batch's LM head backward holds the first's beside every gradient (the analytic model without it: 6.2%
    # below the trace). Within 2% of the trace, never below it; ZeRO-2 traced on the rank whose partition touches the
    # most gradients, which the analytic model plans (rank 0's keeps 28 MiB less here)
    from vram_planner import engine
    from vram_planner.model.phases import estimate
    from vram_planner.tracing.step import trace_step

    context = engine.make_context(SHALLOW_QWEN, "h100-80gb")
    knobs = {**SHALLOW_QWEN_STEP, "num_gpus": 8, "zero_stage": stage}
    train = engine.make_training(context, {**knobs, "gradient_accumulation_steps": 2})
    result = trace_step(SHALLOW_QWEN, train)
    traced = result.phase("training")
    analytic = {p.name: p for p in estimate(context.arch, train, context.release, context.calibration,
                                            context.capacity_bytes).phases}["training"]
    planned = analytic.tensor_bytes
    if stage == 3:
        assert traced.components["weights"] >= 2 * context.arch.params
    elif stage == 1:
        assert traced.moment == "LM head backward"
        bucket = zero.reduce_bucket_bytes(context.arch, train)
        assert traced.components["gradients"] >= bucket + 2 * context.arch.params
    else:
        groups = zero.optimizer_groups(context.arch, None, None)
        assert zero.accumulating_rank(groups, 8) == 5
        assert "rank 5 of 8 traced, whose ZeRO-2 partition the planner counts: it holds more than rank 0's" in result.notes
    # the trace rounds each block to 512 bytes, the analytic model does not
    assert traced.peak_bytes - 2**16 <= planned <= traced.peak_bytes * 1.02


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [{"beta": 0.04}, {"lora_r": 16}], ids=["full-with-reference", "lora"])
def test_the_scoring_holds_what_each_engines_coordinator_prefetched(knobs):
    # Old log-probs in four chunks (and a full fine-tune's reference's): each engine's coordinator records the
    # modules' order in its first forward after the generation and prefetches the whole model from the next on, kept
    # through the next pass, the round in use's flat buffer beside, which passes the bucket by part of its last
    # parameter (phases._zero3_scoring_prefetch_bytes): the policy and the reference two engines. The analytic
    # scoring was 7-11% under the trace without them (Qwen3-0.6B's widths at 4 layers on 2 and 8), and 4.1 MiB under
    # with LoRA counting the bucket for the round
    from vram_planner import engine
    from vram_planner.model.phases import estimate
    from vram_planner.tracing.step import trace_step

    context = engine.make_context(SHALLOW_QWEN, "h100-80gb")
    train = engine.make_training(context, {**SHALLOW_QWEN_STEP, "num_gpus": 2, "zero_stage": 3,
                                           "steps_per_generation": 4, "gradient_accumulation_steps": 2, **knobs})
    traced = trace_step(SHALLOW_QWEN, train).phase("scoring")
    analytic = {p.name: p for p in estimate(context.arch, train, context.release, context.calibration,
                                            context.capacity_bytes).phases}["scoring"]
    gathered = 2 * context.arch.params * (2 if "lora_r" not in knobs else 1)
    assert traced.components["weights"] >= gathered
    # within 1 MiB below (its LM head's buffers where the trace peaks in the decoder), 1% above
    assert traced.peak_bytes - 2**20 <= analytic.tensor_bytes <= traced.peak_bytes * 1.01


@pytest.mark.slow
def test_the_third_loss_micro_batch_of_a_generation_round_prefetches_the_whole_model():
    # LoRA's old log-probs leave the coordinator a forward-only trace, which the loss's first micro-batch follows and
    # its backward invalidates; the second records, the third prefetches (tracing.zero.loss_micro_batches), here in
    # the third optimizer step a generation round of three micro-batches serves. With two micro-batches traced the
    # trace never held it, and the analytic model, counting by gradient_accumulation_steps, was 10% under
    from vram_planner import engine
    from vram_planner.model.phases import estimate
    from vram_planner.tracing.step import trace_step

    context = engine.make_context(SHALLOW_QWEN, "h100-80gb")
    train = engine.make_training(context, {**SHALLOW_QWEN_STEP, "num_gpus": 2, "zero_stage": 3,
                                           "steps_per_generation": 3, "gradient_accumulation_steps": 1, "lora_r": 16})
    traced = trace_step(SHALLOW_QWEN, train).phase("training")
    assert traced.moment == "forward, micro-batch 3"
    assert traced.components["weights"] >= 2 * context.arch.params  # the whole model gathered, partitions beside
    analytic = {p.name: p for p in estimate(context.arch, train, context.release, context.calibration,
                                            context.capacity_bytes).phases}["training"]
    assert traced.peak_bytes - 2**20 <= analytic.tensor_bytes <= traced.peak_bytes * 1.01


def test_the_trace_turns_deepspeeds_shared_memory_all_reduce_off_and_back(monkeypatch):
    # DeepSpeed's CPU backend compiles its shared-memory all-reduce as it starts unless DeepSpeed's own switch marks it
    # incompatible (deepspeed/comm/torch.py build_shm_op); the trace marks it off while it runs and puts the entry
    # back, as it found it, for the long-lived process it runs in (the app, a notebook)
    import importlib

    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    comm_torch = importlib.import_module("deepspeed.comm.torch")  # deepspeed.comm's `torch` is torch itself
    seen = []
    build = comm_torch.build_shm_op

    def spy():
        seen.append(deepspeed.ops.__compatible_ops__.get(ShareMemCommBuilder.NAME))
        return build()

    monkeypatch.setattr(comm_torch, "build_shm_op", spy)
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, ShareMemCommBuilder.NAME, "as found")
    _trace("--zero-stage", "1")
    assert seen == [False]
    assert deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] == "as found"
    monkeypatch.delitem(deepspeed.ops.__compatible_ops__, ShareMemCommBuilder.NAME)
    forget_traces()  # the same step, traced again
    _trace("--zero-stage", "1")
    assert len(seen) == 2
    assert ShareMemCommBuilder.NAME not in deepspeed.ops.__compatible_ops__


@pytest.mark.slow
def test_lora_under_zero3_checkpoints_reentrant_as_trl_forces_it(monkeypatch):
    # TRL 1.9 on sets use_reentrant=True for PEFT + ZeRO-3 + checkpointing (grpo_trainer.py 1.16.0:513-525): the
    # layers run through torch's reentrant CheckpointFunction, not the saved-tensor hooks of the non-reentrant one
    from torch.utils import checkpoint

    calls = []
    apply = checkpoint.CheckpointFunction.apply
    monkeypatch.setattr(checkpoint.CheckpointFunction, "apply", lambda *args: calls.append(1) or apply(*args))
    _trace("--zero-stage", "3", "--lora-r", "8")
    assert calls
