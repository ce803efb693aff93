#!/usr/bin/env bash
# GPU call (issue 13, item 4: async scheduling): one H200, full-size dummy weights, 1-GPU profile, the Talker
# issuing step n+1 before step n's codes reach the host (`ahead`, the profile) against the synchronous loop
# (`sync`, --stage-overrides). PARTS picks what runs (default: diag bench):
#   diag   in process (diag.py), c=1/16/64, one engine per variant: per-stage step times (host work and device
#          waits); the stage threads' sampled stacks per round (DIAG_STACKS=1, default) and, for `ahead`, every
#          operation that made a thread wait for the device (DIAG_SYNC=1, default) -> diag-*.txt, results.tgz
#   bench  `omnirt bench` at prompt 160, c=1 and c=64, a server per row of ROWS (default: ahead sync)
# Everything else lands in $OUT/results-PARTS.tgz (a call brings back 8 files at most).
source loadtest/gpu/common.sh
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
PARTS=${PARTS:-diag bench}
has() { [[ " $PARTS " == *" $1 "* ]]; }
SYNC='{"1":{"async_scheduling":false}}'
declare -A SERVE=([ahead]="" [sync]="--stage-overrides $SYNC")

if has diag; then
  for v in ${DIAG_ROWS:-ahead sync}; do
    # shellcheck disable=SC2086  # the serve args split on spaces
    DIAG_STACKS=${DIAG_STACKS-1} DIAG_SYNC=$([ $v = ahead ] && echo "${DIAG_SYNC-1}") DIAG_CONC="${DIAG_CONC:-1 16 64}" \
      DIAG_TIMEOUT=250 timeout ${DIAG_LIMIT:-270} python3 loadtest/gpu/diag.py --model $MODEL --load-format dummy \
      --deploy-config deploy/qwen3_omni_moe_1gpu.yaml ${SERVE[$v]} > "$OUT/diag-$v.txt" 2> "$OUT/diag-$v.log"
    echo "diag $v rc=$?"; cat "$OUT/diag-$v.txt"; grep -E "Error|Traceback" "$OUT/diag-$v.log" | head -3
    echo "$v: $(grep -c '^SYNC' "$OUT/diag-$v.log") synchronizing operations reported"
    for c in ${DIAG_CONC:-1 16 64}; do [ -f "$OUT/stacks-c$c.txt" ] && mv "$OUT/stacks-c$c.txt" "$OUT/stacks-c$c-$v.txt"; done
  done
fi
if has bench; then
  for v in ${ROWS:-ahead sync}; do
    # shellcheck disable=SC2086
    PT_LIMIT=${PT_LIMIT:-200} point "$v" "1 64" ${SERVE[$v]}
  done
fi
part="results-$(echo $PARTS | tr ' ' -).tgz"  # one archive per run, so that runs in one call add up
(cd "$OUT" && tar czf "/tmp/$part" --exclude 'diag-*.txt' --exclude '*.tgz' . \
  && find . -type f ! -name 'diag-*.txt' ! -name '*.tgz' -delete && mv "/tmp/$part" .)
