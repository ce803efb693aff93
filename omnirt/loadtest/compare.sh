#!/usr/bin/env bash
# The same bench against servers that differ in one thing, each started for its run and stopped after, one after
# the other in one session (CPU and the tiny model unless SERVE_ARGS says otherwise):
#   VARIANTS="profile reference" bash omnirt/loadtest/compare.sh [realtime] [bench args...]
# VARIANTS: names of omnirt/loadtest/variants.py (`python -m omnirt.loadtest.variants` lists them); VARIANT@DIR serves it from the
# checkout in DIR (e.g. `git worktree add /tmp/before REV`), to compare builds. Without bench args, the chat bench
# runs prompts of about 160 tokens at c 1/4/8 (16 tokens, 3.2 s of audio a reply), each point 5 s of warm-up and a
# window of >= 20 s and a request a worker; the voice bench 1 and 16 sessions of 3 turns.
# Reports: NAME-VARIANT.{json,md,png} in OUT (default bench-results/compare-<date>-<time>/).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
BIN=${BIN:-$here/.venv/bin}
OUT=${OUT:-$here/bench-results/compare-$(date +%Y%m%d-%H%M%S)}
if [ "${1:-}" = realtime ]; then
  shift; bench=(bench realtime); name=${NAME:-cpu-tiny-realtime}
  [ $# -gt 0 ] || set -- --sessions 1 16 --turns 3 --mode cancel --clients 4
else
  bench=(bench); name=${NAME:-cpu-tiny}
  [ $# -gt 0 ] || set -- --prompt-lens 160 --concurrency 1 4 8 --thinker-tokens 16 --talker-frames 40 \
    --warmup-s 5 --window-s 20 --min-requests 1 --seed 1
fi
for v in ${VARIANTS:-profile reference}; do
  variant=${v%@*} src=$here
  [[ $v == *@* ]] && src=${v#*@}
  "$BIN/python" -m omnirt.app.cli "${bench[@]}" --serve "$variant" --serve-from "$src" \
    --serve-args "${SERVE_ARGS:---threads 1 --realtime-max-sessions 160}" --name "$name-${variant//+/-}" --out "$OUT" "$@"
done
