"""generate()'s sampling as the device runs it: torch.multinomial draws one sample per row as argmax(p / q), q ~ Exp(1),
in a tensor like the probabilities that its kernel allocates (aten/src/ATen/native/Distributions.cpp
multinomial_out), which the fake tensor's meta kernel never makes; the trace counts it, and so does the analytic model
at the last decoding step."""

from __future__ import annotations

import json

import pytest

from helpers import FIXTURES

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

ROWS, VOCAB = 64, 100_000
BLOCK = 512  # the caching allocator's block, which the trace rounds every storage up to


def _rounded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _real_kernels_scratch_bytes(num_samples: int, replacement: bool) -> int:
    """The largest allocation torch.multinomial's own CPU kernel makes (the device kernels run the same code),
    as PyTorch's profiler sees it."""
    from torch.profiler import ProfilerActivity, profile

    probs = torch.rand(ROWS, VOCAB)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.multinomial(probs, num_samples, replacement=replacement)
    return max(event.cpu_memory_usage for event in prof.events())


def _traced_peak_above_probs(num_samples: int, replacement: bool) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vram_planner.tracing.counter import LiveBytes

    tracker = LiveBytes()
    with FakeTensorMode(), tracker:
        probs = torch.empty(ROWS, VOCAB)
        tracker.reset_peak()
        before = tracker.peak
        torch.multinomial(probs, num_samples, replacement=replacement)
        return tracker.peak - before


@pytest.mark.parametrize(("num_samples", "replacement"), [(1, False), (1, True), (4, False)])
def test_the_trace_holds_multinomials_noise_as_its_kernel_allocates_it(num_samples, replacement):
    noise = ROWS * VOCAB * 4
    assert _real_kernels_scratch_bytes(num_samples, replacement) == noise  # the real kernel's empty_like
    samples = _rounded(ROWS * num_samples * 8)  # the int64 output
    assert _traced_peak_above_probs(num_samples, replacement) == _rounded(noise) + samples


def test_drawing_several_samples_with_replacement_makes_no_noise():
    assert _real_kernels_scratch_bytes(4, True) < ROWS * VOCAB
    assert _traced_peak_above_probs(4, True) == _rounded(ROWS * 4 * 8)


# generate()'s sampling as GRPOConfig's knobs set it: none (TRL 1.16's defaults), each filter alone, Qwen2.5's
# recipe, and Qwen3's with every filter at once
SAMPLINGS = [{}, {"temperature": 0.7}, {"top_k": 50}, {"top_p": 0.95}, {"min_p": 0.0}, {"repetition_penalty": 1.1},
             {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
             {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.2}]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=lambda s: "+".join(s) or "defaults")
def test_the_last_decoding_steps_lm_head_holds_the_sampling_in_the_analytic_model_as_in_the_trace(tmp_path, sampling):
    # A small decoder with a wide vocabulary generating 64 sequences at once from 8-token prompts: the last decoding
    # step's sampling is the generation's peak; the estimate without multinomial's noise was 14% under the trace
    # there, and without the filters' tensors 33% (top-p) to 39% (every filter)
    from vram_planner import engine
    from vram_planner.model.phases import estimate
    from vram_planner.tracing.step import trace_step

    config = json.loads((FIXTURES / "tiny-llama-headdim.json").read_text()) | {"vocab_size": 50_000}
    model = tmp_path / "wide-vocabulary.json"
    model.write_text(json.dumps(config))
    context = engine.make_context(str(model), "h100-80gb")
    train = engine.make_training(context, {"per_device_train_batch_size": 8, "num_generations": 8,
                                           "steps_per_generation": 8, "max_prompt_length": 8,
                                           "max_completion_length": 8, "dtype": "float32", **sampling})
    traced = trace_step(config, train).phase("generation")
    analytic = {p.name: p for p in estimate(context.arch, train, context.release, context.calibration,
                                            context.capacity_bytes).phases}["generation"]
    assert traced.moment == analytic.moment == "last decoding step: LM head"
    assert abs(analytic.tensor_bytes - traced.peak_bytes) <= 0.005 * traced.peak_bytes
