#!/usr/bin/env bash
# GPU call (issue: voice sessions at scale): the issue's Realtime targets on one server of this build, one point per
# bench run so that a call cut short still brings back the points it finished, most wanted first (POINTS, default
# "32 64 1 full32"): N sessions of 3 turns cancelled at first audio, then 32 sessions of whole replies capped at 50
# frames and 40 text tokens; "cN" is a chat point instead (`omnirt bench`, prompt 160, concurrency N, 2 warm-up
# requests). A point may come twice (POINTS="32 64 32": a fresh server's first point against a later
# one). Each point's files go into $OUT/results.tar as it ends (a call brings back 8 files), named by its place.
# After each point: the Triton kernels and inductor files written during it (a compile while serving holds the
# engine's interpreter lock), beside the engine's steps and device allocations that the bench's report lists.
source loadtest/gpu/common.sh
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
# SERVE_ARGS: more server flags (e.g. "--step-log $OUT/steps.log"); BENCH_ARGS, CHAT_ARGS: more flags of every
# voice point, every chat point (e.g. "--distinct-prompts")
START_LIMIT=${START_LIMIT:-300} start_server targets --realtime-max-sessions 160 ${SERVE_ARGS:-} || exit 1
compiled_since() {  # compiled_since POINT: what the compilers wrote since the last call, then a new mark
  local triton=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
  echo "$1 compiled: $(find "$triton" -name '*.json' ! -name '__grp__*' -newer /tmp/mark 2>/dev/null | wc -l) Triton" \
    "kernels ($(find "$triton" -name '*.json' ! -name '__grp__*' -newer /tmp/mark -exec basename {} .json \; \
    2>/dev/null | sort | uniq -c | sort -rn | head -5 | tr -s ' \n' ' ')), $(find $TORCHINDUCTOR_CACHE_DIR -type f \
    -newer /tmp/mark 2>/dev/null | wc -l) inductor files"
  touch /tmp/mark
}
touch /tmp/mark
i=0
for point in ${POINTS:-32 64 1 full32}; do
  i=$((i + 1))
  case $point in c*) name=h200-chat-$i-$point ;; *) name=h200-realtime-$i-$point ;; esac
  echo "$point from $(date +%s.%N)"  # the point's span, to cut a --step-log by
  case $point in
    c*) timeout "${PT_LIMIT:-150}" python3 -m app.cli bench --model $MODEL --prompt-lens 160 \
          --concurrency "${point#c}" --requests-per-point 2 --rounds 1 --warmup 2 ${CHAT_ARGS:-} --name $name --out "$OUT" 2>&1 \
          | grep -E "^\| 160|Error" | sed "s/^/$point /" ;;
    *) case $point in
         full*) n=${point#full} args=(--mode full --reply-frames 50 --reply-tokens 40) ;;
         *) n=$point args=(--mode cancel) ;;
       esac
       timeout "${PT_LIMIT:-150}" python3 -m app.cli bench realtime --url http://127.0.0.1:8091 --model $MODEL \
         --sessions "$n" --turns 3 --clients 8 --turn-timeout 30 "${args[@]}" ${BENCH_ARGS:-} --name $name \
         --out "$OUT" 2>&1 | grep -E "^\| [0-9]|^- |Error|error" | grep -v "^| sessions" | sort -u | sed "s/^/$point /" ;;
  esac
  echo "$point until $(date +%s.%N)"
  grep -h "engine steps" "$OUT/$name.md" 2>/dev/null | sed "s/^/$point /"
  compiled_since "$point"
  (cd "$OUT" && ls $name.* >/dev/null 2>&1 && tar rf results.tar $name.* && rm -f $name.*)
done
stop_server
tr '\r' '\n' < "$OUT/server-targets.log" | grep -E "100%|engine ready|Traceback|Error" | sort -u | head -40 \
  > "$OUT/server-startup.txt"
