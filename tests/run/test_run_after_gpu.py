"""What the H200 runs of issue 29 showed about `vram-plan run`: the smoke step's trainer is gone before the run
starts, each step's memory is its own and set beside a prediction of the same thing, an out-of-memory error in the
smoke step falls back too, and the error's lines keep the advise command whole."""

from __future__ import annotations

import json
import pickle
import shlex
import weakref

import pytest
from snapshot_builder import Recorder

from helpers import FIXTURES, SMALL, run
from vram_planner import engine
from vram_planner.allocator.caching import OutOfMemory
from vram_planner.run.launch import RunSummary, closing_line
from vram_planner.run.out_of_memory import RunOutOfMemory, whole_sentences
from vram_planner.run.setup import RunSetup
from vram_planner.run.step_memory import ReservedGrowth, StepMemory

pytest.importorskip("trl")
MiB = 2**20


class ModelsSeen:
    """Each trainer's model once it is made (its weights loaded, before accelerate's own clean-up as training
    begins), held weakly, and how many of the earlier ones were still alive then."""

    def __init__(self):
        self.models: list[weakref.ref] = []
        self.alive_at_init: list[int] = []

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self.alive_at_init.append(sum(ref() is not None for ref in self.models))
        self.models.append(weakref.ref(model))


class SmokeCap:
    """Out of memory at any step, the smoke step's included, whenever a micro-batch holds more than one sequence."""

    def on_step_begin(self, args, state, control, **kwargs):
        import torch

        if args.per_device_train_batch_size > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                              "capacity of 8.00 GiB of which 0 bytes is free. (fake cap)")


def callbacks(monkeypatch, *kinds):
    from transformers import TrainerCallback

    from vram_planner.run import launch

    made = [type(kind.__name__, (kind, TrainerCallback), {})() for kind in kinds]
    monkeypatch.setattr(launch, "EXTRA_CALLBACKS", made)
    return made


def run_args(model, out, *extra, steps=2):
    return ["run", "--model", str(model), "--dataset", "math-sample", "--max-steps", str(steps), "--save-steps", "1",
            "--output-dir", str(out), *SMALL, *extra]


@pytest.mark.slow
def test_the_run_starts_after_the_smoke_steps_model_is_freed(capsys, monkeypatch, tiny_model_folder, tmp_path):
    # on CUDA the caching allocator keeps the blocks of these objects, and the run's weights would load into them:
    # collected before the run's model is made, empty_cache can give them back first
    import gc

    seen, = callbacks(monkeypatch, ModelsSeen)
    gc.disable()  # the trainer sits in reference cycles: only the smoke step's own collection may free it here
    try:
        code, _, err = run(capsys, *run_args(tiny_model_folder, tmp_path / "run"))
    finally:
        gc.enable()
    assert code == 0, err
    assert seen.alive_at_init == [0, 0]  # the smoke step's, then the run's: nothing of the smoke step alive


@pytest.mark.slow
def test_out_of_memory_in_the_smoke_step_falls_back_and_starts_afresh(capsys, monkeypatch, tiny_model_folder,
                                                                      tmp_path):
    seen, _ = callbacks(monkeypatch, ModelsSeen, SmokeCap)
    out = tmp_path / "run"
    code, _, err = run(capsys, *run_args(tiny_model_folder, out, "--auto-fallback"))
    assert code == 0, err
    assert err.count("smoke step:") == 2 and "out of GPU memory" in err
    assert "falling back: per_device_train_batch_size 2 -> 1" in err and "the smoke step again" in err
    assert seen.alive_at_init == [0, 0, 0]  # the failed smoke trainer was freed before the next one began
    assert (out / "vram-plan-run.json").is_file(), (err, sorted(p.name for p in out.iterdir()))
    record = json.loads((out / "vram-plan-run.json").read_text())
    assert record["grpo_config"]["per_device_train_batch_size"] == 1 and record["outcome"]["status"] == "finished"
    steps = [json.loads(line) for line in (out / "vram-plan-log.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "reward" in s] == [1, 2]


@pytest.mark.slow
def test_out_of_memory_in_the_smoke_step_without_fallback_says_it_in_lines(capsys, monkeypatch, tiny_model_folder,
                                                                           tmp_path):
    callbacks(monkeypatch, SmokeCap)
    out = tmp_path / "run"
    code, _, err = run(capsys, *run_args(tiny_model_folder, out))
    lines = err.splitlines()
    assert code == 2 and lines[0] == "smoke step: the longest prompts, full-length completions", err
    assert lines[1].startswith("error: out of GPU memory: CUDA out of memory. Tried to allocate 2.00 GiB.")
    assert lines[2].startswith("The plan put the peak at ") and lines[2].endswith(".") and len(lines) == 3
    assert not out.exists()  # nothing was trained (a run without CUDA writes no snapshot)


def test_the_out_of_memory_error_is_sentences_on_lines_and_its_advise_command_runs(capsys, setup, tmp_path):
    import torch

    recorder = Recorder(capacity_bytes=110 * MiB)
    recorder.malloc(100 * MiB)
    with pytest.raises(OutOfMemory):
        recorder.malloc(50 * MiB)
    snapshot = tmp_path / "run dir" / "oom-snapshot.pickle"  # a space: the command must quote it
    snapshot.parent.mkdir()
    snapshot.write_bytes(pickle.dumps(recorder.snapshot()))
    torch_words = ("CUDA out of memory. Tried to allocate 102.00 MiB. GPU 0 has a total capacity of 14.56 GiB of "
                   "which 3.06 MiB is free. Including non-PyTorch memory, this process has 14.55 GiB memory in use. "
                   "Of the allocated memory 13.90 GiB is allocated by PyTorch, and 520.34 MiB is reserved by PyTorch "
                   "but unallocated. If reserved but unallocated memory is large try setting "
                   "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
    oom = RunOutOfMemory(setup, torch.cuda.OutOfMemoryError(torch_words), tmp_path / "run" / "checkpoint-3",
                         snapshot)
    lines = str(oom).splitlines()
    assert lines[0] == ("out of GPU memory: CUDA out of memory. Tried to allocate 102.00 MiB. GPU 0 has a total "
                        "capacity of 14.56 GiB of which 3.06 MiB is free. Including non-PyTorch memory, this process "
                        "has 14.55 GiB memory in use.")  # whole sentences, none cut
    assert lines[1].startswith("The plan put the peak at") and lines[1].endswith(" GiB.")
    assert lines[2] == f"Training so far is saved in {tmp_path / 'run' / 'checkpoint-3'}."
    assert lines[3].endswith(":") and len(lines) == 5
    argv = shlex.split(lines[4])
    assert argv[:3] == ["vram-plan", "advise", str(snapshot)]
    code, out, err = run(capsys, *argv[1:])  # pasted as printed, it runs
    assert code in (0, 1) and err == "" and out


def test_whole_sentences_keep_at_least_the_first():
    assert whole_sentences("A long first sentence. Second.", 5) == "A long first sentence."
    assert whole_sentences("Tried 1.50 GiB. Free 0.25 GiB. More.", 31) == "Tried 1.50 GiB. Free 0.25 GiB."


def test_the_prediction_beside_the_allocators_peak_leaves_the_cuda_context_out(setup):
    peak = setup.verdict.estimate.peak_phase
    assert peak.components["cuda_context"] > 0
    assert setup.predicted_reserved_bytes == pytest.approx(peak.total_bytes - peak.components["cuda_context"])
    assert f"; {setup.predicted_reserved_bytes / 2**30:.2f} GiB reserved by PyTorch, the rest the CUDA context" in (
        setup.describe())


@pytest.mark.parametrize(("settings", "outside", "words"), [
    ({"num_gpus": 2, "fsdp": True}, ("cuda_context", "nccl_buffers"), "the CUDA context and NCCL's buffers"),
    # colocated vLLM over two ranks: its TP communicators are NCCL's, cudaMalloc's and symmetric memory's bytes
    ({"num_gpus": 2, "zero_stage": 3, "use_vllm": True, "vllm_mode": "colocate", "vllm_tensor_parallel_size": 2},
     ("cuda_context", "nccl_buffers", "vllm_communicators"),
     "the CUDA context, NCCL's buffers and vLLM's TP communicators"),
], ids=["fsdp", "vllm-tp"])
def test_on_several_gpus_the_prediction_leaves_what_the_allocator_never_sees_out(tmp_path, settings, outside, words):
    verdict = engine.check("Qwen2.5-0.5B", "h100-80gb", settings)
    several = RunSetup(verdict=verdict, model_id="Qwen2.5-0.5B", dataset="math-sample", rewards=["format"],
                       output_dir=tmp_path / "run")
    peak = verdict.estimate.peak_phase
    assert all(peak.components[c] > 0 for c in outside)
    assert {c: b for c, b in several.predicted_outside_allocator_bytes.items() if b} == {
        c: round(peak.components[c]) for c in outside}
    assert several.predicted_reserved_bytes == pytest.approx(
        peak.total_bytes - sum(peak.components[c] for c in outside))
    assert f"the rest {words}, which" in several.describe()
    line = closing_line(several, RunSummary(several.output_dir, 4, 9.0, round(several.predicted_reserved_bytes)))
    gone = several.predicted_peak_bytes - several.predicted_reserved_bytes
    assert f"less {gone / 2**30:.2f} GiB of {words})" in line


def test_reserved_growth_counts_from_the_settled_step():
    memory = StepMemory(reserved_by_step={1: 100, 2: 180})
    assert memory.reserved_growth() is None  # nothing after the allocator settled yet
    memory.reserved_by_step.update({3: 180, 4: 180})
    assert memory.reserved_growth() == ReservedGrowth(2, 4, 0)
    assert memory.reserved_growth().describe() == "reserved flat from step 2 to 4"
    memory.reserved_by_step[5] = 180 + 3 * 2**30
    assert memory.reserved_growth().describe() == "reserved grew 3.00 GiB from step 2 to 5"


def test_the_closing_line_sets_like_beside_like(setup):
    summary = RunSummary(setup.output_dir, 32, 120.0, round(setup.predicted_reserved_bytes * 0.9),
                         ReservedGrowth(2, 32, 0))
    line = closing_line(setup, summary)
    context = setup.predicted_peak_bytes - setup.predicted_reserved_bytes
    assert f"predicted {setup.predicted_reserved_bytes / 2**30:.2f} GiB" in line
    assert f"less {context / 2**30:.2f} GiB of the CUDA context)" in line and "reserved flat from step 2 to 32" in line
    off_cuda = closing_line(setup, RunSummary(setup.output_dir, 2, 3.0, None))
    assert "not measured without CUDA" in off_cuda and "reserved flat" not in off_cuda


def test_off_cuda_the_log_has_both_predictions_and_no_measurement(tmp_path):
    from transformers import TrainerControl, TrainerState

    from vram_planner.run.progress import JsonlLog

    log = JsonlLog(tmp_path / "log.jsonl", 5e9, predicted_reserved_bytes=4.4e9, predicted_allocated_bytes=4.1e9)
    log.on_log(None, TrainerState(global_step=1, is_world_process_zero=True), TrainerControl(), logs={"reward": 1})
    line = json.loads((tmp_path / "log.jsonl").read_text())
    assert line["predicted_peak_bytes"] == 5e9 and line["predicted_peak_reserved_bytes"] == 4.4e9
    assert line["predicted_peak_allocated_bytes"] == 4.1e9
    assert not [key for key in line if key.startswith("measured_peak")]


@pytest.fixture(scope="module")
def multimodal_folder_with_a_tokenizer(tmp_path_factory):
    """tiny-gemma3-vision.json as a model folder with random weights and a tokenizer, and no image processor."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from helpers import math_sample_tokenizer

    folder = tmp_path_factory.mktemp("tiny-gemma3-vision")
    config = AutoConfig.for_model(**json.loads((FIXTURES / "tiny-gemma3-vision.json").read_text()))
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    math_sample_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_a_multimodal_folder_with_only_a_tokenizer_trains_its_text(capsys, multimodal_folder_with_a_tokenizer,
                                                                   tmp_path):
    out = tmp_path / "run"
    code, stdout, err = run(capsys, *run_args(multimodal_folder_with_a_tokenizer, out, steps=1))
    assert code == 0, err
    assert "has a tokenizer and no processor: the run trains on the text prompts" in " ".join(stdout.split())
    assert (out / "final" / "config.json").is_file()
    assert json.loads((out / "vram-plan-run.json").read_text())["outcome"]["steps"] == 1
