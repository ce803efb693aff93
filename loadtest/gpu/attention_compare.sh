#!/usr/bin/env bash
# GPU call (issue 13): the served path against the plain one, in one call on one machine.
#   1. full-size parity (gpu_check.py, 8 prompts, 32 tokens, 16 frames) with the top-2 logit gaps where
#      the runs part;
#   2. step times per stage and req/s at c=1/16/64 (diag.py, in process) with --attention dense, then
#      with slot attention;
#   3. `omnirt bench` at prompt 160, c=1/16/64, against a server with slot attention (PT_LIMIT s).
source loadtest/gpu/common.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 150 python3 loadtest/gpu_check.py --num-requests 8 --thinker-tokens 32 --frames 16 -- --model $MODEL \
  --load-format dummy --deploy-config deploy/qwen3_omni_moe_1gpu.yaml > "$OUT/gpu-check-full.json" \
  2> "$OUT/gpu-check-full.log"
echo "gpu_check rc=$?"
python3 -c "import json; d=json.load(open('$OUT/gpu-check-full.json')); print(json.dumps({k: d[k] for k in ('identical_text','first_token_diff','audio_max_abs_diff','divergence','seconds_graphed','seconds_eager')}))" \
  || tail -20 "$OUT/gpu-check-full.log"
for att in ${ATTENTIONS:-dense slots}; do
  DIAG_CONC="1 16 64" DIAG_PROFILE= LIMIT=120 bash loadtest/gpu/diag.sh $att --attention $att
done
PT_LIMIT=${PT_LIMIT:-150} point slots "1 16 64"
