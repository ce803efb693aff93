#!/usr/bin/env bash
# diag.sh NAME [serve args...]: start the full-size engine in-process and time a few requests.
source loadtest/gpu/common.sh
name=$1; shift
DIAG_TIMEOUT=${DIAG_TIMEOUT:-200} timeout ${LIMIT:-240} python3 loadtest/gpu/diag.py --model $MODEL --load-format dummy \
  --deploy-config deploy/qwen3_omni_moe_1gpu.yaml "$@" 2> "$OUT/diag-$name.log" | grep --line-buffered -v "graph/s"
echo "$name rc=$?"; grep -E "capture failed|Error" "$OUT/diag-$name.log" | head -3
