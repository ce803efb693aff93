#!/usr/bin/env bash
# GPU call: full-size server (graphs; grouped_mm prefill, batched_mm in graphs), HTTP bench at prompt 160.
source loadtest/gpu/common.sh
start_server graphs || exit 1
grep -E "GiB|MiB|capture failed" "$OUT/server-graphs.log" | head -6
timeout ${LIMIT:-300} python3 -m app.cli bench --model $MODEL --name h200-graphs --out "$OUT" --prompt-lens 160 \
  --concurrency ${CONC:-1 16 64} --requests-per-point ${REQS:-1} --rounds ${ROUNDS:-1} --warmup ${WARMUP:-1} 2>&1 | grep -v "^\s*$" | tail -12
stop_server
