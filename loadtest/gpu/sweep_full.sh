#!/usr/bin/env bash
# GPU call: the HTTP sweep on the graphed full-size server: prompt 10/160/320/640 x concurrency 1/16/32/64.
source loadtest/gpu/common.sh
start_server graphs || exit 1
grep -E "GiB|MiB|capture failed" "$OUT/server-graphs.log" | head -6
timeout ${LIMIT:-330} python3 -m app.cli bench --model $MODEL --name ${NAME:-h200-sweep} --out "$OUT" \
  --prompt-lens ${PROMPTS:-10 160 320 640} --concurrency ${CONC:-1 16 32 64} --requests-per-point 2 --rounds 1 \
  --warmup 2 2>&1 | grep -v "^\s*$" | tail -${TAIL:-22}
stop_server
