"""Which installed (TRL, transformers) pairs the trace runs: pure, no torch."""

from __future__ import annotations

import pytest

from vram_planner.errors import VramPlanError
from vram_planner.tracing.support import check_kernels_importable, check_supported_pair, pair_for


@pytest.mark.parametrize(("trl", "transformers"), [
    ("0.14.0", "4.48.2"), ("0.14.0", "4.52.4"), ("0.14.0", "4.57.3"), ("0.16.1", "4.50.3"), ("0.19.1", "4.53.1"),
    ("0.23.1", "4.56.2"), ("0.26.2", "4.57.3"), ("0.29.1", "5.3.0"), ("1.0.0", "5.4.0"), ("1.14.2", "5.19.0"),
    ("1.15.0", "5.19.0"), ("1.16.0", "5.24.0"),
    # the releases between them, traced with their neighbours' libraries
    ("0.18.2", "4.52.4"), ("0.20.0", "4.55.0"), ("0.22.2", "4.56.2"), ("0.25.1", "4.57.3"), ("0.27.1", "4.57.3"),
    ("0.28.0", "5.3.0"), ("1.5.1", "5.4.0"), ("1.13.0", "5.16.1"), ("1.16.0rc1", "5.24.0.dev0"),
])
def test_the_pairs_the_release_matrix_traced_are_accepted(trl, transformers):
    check_supported_pair(trl, transformers)


@pytest.mark.parametrize(("trl", "transformers"), [
    ("0.14.0", "4.46.3"),  # older than any transformers the engine ran
    ("0.14.0", "5.4.0"),  # TRL 0.14's GRPOTrainer does not import under transformers 5
    ("1.16.0", "4.57.3"),  # a TRL release of the transformers 5 generation under 4.x
    ("0.13.0", "4.48.2"),  # before the oldest TRL row
    ("2.0.0", "5.24.0"),
    ("1.16.0", "6.0.0"),
    ("main", "5.24.0"),
])
def test_other_pairs_are_refused_in_one_line_naming_both_and_what_works(trl, transformers):
    with pytest.raises(VramPlanError) as caught:
        check_supported_pair(trl, transformers)
    message = str(caught.value)
    assert "\n" not in message
    assert f"TRL {trl} with transformers {transformers} (installed)" in message
    assert "TRL 0.14.0 to 0.27.1 with transformers 4.48.0 to 4.x" in message
    assert "TRL 0.27.2 to 1.x with transformers 5.0.0 to 5.x" in message


def test_a_release_to_trace_is_named_with_the_transformers_it_runs_with():
    assert pair_for("0.14.0") == "transformers 4.48.0 to 4.x"
    assert pair_for("0.27.1") == "transformers 4.48.0 to 4.x"
    assert pair_for("0.27.2") == "transformers 5.0.0 to 5.x"
    assert pair_for("1.16") == "transformers 5.0.0 to 5.x"


@pytest.mark.parametrize(("transformers", "model_type", "refused"), [
    ("4.52.4", "gemma2", True), ("4.48.2", "gemma3_text", True), ("4.53.1", "gemma2", False),
    ("4.52.4", "llama", False),
])
def test_gemma_2_and_3_before_transformers_4_53_are_refused_up_front(monkeypatch, transformers, model_type, refused):
    # their generation fills a HybridCache allocated at full length, which the trace's growing cache does not model
    pytest.importorskip("trl")
    from vram_planner.model.spec import TrainingConfig
    from vram_planner.model.trl_releases import trl_release
    from vram_planner.tracing import step

    versions = {"trl": "0.14.0", "transformers": transformers}
    monkeypatch.setattr(step, "installed_version", lambda name: versions.get(name))
    monkeypatch.setattr(step, "installed_trl_version", lambda: versions["trl"])
    train = TrainingConfig(trl_version="0.14.0", per_device_train_batch_size=1, num_generations=2)
    if refused:
        with pytest.raises(VramPlanError, match=f"transformers {transformers} generates {model_type} into a "
                                                "preallocated HybridCache"):
            step.check_traceable(train, trl_release("0.14.0"), None, model_type)
    else:
        step.check_traceable(train, trl_release("0.14.0"), None, model_type)


def test_a_fused_head_that_imports_triton_unconditionally_is_refused_without_triton(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    kernels = tmp_path / "chunked_logprob.py"
    kernels.write_text("import torch\nimport triton\nimport triton.language as tl\n")  # TRL 1.15.0's first lines
    with pytest.raises(VramPlanError) as caught:
        check_kernels_importable("1.15.0", kernels)
    assert "\n" not in str(caught.value)
    assert "TRL 1.15.0 (installed)" in str(caught.value) and "pip install triton" in str(caught.value)
    # TRL 1.16 imports it only where it is available
    kernels.write_text("from transformers.utils import is_triton_available\nif is_triton_available():\n"
                       "    import triton\n")
    check_kernels_importable("1.16.0", kernels)
    # and with triton installed, 1.15's import works
    kernels.write_text("import triton\n")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else real(name, *a))
    check_kernels_importable("1.15.0", kernels)


def test_a_trainer_whose_import_needs_an_uninstalled_module_is_refused_in_one_line_naming_it():
    from vram_planner.tracing.step import require_grpo_trainer

    def load():  # TRL 0.28.0 without weave, as its lazy module reports it
        raise RuntimeError("Failed to import trl.trainer.grpo_trainer because of the following error (look up to see "
                           "its traceback):\nNo module named 'weave'")

    with pytest.raises(VramPlanError) as caught:
        require_grpo_trainer("0.28.0", load)
    message = str(caught.value)
    assert "\n" not in message and "TRL 0.28.0 (installed)" in message and "`pip install weave`" in message
    # TRL's bug, which users hit too: it asks transformers whether weave is installed, and transformers 5.3 on answer
    # with a tuple; what works instead is named
    assert "from transformers 5.3 on the answer is a tuple" in message and "a run fails the same way" in message
    assert "transformers 5.0 to 5.2, or TRL 0.29 or later" in message

    def load_other():
        raise ImportError("No module named 'somepackage.sub'")

    with pytest.raises(VramPlanError, match=r"needs somepackage, which is not installed \(`pip install somepackage`, "
                                            r"or another TRL release;"):
        require_grpo_trainer("1.16.0", load_other)
    require_grpo_trainer("1.16.0", lambda: object)  # an importable trainer passes

    def broken():
        raise RuntimeError("something else")

    with pytest.raises(RuntimeError):  # anything else is the trace's own error to explain, as before
        require_grpo_trainer("1.16.0", broken)


def test_the_zero_trace_without_deepspeed_says_how_to_install_it(monkeypatch):
    import importlib.util

    from vram_planner.model.spec import TrainingConfig
    from vram_planner.tracing.support import zero_problems

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else found(name, *a))
    assert zero_problems(TrainingConfig(num_gpus=2, zero_stage=2)) == [
        "the ZeRO trace runs DeepSpeed's own engine, which is not installed (pip install 'vram-plan[deepspeed]')"]
