#!/usr/bin/env bash
# The GPU measurements the open issues owe, as one call of a lent machine (run from the repository root there, with
# OUT set to the folder that comes back and, in .whl/, the Python 3.12 wheels the machine's image lacks: trl 1.16.0,
# datasets 5.2.0, dill, multiprocess, fsspec, pydantic with pydantic_core, annotated-types and typing-inspection,
# typing_extensions, regex, accelerate, bitsandbytes (its CPU and CUDA 13.0 libraries alone), and the transformers,
# tokenizers and peft releases to measure; about 27 MB). What the H200 call of 2026-11-26 left owed:
#   1. memory only, side by side, while the catalog models are built on the CPU: issue 25 item 7's placement runs
#      (SmolLM2-135M's eager-attention point at the need with autograd's cuBLAS workspace placed at the training
#      phase's start and at the backward's first product, each -2%/+2%; Qwen2.5-0.5B's 4096-token point takes ~6
#      minutes of host-bound decoding and waits), the fixture architectures' boundary points with their allocator
#      histories (where the model's reserve for their full fine-tuning went 20% over), and `vram-plan run
#      --auto-fallback` on an emulated 5.5 GiB card (the last call's ran out of memory instead of falling back);
#   2. alone on the GPU, timed: issue 30's configs whose steps the last call timed in the wake of other runs, without
#      phases, then QLoRA's first timed step and SmolLM2's (cut by the timeout last time);
#   3. memory only, side by side: the catalog models' boundary points (six never ran).
set -u
start=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - start )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
[ -e vram_planner/profile_data ] || ln -s ../profiles vram_planner/profile_data
MODELS=/tmp/vram-plan-gpu-models RUNS=/tmp/runs POINTS=benchmarks/results/gpu/boundary-points.json
mkdir -p "$MODELS" "$RUNS" "$OUT/boundary" "$OUT/catalog" "$OUT/timing" "$OUT/runs"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, trl, peft, datasets, pyarrow, accelerate, pydantic, bitsandbytes
print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| trl',
      trl.__version__, '| peft', peft.__version__, '| accelerate', accelerate.__version__, '| bitsandbytes',
      bitsandbytes.__version__, '| datasets', datasets.__version__, '| pyarrow', pyarrow.__version__)" || exit 1
# the points of each window, by name
python3 - "$POINTS" <<'EOF'
import json, sys
points = json.load(open(sys.argv[1]))["points"]
first = [p["name"] for p in points
         if p["model"].endswith(".json") or (p.get("placement") and p["model"] == "SmolLM2-135M")]
catalog = [p["name"] for p in points if not p["model"].endswith(".json") and not p.get("placement")]
open("/tmp/first.txt", "w").write("\n".join(first) + "\n")
open("/tmp/catalog.txt", "w").write("\n".join(catalog) + "\n")
print(len(first), "points first,", len(catalog), "catalog points last")
EOF
python3 benchmarks/gpu_steps.py --out "$OUT" --models "$MODELS" --build-model SmolLM2-135M
elapsed "installed"

# 1. memory only: the placement and fixture points, and the fallback run, while the larger models are built
for model in Qwen2.5-0.5B Qwen3-0.6B Llama-3.2-1B Qwen2.5-1.5B; do
  python3 benchmarks/gpu_steps.py --out "$OUT" --models "$MODELS" --build-model "$model" &
done
mapfile -t first < /tmp/first.txt
OMP_NUM_THREADS=1 timeout 150 python3 benchmarks/gpu_steps.py --points "$POINTS" --only "${first[@]}" --jobs 10 \
  --out "$OUT/boundary" --models "$MODELS" > "$OUT/boundary/log.txt" 2>&1 &
emulated='import sys, torch; torch.cuda.set_per_process_memory_fraction(5.5 * 2**30 / torch.cuda.mem_get_info()[1])
from vram_planner.cli import main; sys.argv[0] = "vram-plan"; sys.exit(main())'
OMP_NUM_THREADS=1 timeout 150 python3 -c "$emulated" run --gpu 8GiB --model "$MODELS/SmolLM2-135M" \
  --dataset math-sample --max-steps 3 --max-completion-length 1024 --num-generations 8 \
  --per-device-train-batch-size 64 --auto-fallback --output-dir "$RUNS/smollm2-fallback" \
  2> "$OUT/runs/smollm2-fallback.log"
echo "fallback run: exit $?" >> "$OUT/runs/smollm2-fallback.log"
wait
elapsed "first window done: $(grep -c 'ran: ' "$OUT/boundary/log.txt") runs; models: $(ls "$MODELS" | tr '\n' ' ')"
tail -n 12 "$OUT/runs/smollm2-fallback.log"
run="$RUNS/smollm2-fallback"; mkdir -p "$OUT/runs/smollm2-fallback"
find "$run" -maxdepth 1 \( -name '*.json' -o -name '*.jsonl' \) -exec cp {} "$OUT/runs/smollm2-fallback/" \;
[ -f "$run/oom-snapshot.pickle" ] && python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import pickle
from pathlib import Path; from gpu_steps import save_snapshot
save_snapshot(pickle.loads(Path(sys.argv[1]).read_bytes()), Path(sys.argv[2]))" \
  "$run/oom-snapshot.pickle" "$OUT/runs/smollm2-fallback/oom-snapshot.pickle.gz"
tar -C "$OUT" -czf "$OUT/runs.tgz" runs && rm -rf "$OUT/runs"
tar -C "$OUT" -czf "$OUT/boundary.tgz" boundary && rm -rf "$OUT/boundary"

# 2. timed, alone on the GPU
timeout 230 python3 benchmarks/gpu_steps.py --timing --out "$OUT/timing" --models "$MODELS" --only \
  "Qwen2.5-0.5B full" "Qwen2.5-0.5B full no-checkpointing" "Llama-3.2-1B lora16" \
  "Llama-3.2-1B lora16 no-checkpointing" \
  "Llama-3.2-1B lora16 B2 GA2" "Qwen2.5-0.5B full B8 G8 c256" "Qwen2.5-0.5B fp32 full" "Llama-3.2-1B qlora16" \
  "SmolLM2-135M lora16 B16 G16 c256" > "$OUT/timing/log.txt" 2>&1
elapsed "timing done"; grep -E "steps \[|Error|error" "$OUT/timing/log.txt" | cut -c1-300 | tail -n 12
tar -C "$OUT" -czf "$OUT/timing.tgz" timing && rm -rf "$OUT/timing"

# 3. memory only: the catalog points
mapfile -t catalog < /tmp/catalog.txt
OMP_NUM_THREADS=1 timeout 120 python3 benchmarks/gpu_steps.py --points "$POINTS" --only "${catalog[@]}" --jobs 16 \
  --out "$OUT/catalog" --models "$MODELS" > "$OUT/catalog/log.txt" 2>&1
elapsed "catalog done"; grep -E "ran: |ERROR" "$OUT/catalog/log.txt" | cut -c1-200
tar -C "$OUT" -czf "$OUT/catalog.tgz" catalog && rm -rf "$OUT/catalog"
ls -la "$OUT"; elapsed "end"
