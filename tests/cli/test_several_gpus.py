"""Several GPUs shown everywhere: the headline, the plot, the page, `gpus` and the JSON say "per GPU, N x strategy";
`plan` prints TRL's accelerate config and the launch line, each valid as printed at any terminal width."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from helpers import json_of, launched, run
from vram_planner.app import views
from vram_planner.app.query import query_report
from vram_planner.report.plot import plot_phases
from vram_planner.profiles import GpuProfile
from vram_planner.units import GiB

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STRATEGIES = [(["--num-gpus", "2", "--zero-stage", "3"], "2 x ZeRO-3"),
              (["--num-gpus", "4", "--zero-stage", "2", "--gradient-accumulation-steps", "2"], "4 x ZeRO-2"),
              (["--num-gpus", "8", "--zero-stage", "1", "--gradient-accumulation-steps", "4"], "8 x ZeRO-1"),
              (["--num-gpus", "2", "--fsdp"], "2 x FSDP2"), (["--num-gpus", "3"], "3 x DDP")]
MODEL = ["--gpu", "h100", "--model", "Qwen2.5-7B"]


def printed_config(out: str) -> tuple[str, str]:
    """The accelerate config file and the launch line as printed: the lines after their labels."""
    lines = ANSI.sub("", out).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("accelerate_config.yaml ("))
    launch = next(i for i, line in enumerate(lines) if line.startswith("Launch ("))
    return "\n".join(lines[start + 1:launch]) + "\n", lines[launch + 1]


@pytest.mark.parametrize("terminal", ["0", "1"])
@pytest.mark.parametrize(("flags", "label"), STRATEGIES, ids=[s[1] for s in STRATEGIES])
def test_plan_prints_the_accelerate_config_and_launch_line_valid_at_any_width(capsys, monkeypatch, tmp_path,
                                                                             terminal, flags, label):
    _, document = json_of(capsys, "plan", *MODEL, *flags, "--json")
    launch = document["distributed"]
    assert launch["label"] == label and launch["num_gpus"] == int(flags[1])
    monkeypatch.setenv("TTY_COMPATIBLE", terminal)
    for width in [40, 57, 80, 120, 200]:
        monkeypatch.setenv("COLUMNS", str(width))
        code, out, err = run(capsys, "plan", *MODEL, *flags)
        assert code == 0, err
        assert f"per GPU, {label}" in " ".join(ANSI.sub("", out).split())  # the headline, however it wraps
        config, line = printed_config(out)
        assert yaml.safe_load(config) == launch["accelerate_config"]
        assert line == launch["launch_command"] == "accelerate launch --config_file accelerate_config.yaml train_grpo.py"
        args = launched(config, tmp_path)
        assert args.num_processes == launch["num_gpus"]


def test_one_gpu_prints_no_accelerate_config(capsys):
    code, out, _ = run(capsys, "plan", *MODEL)
    assert code == 0 and "accelerate" not in out and "per GPU" not in out
    assert json_of(capsys, "check", *MODEL, "--json")[1]["distributed"] is None


def test_the_json_says_per_gpu_and_its_bytes_are_whole(capsys):
    _, document = json_of(capsys, "check", *MODEL, "--dtype", "bfloat16", "--num-gpus", "2", "--zero-stage", "2",
                          "--json")
    assert document["distributed"]["strategy"] == "zero2" and document["assumptions"]["num_gpus"] == 2
    assert all(isinstance(v, int) for p in document["phases"] for v in p["components"].values())
    # DeepSpeed's own estimate of the model states (2P + 18P/N) is 78.02 GiB of the H100's 79.18: it does not fit
    assert not document["fits"]
    step = next(p for p in document["phases"] if p["name"] == "optimizer")["components"]
    states = step["weights"] + step["gradients"] + step["optimizer_states"]
    assert states >= 2 * document["params"] + 18 * document["params"] // 2


@pytest.mark.parametrize("flags", [["--zero-stage", "2"], ["--zero-stage", "3"], ["--zero-stage", "0"]])
def test_no_change_that_saves_nothing_under_zero(capsys, flags):
    # DeepSpeed's bf16 engine holds 16-bit weights whatever dtype is loaded: float32 -> bfloat16 saves nothing alone
    code, document = json_of(capsys, "plan", "--gpu", "rtx3060", "--model", "Llama-3.2-3B", "--num-gpus", "2",
                             *flags, "--json")
    assert code == 0 and document["changes"]
    assert all(change["saved_bytes"] > 0 for change in document["changes"]), document["changes"]
    _, out, _ = run(capsys, "plan", "--gpu", "rtx3060", "--model", "Llama-3.2-3B", "--num-gpus", "2", *flags)
    assert "saves 0.00" not in out


def test_gpus_says_per_gpu_in_its_title_and_json(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run(capsys, "plan", *MODEL, "--num-gpus", "2", "--zero-stage", "3", "--maximize",
                       "max_completion_length")
    assert "Qwen2.5-7B on NVIDIA H100 80GB HBM3 (79.18 GiB), per GPU, 2 x ZeRO-3" in " ".join(out.split())
    code, out, _ = run(capsys, "gpus", "--model", "Qwen2.5-7B", "--num-gpus", "2", "--zero-stage", "3")
    assert code == 0 and "Qwen2.5-7B, TRL 1.16.0, per GPU, 2 x ZeRO-3: every card" in out
    _, rows = json_of(capsys, "gpus", "--model", "Qwen2.5-7B", "--num-gpus", "2", "--zero-stage", "3", "--json")
    assert {row["per_gpu"] for row in rows} == {"2 x ZeRO-3"}
    _, rows = json_of(capsys, "gpus", "--model", "Qwen2.5-7B", "--json")
    assert {row["per_gpu"] for row in rows} == {None}


def test_the_plot_title_and_the_page_say_per_gpu(tmp_path):
    import matplotlib

    query = [("gpu", "h100"), ("model", "Qwen2.5-7B"), ("num_gpus", "2"), ("zero_stage", "3")]
    report = query_report("check", query)
    matplotlib.rcParams["svg.fonttype"] = "none"  # text as text, so that the title can be read back
    try:
        svg = plot_phases(report, tmp_path / "plan.svg").read_text()
    finally:
        matplotlib.rcParams["svg.fonttype"] = "path"
    assert "Qwen2.5-7B: GRPO step memory by phase, per GPU, 2 x ZeRO-3" in svg
    gpu = GpuProfile.from_name("h100")
    assert views.title_markdown(report, gpu) == (f"**Qwen2.5-7B** on the {gpu.label} ({gpu.total_memory_gib:.2f} "
                                                 "GiB), per GPU, 2 x ZeRO-3, TRL 1.16.0 GRPO")
    single = query_report("check", query[:2])
    assert "per GPU" not in views.title_markdown(single, gpu) and views.launch_markdown(single) == ""
    page = views.launch_markdown(report)  # the page's accelerate config: the fenced YAML is the JSON's
    fenced = page.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(fenced) == report.distributed.accelerate_config
    assert f"```bash\n{report.distributed.launch_command}\n```" in page
    assert single.peak_bytes > report.peak_bytes > 0 and report.capacity_bytes == single.capacity_bytes
    assert report.capacity_bytes / GiB == pytest.approx(gpu.total_memory_gib)


def test_plan_with_several_gpus_never_imports_the_engines(tmp_path):
    code = ("import sys, contextlib, io\n"
            "from vram_planner.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    main(['plan', '--gpu', 'h100', '--model', 'Qwen2.5-7B', '--num-gpus', '2', '--zero-stage', '3'])\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    main(['check', '--gpu', 'h100', '--model', 'Qwen2.5-7B', '--num-gpus', '4', '--fsdp', '--json'])\n"
            "heavy = [m for m in ('torch', 'transformers', 'trl', 'peft', 'deepspeed', 'accelerate') "
            "if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("flags", [*[flags for flags, _ in STRATEGIES], ["--num-gpus", "2", "--zero-stage", "0"],
                                   ["--zero-stage", "0"]])
def test_the_assumptions_name_the_strategy_the_distributed_report_names(capsys, flags):
    # ZeRO stage 0 is DeepSpeed's engine, not torch's DDP: both places say zero0
    _, document = json_of(capsys, "check", *MODEL, "--dtype", "bfloat16", *flags, "--json")
    assert document["assumptions"]["distributed"] == document["distributed"]["strategy"]
