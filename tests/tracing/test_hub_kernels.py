"""transformers 5.25's default kernelization: the trace's stand-ins for the Hub's RMSNorm and rotary kernels, and the
analytic model moving with the trace where they run."""

from __future__ import annotations

import importlib
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

import vram_planner.model.spec as spec
from helpers import FIXTURES, one_line_error
from vram_planner.model import activations as act
from vram_planner.model.architecture import FAMILIES

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from vram_planner.tracing import hub_kernels  # noqa: E402

MODELING_PACKAGES = {"gemma3_text": "gemma3"}
ROWS_AS_SHIPPED = spec.transformers_release


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_family_is_kernelized_where_the_installed_modeling_code_is_decorated(model_type):
    package = MODELING_PACKAGES.get(model_type, model_type)
    module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    names = hub_kernels.decorated_names(module.__name__)
    family = FAMILIES[model_type]
    assert (hub_kernels.RMS_NORM in names.values()) is family.hub_rms_norm
    assert (names.get("apply_rotary_pos_emb") == hub_kernels.ROTARY) is family.hub_rotary


def test_the_rms_norm_stand_in_keeps_the_input_the_weight_and_a_float32_rstd_per_row():
    x = torch.randn(3, 5, 8, dtype=torch.bfloat16, requires_grad=True)
    norm = SimpleNamespace(weight=torch.ones(8, dtype=torch.float32, requires_grad=True))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = hub_kernels._rms_norm_forward(norm, x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape  # the input's dtype, not the weight's
    assert [t.data_ptr() for t in saved[:2]] == [x.data_ptr(), norm.weight.data_ptr()]
    assert saved[2].dtype == torch.float32 and tuple(saved[2].shape) == (15,)
    assert len(saved) == 3
    y.sum().backward()
    assert x.grad.shape == x.shape and norm.weight.grad.shape == (8,)


def test_the_rotary_stand_in_clones_keeping_cos_and_sin_where_the_kernel_runs_and_is_the_torch_code_elsewhere():
    def torch_code(q, k, cos, sin, unsqueeze_dim=1):
        return q * cos, k * cos

    rotary = hub_kernels._rotary_stand_in(torch_code)
    q, k = torch.randn(2, 4, 3, 8, dtype=torch.bfloat16), torch.randn(2, 1, 3, 8, dtype=torch.bfloat16)
    cos = sin = torch.ones(2, 3, 8, dtype=torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        q_out, k_out = rotary(q.requires_grad_(), k, cos, sin)
    assert q_out.data_ptr() != q.data_ptr() and torch.equal(q_out, q) and torch.equal(k_out, k)
    assert [t.data_ptr() for t in saved] == [cos.data_ptr(), sin.data_ptr()]  # its backward's rotation
    # float32 weights under bf16 autocast: q is autocast's bf16, cos the float32 stream's; the kernel checks
    # x1.dtype() == cos.dtype()
    cos = torch.ones(2, 1, 3, 8)
    assert rotary(q, k, cos, cos)[0].dtype == torch.float32


@pytest.mark.parametrize("model", ["Qwen2.5-0.5B", "Llama-3.2-1B", "gemma-2-2b", "Phi-3-mini-4k-instruct"])
@pytest.mark.parametrize("knobs", [{}, {"dtype": "bfloat16"}, {"use_kernels": False}, {"mixed_precision": "no"},
                                   {"transformers_version": "5.24", "use_kernels": True}])
def test_check_says_where_the_rotary_kernel_refuses_float32_weights_under_autocast(model, knobs):
    """Where the trace's rotary stand-in runs the torch code because the kernel's dtype check would refuse (float32
    weights under mixed precision: TRL's default weights), check says so in a note, naming both ways out."""
    from vram_planner import engine

    verdict = engine.check(model, "rtx-4060-laptop", {"transformers_version": "5.25", **knobs})
    notes = [note for note in verdict.estimate.notes if "rotary kernel" in note]
    train, arch = verdict.train, verdict.context.arch
    refuses = ("rotary_pos_emb" in train.hub_kernel_layers and arch.family.hub_rotary and train.dtype == "float32"
               and train.mixed_precision != "no")
    assert act.hub_rotary_refuses(arch, train) == refuses == bool(notes)
    assert refuses == (model != "Phi-3-mini-4k-instruct" and knobs == {})
    if notes:
        assert "--dtype bfloat16" in notes[0] and "use_kernels false" in notes[0]


def _kernelized(monkeypatch, on: bool) -> None:
    """The installed release's row, kernelizing by default or not."""
    monkeypatch.setattr(spec, "transformers_release", lambda version, major: replace(
        ROWS_AS_SHIPPED(version, major), hub_kernels=on))


KNOBS = {"bf16 full": {"dtype": "bfloat16"}, "bf16 LoRA": {"dtype": "bfloat16", "lora_r": 8},
         "float32 weights, full": {}, "bf16 full, checkpointing": {"dtype": "bfloat16", "gradient_checkpointing": True},
         "bf16 LoRA, checkpointing": {"dtype": "bfloat16", "lora_r": 8, "gradient_checkpointing": True}}


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny-qwen3.json", "tiny-phi3.json", "tiny-gemma2.json"])
@pytest.mark.parametrize("knobs", list(KNOBS))
def test_the_analytic_model_moves_with_the_trace_where_the_hub_kernels_run(monkeypatch, fixture, knobs):
    """Kernelized (transformers 5.25's default) and not, each phase's analytic error against the trace is the same
    to 0.2 points, and what the kernels leave unkept at the loss's peak is what the analytic model leaves out."""
    from vram_planner import engine
    from vram_planner.tracing.step import compare_with_estimate, trace_step

    settings = {"per_device_train_batch_size": 4, "num_generations": 4, "max_prompt_length": 48,
                "max_completion_length": 80, **{"gradient_checkpointing": False, **KNOBS[knobs]}}
    errors, traced = {}, {}
    for on in (False, True):
        _kernelized(monkeypatch, on)
        context = engine.make_context(str(FIXTURES / fixture), "h100-80gb")
        train = engine.make_training(context, settings)
        result = trace_step(json.loads((FIXTURES / fixture).read_text()), train, context.release)
        rows = compare_with_estimate(result, engine.judge(context, train).estimate)
        errors[on] = {row.name: row.relative_error for row in rows}
        traced[on] = {row.name: row.components["activations"] for row in rows}["training"]
    assert errors[True].keys() == errors[False].keys()
    assert all(abs(errors[True][name] - errors[False][name]) < 0.002 for name in errors[True]), errors
    # what the kernels leave unkept at the loss's peak: the norms' float32 copies (Gemma's norms are not decorated;
    # the rotary kernel keeps cos and sin, as the torch code does)
    unkept, counted_unkept = (traced[False][i] - traced[True][i] for i in (0, 1))
    assert unkept == counted_unkept
    assert (unkept > 0) is act.hub_rms_norm(context.arch, train)


def test_use_kernels_is_the_releases_default_unless_given_and_liger_is_counted_by_its_own_coefficients():
    from vram_planner.model.spec import training_config

    assert training_config({"transformers_version": "5.25"}).hub_kernel_layers == ("RMSNorm", "rotary_pos_emb")
    assert training_config({"transformers_version": "5.25", "use_kernels": False}).hub_kernel_layers == ()
    # 5.24 kernelizes only when asked, and then its rotary kernel for inference only
    assert training_config({"transformers_version": "5.24"}).hub_kernel_layers == ()
    assert training_config({"transformers_version": "5.24", "use_kernels": True}).hub_kernel_layers == ("RMSNorm",)
    assert training_config({"transformers_version": "5.25", "use_liger_kernel": True}).hub_kernel_layers == ()


def test_use_kernels_where_vram_plan_has_not_read_the_kernels_is_one_line_and_exit_2(capsys):
    message = one_line_error(capsys, "check", "--gpu", "rtx-4090", "--model", "Qwen2.5-0.5B",
                             "--transformers-version", "5.23", "--use-kernels")
    assert message == ("error: --use-kernels is planned from transformers 5.24 on, whose Hub kernels vram-plan has "
                       "read, not for transformers 5.23.0: leave it unset, or plan for 5.24 or later "
                       "(--transformers-version)\n")


@pytest.mark.slow
def test_use_kernels_on_the_installed_release_traces_the_kernelized_norms_as_check_counts_them():
    """No stand-in row: the knob itself, on the installed transformers (5.24 in the tested set, which kernelizes
    RMSNorm for training when asked)."""
    from vram_planner import engine
    from vram_planner.tracing.step import compare_with_estimate, trace_step

    fixture = FIXTURES / "tiny-llama-headdim.json"
    settings = {"per_device_train_batch_size": 4, "num_generations": 4, "max_prompt_length": 48,
                "max_completion_length": 80, "gradient_checkpointing": False, "dtype": "bfloat16"}
    kept = {}
    for use_kernels in (False, True):
        context = engine.make_context(str(fixture), "h100-80gb")
        train = engine.make_training(context, {**settings, "use_kernels": use_kernels})
        result = trace_step(json.loads(fixture.read_text()), train, context.release)
        rows = {row.name: row for row in compare_with_estimate(result, engine.judge(context, train).estimate)}
        kept[use_kernels] = rows["training"].components["activations"]
        assert all(abs(row.relative_error) < 0.005 for row in rows.values())
    assert "RMSNorm" in train.hub_kernel_layers
    assert kept[True][0] < kept[False][0] and kept[False][0] - kept[True][0] == kept[False][1] - kept[True][1]
