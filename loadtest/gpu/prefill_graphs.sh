#!/usr/bin/env bash
# GPU call: prefill graphs. The tiny model's graphs-vs-eager check (prefill graphs replayed, text identical), then
# this build against BASE served in the same call (ab_builds.sh: bench c 1/16/64 at prompt 160, Realtime
# SESSIONS), then each server's prefill capture lines (count, seconds) and any capture failure. BASE as in
# ab_builds.sh, e.g. `mkdir -p build/base && git archive 48a996f app pipeline deploy | tar -x -C build/base`.
source loadtest/gpu/common.sh
timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cudagraph.py 2>&1 | tail -3
ORDER=${ORDER:-new base} SESSIONS=${SESSIONS-32} bash loadtest/gpu/ab_builds.sh
for log in "$OUT"/server-*.log; do
  tr '\r' '\n' < "$log" | grep -E "capturing .*prefill graphs.*100%|capture failed|Traceback" | sort -u \
    | sed "s|^|$(basename "$log" .log) |"
done
