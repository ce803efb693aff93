#!/usr/bin/env bash
# GPU call: this build against another one, served, in the same call (same machine, same inductor cache):
# for each of ORDER (default "base new"; "new-switch": this build with the GIL switch interval at SWITCH_MS,
# default 0.2 ms, in every process of the server), a server of that build, `omnirt bench` at prompt 160 and CONC
# (default c 1/16/64, "" for none; the benches' per-stage first outputs: where first packets wait), then Realtime
# sessions (SESSIONS, default "1 32", 3 turns cancelled at first audio). BASE: the other build's source tree, carried, e.g.
#   mkdir -p build/base && git archive REV app pipeline deploy | tar -x -C build/base
# CHAT_ARGS: more flags of the chat bench (e.g. "--distinct-prompts"); STEP_LOGS=1: each server writes its engine
# steps to $OUT/steps-NAME.log (`python -m loadtest.step_log`).
# Files: h200-{base,new}-timeline.*, h200-{base,new}-realtime.* in $OUT.
source loadtest/gpu/common.sh
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
for which in ${ORDER:-base new}; do
  src=.; [ "$which" = base ] && src=${BASE:-build/base}
  steps=(); [ -n "${STEP_LOGS:-}" ] && steps=(--step-log "$OUT/steps-$which.log")
  if [ "$which" = new-switch ]; then
    SWITCH_MS=${SWITCH_MS:-0.2} EXTRA_PATH=$PWD/loadtest/gpu/switch SRC=$src start_server "$which" \
      --realtime-max-sessions 160 "${steps[@]}" || continue
  else
    SRC=$src start_server "$which" --realtime-max-sessions 160 "${steps[@]}" || continue
  fi
  [ -n "${CONC-1 16 64}" ] && timeout 200 python3 -m app.cli bench --model $MODEL --name "h200-$which-timeline" \
    --out "$OUT" --prompt-lens 160 --concurrency ${CONC-1 16 64} --requests-per-point 2 --rounds 1 --warmup 2 ${CHAT_ARGS:-} 2>&1 \
    | grep -E "^\| [0-9]|Error" | sed "s/^/$which /"
  [ -n "${SESSIONS-1 32}" ] && timeout "${RT_LIMIT:-200}" python3 -m app.cli bench realtime --url http://127.0.0.1:8091 \
    --model $MODEL --clients 8 --name "h200-$which-realtime" --out "$OUT" --sessions ${SESSIONS-1 32} --turns 3 \
    --mode cancel 2>&1 | grep -E "^\| [0-9]|^- |Error|error" | sed "s/^/$which /"
  stop_server
done
