#!/usr/bin/env bash
# GPU call (issue 13): the slot-attention kernel and the pinned host path on the device.
#   1. the GPU tests: the compiled kernel against plain attention (fp32 and bf16), the pinned staging,
#      the tiny model graphed with slot attention against eager dense attention;
#   2. full-size parity (gpu_check.py): served path vs eager dense, 8 prompts, 32 tokens, 16 frames;
#   3. step times per stage at c=1/16/64 (diag.py), then one profiled c=64 round.
# ATTENTION=dense runs step 3 with --attention dense instead (the baseline), SKIP_CHECKS=1 skips 1-2.
source loadtest/gpu/common.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
if [ -z "${SKIP_CHECKS:-}" ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_attention.py tests/test_cudagraph.py \
    -k "kernel or staging or cuda" 2>&1 | tail -4
  timeout 300 python3 loadtest/gpu_check.py --num-requests 8 --thinker-tokens 32 --frames 16 -- --model $MODEL \
    --load-format dummy --deploy-config deploy/qwen3_omni_moe_1gpu.yaml > "$OUT/gpu-check-full.json" \
    2> "$OUT/gpu-check-full.log"
  echo "gpu_check rc=$?"; python3 -c "import json; d=json.load(open('$OUT/gpu-check-full.json')); print({k: d[k] for k in ('identical_text','first_token_diff','audio_max_abs_diff','audio_len_equal','attention_in_place','thinker_graphs','seconds_graphed','seconds_eager')})" \
    || tail -20 "$OUT/gpu-check-full.log"
fi
att=${ATTENTION:-slots}
DIAG_CONC="${DIAG_CONC:-1 16 64}" DIAG_PROFILE=${DIAG_PROFILE-64} LIMIT=${LIMIT:-330} bash loadtest/gpu/diag.sh $att --attention $att
grep -E "capturing|compil" "$OUT/diag-$att.log" | tail -4
