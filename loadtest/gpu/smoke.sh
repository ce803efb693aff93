#!/usr/bin/env bash
# GPU call: environment, graphed-vs-eager check on the tiny model, full-size start-up, a short sweep.
source loadtest/gpu/common.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
if [ -z "${SKIP_CHECK:-}" ]; then
  timeout 150 python3 -m loadtest.gpu_check --num-requests 6 -- --model tiny --dtype float32 --moe-backend batched_mm \
    > "$OUT/check_tiny.json" 2> "$OUT/check_tiny.log"
  echo "tiny check rc=$?"; tr -d "\n " < "$OUT/check_tiny.json"; echo
fi
start_server graphs || exit 1
grep -E "GiB|MiB|capture failed" "$OUT/server-graphs.log" | head
bench h200-smoke --prompt-lens 160 --concurrency ${CONC:-1 16 64} --requests-per-point 8 --rounds 1 --warmup 2
stop_server
