#!/usr/bin/env bash
# The GPU measurements the open issues owe, as one call of a lent machine (run from the repository root there, with
# OUT set to the folder that comes back and, in .whl/, the Python 3.12 wheels the machine's image lacks: trl 1.16.0,
# datasets 5.2.0, dill, multiprocess, fsspec, pydantic with pydantic_core, annotated-types and typing-inspection,
# typing_extensions, regex, accelerate, bitsandbytes (its CPU and CUDA 13.0 libraries alone), and the transformers,
# tokenizers and peft releases to measure; about 27 MB: `bash benchmarks/device_wheels.sh` builds it from
# constraints.txt). What the H200 calls of 2026-12-04 left owed:
#   1. memory, side by side: the three boundary points that ran out of memory above their exact need (Qwen2.5-0.5B
#      full c512 B8 at +2%; SmolLM2-135M's eager point under both cuBLAS-workspace placements at +2%), each at +5%,
#      +10%, +15% and +20%, keeping the snapshot of each failed request (its segments' blocks and last events:
#      gpu_steps.save_oom_snapshot), so the GPU brackets their real need and shows what the allocator model misses;
#      three fixtures' full fine-tuning at +2% with their whole histories (that call's came back empty: `run` stopped
#      and cleared its own recording first; gpu_steps.py now snapshots inside it; the model's reserve there is 18-25%
#      over the GPU's); and `vram-plan run --auto-fallback` on an emulated 5.5 GiB card under
#      an 8 GiB plan (that call fell back to expandable segments at a predicted 7.03 GiB and was cut by the timeout;
#      the fallback now judges each config on the card as it was);
#   2. alone on the GPU, timed: QLoRA held out from the 4-bit linear's host crossings (Llama-3.2-1B at 16 rows and
#      256 tokens, Qwen2.5-1.5B), and SmolLM2's step (cut by the timeout twice).
set -u
start=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - start )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
[ -e vram_planner/profile_data ] || ln -s ../profiles vram_planner/profile_data
MODELS=/tmp/vram-plan-gpu-models RUNS=/tmp/runs POINTS=benchmarks/results/gpu/boundary-points.json
mkdir -p "$MODELS" "$RUNS" "$OUT/boundary" "$OUT/timing" "$OUT/runs"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, trl, peft, datasets, pyarrow, accelerate, pydantic, bitsandbytes
print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| trl',
      trl.__version__, '| peft', peft.__version__, '| accelerate', accelerate.__version__, '| bitsandbytes',
      bitsandbytes.__version__, '| datasets', datasets.__version__, '| pyarrow', pyarrow.__version__)" || exit 1
# the points above the need, and the fixtures' full fine-tuning at +2%, each with its allocator history
python3 - "$POINTS" <<'PY'
import json, sys
points = json.load(open(sys.argv[1]))["points"]
above = {"Qwen2.5-0.5B full c512 B8", "SmolLM2-135M fp32 lora c1024 eager (training start)",
         "SmolLM2-135M fp32 lora c1024 eager (backward product)"}
fixtures = {"tiny-qwen3 full beta", "tiny-gemma2 full beta", "tiny-llama-headdim full beta"}
chosen = []
for point in points:
    if point["point"] in above and point["factor"] == 1.02:
        for factor in (1.05, 1.10, 1.15, 1.20):
            # a whole history here is millions of events: the run's own out-of-memory snapshot is kept instead
            chosen.append({**point, "name": f"{point['point']} x{factor}", "factor": factor, "snapshot": False,
                           "limit_bytes": int(point["need_bytes"] * factor)})
    elif point["point"] in fixtures and point["factor"] == 1.02:
        chosen.append({**point, "snapshot": True})
json.dump({"points": chosen}, open("/tmp/first.json", "w"), indent=1)
print(len(chosen), "points first")
PY
python3 benchmarks/gpu_steps.py --out "$OUT" --models "$MODELS" --build-model SmolLM2-135M
python3 benchmarks/gpu_steps.py --out "$OUT" --models "$MODELS" --build-model Qwen2.5-0.5B
elapsed "installed"

# 1. memory only, side by side, while the timed runs' models are built
for model in Llama-3.2-1B Qwen2.5-1.5B; do
  python3 benchmarks/gpu_steps.py --out "$OUT" --models "$MODELS" --build-model "$model" &
done
OMP_NUM_THREADS=1 timeout 200 python3 benchmarks/gpu_steps.py --points /tmp/first.json --jobs 15 \
  --out "$OUT/boundary" --models "$MODELS" > "$OUT/boundary/log.txt" 2>&1 &
emulated='import sys, torch; torch.cuda.set_per_process_memory_fraction(5.5 * 2**30 / torch.cuda.mem_get_info()[1])
from vram_planner.cli import main; sys.argv[0] = "vram-plan"; sys.exit(main())'
OMP_NUM_THREADS=1 timeout 200 python3 -c "$emulated" run --gpu 8GiB --model "$MODELS/SmolLM2-135M" \
  --dataset math-sample --max-steps 3 --max-completion-length 1024 --num-generations 8 \
  --per-device-train-batch-size 64 --auto-fallback --output-dir "$RUNS/smollm2-fallback" \
  2> "$OUT/runs/smollm2-fallback.log"
echo "fallback run: exit $?" >> "$OUT/runs/smollm2-fallback.log"
wait
elapsed "first window done: $(grep -c 'ran: ' "$OUT/boundary/log.txt") runs; models: $(ls "$MODELS" | tr '\n' ' ')"
grep -E "ran: " "$OUT/boundary/log.txt" | cut -c1-160
grep -E "falling back|predicted|out of GPU|step [0-9]|exit" "$OUT/runs/smollm2-fallback.log" | cut -c1-300 | tail -n 12
run="$RUNS/smollm2-fallback"; mkdir -p "$OUT/runs/smollm2-fallback"
find "$run" -maxdepth 1 \( -name '*.json' -o -name '*.jsonl' \) -exec cp {} "$OUT/runs/smollm2-fallback/" \;
tar -C "$OUT" -czf "$OUT/runs.tgz" runs && rm -rf "$OUT/runs"
mkdir -p "$OUT/oom" && mv "$OUT"/boundary/*.oom.pkl.gz "$OUT/oom/" 2>/dev/null
tar -C "$OUT" -czf "$OUT/oom.tgz" oom && rm -rf "$OUT/oom"
tar -C "$OUT" -czf "$OUT/boundary.tgz" boundary && rm -rf "$OUT/boundary"

# 2. timed, alone on the GPU
timeout 240 python3 benchmarks/gpu_steps.py --timing --out "$OUT/timing" --models "$MODELS" --only \
  "Llama-3.2-1B qlora16 B16 G16 c256" "Qwen2.5-1.5B qlora16" "SmolLM2-135M lora16 B16 G16 c256" \
  > "$OUT/timing/log.txt" 2>&1
elapsed "timing done"; grep -E "steps \[|Error|error" "$OUT/timing/log.txt" | cut -c1-300 | tail -n 12
tar -C "$OUT" -czf "$OUT/timing.tgz" timing && rm -rf "$OUT/timing"
ls -la "$OUT"; elapsed "end"
