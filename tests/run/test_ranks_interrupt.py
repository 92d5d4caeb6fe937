"""Ctrl+C across ranks: a terminal sends it to the launcher and to every rank at once (and torch's launcher passes it
on once more); the ranks stop at the end of the same step, save that step's checkpoint together and rank 0 says how
to resume; the command exits 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import SMALL

pytest.importorskip("trl")
pytest.importorskip("accelerate")


@pytest.mark.slow
def test_ctrl_c_stops_two_ranks_at_the_same_step_with_its_checkpoint(tiny_model_folder, tmp_path):
    out, err_file = tmp_path / "run", tmp_path / "stderr"
    with err_file.open("w") as err:
        launcher = subprocess.Popen([sys.executable, "-m", "vram_planner", "run", "--model", str(tiny_model_folder),
                                     "--dataset", "math-sample", "--max-steps", "50", "--save-steps", "100",
                                     "--output-dir", str(out), *SMALL, "--num-gpus", "2"],
                                    stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while "GRPO step 1/" not in err_file.read_text() and launcher.poll() is None:
            assert time.monotonic() < deadline, err_file.read_text()
            time.sleep(0.2)
        os.killpg(launcher.pid, signal.SIGINT)  # what a terminal's Ctrl+C does: the whole process group
        code = launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    err = err_file.read_text()
    assert code == 130, err
    outcome = json.loads((out / "vram-plan-run.json").read_text())["outcome"]
    assert outcome["status"] == "interrupted" and outcome["signal"] == "Ctrl+C", outcome
    step = outcome["step"]
    assert 1 <= step < 50 and outcome["checkpoint"] == str(out / f"checkpoint-{step}")
    # both ranks' parts of the step's checkpoint, saved though --save-steps 100 would not have saved it
    assert {f"rng_state_{rank}.pth" for rank in (0, 1)} <= {p.name for p in (out / f"checkpoint-{step}").iterdir()}
    assert f"Ctrl+C at step {step}: training so far is saved in {out / f'checkpoint-{step}'}" in err
    assert err.rstrip().endswith("--num-gpus 2 --resume"), err
    assert "internal error" not in err and "gloo" not in err and "death signal" not in err, err
