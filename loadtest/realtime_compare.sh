#!/usr/bin/env bash
# bash loadtest/realtime_compare.sh DIR NAME MODE "SESSIONS": start a tiny-model server from the checkout in DIR
# (e.g. a `git worktree` of an older commit) on :8093, run `omnirt bench realtime` (this checkout's) against
# it, stop it. Two calls with different DIRs (or SERVE_ARGS, e.g. --no-prefix-caching or --api-workers 2) compare
# two servers in one session; TURNS measured turns per session (default 3); BENCH_ARGS more bench flags (e.g.
# --transport webrtc); results in $OUT (default bench-results/).
set -u
dir=$1 name=$2 mode=$3 sessions=$4
here=$(cd "$(dirname "$0")/.." && pwd)
BIN=${BIN:-$here/.venv/bin} OUT=${OUT:-$here/bench-results} TURNS=${TURNS:-3}
(cd "$dir" && exec "$BIN/python" -m app.cli serve --model tiny --port 8093 --threads 1 \
  --realtime-max-sessions 160 --log-level warning ${SERVE_ARGS:-}) > "/tmp/omnirt-rt-server-$name.log" 2>&1 &
pid=$!
until curl -sf http://127.0.0.1:8093/health | grep -qv '"pid":null'; do  # every --api-workers worker serving
  kill -0 $pid 2>/dev/null || { echo "server died: /tmp/omnirt-rt-server-$name.log"; exit 1; }
  sleep 1
done
(cd "$here" && "$BIN/python" -m app.cli bench realtime --url http://127.0.0.1:8093 --sessions $sessions --turns $TURNS \
  --mode "$mode" --clients 4 --name "$name" --out "$OUT" ${BENCH_ARGS:-})
kill $pid; wait $pid 2>/dev/null
