"""`run`'s CUDA-only recording on a machine without CUDA: torch's calls replaced by fakes that keep torch 2.13's
contract (torch/cuda/memory.py, torch/csrc/cuda/Module.cpp), with the allocator model as the device. What is checked
is ours: what is asked of torch, the file the observer writes, that it is whole, and what advise then says."""

from __future__ import annotations

import json
import os
import shlex

import pytest
from snapshot_builder import Recorder, fragmented_until_oom

from helpers import SMALL, run
from vram_planner.allocator.caching import OutOfMemory
from vram_planner.run import memory_history

torch = pytest.importorskip("torch")
MiB = 2**20


class FakeCuda:
    """The device: the allocator model, its history as torch records it, and the observers torch would call."""

    def __init__(self) -> None:
        self.recorder = Recorder(capacity_bytes=10 * 20 * MiB + 10 * MiB)
        self.history: list[dict] = []
        self.observers: list = []

    def record_memory_history(self, enabled="all", context="all", stacks="all", max_entries=2**63 - 1,
                              device=None, clear_history=False, compile_context=False,
                              global_record_annotations=False, skip_actions=None) -> None:
        assert enabled in (None, "state", "all") and context in (None, "state", "alloc", "all")
        assert stacks in ("python", "all")
        self.history.append({"enabled": enabled, "context": context, "max_entries": max_entries,
                             "clear_history": clear_history})

    def run_out_of_memory(self) -> int:
        """Fill the card until a request fails, and call the observers as the allocator does before it raises."""
        try:
            fragmented_until_oom(self.recorder, 4 * MiB, 50, 8 * MiB)
        except OutOfMemory as exc:
            free = self.recorder.events[-1]["device_free"]
            for observer in self.observers:
                observer(0, exc.requested_bytes, self.recorder.capacity_bytes, free)
            return exc.requested_bytes
        raise AssertionError("the card did not fill")

    def unwind(self) -> None:
        """The exception unwinds the step: its tensors are freed."""
        for address in list(self.recorder.live):
            self.recorder.free(address)


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(memory_history, "cuda_available", lambda: True)
    monkeypatch.setattr(memory_history, "OBSERVER", memory_history.OomSnapshots())
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake.record_memory_history)
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", fake.observers.append, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot",
                        lambda device=None, augment_with_fx_traces=False: fake.recorder.snapshot())
    return fake


def test_an_out_of_memory_error_writes_the_snapshot_of_the_card_before_anything_is_freed(cuda, tmp_path, capsys):
    target = tmp_path / "run" / memory_history.OOM_SNAPSHOT_NAME
    with memory_history.memory_history(target) as written:
        requested = cuda.run_out_of_memory()
        cuda.unwind()
    assert written.written == [target] and written.failed is None
    assert os.listdir(target.parent) == [target.name]  # whole, under its name: no temporary file left
    assert target.read_bytes()[:2] == b"\x1f\x8b"  # gzip: a copy off the machine is a tenth of the pickle
    assert cuda.history[0] == {"enabled": "all", "context": None, "max_entries": memory_history.MAX_ENTRIES,
                               "clear_history": True}
    assert cuda.history[-1]["enabled"] is None  # recording stops with the run
    code, out, err = run(capsys, "advise", str(target), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["moment"] == "out_of_memory" and doc["requested_bytes"] == requested
    assert doc["allocated_bytes"] == 25 * 4 * MiB  # the step's blocks as they were, not as unwound
    assert doc["fragmentation_decided"] and doc["fixes"][0]["change"].endswith("expandable_segments:True")


def test_frames_are_recorded_only_when_asked_and_then_name_the_kv_cache(cuda, tmp_path, capsys):
    target = tmp_path / memory_history.OOM_SNAPSHOT_NAME
    cache = [{"filename": "/x/site-packages/transformers/cache_utils.py", "line": 120, "name": "update"}]
    with memory_history.memory_history(target, frames=True):
        cuda.recorder.malloc(30 * MiB, frames=cache)
        cuda.run_out_of_memory()
    assert cuda.history[0]["context"] == "alloc"
    assert cuda.history[0]["max_entries"] == memory_history.MAX_ENTRIES_WITH_FRAMES
    doc = json.loads(run(capsys, "advise", str(target), "--json")[1])
    assert doc["roles_from"] == "frames" and doc["by_role"]["kv_cache"] == 30 * MiB


def test_the_observer_is_attached_once_and_writes_only_while_a_run_records(cuda, tmp_path):
    first, second = tmp_path / "a.pickle", tmp_path / "b.pickle"
    with memory_history.memory_history(first):
        pass
    with memory_history.memory_history(second):
        pass
    assert len(cuda.observers) == 1  # torch cannot detach one
    cuda.run_out_of_memory()  # after the run: nothing written
    assert not first.exists() and not second.exists()


def test_a_write_that_fails_leaves_the_earlier_file_whole_and_raises_nothing(cuda, tmp_path, monkeypatch):
    target = tmp_path / memory_history.OOM_SNAPSHOT_NAME
    target.write_bytes(b"earlier")

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with memory_history.memory_history(target) as written:
        cuda.run_out_of_memory()  # the observer must not raise inside the allocator
    assert target.read_bytes() == b"earlier" and os.listdir(tmp_path) == [target.name]
    assert written.written == [] and "No space left" in written.failed


def test_without_cuda_nothing_is_asked_of_torch(monkeypatch, tmp_path):
    monkeypatch.setattr(memory_history, "cuda_available", lambda: False)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: pytest.fail("called"))
    with memory_history.memory_history(tmp_path / "x.pickle") as written:
        pass
    assert written.written == [] and not (tmp_path / "x.pickle").exists()


class CapUnlessExpandable:
    """The allocator's out-of-memory from the second step on, until the run uses expandable segments: it calls the
    observers (which snapshot the fragmented card) and raises, as torch's allocator does."""

    fake: FakeCuda

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step >= 1 and "expandable_segments:True" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            self.fake.recorder = Recorder(capacity_bytes=10 * 20 * MiB + 10 * MiB)
            self.fake.run_out_of_memory()
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 MiB (fake cap)")


@pytest.fixture
def capped(cuda, monkeypatch):
    from transformers import TrainerCallback

    from vram_planner.run import launch

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # torch's defaults, and the variable restored after
    cap = type("Cap", (TrainerCallback,), dict(vars(CapUnlessExpandable)))()
    cap.fake = cuda
    monkeypatch.setattr(launch, "EXTRA_CALLBACKS", [cap])


@pytest.mark.slow
def test_a_run_out_of_memory_leaves_its_snapshot_and_the_advise_command_that_reads_it(capsys, tiny_model_folder,
                                                                                      tmp_path, capped):
    out = tmp_path / "run"
    code, _, err = run(capsys, "run", "--model", str(tiny_model_folder), "--dataset", "math-sample",
                       "--max-steps", "2", "--save-steps", "1", "--output-dir", str(out), *SMALL)
    assert code == 2 and (out / memory_history.OOM_SNAPSHOT_NAME).is_file()
    record = json.loads((out / "vram-plan-run.json").read_text())
    assert record["outcome"]["oom_snapshot"] == str(out / memory_history.OOM_SNAPSHOT_NAME)
    command = next(line for line in err.splitlines() if "vram-plan advise" in line)
    command = command[command.index("vram-plan advise"):]
    code, doc, advise_err = run(capsys, *shlex.split(command)[1:], "--json")
    assert code == 0, advise_err
    assert json.loads(doc)["fragmentation_decided"] and json.loads(doc)["roles_from"] == "plan"


@pytest.mark.slow
def test_auto_fallback_answers_fragmentation_with_expandable_segments_not_a_smaller_batch(capsys, tiny_model_folder,
                                                                                        tmp_path, capped):
    out = tmp_path / "run"
    code, _, err = run(capsys, "run", "--model", str(tiny_model_folder), "--dataset", "math-sample",
                       "--max-steps", "2", "--save-steps", "1", "--output-dir", str(out), *SMALL, "--auto-fallback")
    assert code == 0, err
    assert "-> expandable_segments:True" in err and "fragmentation decided it" in err
    assert "per_device_train_batch_size" not in err.split("falling back:")[1].split("\n")[0]
    assert (out / "final" / "config.json").is_file()


def test_the_gpu_benchmark_takes_the_runs_own_history_before_the_run_stops_it(cuda, tmp_path, monkeypatch):
    """benchmarks/gpu_steps.py's snapshots: stopping the recording clears torch's history, so the snapshot must be
    taken inside the run's recording (the 2026-12-04 H200 call's, taken after it, came back empty)."""
    from helpers import benchmark_module
    from vram_planner.run import launch

    gpu_steps = benchmark_module("gpu_steps")
    taken_while_recording: list[bool] = []
    snapshot = torch.cuda.memory._snapshot
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda device=None, augment_with_fx_traces=False: (
        taken_while_recording.append(cuda.history[-1]["enabled"] is not None), snapshot())[1])
    recorded: list[dict] = []
    with gpu_steps.run_history(recorded):
        with launch.memory_history(tmp_path / memory_history.OOM_SNAPSHOT_NAME):
            cuda.recorder.malloc(30 * MiB)
    assert taken_while_recording == [True] and cuda.history[-1]["enabled"] is None
    assert cuda.history[0]["max_entries"] == gpu_steps.WHOLE_HISTORY_ENTRIES > memory_history.MAX_ENTRIES
    assert [e["size"] for e in recorded[0]["device_traces"][0] if e["action"] == "alloc"] == [30 * MiB]
    assert launch.memory_history is memory_history.memory_history  # a run after it records as `run` does


def test_the_gpu_benchmark_keeps_an_out_of_memory_snapshot_small_and_readable(cuda, tmp_path, monkeypatch):
    """A catalog model's run makes millions of events, more than a GPU call brings back: the benchmark keeps the
    segments' blocks and the last events, and advise still reads the card at the failed request from them."""
    import gzip
    import pickle

    from helpers import benchmark_module
    from vram_planner.allocator.snapshot import load_snapshot
    from vram_planner.allocator.snapshot_moment import moment_of

    gpu_steps = benchmark_module("gpu_steps")
    target = tmp_path / memory_history.OOM_SNAPSHOT_NAME
    with memory_history.memory_history(target):
        requested = cuda.run_out_of_memory()
    whole = pickle.loads(gzip.decompress(target.read_bytes()))
    monkeypatch.setattr(gpu_steps, "OOM_SNAPSHOT_EVENTS", 40)
    kept = gpu_steps.save_oom_snapshot(target, tmp_path / "small.pkl.gz")
    assert kept["events"] == 40 < len(whole["device_traces"][0])
    full, small = (moment_of(s, 0) for s in (load_snapshot(target), load_snapshot(tmp_path / "small.pkl.gz")))
    assert small.requested_bytes == full.requested_bytes == requested
    assert small.block_sizes == full.block_sizes and small.free_block_sizes == full.free_block_sizes
    assert small.fragmentation_decided and small.device_free_bytes == full.device_free_bytes
