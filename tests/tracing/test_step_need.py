"""Steps traced alongside one another, each in a process of its own, give what tracing them one after another gives;
a step that fails in its process is traced here again, and raises what it raises alone."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from helpers import FIXTURES
from vram_planner import engine
from vram_planner.errors import VramPlanError
from vram_planner.model.cublas import workspace_bytes
from vram_planner.tracing import step_need as module
from vram_planner.tracing.step_need import StepToTrace, step_need, step_needs

CONFIG = json.loads((FIXTURES / "tiny-qwen3.json").read_text())
SETTINGS = {"per_device_train_batch_size": 4, "num_generations": 4, "max_prompt_length": 48,
            "max_completion_length": 24, "allocator_conf": ""}


def steps(*prompt_lengths: int) -> list[StepToTrace]:
    context = engine.make_context(CONFIG, "24GiB")
    train = engine.make_training(context, SETTINGS)
    card = int(context.capacity_bytes - context.cuda_context.bytes)
    return [StepToTrace(CONFIG, replace(train, max_prompt_length=length), context.release, card,
                        workspace_bytes(context.gpu.compute_capability)) for length in prompt_lengths]


def measured(need) -> tuple:
    return (need.need.capacity_bytes, need.need.held_bytes, need.need.tensor_peak_bytes, need.reserved.peak_bytes,
            [(p.name, p.peak_bytes, p.components, p.moment) for p in need.result.phases], events(need.result.events))


def events(traced) -> list:
    """The events with each run of frees in one order: Python frees some runs (a dict's tensors) in an order that
    differs from one trace to the next, which leaves the allocator as it would any other order."""
    ordered, frees = [], []
    for event in [(e.kind, e.block, e.size_bytes, e.phase, e.moment) for e in traced] + [("end",)]:
        if event[0] == "free":
            frees.append(event)
            continue
        ordered += sorted(frees, key=lambda free: free[2:] + free[1:2])
        frees = []
        ordered.append(event)
    return ordered


@pytest.mark.slow  # a second process imports torch, transformers and TRL: about ten seconds
def test_steps_traced_alongside_are_those_traced_one_after_another(monkeypatch):
    monkeypatch.setattr(module, "usable_cores", lambda: 2)  # the processes, even on one core
    wanted = steps(48, 40)
    alone = [step_need(step) for step in wanted]
    module.forget_traces()  # else both are this process's traces, and nothing is traced alongside
    here = []
    original = module.step_need
    monkeypatch.setattr(module, "step_need", lambda step, progress=None: here.append(step) or original(step, progress))
    said = []
    alongside = step_needs(wanted, said.append)
    assert here == wanted[:1]  # the second step was traced in its own process
    assert [measured(n) for n in alongside] == [measured(n) for n in alone]
    assert measured(alone[0])[:5] != measured(alone[1])[:5]
    assert said[-1] == "waiting for the step traced alongside"


@pytest.mark.slow  # a second process imports torch before its trace is refused
def test_a_step_that_fails_alongside_raises_here_what_it_raises_alone(monkeypatch):
    monkeypatch.setattr(module, "usable_cores", lambda: 2)
    good, refused = steps(48, 48)
    bad = replace(refused, train=replace(refused.train, use_vllm=True))  # refused before the model is built
    with pytest.raises(VramPlanError) as alone:
        step_need(bad)
    with pytest.raises(VramPlanError) as alongside:
        step_needs([good, bad])
    assert str(alongside.value) == str(alone.value) and "vLLM" in str(alone.value)


@pytest.mark.parametrize("cores, starting", [(1, AssertionError("no process is started on one core")),
                                             (2, OSError("no executable"))], ids=["one core", "no process starts"])
def test_steps_are_traced_one_after_another_without_a_core_or_a_process_for_each(monkeypatch, cores, starting):
    monkeypatch.setattr(module, "usable_cores", lambda: cores)

    def no_processes(*args, **kwargs):
        raise starting

    monkeypatch.setattr(module.subprocess, "Popen", no_processes)
    wanted = steps(48, 40)
    needs = step_needs(wanted)
    module.forget_traces()
    assert [measured(n) for n in needs] == [measured(step_need(step)) for step in wanted]
    assert needs[0].need.capacity_bytes >= needs[1].need.tensor_peak_bytes


@pytest.mark.slow  # a script that traces two steps, one in a process of its own
def test_a_script_without_a_main_guard_runs_once(tmp_path):
    # multiprocessing's spawn would run the caller's script again in the second process
    script = tmp_path / "unguarded.py"
    script.write_text(f"""import sys
sys.path.insert(0, {str(FIXTURES.parent)!r})
from vram_planner.tracing import step_need as module
from tracing.test_step_need import steps
module.usable_cores = lambda: 2
print("ran", flush=True)
print(len(module.step_needs(steps(48, 40))), "steps")
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=False, timeout=300,
                          cwd=FIXTURES.parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "ran\n2 steps\n"


def test_the_same_step_on_another_card_replays_the_trace_this_process_made(monkeypatch):
    # the web page's card picker and a notebook's loop over cards ask for one step on several cards: the trace does
    # not depend on the card, its replays do
    from vram_planner.tracing import step as tracing_step

    first, = steps(48)
    traced = []
    original = tracing_step.trace_step
    monkeypatch.setattr(tracing_step, "trace_step", lambda *args, **kwargs: traced.append(args) or
                        original(*args, **kwargs))
    roomy = step_need(first)
    smaller = replace(first, card_bytes=roomy.need.capacity_bytes - (4 << 20))  # a card the step runs out on
    said = []
    kept = step_need(smaller, said.append)
    assert len(traced) == 1 and "using the trace this process made of the same step" in said
    module.forget_traces()
    fresh = step_need(smaller)
    assert len(traced) == 2
    assert measured(kept) == measured(fresh)
    assert kept.reserved.out_of_memory and not roomy.reserved.out_of_memory  # the replays are the card's own
    # another step is traced: the knobs, the model's config and the TRL release are the key
    step_need(replace(first, train=replace(first.train, max_completion_length=16)))
    assert len(traced) == 3


def test_a_process_keeps_the_latest_traces_only():
    for length in range(module.TRACES_KEPT + 1):
        module.keep_trace(replace(steps(48)[0], zero_rank=length), length)
    kept = [module.traced_before(replace(steps(48)[0], zero_rank=length)) for length in range(module.TRACES_KEPT + 1)]
    assert kept == [None, *range(1, module.TRACES_KEPT + 1)]
