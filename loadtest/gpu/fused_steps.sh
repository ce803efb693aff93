#!/usr/bin/env bash
# GPU calls (issue 13): the kernels, the compiled steps and the fused MoE on the device. PARTS picks what
# runs, in this order (default: all):
#   tests  the GPU tests: slot attention and fused MoE kernels compiled for the device (fp32, bf16), pinned
#          staging, the tiny model served (graphs, compiled layers, slot attention) against eager;
#   check  full-size parity (gpu_check.py): the served path vs eager, dense attention, uncompiled, grouped_mm;
#          8 prompts, 32 tokens, 16 frames, with the compile seconds per step;
#   moe    moe_check.py: both full-size MoE blocks at b=1/16/64, grouped_mm vs the fused kernels, captured;
#   diag   step times per stage and req/s at c=1/16/64 in process (diag.py), as served, then one profiled
#          c=64 round (DIAG_PROFILE);
#   bench  `omnirt bench` against a server as served, prompt 160, c=1/16/64;
#   base   the same step times on the path before this steps (dense attention, no compilation,
#          grouped_mm): the baseline of the same session.
# DIAG_STEPS=1 adds each stage's captured decode step timed alone at batch 1/16/64 (diag and base).
# Inductor's cache lives in /tmp/inductor: later engines of the same call reuse what was compiled.
source loadtest/gpu/common.sh
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
PARTS=${PARTS:-tests check moe diag bench base}
has() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
if has tests; then
  timeout ${TEST_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider tests/test_attention.py tests/test_moe.py \
    tests/test_cudagraph.py -k "kernel or staging or cuda or fused or align" 2>&1 | tail -4
fi
if has check; then
  timeout ${CHECK_LIMIT:-300} python3 loadtest/gpu_check.py --num-requests 8 --thinker-tokens 32 --frames 16 -- \
    --model $MODEL --load-format dummy --deploy-config deploy/qwen3_omni_moe_1gpu.yaml ${SERVE_ARGS:-} \
    > "$OUT/gpu-check-full.json" 2> "$OUT/gpu-check-full.log"
  echo "gpu_check rc=$?"
  grep -E "compiled|capture failed|Error" "$OUT/gpu-check-full.log" | cut -c1-160 | head -12
  python3 -c "import json; d=json.load(open('$OUT/gpu-check-full.json')); print(json.dumps({k: d[k] for k in ('identical_text','first_token_diff','audio_max_abs_diff','divergence','compile_seconds','seconds_graphed','seconds_eager')}))" \
    || tail -5 "$OUT/gpu-check-full.log"
fi
if has moe; then
  timeout ${MOE_LIMIT:-130} python3 loadtest/gpu/moe_check.py > "$OUT/moe-check.txt" 2> "$OUT/moe-check.log"
  echo "moe_check rc=$?"
  grep '^{' "$OUT/moe-check.txt" > "$OUT/h200-moe-check.jsonl"
  sed -n '/^ms per block call/,$p' "$OUT/moe-check.txt"
fi
if has diag; then
  DIAG_CONC="1 16 64" DIAG_PROFILE=${DIAG_PROFILE-64} LIMIT=${DIAG_LIMIT:-170} bash loadtest/gpu/diag.sh served ${SERVE_ARGS:-}
  grep -E "compiled layers|capture failed" "$OUT/diag-served.log" | cut -c1-160
fi
if has bench; then
  PT_LIMIT=${PT_LIMIT:-200} point served "1 16 64" ${SERVE_ARGS:-}
fi
if has base; then
  DIAG_CONC="1 16 64" DIAG_PROFILE= LIMIT=${BASE_LIMIT:-150} bash loadtest/gpu/diag.sh base --attention dense \
    --compile off --moe-backend grouped_mm
fi
