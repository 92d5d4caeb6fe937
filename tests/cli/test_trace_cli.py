"""`vram-plan trace` from the command line: check's JSON shape with the trace beside the analytic model, the
caching allocator model's reserved bytes (--allocator-conf), and one-line errors for what cannot be traced."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import time

import pytest

from helpers import FIXTURES, cli_in_a_subprocess, json_of, library_warning_before, one_line_error, run
from vram_planner.cli import main
from vram_planner.model.spec import TrainingConfig
from vram_planner.tracing.step import trace_step

pytest.importorskip("trl")

TINY = FIXTURES / "tiny-llama-headdim.json"
SHORT = ["--per-device-train-batch-size", "2", "--num-generations", "2", "--max-prompt-length", "16",
         "--max-completion-length", "16"]


@pytest.fixture(scope="module")
def traced_directly():
    return trace_step(json.loads(TINY.read_text()), TrainingConfig(per_device_train_batch_size=2, num_generations=2,
                                                                   max_prompt_length=16, max_completion_length=16))


def test_trace_json_has_checks_shape_and_the_traced_bytes(capsys, traced_directly):
    code, out, _ = run(capsys, "check", "--gpu", "24GiB", "--model", str(TINY), *SHORT, "--json")
    check = json.loads(out)
    code, out, _ = run(capsys, "trace", "--gpu", "24GiB", "--model", str(TINY), *SHORT, "--json")
    trace = json.loads(out)
    assert code == 0 and trace["fits"] and trace["command"] == "trace" and trace["engine"] == "trace"
    assert set(check) <= set(trace) and trace["seconds"] > 0
    assert "do not include the CUDA context" in trace["trace_counts"] and check["engine"] == "analytic"
    assert [p["name"] for p in trace["phases"]] == [p.name for p in traced_directly.phases]
    for phase, direct in zip(trace["phases"], traced_directly.phases, strict=True):
        assert phase["tensor_bytes"] == direct.peak_bytes
        assert phase["components"]["cuda_context"] > 0  # the calibration's overheads make it a verdict
        assert phase["total_bytes"] == sum(phase["components"].values())
        assert abs(phase["analytic_relative_error"]) < 0.05
    assert trace["params"] == check["params"] and trace["config"] == check["config"]


def test_trace_prints_both_engines_and_its_wall_time(capsys):
    code, out, _ = run(capsys, "trace", "--gpu", "24GiB", "--model", str(TINY), *SHORT)
    assert code == 0
    assert "trace against the analytic model" in out and "Memory by phase" in out and "Per phase (GiB)" in out
    assert all(column in out for column in ("trace", "reserved", "analytic", "error"))
    assert "Traced in" in out and "caching allocator (torch's defaults)" in out and "CUDA context" in out


def test_a_trace_that_does_not_fit_exits_1(capsys):
    code, out, _ = run(capsys, "trace", "--gpu", "0.3GiB", "--model", str(TINY), *SHORT, "--json")
    assert code == 1 and not json.loads(out)["fits"]


@pytest.mark.parametrize("flags", [["--use-vllm"], ["--optim", "paged_adamw_8bit"],
                                   ["--num-gpus", "2", "--zero-stage", "0"], ["--num-gpus", "2", "--zero-stage", "2",
                                    "--offload-optimizer", "cpu"]])
def test_what_the_cpu_cannot_trace_is_one_line(capsys, flags):
    err = one_line_error(capsys, "trace", "--gpu", "24GiB", "--model", "Llama-3.2-1B", *flags)
    assert "cannot" in err and "vram-plan check" in err


def test_a_model_transformers_cannot_build_is_one_line(capsys, tmp_path):
    config = tmp_path / "config.json"
    # A causal LM the planner reads as Llama-style, of a model_type transformers does not know.
    config.write_text(json.dumps({"model_type": "notamodel", "architectures": ["NotamodelForCausalLM"],
                                  "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "intermediate_size": 128}))
    err = one_line_error(capsys, "trace", "--gpu", "24GiB", "--model", str(config))
    assert "cannot build" in err and "notamodel" in err and len(err) < 400


def test_an_unknown_model_name_suggests_close_ones(capsys):
    err = one_line_error(capsys, "trace", "--gpu", "24GiB", "--model", "Llama-3.2-1b-instrct")
    assert "Llama-3.2-1B-Instruct" in err


def test_without_gpu_it_judges_against_the_fallback_card_and_says_so(capsys, monkeypatch):
    from vram_planner import engine, local_gpu
    from vram_planner.errors import VramPlanError
    from vram_planner.profiles import GpuProfile

    def no_card():
        raise VramPlanError("no nvidia-smi")

    monkeypatch.setattr(local_gpu, "detect_local_gpu", no_card)
    code, out, _ = run(capsys, "trace", "--model", str(TINY), *SHORT, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["gpu"] == GpuProfile.from_name(engine.FALLBACK_TRACE_GPU).name
    assert any("no --gpu given" in note for note in doc["notes"])


def test_the_library_returns_both_engines(traced_directly):
    from vram_planner import engine

    said = []
    outcome = engine.trace(str(TINY), "24GiB", {"per_device_train_batch_size": 2, "num_generations": 2,
                                             "max_prompt_length": 16, "max_completion_length": 16},
                        progress=said.append)
    assert said == ["building the model on fake tensors", "tracing generation", "tracing loss forward and backward",
                    "tracing the optimizer step", "replaying the allocations through the caching allocator model",
                    "bisecting the least memory the step runs in"]
    assert [p.peak_bytes for p in outcome.result.phases] == [p.peak_bytes for p in traced_directly.phases]
    assert outcome.fits and outcome.seconds > 0 and outcome.analytic.estimate.params == outcome.result.params
    assert [c.name for c in outcome.comparison()] == [p.name for p in traced_directly.phases]


def test_a_config_too_large_for_torch_to_size_is_one_line(capsys, tmp_path):
    # A (2**31 - 1) x (2**31 - 4) float32 embedding has more than 2**63 bytes; fake tensors still have to compute
    # their size. (A 70B or 405B model traces: fake tensors hold no data, the process stays near 0.5 GiB; see the
    # README.)
    config = json.loads(TINY.read_text()) | {"vocab_size": 2**31 - 1, "hidden_size": 2**31 - 4}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    err = one_line_error(capsys, "trace", "--gpu", "80GiB", "--model", str(path), *SHORT)
    assert "building the model" in err and "2**63 bytes" in err


def _cli_in_a_subprocess(*args: str, blocked: str = "") -> subprocess.CompletedProcess:
    """The real command's stderr (torch logs to the process's own stream), with a package made unimportable."""
    return cli_in_a_subprocess(*args, setup=f"sys.modules[{blocked!r}] = None" if blocked else "")


@pytest.mark.parametrize("blocked", ["torch", pytest.param("trl", marks=pytest.mark.slow)])
def test_without_the_train_extras_it_says_how_to_install_them(blocked):
    done = _cli_in_a_subprocess("trace", "--gpu", "24GiB", "--model", str(TINY), *SHORT, blocked=blocked)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "pip install 'vram-plan[train]'" in done.stderr
    assert f"({blocked} cannot be imported)" in done.stderr


@pytest.mark.slow
def test_a_failure_inside_torch_is_one_line_without_torchs_logged_traceback(tmp_path):
    # A BERT-style decoder (read as Llama-style by the planner: it names a ...ForCausalLM) has learned positions:
    # the 512 of its config class, unstated in config.json, cannot take a 256 + 512-token sequence.
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "bert", "architectures": ["BertForCausalLM"], "is_decoder": True,
                                "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "intermediate_size": 128}))
    done = _cli_in_a_subprocess("trace", "--gpu", "24GiB", "--model", str(path), "--max-completion-length", "512")
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    # Generation reads positions beyond 512 in the last decoding step (fake tensors do not check indices); the
    # loss forward's 768 positions fail to broadcast.
    assert "the trace failed while tracing loss forward and backward" in done.stderr
    assert "max_position_embeddings" in done.stderr


def test_library_warnings_while_the_engine_loads_and_runs_stay_off_stderr():
    setup = library_warning_before("vram_planner.tracing.step:_import_engine",
                                   "vram_planner.tracing.session:build_session")
    done = cli_in_a_subprocess("trace", "--gpu", "24GiB", "--model", str(TINY), *SHORT, setup=setup)
    assert done.returncode == 0, done.stderr
    assert "a library warning" not in done.stderr and "peak" in done.stdout


@pytest.mark.parametrize("sizes", [["--per-device-train-batch-size", "1000000000000", "--num-generations", "2"],
                                   ["--max-completion-length", "100000000"],
                                   ["--per-device-train-batch-size", "4096", "--max-completion-length", "65536",
                                    "--num-generations", "4"]])
def test_the_traces_time_does_not_grow_with_the_sizes(capsys, traced_directly, sizes):
    # The tiny config states no max_position_embeddings: nothing refuses these lengths, the trace has to run them.
    start = time.perf_counter()
    code, out, err = run(capsys, "trace", "--gpu", "24GiB", "--model", str(TINY), *SHORT, *sizes, "--json")
    assert code == 1 and not json.loads(out)["fits"], err
    assert time.perf_counter() - start < 30  # it took minutes when the LM head's loop ran every token chunk


def test_a_sequence_longer_than_the_models_positions_is_refused_before_building_it(capsys, tmp_path, monkeypatch):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(json.loads(TINY.read_text()) | {"max_position_embeddings": 2048}))
    from vram_planner.tracing import session

    def no_model(*_args, **_kwargs):
        raise AssertionError("a model was built for a sequence the model cannot hold")

    monkeypatch.setattr(session, "_build_model", no_model)
    err = one_line_error(capsys, "trace", "--gpu", "24GiB", "--model", str(config), *SHORT,
                         "--max-completion-length", "100000000")
    assert "max_position_embeddings (2048)" in err and "100000016" in err and "vram-plan check" in err


@pytest.fixture
def no_alloc_conf(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)


def traced_json(capsys, *flags: str) -> tuple[int, dict]:
    return json_of(capsys, "trace", "--model", str(TINY), *SHORT, *flags)


@pytest.fixture(scope="module")
def default_reserve():
    """`trace --json` on a 24 GiB card with torch's allocator defaults, run once for the tests below."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["trace", "--gpu", "24GiB", "--model", str(TINY), *SHORT, "--json"])
        assert code == 0
        return json.loads(out.getvalue())


def test_trace_json_has_reserved_bytes_per_phase_and_the_verdict_uses_them(default_reserve):
    doc = default_reserve
    assert doc["allocator_conf"] == "" and "reserved_bytes are what a model of PyTorch's caching allocator" in (
        doc["trace_counts"])
    for phase in doc["phases"]:
        assert phase["reserved_bytes"] >= phase["tensor_bytes"] > 0
        # A segment is at least 2 MiB (small blocks) or 20 MiB (1-10 MiB requests): the tiny step reserves both.
        assert phase["reserved_bytes"] % (2 * 1024**2) == 0
        workspaces = phase["components"]["cublas_workspaces"]
        assert workspaces > 0  # the replay allocates them as a real step does (vram_planner.model.cublas)
        assert phase["components"]["allocator_overhead"] == phase["reserved_bytes"] - phase["tensor_bytes"] - workspaces
        assert phase["total_bytes"] == phase["reserved_bytes"] + phase["components"]["cuda_context"]
    assert doc["reserved_peak_bytes"] == max(p["reserved_bytes"] for p in doc["phases"])
    assert doc["peak_bytes"] == doc["reserved_peak_bytes"] + doc["phases"][0]["components"]["cuda_context"]


def test_expandable_segments_reserve_no_more_than_the_default(capsys, default_reserve, monkeypatch):
    # This tiny step reserves the same either way: two 2 MiB segments (pages) for its small tensors and one 20 MiB
    # segment (page) for its one 1-10 MiB tensor, the LM head's 2 MiB tile.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:abc")  # the flag wins over the environment
    _, doc = traced_json(capsys, "--gpu", "24GiB", "--allocator-conf", "expandable_segments:True")
    assert doc["allocator_conf"] == "expandable_segments:True"
    pairs = list(zip(doc["phases"], default_reserve["phases"], strict=True))
    assert all(p["reserved_bytes"] <= d["reserved_bytes"] for p, d in pairs)
    assert doc["reserved_peak_bytes"] <= default_reserve["reserved_peak_bytes"]
    assert all(p["tensor_bytes"] == d["tensor_bytes"] for p, d in pairs)


def test_expandable_segments_reserve_less_for_a_growing_kv_cache(capsys, no_alloc_conf):
    # TRL's defaults on the tiny model (8 x 512-token completions): the cache's concatenations fragment the
    # default allocator's segments; expandable segments grow one segment in 20 MiB pages instead.
    def reserved(*conf: str) -> int:
        code, out, err = run(capsys, "trace", "--gpu", "24GiB", "--model", str(TINY), *conf, "--json")
        return json.loads(out)["reserved_peak_bytes"]

    assert reserved("--allocator-conf", "expandable_segments:True") < reserved()


def test_the_allocator_conf_defaults_to_the_environment_variable(capsys, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    _, doc = traced_json(capsys, "--gpu", "24GiB")
    assert doc["allocator_conf"] == "expandable_segments:True"


REFUSED = "--allocator-conf should be a PYTORCH_CUDA_ALLOC_CONF text torch accepts; "


@pytest.mark.parametrize("flag,environment,said", [
    (["--allocator-conf", "expandable_segments:yes"], None, REFUSED + "expandable_segments takes True or False"),
    (["--allocator-conf", "max_split_size_mb"], None, REFUSED + "the text is not a list of key:value pairs"),
    ([], "garbage_collection_threshold:2", "PYTORCH_CUDA_ALLOC_CONF 'garbage_collection_threshold:2': "
                                           "garbage_collection_threshold must be a number between 0 and 1")])
def test_a_bad_allocator_conf_is_one_line_before_anything_is_traced(capsys, monkeypatch, flag, environment, said):
    if environment is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", environment)
    start = time.perf_counter()
    err = one_line_error(capsys, "trace", "--gpu", "24GiB", "--model", str(TINY), *SHORT, *flag)
    assert said in err
    assert time.perf_counter() - start < 5  # refused before the model is built


def test_when_the_allocator_finds_no_memory_the_trace_does_not_fit_and_says_where(capsys, no_alloc_conf,
                                                                                 default_reserve):
    # The card holds the CUDA context and 1 MiB less than the allocator model reserves at the peak (segments of 2 and
    # 20 MiB for a step of a few MiB of tensors and the cuBLAS workspaces). Tensors plus the flat 12% reserve would
    # have fitted.
    context = default_reserve["phases"][0]["components"]["cuda_context"]
    workspaces = default_reserve["phases"][0]["components"]["cublas_workspaces"]
    tensors = max(p["tensor_bytes"] for p in default_reserve["phases"])
    capacity_mib = (context + default_reserve["reserved_peak_bytes"]) // 2**20 - 1
    assert (context + workspaces + 1.12 * tensors) / 2**20 < capacity_mib
    code, doc = traced_json(capsys, "--gpu", f"{capacity_mib}MiB", "--safety-margin", "0")
    assert code == 1 and not doc["fits"] and doc["peak_bytes"] > doc["capacity_bytes"]
    note = next(n for n in doc["notes"] if "could not find memory after freeing its cache" in n)
    assert re.search(r"in (generation|scoring|training|optimizer) \([^)]+, step [12]\) it asked for \d", note), note


def test_tracing_an_8bit_optimizer_without_bitsandbytes_says_how_to_install_it():
    done = cli_in_a_subprocess("trace", "--gpu", "24GiB", "--model", str(TINY), *SHORT, "--optim", "adamw_8bit",
                               setup="sys.modules['bitsandbytes'] = None")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("error: tracing --optim adamw_8bit needs bitsandbytes, which is not installed: "
                           "pip install 'vram-plan[train]'\n")


def test_an_installed_pair_the_engine_does_not_run_is_refused_in_one_line(capsys, monkeypatch):
    # TRL 1.16 with transformers 4.57 installed (pip allows it; the trace would read transformers 5's cache argument):
    # refused before anything is built, naming what is installed and what works
    from vram_planner.tracing import step

    versions = {"trl": "1.16.0", "transformers": "4.57.3"}
    monkeypatch.setattr(step, "installed_version", lambda name: versions.get(name))
    monkeypatch.setattr(step, "installed_trl_version", lambda: versions["trl"])
    err = one_line_error(capsys, "trace", "--gpu", "24GiB", "--model", str(TINY), *SHORT)
    assert "cannot run TRL 1.16.0 with transformers 4.57.3 (installed)" in err
    assert "TRL 0.27.2 to 1.x with transformers 5.0.0 to 5.x" in err
