#!/usr/bin/env bash
# GPU call (issue 14, item 4: the full picture of one build; issue 12's GPU targets; issue 13's in-stage steps):
# one H200, full-size dummy weights, the 1-GPU profile as shipped. PARTS picks what runs, in this order
# (default: sweep distinct realtime full; `ablation reference` in later calls: a command may run 600 s):
#   diag       in process (diag.py), c=1/16/64: per-stage time per step and per decode step, no stack sampler
#   sweep      `omnirt bench`, prompt 10/160/320/640 x c 1/16/32/64
#   distinct   `omnirt bench --distinct-prompts`, prompt 160 at c=64: every prompt new to the server
#   realtime   `omnirt bench realtime`: 1/32/64 sessions cancelled at first audio (3 turns after a warm-up turn)
#   full       `omnirt bench realtime`: 32 sessions of whole replies capped at REPLY_FRAMES codec frames (underruns)
#              (sweep, distinct, realtime and full share one server, `--realtime-max-sessions 160`)
#   ablation   `omnirt bench` at prompt 160, c=64, a server per row of ABLATE (default: all of them, the profile
#              first): no graphs, no async chunk, no async output, compile off, first-packet priority off,
#              the Talker's synchronous loop, prefill through the uncompiled layers (eager-prefill)
#   reference  `--engine reference` (transformers' generate, one request at a time), c=1
#   abusive    32 sessions cancelled at first audio, without and beside one abusive session
#   timeline   where first packets wait, stage by stage (the benches' "engine: first output per stage"): one
#              server, `omnirt bench` prompt 160 at c 1/16/64, then TIMELINE_SESSIONS (1 32; "" for none)
#              Realtime sessions (3 turns)
#   budgets    the prefill token budget against it: a server per max_num_batched_tokens B in BUDGETS (default
#              1024 2048 8192 16384) for the Thinker, max(B, 8192) for the Talker; prompt 160 at c=64
# Everything but diag.txt lands in $OUT/results-PARTS.tar, appended after each part (a call brings back 8 files
# at most, and what a part left is kept if a later one runs past the call's limit).
source loadtest/gpu/common.sh
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
PARTS=${PARTS:-sweep distinct realtime full}
has() { [[ " $PARTS " == *" $1 "* ]]; }
ARCHIVE="results-$(echo $PARTS | tr ' ' -).tar"
pack() {  # pack [FILE]: move what the last part wrote into the archive, but FILE (a running server's log)
  (cd "$OUT" && find . -type f ! -name diag.txt ! -name '*.tar' ! -name "${1:-}" -print0 |
    tar rf "$ARCHIVE" --null -T - --remove-files)
}
chat() {  # chat NAME LIMIT [bench args...]: `omnirt bench` against the running server, its rows printed
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m app.cli bench --model $MODEL --name "$name" --out "$OUT" --requests-per-point 2 \
    --rounds 1 --warmup 2 "$@" 2>&1 | grep -E "^\| [0-9]|Error"
}
rt() {  # rt NAME [bench realtime args...]
  local name=$1; shift
  timeout "${RT_LIMIT:-200}" python3 -m app.cli bench realtime --url http://127.0.0.1:8091 --model $MODEL \
    --clients 8 --name "$name" --out "$OUT" "$@" 2>&1 | grep -E "^\| [0-9]|^- |Error|error" | sed "s/^/$name /"
}

if has diag; then  # DIAG_TRACE=c adds a round of c with every stage step timed (trace-c{c}.txt)
  DIAG_CONC="${DIAG_CONC:-1 16 64}" DIAG_TIMEOUT=200 timeout 220 python3 loadtest/gpu/diag.py --model $MODEL \
    --load-format dummy --deploy-config deploy/qwen3_omni_moe_1gpu.yaml > "$OUT/diag.txt" 2> "$OUT/diag.log"
  echo "diag rc=$?"; cat "$OUT/diag.txt"; grep -E "Error|Traceback" "$OUT/diag.log" | head -3; pack
fi
if has sweep || has distinct || has realtime || has full; then
  live=server-served.log  # kept out of the archive while the server writes it
  start_server served --realtime-max-sessions 160 && {
    has sweep && { chat h200-sweep "${SWEEP_LIMIT:-240}" --prompt-lens 10 160 320 640 --concurrency 1 16 32 64
      pack $live; }
    has distinct && { chat h200-sweep-distinct 90 --prompt-lens 160 --concurrency 64 --distinct-prompts; pack $live; }
    has realtime && { rt h200-realtime --sessions 1 32 64 --turns 3 --mode cancel; pack $live; }
    has full && { rt h200-realtime-full --sessions 32 --turns 1 --mode full --reply-frames "${REPLY_FRAMES:-50}" \
      --reply-tokens 40; pack $live; }
  }
  stop_server; pack
fi
declare -A ABLATION=([profile]="" [no-graphs]="--enforce-eager" [no-async-chunk]="--no-async-chunk"
                     [no-async-output]="--no-async-output" [compile-off]="--compile off"
                     [no-priority]="--no-first-packet-priority"
                     [sync-talker]="--stage-overrides {\"1\":{\"async_scheduling\":false}}"
                     [eager-prefill]="--stage-overrides {\"0\":{\"compiled_prefill\":false},\"1\":{\"compiled_prefill\":false}}")
if has ablation; then
  for row in ${ABLATE:-profile no-graphs no-async-chunk no-async-output compile-off no-priority}; do
    # shellcheck disable=SC2086  # the serve args split on spaces
    PT_LIMIT=${PT_LIMIT:-60} point "ablation-$row" 64 ${ABLATION[$row]}; pack
  done
fi
if has reference; then WARM=1 PT_LIMIT=${REF_LIMIT:-150} point reference 1 --engine reference; pack; fi
if has timeline; then
  start_server timeline --realtime-max-sessions 160 && {
    chat h200-timeline 200 --prompt-lens 160 --concurrency 1 16 64
    [ -n "${TIMELINE_SESSIONS-1 32}" ] && rt h200-realtime-timeline --sessions ${TIMELINE_SESSIONS-1 32} --turns 3 \
      --mode cancel
  }
  stop_server; pack
fi
if has budgets; then
  for b in ${BUDGETS:-1024 2048 8192 16384}; do
    PT_LIMIT=60 point "budget-$b" 64 --stage-overrides \
      "{\"0\":{\"max_num_batched_tokens\":$b},\"1\":{\"max_num_batched_tokens\":$(( b > 8192 ? b : 8192 ))}}"; pack
  done
fi
if has abusive; then
  start_server abusive --realtime-max-sessions 160 && rt h200-realtime-abusive --sessions 32 --turns 3 --mode cancel \
    --abusive 1 --deaf-s 20
  stop_server; pack
fi
