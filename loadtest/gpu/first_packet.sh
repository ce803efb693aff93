#!/usr/bin/env bash
# GPU call (issue 14, item 2): first-packet priority on and off, each with a server of its own (1-GPU profile,
# full-size dummy weights): `omnirt bench` at prompt 160 and c=$CONC (default "64 96"). At c=64 every stage
# holds all its requests in one step (max_num_seqs 64), so only Code2Wav's first-chunk steps differ; at c=96
# the Thinker and Talker also rank who runs (the memory plan's extra slots hold the requests beyond 64).
# After each bench the server's wait counts and batch sizes from /metrics -> $OUT/metrics-NAME.txt.
#   bash loadtest/gpu/first_packet.sh            (CONC=64 for the ablation point alone)
source loadtest/gpu/common.sh
CONC=${CONC:-64 96}

run() {  # run NAME [serve args...]
  local name=$1; shift
  start_server "$name" "$@" || return 1
  timeout "${PT_LIMIT:-300}" python3 -m app.cli bench --model $MODEL --name "h200-first-packet-$name" --out "$OUT" \
    --prompt-lens 160 --concurrency $CONC --requests-per-point 2 --rounds ${ROUNDS:-1} --warmup "${WARM:-2}" 2>&1 \
    | grep -E "^\| 160|Error" | sed "s/^/$name /"
  python3 -c "import httpx; print(httpx.get('http://127.0.0.1:8091/metrics', timeout=10).text)" \
    | grep -E "^omnirt_stage_(first_step_wait_steps|max_wait_steps|deferred_rows|batch_size_(sum|count))" \
    > "$OUT/metrics-$name.txt"
  sed "s/^/$name /" "$OUT/metrics-$name.txt"
  stop_server
}

run on
run off --no-first-packet-priority
