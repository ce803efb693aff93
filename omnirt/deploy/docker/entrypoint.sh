#!/bin/sh
# The container's command. `entrypoint.sh [FLAGS...]`: `omnirt serve` with the model, profile, host and port
# from $OMNIRT_MODEL, $OMNIRT_PROFILE, $OMNIRT_HOST and $OMNIRT_PORT, then any further `omnirt serve` flags
# (they win: argparse takes the last). `entrypoint.sh health`: exit 0 when /health answers 200 (the
# HEALTHCHECK), else 1.
set -eu
host="${OMNIRT_HOST:-0.0.0.0}"
port="${OMNIRT_PORT:-8091}"
if [ "${1:-}" = "health" ]; then
    exec python -c 'import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=5).status == 200 else 1)
except OSError as exc:
    sys.exit(f"unhealthy: {exc}")' "http://127.0.0.1:${port}/health"
fi
exec omnirt serve --host "$host" --port "$port" --model "${OMNIRT_MODEL:-tiny}" \
    ${OMNIRT_PROFILE:+--deploy-config "$OMNIRT_PROFILE"} "$@"
