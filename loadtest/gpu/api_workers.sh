#!/usr/bin/env bash
# GPU call (issue: voice sessions at scale, --api-workers): one H200, full-size dummy weights, 1-GPU profile.
# For API workers W in ${WORKERS:-1 4}: a server of its own, then `omnirt bench realtime` VAD only (the front
# end alone) at 64 and 128 WebSocket sessions, and 32 WebRTC calls cancelled at their first audio. Client
# over 8 processes (the host has 16 cores: the client must not be the bottleneck).
source loadtest/gpu/common.sh
for w in ${WORKERS:-1 4}; do
  start_server "workers-$w" --realtime-max-sessions 200 --api-workers "$w" || exit 1
  until python3 -c "import httpx,sys; h=httpx.get('http://127.0.0.1:8091/health').json(); \
sys.exit(any(x['pid'] is None for x in h.get('api_workers', [])))" 2>/dev/null; do sleep 1; done
  python3 -m app.cli bench realtime --url http://127.0.0.1:8091 --model $MODEL --sessions 64 128 --turns 3 \
    --mode no-responses --clients 8 --name "h200-api-workers-$w-vad" --out "$OUT" 2>&1 | grep -E "^\| [0-9]|Error|error"
  python3 -m app.cli bench realtime --url http://127.0.0.1:8091 --model $MODEL --sessions 32 --turns 3 \
    --mode cancel --transport webrtc --clients 8 --name "h200-api-workers-$w-webrtc" --out "$OUT" 2>&1 \
    | grep -E "^\| [0-9]|Error|error"
  stop_server
done
cd "$OUT" && tar czf results.tgz --exclude results.tgz * && find . -type f ! -name results.tgz -delete
