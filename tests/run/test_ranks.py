"""`vram-plan run --num-gpus 2`: two gloo ranks on the CPU train a tiny model through accelerate's own launcher under
DDP and FSDP2 (and DeepSpeed ZeRO-2/3 where it is installed), and each rank's bytes are held to the plan's per-rank
figures."""

from __future__ import annotations

import importlib.util
import json

import pytest

from helpers import SMALL, one_line_error, run

pytest.importorskip("trl")
pytest.importorskip("accelerate")

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _planned(record: dict, phase: str = "optimizer") -> dict[str, int]:
    return next(p["components"] for p in record["phases"] if p["name"] == phase)


def _close(measured: float, planned: float, within: float = 0.01) -> bool:
    return abs(measured - planned) <= within * planned


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    [],
    ["--fsdp"],
    pytest.param(["--zero-stage", "2"], marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed not installed")),
    pytest.param(["--zero-stage", "3"], marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed not installed")),
    # a bucket of its own: the accelerate config names the DeepSpeed config the run writes beside it
    pytest.param(["--zero-stage", "2", "--reduce-bucket-size", "auto", "--overlap-comm"],
                 marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed not installed")),
], ids=["ddp", "fsdp2", "zero2", "zero3", "zero2-buckets"])
def test_two_cpu_ranks_train_and_hold_the_plans_per_rank_bytes(capsys, monkeypatch, tiny_model_folder, tmp_path,
                                                                flags):
    out = tmp_path / "run"
    # where torch would build DeepSpeed's shared-memory all-reduce, which the CPU ranks' training never calls
    extensions = tmp_path / "torch-extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    code, stdout, _ = run(capsys, "run", "--model", str(tiny_model_folder), "--dataset", "math-sample",
                          "--max-steps", "1", "--output-dir", str(out), *SMALL, "--num-gpus", "2", *flags)
    assert code == 0, stdout
    assert not extensions.exists()  # nothing compiled: a minute per session on two cores
    config = (out / "accelerate_config.yaml").read_text()
    if "--reduce-bucket-size" in flags:  # the stage and precision live in the DeepSpeed config, "auto" the GRPOConfig's
        deepspeed = json.loads((out / "ds_config.json").read_text())
        assert f"deepspeed_config_file: {out / 'ds_config.json'}" in config and "mixed_precision" not in config
        assert deepspeed["zero_optimization"] == {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": True}
    else:
        assert "num_processes: 2" in config and "mixed_precision: 'no'" in config  # float32 ranks on the CPU
        expected = ({0: "distributed_type: MULTI_GPU", 1: "fsdp_version: 2"}.get(len(flags))
                    or f"zero_stage: {flags[1]}")
        assert expected in config
    record = json.loads((out / "vram-plan-run.json").read_text())
    assert record["outcome"]["status"] == "finished" and record["outcome"]["steps"] == 1
    # rank 0 alone writes: one line per logged step, one record that holds both ranks
    lines = [json.loads(line) for line in (out / "vram-plan-log.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "reward" in line] == [1]
    ranks = record["outcome"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    # beside what a CUDA rank measures outside the allocator (a CPU rank has no card): the plan's context and NCCL
    outside = record["outcome"]["predicted_outside_allocator_bytes"]
    peak = max(record["phases"], key=lambda p: p["peak_bytes"])["components"]
    assert outside == {c: round(peak[c]) for c in ("cuda_context", "nccl_buffers", "vllm_communicators")}
    assert outside["nccl_buffers"] > 0 and outside["vllm_communicators"] == 0
    assert not any("outside_allocator_bytes" in r for r in ranks)
    plan = _planned(record)
    for rank in ranks:
        # DeepSpeed's fp32 master partition with the moments, FSDP2's fp32 shard of both: what the plan counts
        assert _close(rank["optimizer_states"], plan["optimizer_states"]), (rank, plan)
        if not flags:
            # DDP: the whole model on every rank; the plan's gradients add DDP's bucket copy of them, which the
            # reducer holds, not the parameters' .grad
            assert _close(rank["weights"], plan["weights"]) and _close(2 * rank["gradients"], plan["gradients"]), rank
        elif flags == ["--fsdp"]:
            assert _close(rank["weights"], plan["weights"]) and _close(rank["gradients"], plan["gradients"]), rank
        elif flags[1] == "2":
            # transformers refuses bf16 without a GPU, so the CPU ranks run DeepSpeed's fp32 engine: the whole
            # module at 4 bytes a parameter where the plan counts bf16's 2
            assert _close(rank["weights"], 2 * plan["weights"]), (rank, plan)
        else:
            # ZeRO-3: this rank's fp32 partition; the plan's step counts it in bf16, every gathered layer released
            # (model/zero.py)
            assert _close(rank["weights"], 2 * plan["weights"]), (rank, plan)


def test_rank_bytes_reads_weights_gradients_and_optimizer_states():
    import torch

    from vram_planner.run.ranks import gathered, rank_bytes

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2, bias=False))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(3, 8)).sum().backward()
    optimizer.step()
    tensors = 3  # two weights and a bias, each under 512 bytes: one 512-byte block each, as CUDA allocates them
    assert rank_bytes(model, optimizer) == {"weights": tensors * 512, "gradients": tensors * 512,
                                            "optimizer_states": 2 * tensors * 512}  # the moments; steps on the host
    fused = torch.optim.AdamW(model.parameters(), fused=True)
    fused.step()
    assert rank_bytes(model, fused)["optimizer_states"] == 3 * tensors * 512  # fused AdamW's steps on the device
    optimizer.zero_grad()
    assert rank_bytes(model, optimizer)["gradients"] == 0
    assert gathered({"weights": 1}) == [{"rank": 0, "weights": 1}]  # no process group: this process alone


def test_a_cuda_rank_records_what_its_card_holds_outside_the_allocator(monkeypatch):
    import torch

    from vram_planner.run.ranks import RankBytes

    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    # a card of 80 GiB with 60 free, 15 of the used 20 reserved by the caching allocator
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (60 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *_: 15 * 2**30)
    ranks = RankBytes()
    ranks.on_optimizer_step(None, None, None, model=model, optimizer=optimizer)
    assert ranks.measured["outside_allocator_bytes"] == 5 * 2**30
    assert ranks.measured["weights"] == 2 * 512


# A rank's last moments as they went wrong: a thread waits inside torch's C++ with the GIL released (a store read
# that returns when its timeout, or the peer rank's exit, ends it) while the interpreter tears down slowly.
RANK_ENDING = """
import atexit, datetime, os, sys, threading, time
import torch.distributed as dist

store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=2))
waiting = threading.Event()

def read_a_key_nobody_writes():
    waiting.set()
    try:
        store.wait(["never"])
    except Exception:
        pass

class SlowTeardown:
    def __del__(self, sleep=time.sleep):
        sleep(6)

teardown = SlowTeardown()
threading.Thread(target=read_a_key_nobody_writes, daemon=True).start()
waiting.wait()
atexit.register(lambda: open(os.environ["EXIT_FUNCTIONS_RAN"], "w").close())
print("done")
if sys.argv[1] == "exit_rank":
    from vram_planner.run.several import exit_rank
    exit_rank(3)
sys.exit(3)
"""


def test_a_finished_rank_leaves_without_the_teardown_that_aborts_it(tmp_path):
    """The interpreter's exit aborts the rank (SIGABRT, "terminate called without an active exception") when a thread
    in torch's C++ asks for the GIL back during finalization; exit_rank leaves with the rank's own exit code, its
    output and its exit functions, and no abort."""
    import os
    import subprocess
    import sys

    script = tmp_path / "rank.py"
    script.write_text(RANK_ENDING)
    ended = {}
    for how in ("interpreter", "exit_rank"):
        ran = tmp_path / f"atexit-{how}"
        ended[how] = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=120,
                                    env={**os.environ, "EXIT_FUNCTIONS_RAN": str(ran)})
        assert ended[how].stdout == "done\n" and ran.exists()
    assert ended["interpreter"].returncode == -6 and "terminate called" in ended["interpreter"].stderr
    assert ended["exit_rank"].returncode == 3 and "terminate called" not in ended["exit_rank"].stderr


@pytest.mark.parametrize(("missing", "flags", "install"), [
    ("accelerate", ["--fsdp"], "pip install accelerate"),
    ("deepspeed", ["--zero-stage", "2"], "pip install deepspeed"),
])
def test_a_missing_launcher_package_is_refused_in_one_line(capsys, monkeypatch, tiny_model_folder, tmp_path, missing,
                                                            flags, install):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else found(name, *a))
    out = tmp_path / "run"
    args = ["run", "--model", str(tiny_model_folder), "--dataset", "math-sample", "--output-dir", str(out), *SMALL,
            "--num-gpus", "2", *flags]
    err = one_line_error(capsys, *args)
    assert install in err and "--num-gpus 2" in err and not out.exists()
    # the dry run prints the config and the launch line all the same, and says what is missing
    code, stdout, _ = run(capsys, *args, "--dry-run")
    assert code == 0 and "accelerate launch --config_file" in stdout and install in stdout and not out.exists()
    # the accelerate config of the GPU run, as plan prints it (its CPU ranks would train in float32)
    assert "mixed_precision: bf16" in stdout and "no CUDA here" not in stdout


RANK_1_FAILS = {
    "refused": "raise RuntimeError('no answer column on this rank')",  # the rank says why in its own line
    "killed": "os.kill(os.getpid(), signal.SIGKILL)",  # as the kernel's out-of-memory killer does: not a word
}


@pytest.mark.slow
@pytest.mark.parametrize("how", list(RANK_1_FAILS))
def test_a_failed_rank_is_one_line_not_the_launchers_traceback(capfd, tiny_model_folder, tmp_path, how):
    from vram_planner.cli import main

    rewards = tmp_path / "rewards.py"
    rewards.write_text("import os, signal\n\ndef reward(completions, **kwargs):\n"
                       f"    if os.environ.get('RANK') == '1':\n        {RANK_1_FAILS[how]}\n"
                       "    return [0.0] * len(completions)\n")
    code = main(["run", "--model", str(tiny_model_folder), "--dataset", "math-sample", "--max-steps", "1",
                 "--output-dir", str(tmp_path / "run"), *SMALL, "--num-gpus", "2", "--fsdp",
                 "--reward", f"{rewards}:reward"])
    err = capfd.readouterr().err
    assert code == 2 and "Traceback" not in err and "ChildFailedError" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    if how == "refused":
        assert errors == [f"error: reward {rewards}:reward fails on a sample batch: no answer column on this rank "
                          "(--debug shows where)"]
    else:
        assert errors == ["error: rank 1 of 2 was killed by SIGKILL (out of host memory, or killed); --verbose "
                          "shows the launcher's report"]


def test_the_launch_line_spells_out_what_num_gpus_auto_chose(capsys, tmp_path):
    out = tmp_path / "run"
    base = ["run", "--gpu", "h100", "--model", "Qwen2.5-7B", "--dataset", "math-sample", "--output-dir", str(out)]
    code, stdout, _ = run(capsys, *base, "--num-gpus", "auto", "--dry-run")
    assert code == 0 and not out.exists()
    command = stdout.split("command: ")[1].strip().split()
    assert "auto" not in command and "--dry-run" not in command
    count = command[command.index("--num-gpus") + 1]
    chosen = command[command.index("--num-gpus") + 2:]
    assert chosen and chosen[0] in ("--fsdp", "--zero-stage", "--offload-optimizer", "--offload-param"), command
    # the ranks plan the same run from the spelled-out flags: the same config file, the same launch line
    spelled = run(capsys, *base, "--num-gpus", count, *chosen, "--dry-run")[1]
    assert spelled.split(f"{out}/accelerate_config.yaml:")[1] == stdout.split(f"{out}/accelerate_config.yaml:")[1]


def _signalled(sigval):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return SignalException(f"Process got signal: {sigval}", sigval)


@pytest.mark.parametrize(("ending", "code"), [
    (lambda: _signalled(2), 130),  # accelerate up to 1.15: torch's launcher's exception passes through
    (lambda: SystemExit(130), 130),  # accelerate 1.16 on: its launcher exits 128 + the signal itself
    (lambda: SystemExit(143), 143),
    (lambda: SystemExit(1), 2),
], ids=["ctrl-c-1.15", "ctrl-c-1.16", "sigterm-1.16", "launcher-failed"])
def test_the_launchers_own_ending_is_the_commands_exit_code(capsys, monkeypatch, tiny_model_folder, tmp_path, ending,
                                                            code):
    # the ranks stopped at a signal said where their checkpoint is and how to resume; the command exits as they did,
    # not with "code vram-plan ran for you called sys.exit" (what accelerate 1.16's own exit read as until 2026-12-04)
    import accelerate.commands.launch

    def launched(args):
        raise ending()

    monkeypatch.setattr(accelerate.commands.launch, "launch_command", launched)
    args = ["run", "--model", str(tiny_model_folder), "--dataset", "math-sample", "--output-dir",
            str(tmp_path / "run"), *SMALL, "--num-gpus", "2"]
    exit_code, out, err = run(capsys, *args)
    assert exit_code == code and "accelerate launch --config_file" in out, err
    if code == 2:
        assert err == "error: accelerate's launcher stopped with exit code 1; --verbose shows its report\n"
    else:
        assert "error" not in err, err
