"""Older (TRL, transformers) pairs traced end to end, each in the virtual environment benchmarks/trl_matrix.py builds.

The suite's own environment holds one pair (constraints.txt); these run in the two TRL 0.14 pairs' environments, which
the README's test set-up and CI build (`python benchmarks/trl_matrix.py --build-only --pair ...`, in .release-venvs
of this checkout, or VRAM_PLAN_RELEASE_VENVS), and are skipped, saying how to build them, where they are missing. The
shims they rely on are tested without those environments in test_shims.py.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENVS = Path(os.environ.get("VRAM_PLAN_RELEASE_VENVS", ROOT / ".release-venvs"))
# The seeds' crash (issue 26): Llama-3.2-1B-Instruct, TRL 0.14, bf16 weights and autocast, 1 prompt x 4 generations,
# 4 accumulation steps, 208-token prompts, 786-token completions, no checkpointing. SDPA stands in for
# FlashAttention-2, which has no CPU kernel; the logits do not depend on it.
SEEDS = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 4, "num_generations": 4,
         "max_prompt_length": 208, "max_completion_length": 786, "gradient_checkpointing": False,
         "dtype": "bfloat16", "mixed_precision": "bf16", "attn_implementation": "sdpa"}
VOCAB, FP32 = 128256, 4
SCRIPT = textwrap.dedent("""
    import json, sys
    from vram_planner import engine
    from vram_planner.profiles import model_config
    from vram_planner.tracing.step import trace_step
    settings = json.loads(sys.argv[1])
    context = engine.make_context("Llama-3.2-1B-Instruct", "rtx3080-mobile", trl_version="0.14.0")
    train = engine.make_training(context, settings)
    result = trace_step(model_config("Llama-3.2-1B-Instruct")[0], train, context.release)
    allocs = [e for e in result.events if e.kind == "alloc"]
    largest = max(allocs, key=lambda e: e.size_bytes)  # the first of the largest, in the order of the step
    second = next((i for i, e in enumerate(allocs) if "micro-batch 2" in e.moment), len(allocs))
    print(json.dumps({"bytes": largest.size_bytes, "phase": largest.phase, "moment": largest.moment,
                      "before_second_micro_batch": allocs.index(largest) < second,
                      "phases": [p.name for p in result.phases],
                      "moments": {p.name: p.moment for p in result.phases},
                      "gradients": {p.name: p.components["gradients"] for p in result.phases}}))
""")


def pair_python(trl: str, transformers: str) -> Path:
    python = VENVS / f"trl-{trl}-transformers-{transformers}" / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no environment with TRL {trl} and transformers {transformers} at {python.parent.parent} "
                    f"(python benchmarks/trl_matrix.py --build-only --pair {trl}/{transformers} makes it)")
    return python


@functools.cache  # two tests read the same pair's trace: one subprocess for both (a skip is not cached)
def traced_in(trl: str, transformers: str) -> dict:
    done = subprocess.run([str(pair_python(trl, transformers)), "-c", SCRIPT, json.dumps(SEEDS)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.slow
def test_the_seeds_1_90_gib_request_is_the_fp32_copy_of_full_sequence_logits_under_transformers_4_52():
    # transformers 4.52 dropped Llama's num_logits_to_keep, which TRL 0.14 passes: the logits cover the whole prompt
    # and completion, and accelerate's float32 copy of them is the request the seeds' run died on, in the first
    # micro-batch of the first step.
    largest = traced_in("0.14.0", "4.52.4")
    assert largest["bytes"] == 4 * (208 + 786) * VOCAB * FP32  # 1.900 GiB
    assert f"{largest['bytes'] / 2**30:.2f}" == "1.90"
    assert (largest["phase"], largest["moment"]) == ("training", "forward: LM head")
    assert largest["before_second_micro_batch"]
    assert largest["phases"] == ["generation", "training", "optimizer"]  # 0.14 scores inside compute_loss


@pytest.mark.slow
def test_transformers_4_48_honours_num_logits_to_keep_and_no_1_90_gib_tensor_exists():
    largest = traced_in("0.14.0", "4.48.2")
    assert largest["bytes"] == 4 * (786 + 1) * VOCAB * FP32  # the completion's logits and one more, 1.50 GiB
    assert largest["bytes"] < 1.85 * 2**30


@pytest.mark.slow
def test_under_trl_0_14_later_micro_batches_generate_with_the_gradients_alive():
    # TRL 0.14-0.16 generate inside every micro-batch of the accumulation: from the second on, next to the gradients
    # of the first (issue 26: 11.65 GiB there, not the 9.34 of the first micro-batch)
    traced = traced_in("0.14.0", "4.48.2")
    assert traced["moments"]["generation"].endswith("next micro-batch (gradients alive)")
    assert traced["gradients"]["generation"] == traced["gradients"]["optimizer"] > 2 * 2**30  # bf16 1.24B params


@pytest.mark.parametrize("transformers", ["4.48.2", "4.52.4"])
def test_an_8bit_optimizer_asks_for_bitsandbytes_under_transformers_4(transformers):
    # transformers 4 names no least bitsandbytes (5 does): the check reads what is there instead of failing to import
    code = textwrap.dedent("""
        from vram_planner.errors import VramPlanError
        from vram_planner.extras import require_bitsandbytes
        try:
            require_bitsandbytes("--optim adamw_8bit")
        except VramPlanError as exc:
            print(exc)
        else:
            print("installed")
    """)
    done = subprocess.run([str(pair_python("0.14.0", transformers)), "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    said = done.stdout.strip()
    assert said == "installed" or said.startswith("--optim adamw_8bit needs bitsandbytes, which is not installed")


@pytest.mark.slow  # one step of Qwen2.5-0.5B traced and bisected: about 20 s
def test_a_published_lora_run_holds_what_the_trace_holds_on_its_card():
    # oxen.ai's H100 table, TRL 0.14: Qwen2.5-0.5B-Instruct with LoRA under PEFT's 0.05 dropout held 13 GB. The
    # trace holds within 10% of it; with the CPU kernel's dropout noise (not CUDA's mask) it held 16.7 GiB
    python = pair_python("0.14.0", "4.48.2")
    done = subprocess.run([str(python), str(ROOT / "benchmarks" / "public_traced.py"), "--rows", "oxen-h100-0.5b-lora"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("oxen-h100-0.5b-lora"))
    measured, check, need, held = (float(v) for v in row.split()[-6:-2])
    assert measured == 13.0 and need <= held
    assert abs(measured - held) / held < 0.10
    # and `check` within 1% of the need or above it: 13.15 GiB against 13.94, a window, before the reference's logits
    # in the policy's float32 copy segment were counted (stranding.reference_logits_stranded_bytes)
    assert check >= need * 0.99
