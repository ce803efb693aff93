#!/usr/bin/env bash
# GPU call 1: environment, graphed-vs-eager check on the tiny model, full-size start-up and a short sweep.
source loadtest/gpu/common.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
[ -n "${SKIP_CHECK:-}" ] || timeout 150 python3 -m loadtest.gpu_check --num-requests 6 -- --model tiny --dtype float32 --moe-backend batched_mm \
  > "$OUT/check_tiny.json" 2> "$OUT/check_tiny.log"; echo "tiny check rc=$?"; tr -d "\n " < "$OUT/check_tiny.json"; echo; grep -A3 "capture failed" "$OUT/check_tiny.log" | head -8
timeout 200 python3 loadtest/gpu/mem.py --model $MODEL --load-format dummy --deploy-config deploy/qwen3_omni_moe_1gpu.yaml 2>&1 | grep -v "graph/s\]" | grep -E "GiB|MiB|{|rror" | head -20
python3 -c "print(1)" > /dev/null
python3 - <<PY
import torch
from pipeline.models.loader import load_hf_model
hf, _, _ = load_hf_model("qwen3-omni-30b-a3b", "dummy", torch.bfloat16, torch.device("cuda"), "grouped_mm")
print("dummy model GiB", torch.cuda.memory_allocated() / 2**30, {str(p.dtype) for p in hf.parameters()})
PY
start_server graphs || exit 1
bench h200-smoke --prompt-lens 160 --concurrency 1 16 64 --requests-per-point 8 --rounds 1 --warmup 2
grep -E "capturing|KV cache|error|Error" "$OUT/server-graphs.log" | tail -12
stop_server
