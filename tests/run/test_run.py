"""`vram-plan run`: a real GRPOTrainer run of a tiny random model on the CPU, and bad input refused up front."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import FIXTURES, SMALL, bad_run, one_line_error, run

pytest.importorskip("trl")


@pytest.mark.slow
def test_run_trains_two_steps_and_logs_memory_per_step(tiny_model_folder, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "README.md").write_text("# my notes on this run\n")  # the user's: TRL's model card must not replace it
    # a process of its own, as a user starts it: pytest would otherwise catch the warnings before stderr does
    done = subprocess.run([sys.executable, "-m", "vram_planner", "run", "--model", str(tiny_model_folder), "--dataset",
                           "math-sample", "--max-steps", "2", "--save-steps", "2", "--output-dir", str(out), *SMALL],
                          capture_output=True, text=True, timeout=300)
    stdout, err = done.stdout, done.stderr
    assert done.returncode == 0, err
    assert "GRPOConfig(" in stdout and "predicted peak" in stdout
    assert "WARNING" not in stdout, stdout  # DeepSpeed's logger prints to stdout where it is installed
    # off a terminal: the smoke step's line, a line per step, the closing summary; no library warnings or progress
    # bars without --verbose
    lines = err.splitlines()
    assert len(lines) == 4 and lines[0].startswith("smoke step:"), err
    for step, line in enumerate(lines[1:3], 1):
        assert line.startswith(f"GRPO step {step}/2  reward ") and "predicted" in line
    assert lines[3].startswith("done: 2 steps in ") and f"the model is in {out / 'final'}" in lines[3]
    assert (out / "checkpoint-2").is_dir() and (out / "final" / "config.json").is_file()
    assert (out / "README.md").read_text() == "# my notes on this run\n"
    card = (out / "MODEL_CARD.md").read_text()
    assert "trained using [TRL]" in card and f"fine-tuned version of `{tiny_model_folder}`" in card
    assert "[None]" not in card and 'model="None"' not in card
    assert f'pipeline("text-generation", model="{out / "final"}"' in card  # its quick start loads what was trained
    assert not [p for p in out.iterdir() if p.name.startswith(".model-card-")]
    # the folder says how it was made, what the plan expected and how it ended
    record = json.loads((out / "vram-plan-run.json").read_text())
    assert record["command"].startswith("vram-plan run --model ") and "--max-steps 2" in record["command"]
    assert record["grpo_config"]["max_steps"] == 2 and record["lora_config"] is None
    assert {p["name"] for p in record["phases"]} >= {"generation", "training", "optimizer"}
    assert max(p["peak_bytes"] for p in record["phases"]) == record["predicted_peak_bytes"]
    from vram_planner.model.trl_releases import installed_version

    assert record["versions"]["trl"] == installed_version("trl") and record["versions"]["torch"]
    assert record["outcome"]["status"] == "finished" and record["outcome"]["steps"] == 2
    # torch's allocated peak is set beside the plan's tensors and workspaces, its reserved one beside those with the
    # allocator's reserve, its device memory beside the need with the CUDA context
    outcome = record["outcome"]
    assert 0 < outcome["predicted_peak_allocated_bytes"] < outcome["predicted_peak_reserved_bytes"] \
        < outcome["predicted_peak_bytes"]
    steps = [json.loads(line) for line in (out / "vram-plan-log.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "reward" in s]
    assert [s["step"] for s in trained] == [1, 2]
    assert all(s["predicted_peak_bytes"] > 0 and "rewards/format_reward/mean" in s for s in trained)
    assert all(s["predicted_peak_allocated_bytes"] == outcome["predicted_peak_allocated_bytes"] for s in trained)


def test_dry_run_prints_the_config_and_starts_nothing(capsys, tiny_model_folder, tmp_path):
    out = tmp_path / "run"
    code, stdout, _ = run(capsys, "run", "--model", str(tiny_model_folder), "--dataset", "math-sample",
                          "--output-dir", str(out), "--dry-run", *SMALL)
    assert code == 0 and "GRPOConfig(per_device_train_batch_size=2" in stdout and "LoraConfig" not in stdout
    assert not out.exists()
    # the GPU run's config, not the CPU's adaptation of it (which a note names)
    config = stdout.split("GRPOConfig(")[1].split("\n")[0]
    assert "use_cpu" not in config
    assert "use_cpu=True, bf16=False, fp16=False over the GPU run's GRPOConfig" in " ".join(stdout.split())


def test_a_dataset_without_prompts_is_refused(capsys, tiny_model_folder, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"question": "1 + 1?", "answer": "2"}) + "\n")
    err = bad_run(capsys, tmp_path, tiny_model_folder, "--dataset", str(data))
    assert "no prompt column" in err and "question" in err


def test_a_reward_that_does_not_import_is_refused(capsys, tiny_model_folder, tmp_path):
    err = bad_run(capsys, tmp_path, tiny_model_folder, "--dataset", "math-sample", "--reward", "no_such_mod:f")
    assert "cannot import no_such_mod" in err


def test_a_reward_returning_the_wrong_length_is_refused(capsys, tiny_model_folder, tmp_path):
    module = tmp_path / "my_rewards.py"
    module.write_text("def one(completions, **kw):\n    return [1.0]\n")
    err = bad_run(capsys, tmp_path, tiny_model_folder, "--dataset", "math-sample", "--reward", f"{module}:one")
    assert "one value per completion" in err


def test_a_model_folder_without_weights_is_refused(capsys, tmp_path):
    folder = tmp_path / "config-only"
    folder.mkdir()
    (folder / "config.json").write_text((FIXTURES / "tiny-llama-headdim.json").read_text())
    err = bad_run(capsys, tmp_path, folder, "--dataset", "math-sample")
    assert "no weights" in err


def test_the_recipe_rewards_score_format_and_answers():
    from vram_planner.run.rewards import correctness_reward, format_reward

    strict = "<reasoning>\n3 + 4 = 7\n</reasoning>\n<answer>\n7\n</answer>\n"
    loose = "<reasoning>3+4</reasoning> <answer>7</answer>"  # the tags in order, not on their own lines
    chat = [{"role": "assistant", "content": strict}]
    assert format_reward([strict, loose, "7", chat]) == [0.5, 0.25, 0.0, 0.5]
    assert correctness_reward([strict, loose, "7", chat], answer=["7", "7.0", "7", "8"]) == [2.0, 2.0, 0.0, 0.0]
    assert correctness_reward(["<answer>1,234</answer>"], answer=["1234"]) == [2.0]


class FakeAllocatorCap:
    """Out of memory from the second step on whenever a micro-batch holds more than one sequence."""

    def on_step_begin(self, args, state, control, **kwargs):
        import torch

        if args.per_device_train_batch_size > 1 and state.global_step >= 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (fake cap)")


@pytest.fixture
def capped(monkeypatch):
    from transformers import TrainerCallback

    from vram_planner.run import launch

    monkeypatch.setattr(launch, "EXTRA_CALLBACKS", [type("Cap", (TrainerCallback,), dict(vars(FakeAllocatorCap)))()])


@pytest.mark.slow
def test_out_of_memory_falls_back_to_a_smaller_micro_batch_from_the_checkpoint(capsys, tiny_model_folder, tmp_path,
                                                                                 capped):
    out = tmp_path / "run"
    args = ["run", "--model", str(tiny_model_folder), "--dataset", "math-sample", "--max-steps", "2",
            "--save-steps", "1", "--output-dir", str(out), *SMALL]
    code, _, err = run(capsys, *args, "--auto-fallback")
    assert code == 0, err
    assert "out of GPU memory" in err and "per_device_train_batch_size 2 -> 1" in err and "checkpoint-1" in err
    steps = [json.loads(line) for line in (out / "vram-plan-log.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "reward" in s] == [1, 2]  # step 1 kept, step 2 after the resume
    assert (out / "checkpoint-2").is_dir() and (out / "final" / "config.json").is_file()


@pytest.mark.slow
def test_out_of_memory_without_fallback_explains_and_keeps_the_checkpoint(capsys, tiny_model_folder, tmp_path,
                                                                           capped):
    out = tmp_path / "run"
    code, _, err = run(capsys, "run", "--model", str(tiny_model_folder), "--dataset", "math-sample",
                       "--max-steps", "2", "--save-steps", "1", "--output-dir", str(out), *SMALL)
    assert code == 2 and "error: out of GPU memory" in err and "\nThe plan put the peak at" in err
    assert (out / "checkpoint-1").is_dir()


def test_trl_1_15_is_refused_on_a_machine_without_cuda_its_triton_kernel_needs_one(capsys, installed_trl,
                                                                                 tiny_model_folder, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    installed_trl("1.15.0")
    out = tmp_path / "run"
    err = one_line_error(capsys, "run", "--model", str(tiny_model_folder), "--dataset", "math-sample",
                         "--output-dir", str(out), *SMALL)
    assert "TRL 1.15.0 scores log-probabilities only with a Triton kernel" in err and "'trl>=1.16'" in err
    assert not out.exists()
    code, stdout, _ = run(capsys, "run", "--model", str(tiny_model_folder), "--dataset", "math-sample",
                          "--output-dir", str(out), "--dry-run", *SMALL)
    assert code == 0 and "note: TRL 1.15.0 scores log-probabilities only with a Triton kernel" in stdout


@pytest.mark.slow
def test_the_smoke_steps_completions_are_full_length_though_the_model_ends_them_at_once(capsys, monkeypatch,
                                                                                      tiny_model_folder, tmp_path):
    """TRL cuts each completion at its first EOS before the loss passes, so a smoke step must never sample EOS: a
    model that always ends its answer at once gets full-length completions in the smoke step, one token in the run."""
    import torch
    from transformers import LlamaForCausalLM, TrainerCallback

    from vram_planner.run import launch

    eos = json.loads((tiny_model_folder / "config.json").read_text())["eos_token_id"]
    forward = LlamaForCausalLM.forward

    def ends_at_once(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if out.logits is not None and not torch.is_grad_enabled():
            out.logits[..., eos] += 1e4
        return out

    lengths = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "completions/mean_length" in logs:
            lengths.append(logs["completions/mean_length"])

    monkeypatch.setattr(LlamaForCausalLM, "forward", ends_at_once)
    monkeypatch.setattr(launch, "EXTRA_CALLBACKS", [type("Lengths", (TrainerCallback,), {"on_log": on_log})()])
    code, _, err = run(capsys, "run", "--model", str(tiny_model_folder), "--dataset", "math-sample", "--max-steps",
                       "1", "--output-dir", str(tmp_path / "run"), *SMALL)
    assert code == 0, err
    assert lengths == [8, 1]  # SMALL's --max-completion-length 8: the smoke step's, then the run's


def test_the_smoke_step_takes_the_longest_prompts_first():
    from datasets import Dataset

    from vram_planner.run.smoke import longest_first

    data = Dataset.from_list([{"prompt": "x" * n, "answer": str(n)} for n in (3, 10, 1, 7)])
    assert longest_first(data, 2)["answer"] == ["10", "7"]


@pytest.mark.parametrize(("flags", "distributed_type", "extra"), [
    (["--num-gpus", "2"], "MULTI_GPU", {}),
    (["--num-gpus", "4", "--zero-stage", "3"], "DEEPSPEED", {"deepspeed_config": "zero_stage: 3"}),
    (["--num-gpus", "2", "--fsdp"], "FSDP", {"fsdp_config": "fsdp_version: 2"}),
])
def test_several_gpus_start_through_accelerate_with_trls_config(capsys, tmp_path, flags, distributed_type, extra):
    out = tmp_path / "run"
    code, stdout, _ = run(capsys, "run", "--gpu", "h100", "--model", "Llama-3.2-1B", "--dataset", "math-sample",
                          "--per-device-train-batch-size", "4", "--num-generations", "8", "--output-dir", str(out),
                          *flags, "--dry-run")
    assert code == 0 and not out.exists()
    assert f"distributed_type: {distributed_type}" in stdout and f"num_processes: {flags[1]}" in stdout
    assert all(text in stdout for text in extra.values())
    command = stdout.split("command: ")[1].strip()
    assert command.startswith(f"accelerate launch --config_file {out}/accelerate_config.yaml -m vram_planner run")
    assert "--dry-run" not in command


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk", "jsonl"])
def test_local_datasets_in_every_format(tmp_path, kind):
    from datasets import Dataset

    from vram_planner.run.train_data import load_prompts

    data = Dataset.from_list([{"prompt": "1 + 1?", "answer": "2"}, {"prompt": "2 + 2?", "answer": "4"}])
    path = tmp_path / f"data.{kind}"
    {"parquet": lambda: data.to_parquet(str(path)), "save_to_disk": lambda: data.save_to_disk(str(path)),
     "jsonl": lambda: data.to_json(str(path))}[kind]()
    assert load_prompts(str(path))["answer"] == ["2", "4"]


def test_gsm8k_offline_says_what_to_use_instead(monkeypatch):
    import datasets

    from vram_planner.errors import VramPlanError
    from vram_planner.run.train_data import load_prompts

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(VramPlanError, match="math-sample"):
        load_prompts("gsm8k")


def test_a_plan_that_fits_nowhere_is_refused(capsys, tmp_path):
    err = one_line_error(capsys, "run", "--gpu", "1GiB", "--model", "Llama-3.2-1B", "--dataset", "math-sample",
                         "--output-dir", str(tmp_path / "run"))
    assert "nothing vram-plan knows fits" in err and not (tmp_path / "run").exists()


def test_an_empty_output_dir_is_refused_not_taken_as_this_folder(capsys, tiny_model_folder):
    for empty in ("", "  "):
        err = one_line_error(capsys, "run", "--model", str(tiny_model_folder), "--dataset", "math-sample",
                             "--output-dir", empty, "--dry-run", *SMALL)
        assert "--output-dir" in err and "is empty" in err


def test_trls_own_card_is_replaced_a_users_readme_is_not(tmp_path):
    from vram_planner.run.model_card import TRL_CARD_LINE, users_readme

    assert not users_readme(tmp_path)
    (tmp_path / "README.md").write_text(f"---\ntags: [trl]\n---\n# Model Card for run\n{TRL_CARD_LINE}\n")
    assert not users_readme(tmp_path)  # an earlier run's card: the new one replaces it
    (tmp_path / "README.md").write_text("my experiment log\n")
    assert users_readme(tmp_path)


def test_a_trl_release_other_than_the_installed_one_is_refused_before_the_dry_run(capsys, tiny_model_folder):
    from vram_planner.model.trl_releases import installed_trl_version

    err = one_line_error(capsys, "run", "--model", str(tiny_model_folder), "--dataset", "math-sample",
                         "--trl-version", "0.14.0", "--dry-run", *SMALL)
    assert f"installed TRL {installed_trl_version()}, not --trl-version 0.14.0" in err
    assert "pip install 'trl==0.14.0'" in err
    code, out, _ = run(capsys, "run", "--model", str(tiny_model_folder), "--dataset", "math-sample", "--trl-version",
                       installed_trl_version(), "--dry-run", *SMALL)
    assert code == 0 and "GRPOConfig(" in out


@pytest.mark.slow
def test_sigterm_saves_the_steps_done_and_the_printed_command_continues_without_logging_a_step_twice(
        tiny_model_folder, tmp_path):
    import shlex
    import signal

    out = tmp_path / "run"
    command = [sys.executable, "-m", "vram_planner", "run", "--model", str(tiny_model_folder), "--dataset",
               "math-sample", "--max-steps", "4", "--save-steps", "100", "--output-dir", str(out), *SMALL]
    started = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in started.stderr:  # off a terminal: a line per step, as it comes
        lines.append(line)
        if line.startswith("GRPO step 1/4"):
            started.send_signal(signal.SIGTERM)
            break
    rest = started.stderr.read()
    assert started.wait(timeout=300) == 143, "".join(lines) + rest
    said = rest.strip().splitlines()
    assert said[-2].startswith("SIGTERM at step ") and "training so far is saved in" in said[-2], rest
    step = int(said[-2].split("SIGTERM at step ")[1].split(":")[0])
    assert (out / f"checkpoint-{step}").is_dir()
    again = shlex.split(said[-1])
    assert again[:2] == ["vram-plan", "run"] and again[-1] == "--resume"
    stopped = json.loads((out / "vram-plan-run.json").read_text())["outcome"]
    assert stopped == {"status": "interrupted", "signal": "SIGTERM", "step": step,
                       "checkpoint": str(out / f"checkpoint-{step}")}
    resumed = subprocess.run([sys.executable, "-m", "vram_planner", *again[1:]], capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.strip().splitlines()[-1].startswith("done: 4 steps in ")
    steps = [json.loads(line)["step"] for line in (out / "vram-plan-log.jsonl").read_text().splitlines()
             if "reward" in json.loads(line)]
    assert steps == [1, 2, 3, 4]


def test_a_run_stopped_before_its_first_checkpoint_starts_again_without_overwrite(tmp_path):
    from vram_planner.run.checks import restartable, run_files
    from vram_planner.run.interrupts import RunInterrupted, interrupted_message

    (tmp_path / "vram-plan-log.jsonl").write_text('{"step": 0}\n')
    assert restartable(run_files(tmp_path))
    (tmp_path / "checkpoint-2").mkdir()
    assert not restartable(run_files(tmp_path))
    argv = ["run", "--model", "my model", "--dataset", "math-sample", "--overwrite"]
    fresh = interrupted_message(RunInterrupted(130, "Ctrl+C", 0, None), argv)
    assert fresh.splitlines()[-1] == "vram-plan run --model 'my model' --dataset math-sample"
    kept = interrupted_message(RunInterrupted(130, "Ctrl+C", 2, tmp_path / "checkpoint-2"), argv)
    assert kept.splitlines()[-1] == "vram-plan run --model 'my model' --dataset math-sample --resume"


def test_a_prompt_longer_than_the_plan_counts_is_refused_with_both_numbers(capsys, tiny_model_folder, tmp_path):
    # TRL 1.16 no longer truncates prompts: the plan's max_prompt_length must hold the dataset's longest
    data = tmp_path / "long.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": "count " * n, "answer": "1"}) for n in (3, 900, 40)) + "\n")
    flags = ["--model", str(tiny_model_folder), "--dataset", str(data), "--output-dir", str(tmp_path / "run"),
             "--reward", "format", "--dry-run", *SMALL]
    err = one_line_error(capsys, "run", *flags, "--max-prompt-length", "16")
    longest = int(err.split("longest prompt is ")[1].split(" tokens")[0])
    assert longest >= 900 and "(row 2)" in err and "longer than the 16 the plan counts" in err
    assert f"--max-prompt-length {longest}" in err
    code, out, _ = run(capsys, "run", *flags, "--max-prompt-length", str(longest))
    assert code == 0 and "GRPOConfig(" in out


def test_a_hub_model_offline_is_refused_before_anything_else(capsys, monkeypatch, tmp_path):
    from transformers.utils import hub as transformers_hub

    from vram_planner import hub

    def reached(*args, **kwargs):
        raise AssertionError("a download was tried (transformers retries for half a minute offline)")

    monkeypatch.setattr(hub, "hub_unreachable_reason", lambda *a, **k: "https://huggingface.co did not answer")
    monkeypatch.setattr(transformers_hub, "cached_files", reached)
    flags = ["run", "--gpu", "24GiB", "--model", "Qwen2.5-0.5B", "--dataset", "math-sample", "--output-dir",
             str(tmp_path / "run"), "--max-steps", "1"]
    err = one_line_error(capsys, *flags)
    assert "Qwen/Qwen2.5-0.5B is a hub model, and the hub cannot be reached" in err and "local model folder" in err
    assert not (tmp_path / "run").exists()
    # a dry run says it and goes on
    code, out, _ = run(capsys, *flags, "--dry-run")
    assert code == 0 and "the hub cannot be reached" in " ".join(out.split())


def test_a_recipes_training_arguments_come_along_and_the_config_is_trls(capsys, tiny_model_folder, tmp_path):
    # open-r1's recipe trains with its learning rate, schedule and seed; where the run writes and saves is the run's
    recipe = tmp_path / "config_demo.yaml"
    recipe.write_text("model_name_or_path: Qwen/Qwen2.5-1.5B-Instruct\nlearning_rate: 2.0e-05\n"
                      "lr_scheduler_type: cosine\nwarmup_ratio: 0.1\nseed: 42\nmax_grad_norm: 0.2\n"
                      "output_dir: data/Qwen2.5-1.5B-Open-R1-GRPO\nsave_strategy: epoch\nreward_weights: [1.0, 0.5]\n")
    out = tmp_path / "run"
    code, stdout, _ = run(capsys, "run", "--config", str(recipe), "--model", str(tiny_model_folder), "--dataset",
                          "math-sample", "--output-dir", str(out), "--dry-run", *SMALL)
    config = stdout.split("GRPOConfig(")[1].split("\n")[0]
    assert code == 0 and "learning_rate=2e-05" in config and "seed=42" in config and "max_grad_norm=0.2" in config
    assert f"output_dir='{out}'" in config and "save_strategy" not in config and "reward_weights" not in config
    said = " ".join(stdout.split())
    assert ("from the recipe: learning_rate, lr_scheduler_type, seed, max_grad_norm carried into the GRPOConfig; "
            "warmup_ratio left out (not a field of the installed TRL's GRPOConfig)") in said
    from trl import GRPOConfig

    from vram_planner.files import load_yaml
    from vram_planner.recipe import read_recipe
    from vram_planner.run.setup import RunSetup

    carried, _ = RunSetup.recipe_arguments_of(read_recipe(load_yaml(recipe.read_text(), "recipe")))
    args = GRPOConfig(output_dir=str(out), use_cpu=True, report_to="none", **carried)
    assert (args.learning_rate, args.lr_scheduler_type, args.seed) == (2e-05, "cosine", 42)


def _carried(text: str) -> dict:
    from vram_planner.files import load_yaml
    from vram_planner.recipe import read_recipe
    from vram_planner.run.setup import RunSetup

    return RunSetup.recipe_arguments_of(read_recipe(load_yaml(text, "recipe")))[0]


def test_a_recipes_numbers_written_as_yaml_text_are_read_as_trls_parser_reads_them():
    """YAML reads `5e-6` (no dot) as text; `trl grpo --config` trains at 5e-06 all the same (argparse converts a
    default given as text with the argument's type), and so does the run, where the text once reached the optimizer
    and the run died in an internal error."""
    carried = _carried("learning_rate: 5e-6\nseed: '7'\nscale_rewards: false\nlr_scheduler_type: cosine\n")
    assert carried == {"learning_rate": 5e-06, "seed": 7, "scale_rewards": False, "lr_scheduler_type": "cosine"}
    assert isinstance(carried["learning_rate"], float) and isinstance(carried["seed"], int)


@pytest.mark.parametrize(("text", "said"), [
    ("learning_rate: abc", "learning_rate 'abc': TRL's parser does not read it as a number"),
    ("seed: 1.5e3", "seed '1.5e3': TRL's parser does not read it as a whole number"),
    ("max_grad_norm: .nan", "max_grad_norm nan: GRPOConfig takes a finite number there"),
    ("learning_rate: [1, 2]", "learning_rate [1, 2]: GRPOConfig takes a finite number there"),
])
def test_a_recipes_value_trl_cannot_read_is_refused_in_one_line(capsys, tiny_model_folder, tmp_path, text, said):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text + "\n")
    err = bad_run(capsys, tmp_path, tiny_model_folder, "--config", str(recipe), "--dataset", "math-sample")
    assert err == f"error: {said}\n"


def test_trls_own_flags_on_the_command_line_are_read_as_its_parser_reads_them(capsys, tiny_model_folder, tmp_path):
    err = bad_run(capsys, tmp_path, tiny_model_folder, "--dataset", "math-sample", "--learning_rate", "abc")
    assert err == "error: learning_rate 'abc': TRL's parser does not read it as a number\n"
    code, stdout, _ = run(capsys, "run", "--model", str(tiny_model_folder), "--dataset", "math-sample",
                          "--output-dir", str(tmp_path / "run"), "--dry-run", "--learning_rate", "3e-6", *SMALL)
    assert code == 0 and "learning_rate=3e-06," in stdout.split("GRPOConfig(")[1]
