"""`--use-vllm` on the command line: check refuses what vLLM itself would refuse at start-up, plan recommends the
share vLLM needs (and check agrees), --json carries the `vllm` object, server mode plans the server's card, and
`run` refuses a missing or unsupported vLLM in one line."""

from __future__ import annotations

import json

import pytest

from helpers import one_line_error, run

EIGHT_B = ["--gpu", "h100-80gb", "--model", "Llama-3.1-8B", "--lora-r", "16", "--dtype", "bfloat16", "--use-vllm"]
VLLM_FIELDS = {"weights_bytes", "kv_cache_bytes", "activation_bytes", "cuda_graph_bytes", "reservation_bytes",
               "max_num_seqs", "max_model_len", "kv_capacity_sequences", "min_gpu_memory_utilization", "problem"}


def judged(capsys, command, *args):
    code, out, err = run(capsys, command, *args, "--json")
    assert err == "", err
    return code, json.loads(out)


def test_the_8b_model_in_a_tenth_of_an_h100_is_refused_with_its_reason(capsys):
    # 15 GiB of bf16 weights cannot load into 0.1 x 79.18 GiB; the trainer alone would fit with room to spare
    code, out, _ = run(capsys, "check", *EIGHT_B, "--vllm-gpu-memory-utilization", "0.1")
    assert code == 1
    headline = " ".join(out.split("\n\n")[0].split())
    assert "✘ does not fit: vLLM cannot start in --vllm-gpu-memory-utilization 0.1 (7.92 GiB): weights 14.96 GiB" \
        in headline
    # vLLM derives max_model_len 131072 from the config: one such sequence needs 16 GiB more
    assert "the smallest value that works is 0.41 (0.21 with --vllm-max-model-length 768" in headline
    code, report = judged(capsys, "check", *EIGHT_B, "--vllm-gpu-memory-utilization", "0.1")
    assert code == 1 and report["fits"] is False
    vllm = report["vllm"]
    assert set(vllm) == VLLM_FIELDS
    assert vllm["weights_bytes"] == 2 * 8_030_261_248  # Llama-3.1-8B's parameters in bf16
    assert vllm["max_model_len"] == 131072 and vllm["kv_capacity_sequences"] == 0
    assert vllm["min_gpu_memory_utilization"] == 0.41 and vllm["problem"].startswith("vLLM cannot start")


def test_the_smallest_utilization_starts_vllm_and_one_less_hundredth_does_not(capsys):
    _, report = judged(capsys, "check", *EIGHT_B, "--vllm-gpu-memory-utilization", "0.41")
    assert report["vllm"]["problem"] is None and report["fits"]
    _, report = judged(capsys, "check", *EIGHT_B, "--vllm-gpu-memory-utilization", "0.40")
    assert "cannot hold one sequence of max_model_len 131072" in report["vllm"]["problem"] and not report["fits"]


def test_plans_recommended_utilization_is_verified_by_check(capsys):
    code, plan = judged(capsys, "plan", *EIGHT_B, "--vllm-gpu-memory-utilization", "0.1")
    assert code == 0 and plan["fits"]
    config = plan["config"]
    utilization, max_len = config["vllm_gpu_memory_utilization"], config["vllm_max_model_length"]
    assert max_len == 256 + 512 and utilization == 0.25
    knobs = [c["knob"] for c in plan["changes"]]
    assert knobs[0] == "vllm_max_model_length + vllm_gpu_memory_utilization"
    as_planned = [*EIGHT_B, "--per-device-train-batch-size", str(config["per_device_train_batch_size"]),
                  "--gradient-accumulation-steps", str(config["gradient_accumulation_steps"]),
                  "--vllm-max-model-length", str(max_len)]
    code, check = judged(capsys, "check", *as_planned, "--vllm-gpu-memory-utilization", str(utilization))
    assert code == 0 and check["vllm"]["problem"] is None
    assert check["vllm"]["kv_capacity_sequences"] >= check["vllm"]["max_num_seqs"]
    assert check["peak_bytes"] == plan["peak_bytes"]
    # the smallest multiple of 0.05: one step less cannot hold the whole round
    _, less = judged(capsys, "check", *as_planned, "--vllm-gpu-memory-utilization", str(round(utilization - 0.05, 2)))
    assert less["vllm"]["problem"] is not None or less["vllm"]["kv_capacity_sequences"] < less["vllm"]["max_num_seqs"]


def test_plan_says_costs_when_it_raises_vllms_share(capsys):
    code, out, _ = run(capsys, "plan", *EIGHT_B, "--vllm-gpu-memory-utilization", "0.1")
    assert code == 0
    assert ("vllm_max_model_length + vllm_gpu_memory_utilization: None, 0.1 → 768, 0.25 costs 11.88 GiB"
            in " ".join(out.split()))
    assert "vllm_gpu_memory_utilization=0.25," in out and "vllm_max_model_length=768," in out


def test_json_says_a_larger_vllm_share_costs_and_no_change_saves_a_negative_amount(capsys):
    code, plan = judged(capsys, "plan", "--gpu", "8GiB", "--model", "Llama-3.2-1B", "--use-vllm")
    assert code == 0 and plan["changes"]
    assert all(c["saved_bytes"] >= 0 and c["cost_bytes"] >= 0 for c in plan["changes"]), plan["changes"]
    share = next(c for c in plan["changes"] if c["knob"].endswith("vllm_gpu_memory_utilization"))
    assert (share["saved_bytes"], share["cost_bytes"]) == (0, 1288490189)  # 0.15 of the card, rounded as vLLM does
    net = sum(c["saved_bytes"] - c["cost_bytes"] for c in plan["changes"])
    assert abs(plan["requested_peak_bytes"] - net - plan["peak_bytes"]) <= len(plan["changes"])  # each rounded
    _, out, _ = run(capsys, "plan", "--gpu", "8GiB", "--model", "Llama-3.2-1B", "--use-vllm")
    assert "None, 0.3 → 768, 0.45 costs 1.20 GiB" in " ".join(out.split())


def test_prompt_and_completion_beyond_vllms_context_are_one_line_naming_the_flags(capsys):
    a40 = ["--gpu", "a40", "--model", "Llama-3.2-1B", "--use-vllm", "--vllm-max-model-length", "1024"]
    err = one_line_error(capsys, "check", *a40, "--max-completion-length", "4714")
    assert "--max-prompt-length 256 + --max-completion-length 4714 = 4970 tokens exceed --vllm-max-model-length " \
           "1024" in err and "use --vllm-max-model-length 4970 or more, or --max-completion-length 768 or less" in err
    assert "vLLM's server refuses every such request" in one_line_error(
        capsys, "plan", *a40, "--max-completion-length", "4714", "--vllm-mode", "server")
    code, out, _ = run(capsys, "check", *a40, "--max-completion-length", "768", "--json")  # 1024 tokens: vLLM's all
    assert code == 0 and json.loads(out)["vllm"]["max_model_len"] == 1024


def test_nothing_fits_beside_vllm_offers_server_mode(capsys):
    code, plan = judged(capsys, "plan", "--gpu", "rtx3060-12gb", "--model", "Llama-3.1-8B", "--use-vllm")
    assert code == 1 and plan["vllm"]["problem"] is not None
    assert "--vllm-mode server --vllm-server-gpu CARD" in plan["notes"][-1]


def test_sleep_mode_is_offered_when_vllm_starts_but_the_trainer_does_not_fit_beside_it(capsys):
    code, plan = judged(capsys, "plan", "--gpu", "6.2GiB", "--model", "Llama-3.2-3B", "--use-vllm")
    assert code == 1 and plan["vllm"]["problem"] is None
    assert "--vllm-enable-sleep-mode frees vLLM's weights and KV cache outside generation (the smallest config then " \
           "needs" in plan["notes"][-1] and ": it fits)" in plan["notes"][-1]
    code, asleep = judged(capsys, "plan", "--gpu", "6.2GiB", "--model", "Llama-3.2-3B", "--use-vllm",
                          "--vllm-enable-sleep-mode")
    assert code == 0 and asleep["fits"]


def test_json_has_no_vllm_object_without_vllm_on_a_planned_card(capsys):
    _, report = judged(capsys, "check", "--gpu", "h100", "--model", "Llama-3.2-1B")
    assert report["vllm"] is None
    _, report = judged(capsys, "check", "--gpu", "h100", "--model", "Llama-3.2-1B", "--use-vllm", "--vllm-mode",
                       "server")
    assert report["vllm"] is None
    assert any("--vllm-server-gpu CARD plans the server's card" in n for n in report["notes"])


def test_server_mode_plans_the_servers_card_with_its_own_verdict(capsys):
    server = ["--vllm-mode", "server", "--vllm-max-model-length", "768"]
    code, report = judged(capsys, "check", *EIGHT_B, *server, "--vllm-server-gpu", "h100-80gb")
    assert code == 0 and report["vllm"]["problem"] is None and report["vllm"]["max_num_seqs"] == 1024
    assert all(p["components"]["vllm_reservation"] == 0 for p in report["phases"])
    assert "vllm_gpu_memory_utilization" not in report["config"]  # trl vllm-serve takes its own
    code, report = judged(capsys, "check", *EIGHT_B, *server, "--vllm-server-gpu", "t4")
    assert code == 1 and "vLLM cannot start" in report["vllm"]["problem"]  # 15 GiB of weights on a 15 GiB card
    code, report = judged(capsys, "check", *EIGHT_B, *server, "--vllm-server-gpu", "t4",
                          "--vllm-tensor-parallel-size", "2")
    assert code == 0 and report["vllm"]["problem"] is None  # half the weights on each of two


@pytest.mark.parametrize("flags,expected", [
    (["--vllm-server-gpu", "h10"], "--vllm-server-gpu: unknown GPU 'h10'"),
    (["--vllm-tensor-parallel-size", "3", "--num-gpus", "3"], "attention heads (32) divisible"),
    (["--vllm-max-model-length", "200000"], "exceeds the model's context (131072 tokens)"),
    (["--vllm-tensor-parallel-size", "2"], "must divide the number of processes (--num-gpus 1)"),
])
def test_vllm_settings_vllm_would_refuse_are_one_line(capsys, flags, expected):
    extra = ["--vllm-mode", "server"] if flags[0] == "--vllm-server-gpu" else []
    err = one_line_error(capsys, "check", *EIGHT_B, *extra, *flags)
    assert expected in err


# --- run --use-vllm ----------------------------------------------------------------------------------------------

RUN = ["run", "--gpu", "h100", "--model", "Llama-3.2-1B", "--dataset", "math-sample", "--use-vllm", "--dry-run"]


def fake_vllm(tmp_path, monkeypatch, version: str) -> None:
    """An installed vLLM as importlib sees one: the package and its distribution metadata."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (site / f"vllm-{version}.dist-info").mkdir()
    metadata = f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
    (site / f"vllm-{version}.dist-info" / "METADATA").write_text(metadata)
    monkeypatch.syspath_prepend(str(site))


def test_run_without_vllm_is_one_line_with_the_extra(capsys, tmp_path):
    pytest.importorskip("trl")
    if __import__("importlib").util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    err = one_line_error(capsys, *RUN, "--output-dir", str(tmp_path / "out"))
    assert "--use-vllm needs vLLM >=0.22.0,<=0.31.0, which is not installed: pip install 'vram-plan[vllm]'" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("version", ["0.21.0", "0.32.0"])
def test_run_with_a_vllm_trl_does_not_accept_is_one_line(capsys, tmp_path, monkeypatch, version):
    pytest.importorskip("trl")
    fake_vllm(tmp_path, monkeypatch, version)
    err = one_line_error(capsys, *RUN, "--output-dir", str(tmp_path / "out"))
    assert f"the releases TRL 1.16 accepts (installed: {version})" in err


def test_pyproject_extra_pins_the_range_run_checks():
    import tomllib
    from pathlib import Path

    from vram_planner.extras import VLLM_RANGE

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["vllm"] == [f"vllm{VLLM_RANGE}"]


def test_run_with_vllm_on_a_machine_without_cuda_is_one_line(capsys, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    fake_vllm(tmp_path, monkeypatch, "0.31.0")
    err = one_line_error(capsys, *RUN, "--output-dir", str(tmp_path / "out"))
    assert "--use-vllm needs a CUDA device" in err


@pytest.mark.slow
def test_the_run_passes_the_planned_share_to_trl_which_starts_vllm_with_it(tmp_path):
    from trl import GRPOConfig

    from vram_planner import engine
    from vram_planner.run.setup import RunSetup
    from vram_planner.run.smoke import full_length_completions

    plan = engine.plan("Llama-3.1-8B", "h100-80gb", {"lora_r": 16, "dtype": "bfloat16", "use_vllm": True,
                                                  "vllm_gpu_memory_utilization": 0.1})
    setup = RunSetup.from_plan(plan, model_id="meta-llama/Llama-3.1-8B", dataset="math-sample",
                               rewards=["format"], output_dir=tmp_path / "out", on_cpu=True)
    kwargs = setup.grpo_kwargs()  # on_cpu: no bf16 here, which GRPOConfig checks; the vLLM kwargs are the GPU's
    assert kwargs["vllm_gpu_memory_utilization"] == plan.chosen.train.vllm_gpu_memory_utilization == 0.25
    assert kwargs["vllm_max_model_length"] == 768 and kwargs["vllm_mode"] == "colocate"
    # the smoke step forces full-length completions in vLLM's own words
    smoke = full_length_completions(setup.train)
    assert smoke == {"min_tokens": 512}
    args = GRPOConfig(**kwargs, generation_kwargs=smoke)  # TRL 1.16 hands these to vllm.LLM and SamplingParams
    assert (args.vllm_gpu_memory_utilization, args.vllm_max_model_length) == (0.25, 768)
