"""`vram-plan advise`: every OOM format read into bytes, the diagnosis, the attribution and the ranked fixes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import CURRENT, one_line_error, run
from vram_planner import engine
from vram_planner.advise.oom_log import read_log
from vram_planner.errors import VramPlanError

GiB, MiB = 2**30, 2**20

OLD = ("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.21 GiB "
       "already allocated; 3.12 MiB free; 14.56 GiB reserved in total by PyTorch)")
TRACEBACK = ['Traceback (most recent call last):',
             '  File "/venv/lib/python3.11/site-packages/trl/trainer/grpo_trainer.py", line 1200, in _get_logps',
             "    logits = model(**inputs).logits"]


def test_the_current_message_in_bytes():
    error = read_log([*TRACEBACK, CURRENT])
    assert (error.tried_to_allocate, error.total_capacity, error.free) == (
        round(1.90 * GiB), round(15.73 * GiB), round(1.02 * GiB))
    assert (error.process_in_use, error.allocated_by_pytorch, error.reserved_unallocated) == (
        round(14.70 * GiB), round(11.82 * GiB), round(2.41 * GiB))
    assert error.frames == ["trl/trainer/grpo_trainer.py:1200 in _get_logps"] and not error.expandable_segments


def test_the_torch_1_message_and_other_processes():
    old = read_log([OLD])
    assert (old.tried_to_allocate, old.allocated_by_pytorch, old.free, old.reserved_total) == (
        20 * MiB, round(14.21 * GiB), round(3.12 * MiB), round(14.56 * GiB))
    shared = CURRENT.replace("Process 4242 has 14.70 GiB memory in use.",
                             "Process 4242 has 14.70 GiB memory in use. Process 777 has 512.00 MiB memory in use.")
    assert read_log([shared]).other_processes == {777: 512 * MiB}


@pytest.mark.parametrize(("line", "kind"), [
    ("ValueError: The model's max seq len (4096) is larger than the maximum number of tokens that can be stored in "
     "KV cache (2048).", "vllm_kv_cache"),
    ("ValueError: Free memory on device (10.1/79.1 GiB) on startup is less than desired GPU memory utilization "
     "(0.9, 71.2 GiB).", "vllm_gpu_memory_utilization"),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", "cublas"),
    ("RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED", "cudnn"),
    ("bitsandbytes/functional.py: CUDA error: out of memory", "bitsandbytes"),
])
def test_other_allocation_failures_are_recognised(line, kind):
    assert read_log(["some output", line]).kind == kind


def test_fragmentation_and_memory_outside_pytorch_are_explained():
    from vram_planner.advise.diagnosis import advise

    advice = advise(read_log([CURRENT]))
    assert any("fragmentation" in n for n in advice.diagnosis)
    assert any("outside PyTorch" in n for n in advice.diagnosis)
    assert advice.fixes[0].change == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    on = advise(read_log(["export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", CURRENT]))
    assert not any("expandable" in f.change for f in on.fixes)


def test_with_the_config_it_names_the_tensor_and_ranks_the_fixes(capsys, tmp_path):
    log = tmp_path / "crash.log"
    log.write_text("\n".join([*TRACEBACK, CURRENT]))
    # TRL 1.13: full logits, scaled by the temperature into a second fp32 copy (1.14's Triton kernel makes none, and
    # its peak is the fused head's, as the trace of both finds: benchmarks/trl_matrix.py)
    code, out, _ = run(capsys, "advise", str(log), "--gpu", "rtx3080-mobile", "--model", "Llama-3.2-1B",
                       "--trl-version", "1.13.0", "--per-device-train-batch-size", "4", "--num-generations", "4",
                       "--max-completion-length", "1000", "--json")
    advice = json.loads(out)
    assert code == 0 and "float32 copy of the policy's logits" in advice["culprit"]
    assert advice["phase"] == "loss forward/backward"
    # the fixes that remove that tensor first (the upgrade: the fused head never makes the logits), then the rest,
    # each group by the bytes it saves
    removing = [f["removes_culprit"] for f in advice["fixes"]]
    assert removing == sorted(removing, reverse=True) and removing[0]
    for group in (True, False):
        savings = [f["saves_bytes"] for f in advice["fixes"] if f["removes_culprit"] is group]
        assert savings == sorted(savings, reverse=True) and savings[0] > 0
    assert advice["fitting_config"]["per_device_train_batch_size"] >= 1
    upgrade = next(f for f in advice["fixes"] if f["change"].startswith("pip install 'trl>="))
    # the same config on the installed TRL: the logits go away, the fused head's fp32 weight gradient comes
    knobs = {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 1000}
    old, new = (engine.check("Llama-3.2-1B", "rtx3080-mobile", knobs, trl_version=v).estimate.peak_bytes
                for v in ("1.13.0", "1.16.0"))
    assert upgrade["saves_bytes"] == round(old - new) > 0.5 * GiB


@pytest.mark.parametrize("content", [b"", b"\x00\xff\xfe" * 1000, b"all good, training finished\n"])
def test_no_error_in_the_log_is_one_line(capsys, tmp_path, content):
    log = tmp_path / "log.txt"
    log.write_bytes(content)
    err = one_line_error(capsys, "advise", str(log))
    assert "empty" in err or "no out-of-memory error" in err


def test_a_huge_log_is_read_in_bounded_memory(tmp_path):
    log = tmp_path / "huge.log"
    with log.open("w") as fh:
        for _ in range(200_000):
            fh.write("step 1: loss 0.1 reward 0.5\n")
        fh.write("x" * 5_000_000 + "\n")  # one enormous line
        fh.write(CURRENT + "\n")
    from vram_planner.files import bounded_lines

    assert read_log(bounded_lines(str(log))).tried_to_allocate == round(1.90 * GiB)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=300), max_size=20))
def test_any_text_is_read_or_refused_cleanly(lines):
    try:
        error = read_log(lines)
    except VramPlanError:
        return
    assert error.kind and (error.tried_to_allocate is None or error.tried_to_allocate >= 0)


@pytest.mark.parametrize("knobs", [
    # a generation batch of 1024 on a laptop: the plan shrinks the generation batch, which no single flag names
    ["--per-device-train-batch-size", "1024", "--max-completion-length", "1024"],
    # a 7B model on 16 GB: LoRA and 4-bit, reported joined where one of them alone costs memory
    ["--per-device-train-batch-size", "8"],
])
def test_every_fix_is_flags_that_check_accepts(capsys, tmp_path, knobs):
    log = tmp_path / "crash.log"
    log.write_text(CURRENT)
    model = "Llama-3.2-1B" if "1024" in knobs else "Qwen2.5-7B-Instruct"
    base = ["--gpu", "rtx3080-mobile", "--model", model, *knobs]
    code, out, _ = run(capsys, "advise", str(log), *base, "--json")
    flags = [f["change"] for f in json.loads(out)["fixes"] if f["change"].startswith("--")]
    assert code == 0 and flags
    for change in flags:
        # later flags win in click, so the fix's flags override the run's own: check must accept the result
        code, out, err = run(capsys, "check", *base, *change.split(), "--json")
        assert code in (0, 1), (change, err)


def test_a_larger_vllm_share_is_never_a_fix_that_saves_less_than_nothing(capsys, tmp_path):
    # the plan raises vLLM's share first (0.3 -> 0.45 of 8 GiB costs 1.20 GiB): alone it is no fix, it goes with the
    # next step, whose fix carries both and what they save together
    log = tmp_path / "crash.log"
    log.write_text(CURRENT)
    code, out, _ = run(capsys, "advise", str(log), "--gpu", "8GiB", "--model", "Llama-3.2-1B", "--use-vllm", "--json")
    fixes = [f for f in json.loads(out)["fixes"] if f["change"].startswith("--")]
    assert code == 0 and fixes and all(f["saves_bytes"] > 0 for f in fixes), fixes
    assert not any(f["change"] == "--vllm-max-model-length 768 --vllm-gpu-memory-utilization 0.45" for f in fixes)
    first = min(fixes, key=lambda f: len(f["change"]))
    assert "--vllm-gpu-memory-utilization 0.45" in first["change"] and "--dtype bfloat16" in first["change"]
    assert "vLLM's share of the card" in first["cost"]


# The seeds' laptop run: Llama-3.2-1B-Instruct, TRL 0.14, bf16 weights under bf16 autocast, FlashAttention-2, one
# prompt x 4 generations per micro-batch, GA 4, prompts up to 256, completions up to 786, no checkpointing.
SEEDS_FLAGS = ["--gpu", "rtx3080-mobile", "--model", "Llama-3.2-1B-Instruct", "--trl-version", "0.14.0",
               "--per-device-train-batch-size", "1", "--gradient-accumulation-steps", "4", "--num-generations", "4",
               "--max-prompt-length", "256", "--max-completion-length", "786", "--dtype", "bfloat16",
               "--mixed-precision", "bf16", "--attn-implementation", "flash_attention_2",
               "--no-gradient-checkpointing"]
VOCAB = 128256


def _seeds_advice(capsys, tmp_path, *extra, log_lines=(CURRENT,)):
    log = tmp_path / "crash.log"
    log.write_text("\n".join(log_lines) + "\n")
    code, out, _ = run(capsys, "advise", str(log), *SEEDS_FLAGS, *extra, "--json")
    assert code == 0
    return json.loads(out)


@pytest.mark.parametrize("transformers", [("--transformers-version", "4.52.0"), ()])
def test_the_seeds_crash_to_the_byte(capsys, tmp_path, transformers):
    """transformers 4.52 on drops the num_logits_to_keep TRL 0.14 passes: the policy's logits cover prompt +
    completion, and accelerate's float32 copy of them is the 1.90 GiB request, exact at 994 positions (992-996 round
    to 1.90 GiB), in the first micro-batch of the first step."""
    advice = _seeds_advice(capsys, tmp_path, *transformers)
    found = advice["attribution"]
    assert found["culprit"] == ("accelerate's float32 copy of the policy's logits over the whole prompt + completion: "
                                f"4 completions x 994 positions x {VOCAB} vocabulary entries x 4 B")
    assert found["culprit_bytes"] == 4 * 994 * VOCAB * 4 == 2_039_783_424
    assert found["requested_bytes"] == round(1.90 * 2**30) and found["exact"]
    assert abs(found["culprit_bytes"] - found["requested_bytes"]) <= 0.005 * 2**30
    assert "a 208-token prompt with 786-token completions, or 256 + 738" in found["assumption"]
    assert "992-996 positions" in found["assumption"]
    assert found["moment"] == "policy forward: the logits and accelerate's float32 copy"
    assert found["first_micro_batch"] is True and found["phase"] == "loss forward/backward"
    # live then, by the model at 994 positions: the policy's and the reference's bf16 weights, the policy's
    # activations without checkpointing, and its bf16 logits (the request not yet made)
    from vram_planner import engine
    from vram_planner.model.phases import micro_batch_moments

    knobs = dict(per_device_train_batch_size=1, gradient_accumulation_steps=4, num_generations=4,
                 max_prompt_length=208, max_completion_length=786, dtype="bfloat16", mixed_precision="bf16",
                 attn_implementation="flash_attention_2", gradient_checkpointing=False,
                 transformers_version=found["transformers_version"])
    verdict = engine.check("Llama-3.2-1B-Instruct", "rtx3080-mobile", knobs, trl_version="0.14.0")
    at = next(m for m in micro_batch_moments(verdict.context.arch, verdict.train, verdict.context.release,
                                             verdict.context.calibration, first=True) if m.moment == found["moment"])
    weights = at.components["weights"]
    assert at.components["reference_weights"] == weights and at.components["gradients"] == 0
    assert at.components["optimizer_states"] == 0
    assert at.components["lm_head_buffers"] == 4 * 994 * VOCAB * (2 + 4)
    assert found["live_bytes"] == round(at.tensor_bytes - 4 * 994 * VOCAB * 4)
    assert abs(found["live_bytes"] / round(11.82 * 2**30) - 1) < 0.03  # the message's 11.82 GiB allocated
    # the fix ranked first removes that tensor
    assert advice["fixes"][0]["removes_culprit"]
    removing = {f["change"] for f in advice["fixes"] if f["removes_culprit"]}
    assert removing == {"pip install 'trl>=1.16.0'", "pip install 'transformers<4.52.0'"}
    assert advice["transformers_version_from"] == ("flag" if transformers else "assumed")


def test_the_transformers_release_is_read_from_the_log_and_decides_the_answer(capsys, tmp_path):
    named = _seeds_advice(capsys, tmp_path, log_lines=("transformers==4.48.2", CURRENT))
    assert named["transformers_version"] == "4.48.2" and named["transformers_version_from"] == "log"
    found = named["attribution"]
    # 4.48 honours num_logits_to_keep: the step has no 1.90 GiB tensor; a release that drops it would make one
    assert found["exact"] and "a transformers release that ignores (from 4.52.0)" in found["assumption"]
    assert any("worked out for transformers 4.48.2 (as the log says)" in n for n in named["diagnosis"])
    # the flag wins over the log
    flagged = _seeds_advice(capsys, tmp_path, "--transformers-version", "4.56", log_lines=("transformers==4.48.2",
                                                                                            CURRENT))
    assert flagged["transformers_version"] == "4.56.0" and flagged["transformers_version_from"] == "flag"


def test_a_candidate_is_accepted_only_within_a_few_percent(capsys, tmp_path):
    from vram_planner.advise.candidates import MATCH_TOLERANCE, Candidate, best_match

    request = round(1.90 * 2**30)
    near = Candidate("near", round(request * (1 + MATCH_TOLERANCE * 0.9)), "training")
    far = Candidate("far", round(request * (1 + MATCH_TOLERANCE * 1.1)), "training")
    exact = Candidate("exact", request - round(0.004 * 2**30), "training")
    assert best_match([far], request) is None
    assert best_match([near, far], request).candidate is near and not best_match([near], request).exact
    assert best_match([near, exact], request).candidate is exact and best_match([exact], request).exact
    # the issue's old reading of the seeds' crash: 4 x 787 positions is 21% below the request, and is no answer
    old = Candidate("completion-only logits", 4 * 787 * VOCAB * 4, "training")
    assert best_match([old], request) is None


def test_the_candidates_size_is_printed_beside_the_request(capsys, tmp_path):
    log = tmp_path / "crash.log"
    log.write_text(CURRENT + "\n")
    code, out, _ = run(capsys, "advise", str(log), *SEEDS_FLAGS)
    assert code == 0
    text = " ".join(out.split())
    assert "2,039,783,424 B = 1.900 GiB beside the 1.90 GiB requested: exact to the message's rounding" in text
    assert "When: the first micro-batch of the first step, before any optimizer state exists" in text
    assert "removes that tensor" in text


def test_a_release_the_log_names_that_vram_plan_does_not_know_is_left_unused_and_a_bad_flag_is_one_line(capsys,
                                                                                                       tmp_path):
    unknown = _seeds_advice(capsys, tmp_path, log_lines=("transformers==9.1.0", CURRENT))
    assert unknown["transformers_version"] == "4.56.0" and unknown["transformers_version_from"] == "assumed"
    log = tmp_path / "crash.log"
    err = one_line_error(capsys, "advise", str(log), *SEEDS_FLAGS, "--transformers-version", "7.0")
    assert "--transformers-version should be a transformers release vram-plan knows" in err
    # TRL 1.16's generation: the installed transformers is the one planned for, and advise says so
    log.write_text(CURRENT + "\n")
    code, out, _ = run(capsys, "advise", str(log), "--gpu", "rtx3080-mobile", "--model", "Llama-3.2-1B", "--json")
    from vram_planner.model.trl_releases import installed_version

    installed = installed_version("transformers")
    expected = "installed" if installed and installed.startswith("5.") else "assumed"
    assert code == 0 and json.loads(out)["transformers_version_from"] == expected


def test_the_trl_release_is_read_from_the_log_and_the_flag_wins(capsys, tmp_path):
    without_trl = [flag for i, flag in enumerate(SEEDS_FLAGS)
                   if flag != "--trl-version" and SEEDS_FLAGS[i - 1] != "--trl-version"]
    log = tmp_path / "crash.log"
    log.write_text("\n".join(["trl==0.14.0", "transformers==4.52.0", CURRENT]) + "\n")
    code, out, _ = run(capsys, "advise", str(log), *without_trl, "--json")
    from_log = json.loads(out)
    assert code == 0 and from_log["trl_version"] == "0.14.0" and from_log["trl_version_from"] == "log"
    assert "worked out for TRL 0.14.0 (as the log says)" in from_log["diagnosis"]
    # the same answer as with the flag: accelerate's fp32 copy of the full-sequence logits, to the byte
    flagged = _seeds_advice(capsys, tmp_path, log_lines=("trl==1.16.0", "transformers==4.52.0", CURRENT))
    assert flagged["trl_version"] == "0.14.0" and flagged["trl_version_from"] == "flag"
    assert from_log["attribution"]["culprit_bytes"] == flagged["attribution"]["culprit_bytes"] == 4 * 994 * VOCAB * 4
    # a release the table does not cover is left unused: the installed one is planned for
    log.write_text("\n".join(["trl==0.3.0", CURRENT]) + "\n")
    code, out, _ = run(capsys, "advise", str(log), *without_trl, "--json")
    assert code == 0 and json.loads(out)["trl_version_from"] == "installed"


def test_the_log_names_trl_as_pip_trl_env_and_wheel_paths_write_it():
    from vram_planner.advise.oom_log import read_log

    for line, version in (("trl==0.14.0", "0.14.0"), ("- TRL version: 0.19.1", "0.19.1"),
                          ("/site-packages/trl-1.16.0.dist-info/METADATA", "1.16.0"),
                          ("trl 0.17", "0.17"), ("controlled==1.2.3", None), ("trl_utils 1.2", None)):
        assert read_log([line, CURRENT]).trl_version == version, line


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 200_000), st.integers(1, 4096))
def test_the_positions_a_message_allows_hold_the_tensor_that_asked(per_position, positions):
    """A message prints the segment the allocator asked CUDA for (2 MiB up to 1 MiB, 20 MiB up to 10 MiB, else the
    tensor rounded up to 2 MiB), to two decimals: from 10 MiB on, the positions solved from that figure include the
    tensor's own, and the fewest and most print as the same figure; a snapshot's own bytes allow exactly one."""
    from vram_planner.advise.candidates import (Candidate, positions_for, positions_range, printed_bytes,
                                                rounding_bytes)

    def torch_format(n: int) -> str:  # c10's format_size for what a segment can be (2 MiB and up)
        return f"{n / MiB:.2f} MiB" if n <= GiB else f"{n / GiB:.2f} GiB"

    candidate = Candidate("t", per_position * positions, "training", per_position=per_position, positions=positions)
    size = per_position * positions
    figure = read_log([f"CUDA out of memory. Tried to allocate {torch_format(printed_bytes(size))}. GPU 0 "
                       "has a total capacity of 80.00 GiB of which 1.00 GiB is free."]).tried_to_allocate
    low, high = positions_range(candidate, figure)
    if size >= 10 * MiB:  # below, every tensor prints as 2 or 20 MiB: the figure says nothing of its positions
        assert low <= positions <= high and low <= positions_for(candidate, figure) <= high
    assert all(abs(printed_bytes(n * per_position) - figure) <= rounding_bytes(figure) for n in (low, high)
               if low <= high)
    assert positions_range(candidate, size, exact_request=True) == (positions, positions)


def test_the_h200_runs_message_names_the_mlp_activation_at_the_positions_it_allows(capsys):
    """The H200 run's "Tried to allocate 102.00 MiB" is its 105,873,408 B request rounded up to a 2 MiB segment: an
    MLP activation of 32 sequences, exact for 1067-1088 positions (the snapshot says 1077)."""
    from pathlib import Path

    log = Path(__file__).parents[2] / "benchmarks" / "results" / "gpu" / "h200-runs" / "smollm2-oom" / "stderr.txt"
    code, out, err = run(capsys, "advise", str(log), "--gpu", "8GiB", "--model", "SmolLM2-135M",
                         "--per-device-train-batch-size", "32", "--gradient-accumulation-steps", "2",
                         "--max-completion-length", "1024", "--trl-version", "1.16.0", "--json")
    assert code == 0, err
    found = json.loads(out)["attribution"]
    assert "MLP activation" in found["culprit"] and found["exact"] and found["phase"] == "loss forward/backward"
    assert "1067-1088 positions" in found["assumption"] and found["culprit_bytes"] == 32 * 1077 * 1536 * 2
    # the text version: a later micro-batch of the first step has the earlier ones' gradients, no optimizer states
    code, out, _ = run(capsys, "advise", str(log), "--gpu", "8GiB", "--model", "SmolLM2-135M",
                       "--per-device-train-batch-size", "32", "--gradient-accumulation-steps", "2",
                       "--max-completion-length", "1024", "--trl-version", "1.16.0")
    when = next(line for line in out.splitlines() if "When:" in line)
    assert "optimizer states exist" not in when and "from the second optimizer step on" in " ".join(out.split())
