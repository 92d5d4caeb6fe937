"""Repeated scoring forwards replayed (vram_planner.tracing.repeats): the same events, peaks and splits as running them,
on every fixture architecture, and never a replay of a call that did something a replay cannot do."""

from __future__ import annotations

import json

import pytest

from helpers import family_fixture_files

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

from vram_planner.tracing import repeats  # noqa: E402  (needs torch)
from vram_planner.tracing.counter import FREE, LiveBytes  # noqa: E402
from vram_planner.tracing.step import trace_step  # noqa: E402


def canonical(events) -> list[tuple]:
    """The events with their blocks numbered by first appearance, each run of frees in one order: the caching
    allocator ends a run of frees in the same state whatever their order (autocast frees its casts in hash order)."""
    numbers: dict[int, int] = {}
    out, frees = [], []
    for e in events:
        step = (e.kind, numbers.setdefault(e.block, len(numbers)), e.size_bytes, e.phase, e.moment)
        if e.kind == FREE:
            frees.append(step)
            continue
        out += sorted(frees) + [step]
        frees = []
    return out + sorted(frees)


@pytest.fixture
def replays(monkeypatch):
    """How many calls were replayed."""
    done = []
    original = repeats._replayed

    def counted(tracker, recorded):
        done.append(recorded)
        return original(tracker, recorded)

    monkeypatch.setattr(repeats, "_replayed", counted)
    return done


def traced(fixture, settings, monkeypatch, replay):
    from vram_planner import engine

    monkeypatch.setattr(repeats, "REPLAY", replay)
    context = engine.make_context(str(fixture), "h100-80gb")  # the attention the installed transformers runs
    result = trace_step(json.loads(fixture.read_text()), engine.make_training(context, settings), context.release)
    return canonical(result.events), [(p.name, p.peak_bytes, p.components, p.moment) for p in result.phases]


# Old log-probs (steps_per_generation 3 x the accumulation) and the reference's (beta): 6 chunks of each pass
SCORED = {"per_device_train_batch_size": 2, "num_generations": 2, "gradient_accumulation_steps": 2,
          "steps_per_generation": 6, "max_prompt_length": 8, "max_completion_length": 8, "beta": 0.04}


LORA = {"lora_r": 4}
# float32 weights under bf16 autocast: the casts of the weights outlive each call until TRL's autocast region ends
AUTOCAST = {"dtype": "float32", "mixed_precision": "bf16", "gradient_checkpointing": False}
# every architecture with LoRA; the casts, which do not depend on it, on three (a multimodal one among them)
CASES = [(path, LORA, f"lora-{path.stem}") for path in family_fixture_files()] + [
    (path, AUTOCAST, f"autocast-{path.stem}") for path in family_fixture_files()
    if path.stem in ("tiny-llama-headdim", "tiny-phi3", "tiny-gemma3-vision")]


@pytest.mark.slow
@pytest.mark.parametrize("fixture,changes", [case[:2] for case in CASES], ids=[case[2] for case in CASES])
def test_a_step_with_replays_is_the_step_run_in_full(fixture, changes, monkeypatch, replays):
    run = traced(fixture, {**SCORED, **changes}, monkeypatch, replay=False)
    assert not replays
    assert traced(fixture, {**SCORED, **changes}, monkeypatch, replay=True) == run
    # two passes of 6 chunks: each replays from its third chunk at the latest
    assert len(replays) >= 2 * (6 - 3)


class Steady(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(64, 64), requires_grad=False)

    def forward(self, x, scale=1.0, note=None):
        hidden = (x @ self.weight).relu() * scale
        return {"out": hidden.sum(-1), "hidden": hidden[:, :3], "none": None}


class Hoarding(Steady):
    def __init__(self) -> None:
        super().__init__()
        self.kept = []

    def forward(self, x, scale=1.0, note=None):
        self.kept.append(x * 2)
        return super().forward(x, scale)


class Growing(Steady):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x, scale=1.0, note=None):
        self.calls += 1
        return super().forward(torch.cat([x] * self.calls), scale)


class Echoing(Steady):
    def forward(self, x, scale=1.0, note=None):
        return x


class NumberKeyed(Steady):
    def forward(self, x, scale=1.0, note=None):
        return {0: super().forward(x, scale)["out"]}  # not keyword arguments: cannot be rebuilt


def called(module_type, monkeypatch, replay, arguments=lambda i: {}):
    """Six calls on chunks of one batch, each call's output kept, as the scoring loop runs them; the events."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(repeats, "REPLAY", replay)
    tracker = LiveBytes()
    with FakeTensorMode(), tracker:
        module = module_type()
        batch = torch.empty(6 * 4, 64)
        kept = []
        with torch.no_grad(), repeats.repeated_calls_replayed(tracker, module):
            for i in range(6):
                out = module(batch[4 * i: 4 * i + 4], **arguments(i))
                kept.append(out if isinstance(out, torch.Tensor) else next(iter(out.values())))
        shapes = [tuple(t.shape) for t in kept]
        del kept, out
    return canonical(tracker.events), tracker.peak, shapes


@pytest.mark.parametrize("module_type,replayed", [(Steady, 4), (Hoarding, 0), (Growing, 0), (Echoing, 0),
                                                  (NumberKeyed, 0)])
def test_only_calls_that_did_the_same_twice_and_kept_only_what_they_returned_are_replayed(
        module_type, replayed, monkeypatch, replays):
    run = called(module_type, monkeypatch, replay=False)
    assert called(module_type, monkeypatch, replay=True) == run
    assert len(replays) == replayed


def test_calls_with_other_arguments_are_recorded_apart(monkeypatch, replays):
    # scale alternates: each value's calls agree with the one before of the same value, from the fifth call on
    run = called(Steady, monkeypatch, replay=False, arguments=lambda i: {"scale": float(i % 2)})
    assert called(Steady, monkeypatch, replay=True, arguments=lambda i: {"scale": float(i % 2)}) == run
    assert len(replays) == 2
    replays.clear()
    called(Steady, monkeypatch, replay=True, arguments=lambda i: {"note": [i]})  # not comparable: every call runs
    assert not replays


def test_a_call_inside_a_recorded_call_is_never_replayed_and_the_outer_one_is(monkeypatch, replays):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def run(replay):
        monkeypatch.setattr(repeats, "REPLAY", replay)
        tracker = LiveBytes()
        with FakeTensorMode(), tracker:
            inner = Steady()
            outer = torch.nn.Sequential(inner)
            batch = torch.empty(6 * 4, 64)
            with torch.no_grad(), repeats.repeated_calls_replayed(tracker, inner), \
                    repeats.repeated_calls_replayed(tracker, outer):
                kept = [outer(batch[4 * i: 4 * i + 4])["out"] for i in range(6)]
            del kept
        return canonical(tracker.events), tracker.peak

    assert run(True) == run(False)
    assert len(replays) == 4  # the outer calls from the third: the inner ones ran inside recordings
