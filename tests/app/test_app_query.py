"""`vram-plan app` without a server: the API's query read as the CLI reads its flags, what the page shows of a
report, the install hint without Gradio, and plan/check still never importing it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from pathlib import Path

import re

import pytest

from helpers import run
from vram_planner.app import views
from vram_planner.app.query import error_line, query_parameters, query_report, query_request
from vram_planner.cli.options import NOT_KNOBS, request_from
from vram_planner.cli.plan import check, plan
from vram_planner.errors import VramPlanError, flag
from vram_planner.request import knob_fields
from vram_planner.model.verdict import DEFAULT_SAFETY_MARGIN
from vram_planner.model.phases import COMPONENTS
from vram_planner.units import GiB
from vram_planner.validation import to_json

LLAMA = [("gpu", "rtx3080-mobile"), ("model", "Llama-3.2-1B")]


def test_every_flag_of_check_and_plan_but_the_files_and_the_output_is_a_query_parameter():
    for command in (check, plan):
        flags = {p.name for p in command.params} - set(NOT_KNOBS)
        assert flags <= set(query_parameters())
    assert set(query_parameters()) - set(knob_fields()) == {"gpu", "model", "trl_version", "safety_margin", "exact",
                                                            "keep_copy", "maximize", "allow_savers", "optimize",
                                                            "reward_seconds", "dataset_prompts"}


def test_a_query_gives_the_request_its_flags_give():
    query = [*LLAMA, ("max_completion_length", "1024"), ("use_vllm", "true"), ("gradient-checkpointing", "false"),
             ("lora_target_modules", "q_proj,v_proj")]
    request, questions = query_request(query)
    flags = ["--gpu", "rtx3080-mobile", "--model", "Llama-3.2-1B", "--max-completion-length", "1024", "--use-vllm",
             "--no-gradient-checkpointing", "--lora-target-modules", "q_proj,v_proj"]
    options = check.make_context("check", flags).params
    assert request == request_from("check", options) and questions == {}
    assert request.max_completion_length == 1024 and request.gradient_checkpointing is False


def test_a_negative_value_is_refused_in_the_fields_words():
    with pytest.raises(VramPlanError) as refused:
        query_report("check", [*LLAMA, ("beta", "-0.5")])
    assert error_line(refused.value) == "beta should be greater than or equal to 0 (got -0.5)"


@pytest.mark.parametrize("name", ["max_completion_lenght", "json", "plot", "config", "calibration"])
def test_an_unknown_parameter_and_the_command_line_files_are_refused_with_the_closest_names(name):
    with pytest.raises(VramPlanError) as refused:
        query_request([*LLAMA, (name, "1")])
    line = error_line(refused.value)
    assert line.startswith(f"unknown query parameter '{name}'") and "\n" not in line
    if name == "max_completion_lenght":
        assert "did you mean 'max_completion_length'" in line


def test_a_bad_switch_value_is_refused_naming_the_field():
    with pytest.raises(VramPlanError) as refused:
        query_request([*LLAMA, ("use_vllm", "maybe")])
    assert error_line(refused.value).startswith("use_vllm should be a valid boolean") and "--" not in str(refused.value)


@pytest.mark.parametrize(("query", "words"), [
    ([*LLAMA, ("num_generations", "3")], "change per_device_train_batch_size 8"),
    ([*LLAMA, ("load_in_4bit", "true")], "load_in_4bit needs LoRA (lora_r)"),
    ([*LLAMA, ("optim", "adamw_9bit")], "optim 'adamw_9bit' is not known"),
    ([*LLAMA, ("trl_version", "0.9")], "trl_version 0.9.0 is outside"),
    ([*LLAMA, ("max_completion_lenght", "9")], "did you mean 'max_completion_length'"),
])
def test_errors_over_http_name_the_fields_and_the_cli_the_flags(capsys, query, words):
    with pytest.raises(VramPlanError) as refused:
        query_report("check", query)
    line = error_line(refused.value)
    assert words in line and "--" not in line
    if any("lenght" in name for name, _ in query):
        return  # the CLI's parser refuses an unknown flag itself
    args = [arg for name, value in query for arg in (f"--{name.replace('_', '-')}", value) if arg != "true"]
    code, _, err = run(capsys, "check", *args)
    assert code == 2 and err == f"error: {refused.value.worded(flag)}\n" and "--" in err


def test_a_missing_gpu_is_named_as_the_caller_names_it(capsys):
    with pytest.raises(VramPlanError, match="^gpu is needed: a catalog name"):
        query_report("check", [("model", "Llama-3.2-1B")])
    code, _, err = run(capsys, "check", "--model", "Llama-3.2-1B")
    assert code == 2 and err.startswith("error: check needs --gpu")


def test_maximize_on_plan_is_plans_maximize(capsys):
    code, out, _ = run(capsys, "plan", "--gpu", "t4", "--model", "Llama-3.2-1B", "--lora-r", "16", "--maximize",
                       "max_completion_length", "--json")
    served = query_report("plan", [("gpu", "t4"), ("model", "Llama-3.2-1B"), ("lora_r", "16"),
                                   ("maximize", "max_completion_length")])
    assert json.loads(out) == served.to_dict() and served.maximized.value > 0
    with pytest.raises(VramPlanError, match="maximize goes with /api/plan"):
        query_report("check", [*LLAMA, ("maximize", "max_completion_length")])
    # optimize=speed with maximize is refused as the command line refuses it, never ignored
    code, _, err = run(capsys, "plan", *[f"--{k}={v}" for k, v in LLAMA], "--maximize", "max_completion_length",
                       "--optimize", "speed")
    with pytest.raises(VramPlanError) as refused:
        query_report("plan", [*LLAMA, ("maximize", "max_completion_length"), ("optimize", "speed")])
    assert code == 2 and error_line(refused.value) == err.strip().removeprefix("error: ").replace("--", "")


def test_a_server_that_reads_no_files_refuses_paths_before_looking_at_them(tmp_path, llama_1b_file):
    with pytest.raises(VramPlanError) as refused:
        query_request([("gpu", "t4"), ("model", str(llama_1b_file))], allow_local_files=False)
    assert "reads no files" in str(refused.value) and "unknown model" in str(refused.value)
    missing = tmp_path / "nothing" / "config.json"
    with pytest.raises(VramPlanError) as also:  # the same answer whether the path exists or not
        query_request([("gpu", "t4"), ("model", str(missing))], allow_local_files=False)
    assert str(also.value).rsplit("'", 1)[1] == str(refused.value).rsplit("'", 1)[1]
    request, _ = query_request([("gpu", "t4"), ("model", "Llama-3.2-1B")], allow_local_files=False)
    assert request.model == "Llama-3.2-1B"
    assert query_request([("gpu", "t4"), ("model", str(llama_1b_file))])[0].model == str(llama_1b_file)


def test_model_paths_are_read_by_default_only_on_a_local_address():
    from vram_planner.app.server import local_files_default

    assert local_files_default("127.0.0.1") and local_files_default("localhost")
    assert not local_files_default("0.0.0.0") and not local_files_default("192.168.1.5")


def test_the_page_speaks_fields_not_flags():
    assert views.page_words("(set --max-prompt-length; or --no-gradient-checkpointing, --config FILE)") == \
        "(set max_prompt_length; or gradient_checkpointing off, --config FILE)"
    report = query_report("check", LLAMA)
    assert "--" not in views.notes_markdown(report)


def test_every_chart_draws_the_cards_capacity():
    for report in (query_report("check", LLAMA), query_report("plan", LLAMA)):
        svg = views.bars_html(report, "bars")
        line = re.search(r'<line class="capacity"[^>]*aria-label="capacity: ([\d.]+) GiB"', svg)
        assert line and float(line[1]) == pytest.approx(report.capacity_bytes / GiB, abs=0.005)
        labels = re.findall(r'aria-label="phase: ([^;]+); GiB: ([\d.]+); part: ([^"]+)"', svg)
        assert {phase for phase, _, _ in labels} == {views.PHASE_TITLES[p.name] for p in report.phases}


def test_the_bars_stack_each_phase_up_to_the_card_with_the_weights_at_the_bottom_and_free_memory_on_top():
    report = query_report("plan", LLAMA)
    rows = views.phase_rows(report)
    for phase in report.phases:
        parts = {r["part"]: r["GiB"] for r in rows if r["phase"] == views.PHASE_TITLES[phase.name]}
        assert sum(parts.values()) == pytest.approx(report.capacity_bytes / GiB, abs=0.01)
        assert parts == pytest.approx({views.COMPONENT_LABELS[c]: phase.components[c] / GiB for c in COMPONENTS}
                                      | {views.FREE: (report.capacity_bytes - phase.total_bytes) / GiB}, abs=0.001)
    # the plot stacks the parts in the reverse order of their first rows, and colours those of its first data only
    first_rows = list(dict.fromkeys(r["part"] for r in rows))
    assert first_rows[0] == views.FREE and first_rows[-1] == "weights" and len(first_rows) == len(COMPONENTS) + 1


def test_a_phase_over_the_card_has_nothing_free():
    report = query_report("check", LLAMA)
    assert not report.fits
    over = [views.PHASE_TITLES[p.name] for p in report.phases if p.total_bytes > report.capacity_bytes]
    assert over and all(r["GiB"] == 0 for r in views.phase_rows(report) if r["phase"] in over and r["part"] == "free")


def test_the_verdict_and_the_changes_in_words():
    checked, planned = query_report("check", LLAMA), query_report("plan", LLAMA)
    text = views.verdict_markdown(checked, planned)
    assert "✘ Does not fit as given" in text and f"peak {checked.peak_bytes / GiB:.2f} of 15.73 GiB" in text
    assert "With the plan's 1 change below it fits" in text and f"{planned.peak_bytes / GiB:.2f} GiB" in text
    changes = views.changes_markdown(planned)
    assert "`optim` | adamw_torch_fused → **adamw_8bit**" in changes
    assert f"{planned.changes[0].saved_bytes / GiB:.2f}" in changes
    # a config that does not fit says whether its first micro-batch (no optimizer state yet) does, as check does
    first = checked.first_micro_batch
    assert f"{'First micro-batch' if first.fits else 'Before the first optimizer step'}:**" in text
    assert f"{first.peak_bytes / GiB:.2f} GiB" in text
    small = query_report("check", [("gpu", "rtx3080-mobile"), ("model", "Qwen3-0.6B")])
    assert views.verdict_markdown(small, query_report("plan", [("gpu", "rtx3080-mobile"), ("model", "Qwen3-0.6B")]))\
        .startswith("### ✔ Fits: peak")


def test_the_page_says_a_larger_vllm_share_costs():
    planned = query_report("plan", [("gpu", "8GiB"), ("model", "Llama-3.2-1B"), ("use_vllm", "true")])
    rows = views.changes_markdown(planned).splitlines()
    assert ("| `vllm_max_model_length + vllm_gpu_memory_utilization` | None, 0.3 → **768, 0.45** | costs 1.20 GiB | "
            in "\n".join(rows))
    assert any(row.startswith("| `dtype` |") and "| saves " in row for row in rows)
    assert not any("-" in row.split(" | ")[2] for row in rows if row.startswith("| `"))  # no negative saving


def test_without_gradio_the_app_says_how_to_install_it():
    # the process `vram-plan app` starts (python -m vram_planner.app), in a Python without Gradio
    code = ("import sys\nsys.modules['gradio'] = None\n"
            "from vram_planner.app.__main__ import main\nsys.exit(main(['--port', '7861']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("error: vram-plan app needs Gradio (gradio cannot be imported): "
                           "pip install 'vram-plan[app]'\n")


def test_a_port_in_use_is_one_line_before_gradio_is_imported():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = ("import sys\nfrom vram_planner.cli import main\n"
                f"status = main(['app', '--host', '127.0.0.1', '--port', '{port}'])\n"
                "assert 'gradio' not in sys.modules\nsys.exit(status)\n")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"error: cannot serve on 127.0.0.1:{port}: ") and "pick another --port" in done.stderr


def test_plan_and_check_do_not_import_the_app_or_gradio(llama_1b_file):
    code = ("import sys, contextlib, io\n"
            "from vram_planner.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    main(['plan', '--gpu', '16GiB', '--model', {str(llama_1b_file)!r}, '--json'])\n"
            f"    main(['check', '--gpu', '16GiB', '--model', {str(llama_1b_file)!r}, '--json'])\n"
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('gradio', 'fastapi', 'uvicorn', 'pandas')\n"
            "         or m.startswith('vram_planner.app')]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_api_documents_are_the_clis_json(capsys):
    # the server's tests compare over HTTP; this one holds the function they serve to the CLI in-process
    for command in ("check", "plan"):
        code, out, _ = run(capsys, command, "--gpu", "rtx3080-mobile", "--model", "Llama-3.2-1B", "--json")
        assert json.loads(to_json(query_report(command, LLAMA))) == json.loads(out)


@pytest.mark.parametrize(("command", "questions"), [("check", [("keep_copy", "true")]),
                                                   ("plan", [("exact", "true"), ("keep_copy", "true")])])
def test_keep_copy_goes_with_exact_on_check_and_is_refused_elsewhere_in_one_line(command, questions):
    with pytest.raises(VramPlanError) as refused:
        query_report(command, [*LLAMA, *questions])
    assert "keep_copy" in error_line(refused.value) and "exact" in error_line(refused.value)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["check", "plan"])
def test_exact_true_serves_the_documents_of_exact(capsys, command):
    """`?exact=true` traces the step as --exact does; exact=false is the estimate's document."""
    pytest.importorskip("trl")
    model = str(Path(__file__).resolve().parents[1] / "fixtures" / "tiny-qwen2.json")
    query = [("gpu", "rtx3080-mobile"), ("model", model), ("max_completion_length", "64")]
    code, out, _ = run(capsys, command, "--gpu", "rtx3080-mobile", "--model", model, "--max-completion-length", "64",
                       "--exact", "--json")
    assert code == 0
    served, printed = json.loads(to_json(query_report(command, [*query, ("exact", "true")]))), json.loads(out)
    assert served["exact"]["need_bytes"] == printed["exact"]["need_bytes"] > 0
    for document in (served, printed):
        document["exact"].pop("seconds")
    assert served == printed
    assert json.loads(to_json(query_report(command, [*query, ("exact", "false")])))["exact"] is None


@pytest.mark.slow
def test_the_page_checks_exactly_on_request_and_says_when_the_estimate_is_near_the_boundary():
    pytest.importorskip("gradio")
    pytest.importorskip("trl")
    import gradio as gr

    from vram_planner.app import page

    with gr.Blocks():
        knobs = page._knob_fields()
    values = [None] * len(knobs)
    values[[k.name for k in knobs].index("max_completion_length")] = 64
    model = str(Path(__file__).resolve().parents[1] / "fixtures" / "tiny-qwen2.json")
    said = page.exact_output(knobs, True, "rtx3080-mobile", model, "", page.UNSET, DEFAULT_SAFETY_MARGIN, *values)
    assert said.startswith("**✔ Fits exactly:** the traced step needs ") and "Traced in" in said
    wrong = page.exact_output(knobs, True, "rtx3080-mobil", model, "", page.UNSET, DEFAULT_SAFETY_MARGIN, *values)
    assert wrong.startswith("✘ error: ") and "rtx3080-mobile" in wrong  # the closest name
    near = query_report("check", [("gpu", "9.5GiB"), ("model", "Qwen2.5-0.5B")])
    far = query_report("check", [("gpu", "80GiB"), ("model", "Qwen2.5-0.5B")])
    assert near.near_boundary and not far.near_boundary
    assert "**Near the boundary:**" in views.verdict_markdown(near, near)
    assert "Near the boundary" not in views.verdict_markdown(far, far)


def test_a_pasted_config_nested_100000_deep_is_one_line():
    from vram_planner.app.query import pasted_config

    with pytest.raises(VramPlanError, match="the pasted config.json is nested more than 64 levels deep"):
        pasted_config("[" * 100_000 + "]" * 100_000)


def test_the_page_says_whether_the_release_kernelizes_where_use_kernels_is_left_unset():
    pytest.importorskip("gradio")
    from vram_planner.app import page
    from vram_planner.model.spec import training_config

    assert page.default_text(training_config({"transformers_version": "5.25"}), "use_kernels") == \
        "on in transformers 5.25.0"
    assert page.default_text(training_config({"transformers_version": "5.24"}), "use_kernels") == \
        "off in transformers 5.24.0"
    assert page.default_text(training_config({"use_kernels": False}), "use_kernels") == "off"
