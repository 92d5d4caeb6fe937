"""benchmarks/results/trl_matrix.json: every (TRL, transformers) pair's step traced in a virtual environment of that
pair, beside the analytic model under the same releases, recomputed here as `trl_matrix.py --analytic` does."""

from __future__ import annotations

import json

from helpers import benchmark_module


def _matrix():
    return benchmark_module("trl_matrix")


def _errors(pairs: dict) -> dict[str, float]:
    return {f"{pair} {name} {phase}": figures["analytic"] / figures["trace"] - 1
            for pair, result in pairs.items() for name, point in result.get("points", {}).items()
            if "error" not in point for phase, figures in point["phases"].items() if figures["analytic"]}


def test_every_traced_phase_of_every_release_pair_is_within_1_percent_of_the_analytic_model():
    matrix = _matrix()
    committed = json.loads(matrix.RESULTS.read_text())["pairs"]
    recomputed = matrix.reanalyse(json.loads(matrix.RESULTS.read_text())["pairs"])
    assert recomputed == committed  # the committed table's analytic column is this model's
    errors = _errors(recomputed)
    assert len({key.split()[0] for key in errors}) >= 24  # every pair the trace runs (0.28.0 with weave installed)
    # every phase within 1%, the fixtures of a few MiB too (where a rotary table or one layer norm is a few tenths)
    assert {key: f"{error:+.2%}" for key, error in errors.items() if abs(error) > 0.01} == {}
    # the two Llama-3.2-1B steps (the seeds' crash and a LoRA step with a reference) within 0.2% in every pair
    assert max(abs(e) for key, e in errors.items() if " Llama-3.2-1B" in key) < 0.002


def test_under_trl_0_14_the_reference_forward_runs_beside_the_policys_graph():
    # TRL 0.14's compute_loss scores the reference inside the loss step, after the policy's forward: with
    # transformers 4.48 the float32 fixture's trace peaks inside that forward (not at an LM head), its KV cache
    # filling next to the policy's graph and log-softmax rows, and the analytic model's heaviest moment is the same
    matrix = _matrix()
    point = json.loads(matrix.RESULTS.read_text())["pairs"]["0.14.0/4.48.2"]["points"]["tiny-llama/full-fp32"]
    traced = point["phases"]["training"]
    assert traced["moment"] == "forward, micro-batch 2"
    model, settings = next((m, s) for name, m, s in matrix.GRID if name == "tiny-llama/full-fp32")
    analytic = matrix.analytic_phases(model, settings, "0.14.0", "4.48.2")["training"]
    assert analytic.moment == "reference forward while the policy's graph is alive"
    assert analytic.components["kv_cache"] == traced["components"]["kv_cache"][0] > 0


def test_trl_0_28_traces_with_weave_installed_and_its_rows_say_why():
    # TRL 0.28.0's GRPOTrainer imports weave under transformers 5.3 on without requiring it (a run fails the same
    # way, and the trace refuses it in one line): its environment installs weave, and the table names it
    matrix = _matrix()
    result = json.loads(matrix.RESULTS.read_text())["pairs"]["0.28.0/5.3.0"]
    assert "weave" in result["installed_unrequired"]
    assert all("phases" in point for point in result["points"].values())
    rows = [line for line in matrix.table({"0.28.0/5.3.0": result}).splitlines() if line.startswith("0.28.0")]
    assert rows[0].startswith("0.28.0   5.3.0        weave installed, which TRL 0.28.0 does not require")


def test_from_transformers_4_56_trl_0_14s_policy_forward_keeps_its_keys_and_values_in_its_own_kv_cache():
    # TRL 0.14 leaves use_cache on in the loss's forward; from transformers 4.56 each cache layer concatenates the
    # states onto an empty tensor (DynamicLayer.lazy_initialization), and SDPA, without a mask, keeps the cache's
    # copies for backward: at the reference's LM head the policy's cache and the reference's are both there, as
    # the trace counts them (kv_cache), where 4.52's cache kept the layers' own tensors (activations)
    from vram_planner import engine
    from vram_planner.model.components import kv_cache_bytes

    matrix = _matrix()
    pairs = json.loads(matrix.RESULTS.read_text())["pairs"]
    model, settings = next((m, s) for name, m, s in matrix.GRID if name == "tiny-qwen2/lora-bf16")
    context = engine.make_context(model, "rtx3080-mobile", trl_version="0.14.0")
    train = engine.make_training(context, {**settings, "transformers_version": "4.57.3"})
    one_cache = kv_cache_bytes(context.arch, train, train.micro_batch_completions, train.sequence_length, train)
    for transformers, caches in (("4.57.3", 2), ("4.52.4", 1)):
        traced = pairs[f"0.14.0/{transformers}"]["points"]["tiny-qwen2/lora-bf16"]["phases"]["training"]
        analytic = matrix.analytic_phases(model, settings, "0.14.0", transformers)["training"]
        assert traced["components"]["kv_cache"][0] == analytic.components["kv_cache"] == caches * one_cache
