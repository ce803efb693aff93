#!/usr/bin/env bash
# host_stacks.sh: where the stage threads spend their time, in process at c=1/16/64 (full-size dummy engine):
# diag.py with DIAG_STACKS (each round's sampled stacks, stacks-c*.txt) and DIAG_SYNC (every operation that
# makes a thread wait for the device, with its stack: syncs.txt). Extra args go to the engine.
source loadtest/gpu/common.sh
DIAG_STACKS=1 DIAG_SYNC=${DIAG_SYNC-1} DIAG_CONC="${DIAG_CONC:-1 16 64}" DIAG_TIMEOUT=${DIAG_TIMEOUT:-300} \
  timeout ${LIMIT:-330} python3 loadtest/gpu/diag.py --model $MODEL --load-format dummy \
  --deploy-config deploy/qwen3_omni_moe_1gpu.yaml "$@" > "$OUT/diag.txt" 2> "$OUT/diag.log"
echo "diag rc=$?"
cat "$OUT/diag.txt"
echo "$(grep -c '^SYNC' "$OUT/diag.log") synchronizing operations reported"
grep -A9 "^SYNC" "$OUT/diag.log" | head -200 > "$OUT/syncs.txt"
(cd "$OUT" && tar czf diag-log.tgz diag.log && rm diag.log)
