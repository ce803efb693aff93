#!/usr/bin/env bash
# Side-by-side: the omnirt engine and the reference engine (transformers' generate(), one request at a
# time) behind the same HTTP API, the same bench run against each. CPU + tiny model by default.
#   bash loadtest/compare.sh [extra bench args...]
set -euo pipefail
BIN=${BIN:-.venv/bin}
OUT=${OUT:-docs/benchmarks}
ARGS=(--prompt-lens 160 --concurrency 1 4 8 --thinker-tokens 16 --talker-frames 40 --requests-per-point 8 --warmup 2 "$@")
for engine in omnirt reference; do
  port=$((18100 + RANDOM % 500))
  $BIN/omnirt serve --engine $engine --port $port --threads 1 --log-level warning > "/tmp/compare-$engine.log" 2>&1 &
  pid=$!
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; kill -0 $pid; done
  curl -sf "http://127.0.0.1:$port/health" > /dev/null || { echo "$engine server not healthy"; kill $pid; exit 1; }
  $BIN/omnirt bench --url "http://127.0.0.1:$port" --name "cpu-tiny-$engine" --out "$OUT" "${ARGS[@]}" | tail -3
  kill $pid; wait $pid 2>/dev/null || true
done
