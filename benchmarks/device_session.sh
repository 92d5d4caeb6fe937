#!/usr/bin/env bash
# The GPU measurements the open issues owe, as one call of a lent machine (run from the repository root there, with
# OUT set to the folder that comes back and, in .whl/, the Python 3.12 wheels the machine's image lacks: trl 1.16.0,
# datasets 5.2.0, dill, multiprocess, fsspec, pydantic with pydantic_core, annotated-types and typing-inspection,
# typing_extensions, regex, and the transformers, tokenizers and peft releases to measure; about 23 MB):
#   1. memory only, at once: issue 25 item 7 (boundary configs at the need -2%/+2%: benchmarks/gpu_boundary.py) and
#      issue 29 item 5 (`vram-plan run` of Qwen2.5-0.5B full and Llama-3.2-1B LoRA for 32 steps, logged; a run on a
#      card smaller than planned, its oom-snapshot.pickle, and the same with --auto-fallback);
#   2. then alone on the GPU, timed: issue 30's step-time set (benchmarks/gpu_steps.py --timing).
set -u
start=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - start )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
[ -e vram_planner/profile_data ] || ln -s ../profiles vram_planner/profile_data
MODELS=/tmp/vram-plan-gpu-models RUNS=/tmp/runs
mkdir -p "$MODELS" "$RUNS" "$OUT/boundary" "$OUT/timing" "$OUT/runs"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, trl, peft, datasets, pyarrow, accelerate, pydantic
print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| trl',
      trl.__version__, '| peft', peft.__version__, '| accelerate', accelerate.__version__, '| datasets',
      datasets.__version__, '| pyarrow', pyarrow.__version__)" || exit 1
elapsed "installed"

# the catalog models' folders (random bf16 weights, the test tokenizer), built at once on the CPU before any GPU work
for model in SmolLM2-135M Qwen2.5-0.5B Qwen3-0.6B Llama-3.2-1B Qwen2.5-1.5B; do
  python3 benchmarks/gpu_steps.py --out "$OUT" --models "$MODELS" --build-model "$model" &
done
wait
elapsed "models built: $(ls "$MODELS" | tr '\n' ' ')"

# 1. memory only, side by side
timeout 230 python3 benchmarks/gpu_steps.py --points benchmarks/results/gpu/boundary-points.json --jobs 8 \
  --out "$OUT/boundary" --models "$MODELS" > "$OUT/boundary/log.txt" 2>&1 &
common=(--gpu h200 --dataset math-sample --max-steps 32 --save-steps 1000 --max-completion-length 128
        --num-generations 4 --per-device-train-batch-size 4 --dtype bfloat16)
timeout 230 python3 -m vram_planner run "${common[@]}" --model "$MODELS/Qwen2.5-0.5B" \
  --output-dir "$RUNS/qwen2.5-0.5b-full" 2> "$OUT/runs/qwen2.5-0.5b-full.log" &
timeout 230 python3 -m vram_planner run "${common[@]}" --model "$MODELS/Llama-3.2-1B" --lora-r 16 \
  --output-dir "$RUNS/llama-3.2-1b-lora16" 2> "$OUT/runs/llama-3.2-1b-lora16.log" &
# planned for an 8 GiB card, run where the allocator may hold 5.5 GiB (another process holds the rest)
small=(--gpu 8GiB --model "$MODELS/SmolLM2-135M" --dataset math-sample --max-steps 3 --max-completion-length 1024
       --num-generations 8 --per-device-train-batch-size 64)
emulated='import sys, torch; torch.cuda.set_per_process_memory_fraction(5.5 * 2**30 / torch.cuda.mem_get_info()[1])
from vram_planner.cli import main; sys.argv[0] = "vram-plan"; main()'
timeout 230 python3 -c "$emulated" run "${small[@]}" --output-dir "$RUNS/smollm2-oom" \
  2> "$OUT/runs/smollm2-oom.log" &
timeout 230 python3 -c "$emulated" run "${small[@]}" --auto-fallback --output-dir "$RUNS/smollm2-fallback" \
  2> "$OUT/runs/smollm2-fallback.log" &
wait
elapsed "memory runs done"
tail -n 3 "$OUT/boundary/log.txt"; for f in "$OUT"/runs/*.log; do echo "== $f"; tail -n 4 "$f"; done

# what comes back (at most 8 files; a timed-out phase 2 must not lose phase 1): the runs' records and their
# snapshots reduced to what a replay reads, no weights
for run in "$RUNS"/*; do
  name=$(basename "$run"); mkdir -p "$OUT/runs/$name"
  find "$run" -maxdepth 1 \( -name '*.json' -o -name '*.jsonl' \) -exec cp {} "$OUT/runs/$name/" \;
  [ -f "$run/oom-snapshot.pickle" ] && python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import pickle
from pathlib import Path; from gpu_steps import save_snapshot
save_snapshot(pickle.loads(Path(sys.argv[1]).read_bytes()), Path(sys.argv[2]))" \
    "$run/oom-snapshot.pickle" "$OUT/runs/$name/oom-snapshot.pickle.gz"
done
tar -C "$OUT" -czf "$OUT/runs.tgz" runs && rm -rf "$OUT/runs"
tar -C "$OUT" -czf "$OUT/boundary.tgz" boundary && rm -rf "$OUT/boundary"

# 2. timed, alone on the GPU
timeout 200 python3 benchmarks/gpu_steps.py --timing --out "$OUT/timing" --models "$MODELS" \
  > "$OUT/timing/log.txt" 2>&1
elapsed "timing done"; grep -E "steps \[|Error|error" "$OUT/timing/log.txt" | tail -n 14
tar -C "$OUT" -czf "$OUT/timing.tgz" timing && rm -rf "$OUT/timing"
ls -la "$OUT"; elapsed "end"

