#!/usr/bin/env bash
# GPU call (issue: voice sessions at scale): `omnirt bench realtime` against the full-size dummy model on
# one H200 (1-GPU profile): 1, 32 and 64 spoken sessions, 3 turns each, every reply cancelled at its first
# audio (turn latency alone), then 64 sessions VAD-only (the front end alone). Client over 8 processes.
source loadtest/gpu/common.sh
start_server realtime --realtime-max-sessions 160 || exit 1
python3 -m app.cli bench realtime --url http://127.0.0.1:8091 --model $MODEL --sessions ${SESSIONS:-1 32 64} \
  --turns 3 --mode cancel --clients 8 --name h200-realtime-cancel --out "$OUT" 2>&1 | grep -E "^\| [0-9]|Error|error"
python3 -m app.cli bench realtime --url http://127.0.0.1:8091 --model $MODEL --sessions 64 --turns 3 \
  --mode no-responses --clients 8 --name h200-realtime-vad --out "$OUT" 2>&1 | grep -E "^\| [0-9]|Error|error"
stop_server
cd "$OUT" && tar czf results.tgz --exclude results.tgz * && find . -type f ! -name results.tgz -delete
