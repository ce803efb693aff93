#!/usr/bin/env bash
# GPU call (issue: voice sessions at scale): one H200, full-size dummy model, 1-GPU profile.
# 1. The session layer's share of one turn: chat TTFP for the bench's spoken utterance as input_audio
#    (and a text prompt), then one Realtime session (1 warm-up + 6 turns, cancel at first audio) whose
#    server-side TTFP per response is in the log ("request finished ... ttfp_ms").
# 2. 32 sessions without and with one abusive session (--abusive 1: flood, garbage, deaf in turn); ABUSE=0 skips it.
source loadtest/gpu/common.sh
start_server abusive --realtime-max-sessions 160 --log-level info || exit 1
python3 loadtest/gpu/utterance_chat.py http://127.0.0.1:8091 $MODEL | tee "$OUT/chat-ttfp.txt"
python3 -m app.cli bench realtime --url http://127.0.0.1:8091 --model $MODEL --sessions 1 --turns 6 \
  --mode cancel --clients 1 --name h200-realtime-one --out "$OUT" 2>&1 | grep -E "^\| [0-9]|Error|error"
[ "${ABUSE:-1}" = 1 ] && python3 -m app.cli bench realtime --url http://127.0.0.1:8091 --model $MODEL \
  --sessions ${SESSIONS:-32} --turns 3 --mode cancel --clients 8 --abusive 1 --name h200-realtime-abusive \
  --out "$OUT" 2>&1 | grep -E "^\| [0-9]|^- |Error|error"
stop_server
grep "request finished" "$OUT/server-abusive.log" | sed 's/.*request_id=\([a-z]*\)_.* ttfp_ms=\([0-9.]*\).*/\1 \2/' > "$OUT/server-ttfp.txt"
grep -c "" "$OUT/server-ttfp.txt"
