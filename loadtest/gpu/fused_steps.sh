#!/usr/bin/env bash
# GPU call (issue 13): the kernels, the compiled steps and the fused MoE on the device, in one call.
#   1. the GPU tests: slot attention and fused MoE kernels compiled for the device (fp32, bf16), pinned
#      staging, the tiny model served (graphs, compiled steps, slot attention) against eager;
#   2. full-size parity (gpu_check.py): served path vs eager dense uncompiled, 8 prompts, 32 tokens, 16
#      frames, with the compile seconds per step;
#   3. moe_check.py: both full-size MoE blocks at b=1/16/64, grouped_mm vs the fused kernels, captured.
# Inductor's cache lives in /tmp/inductor (later servers of the same call reuse what was compiled).
source loadtest/gpu/common.sh
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
timeout ${TEST_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider tests/test_attention.py tests/test_moe.py \
  tests/test_cudagraph.py -k "kernel or staging or cuda or fused or align" 2>&1 | tail -6
timeout ${CHECK_LIMIT:-300} python3 loadtest/gpu_check.py --num-requests 8 --thinker-tokens 32 --frames 16 -- \
  --model $MODEL --load-format dummy --deploy-config deploy/qwen3_omni_moe_1gpu.yaml ${SERVE_ARGS:-} \
  > "$OUT/gpu-check-full.json" 2> "$OUT/gpu-check-full.log"
echo "gpu_check rc=$?"
grep -E "compiled|graphs of the compiled|capture failed|Error" "$OUT/gpu-check-full.log" | cut -c1-200 | head -12
python3 -c "import json; d=json.load(open('$OUT/gpu-check-full.json')); print(json.dumps({k: d[k] for k in ('identical_text','first_token_diff','audio_max_abs_diff','audio_len_equal','divergence','compile_seconds','seconds_graphed','seconds_eager')}))" \
  || tail -20 "$OUT/gpu-check-full.log"
timeout ${MOE_LIMIT:-130} python3 loadtest/gpu/moe_check.py > "$OUT/moe-check.txt" 2> "$OUT/moe-check.log"
echo "moe_check rc=$?"
grep '^{' "$OUT/moe-check.txt" > "$OUT/h200-moe-check.jsonl"
sed -n '/^ms per block call/,$p' "$OUT/moe-check.txt"
tail -3 "$OUT/moe-check.log"
