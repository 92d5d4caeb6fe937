"""NCCL's buffers wherever per-rank memory is judged: `check` (text, JSON component, assumptions, note), the verdict
they move, `gpus --model`, `plan --num-gpus auto`; nothing on one GPU."""

from __future__ import annotations

from helpers import json_of, run
from vram_planner.model.nccl import nccl_figure
from vram_planner.profiles import GpuProfile, profile_dirs

QWEN_7B_ZERO3 = ("--model", "Qwen2.5-7B", "--dtype", "bfloat16", "--num-gpus", "8", "--zero-stage", "3")
H100 = GpuProfile.from_name("h100-80gb")
STRATEGIES = ("ddp", "fsdp", "zero0", "zero1", "zero2", "zero3")


def _without_nccl(tmp_path, monkeypatch) -> None:
    """A user's nccl.toml that opens no communicator: what the plans said before NCCL was counted."""
    text = (profile_dirs()[0] / "nccl.toml").read_text()
    lines = [f"{line.split('=')[0].strip()} = []" if line.split("=")[0].strip() in STRATEGIES else line
             for line in text.splitlines()]
    text = "\n".join(lines)
    (tmp_path / "nccl.toml").write_text(text)
    monkeypatch.setenv("VRAM_PLAN_PROFILES", str(tmp_path))


def test_check_json_counts_nccl_in_every_phase_and_says_where_from(capsys):
    _, doc = json_of(capsys, "check", "--gpu", "h100-80gb", *QWEN_7B_ZERO3)
    figure = nccl_figure(H100, 8, "zero3")
    assert figure.bytes > 1.5 * 2**30  # two communicators of 24 channels, each with NVLS's buffers
    assert {p["components"]["nccl_buffers"] for p in doc["phases"]} == {figure.bytes}
    assert all(p["total_bytes"] >= p["components"]["nccl_buffers"] for p in doc["phases"])
    assert doc["assumptions"]["nccl_buffers"] == figure.source
    assert sum(note.startswith("NCCL buffers 1.51 GiB per GPU") for note in doc["notes"]) == 1


def test_the_verdict_moves_by_nccls_bytes(capsys, tmp_path, monkeypatch):
    args = ("check", "--gpu", "h100-80gb", "--model", "Qwen2.5-7B", "--dtype", "bfloat16", "--num-gpus", "4",
            "--zero-stage", "2")
    _, counted = json_of(capsys, *args)
    figure = nccl_figure(H100, 4, "zero2").bytes
    _without_nccl(tmp_path, monkeypatch)
    _, before = json_of(capsys, *args)
    assert counted["peak_bytes"] - before["peak_bytes"] == figure
    # a margin that leaves room between the two peaks: the config fitted without NCCL and does not with it
    margin = f"{1 - (before['peak_bytes'] + figure / 2) / counted['capacity_bytes']:.6f}"
    assert json_of(capsys, *args, "--safety-margin", margin)[0] == 0
    monkeypatch.delenv("VRAM_PLAN_PROFILES")
    assert json_of(capsys, *args, "--safety-margin", margin)[0] == 1


def test_the_text_breakdown_has_an_nccl_row_and_a_note(capsys):
    code, out, _ = run(capsys, "check", "--gpu", "h100-80gb", *QWEN_7B_ZERO3)
    assert code in (0, 1)
    row = next(line for line in out.splitlines() if "NCCL buffers" in line and "│" in line)
    assert row.count("1.51") == 3  # every phase
    assert "Note: NCCL buffers 1.51 GiB per GPU" in out


def test_one_gpu_has_no_nccl_buffers(capsys):
    _, doc = json_of(capsys, "check", "--gpu", "rtx4090", "--model", "Qwen2.5-0.5B")
    assert {p["components"]["nccl_buffers"] for p in doc["phases"]} == {0}
    assert not any("NCCL" in note for note in doc["notes"])


def test_gpus_judges_every_card_with_its_own_nccl_figure(capsys, tmp_path, monkeypatch):
    args = ("gpus", "--model", "Qwen2.5-7B", "--dtype", "bfloat16", "--num-gpus", "4", "--zero-stage", "2")
    _, counted = json_of(capsys, *args)
    figures = {card["name"]: nccl_figure(GpuProfile.from_name(card["name"]), 4, "zero2").bytes for card in counted}
    _without_nccl(tmp_path, monkeypatch)
    _, before = json_of(capsys, *args)
    judged = [card for card in before if card["peak_bytes"] is not None]  # not a card that cannot run bf16
    assert len(judged) > 30
    assert {card["name"]: card["peak_bytes"] for card in counted if card["peak_bytes"] is not None} == {
        card["name"]: card["peak_bytes"] + figures[card["name"]] for card in judged}
    assert figures["h100-80gb"] > figures["h100-pcie"] > figures["rtx4090"] > 0  # NVLS and NVLink; PCIe; host buffers


def test_num_gpus_auto_counts_nccl_on_the_gpus_it_chooses(capsys):
    _, doc = json_of(capsys, "check", "--gpu", "h100-80gb", "--model", "Qwen2.5-7B", "--num-gpus", "auto",
                     "--host-memory", "64GiB")
    train = doc["assumptions"]
    assert train["num_gpus"] > 1
    figure = nccl_figure(H100, train["num_gpus"], train["distributed"])
    assert {p["components"]["nccl_buffers"] for p in doc["phases"]} == {figure.bytes}
    assert figure.bytes > 0
