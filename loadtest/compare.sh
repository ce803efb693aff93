#!/usr/bin/env bash
# Side-by-side: the same bench run against servers that differ in one thing, each started on its own.
# CPU + tiny model by default. Variants (VARIANTS, space-separated):
#   omnirt         the default server (engine core in a process of its own)
#   omnirt-inproc  the engine in the API process (--engine-process inproc)
#   reference      transformers' generate(), one request at a time (--engine reference)
#   VARIANTS="omnirt omnirt-inproc" OUT=/tmp/cmp bash loadtest/compare.sh [extra bench args...]
set -euo pipefail
BIN=${BIN:-.venv/bin}
OUT=${OUT:-docs/benchmarks}
ARGS=(--prompt-lens 160 --concurrency 1 4 8 --thinker-tokens 16 --talker-frames 40 --requests-per-point 8 --warmup 2 "$@")
serve_args() {
  case $1 in
    omnirt) ;;
    omnirt-inproc) echo "--engine-process inproc" ;;
    reference) echo "--engine reference" ;;
    *) echo "unknown variant $1" >&2; exit 2 ;;
  esac
}
for variant in ${VARIANTS:-omnirt reference}; do
  port=$((18100 + RANDOM % 500))
  # shellcheck disable=SC2046
  $BIN/python -m app.cli serve $(serve_args "$variant") --port $port --threads 1 --log-level warning > "/tmp/compare-$variant.log" 2>&1 &
  pid=$!
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; kill -0 $pid; done
  curl -sf "http://127.0.0.1:$port/health" > /dev/null || { echo "$variant server not healthy"; kill $pid; exit 1; }
  $BIN/python -m loadtest.bench --url "http://127.0.0.1:$port" --name "cpu-tiny-$variant" --out "$OUT" "${ARGS[@]}" | tail -3
  kill $pid; wait $pid 2>/dev/null || true
done
