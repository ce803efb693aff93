#!/usr/bin/env bash
# GPU call (issue 17, the agent parts): one H200, full-size dummy weights, 1-GPU profile.
# 1. grammar_check.py: the grammar mask inside a captured graph at the released vocabulary, its device cost per
#    batch, the host cost of filling the masks (synthetic vocabulary of the released size) -> grammar-kernels.jsonl;
# 2. one server: CONC concurrent chat requests free, with a json_schema response format and with
#    tool_choice "required" (validity against the schema, tokens/s) -> grammar-serve.jsonl;
# 3. the same server: reply latency (`speech_stopped` -> first audio delta) with and without transcripts of the
#    user in one run (`omnirt bench realtime --transcription both`), MODES cancel (each reply cancelled at its
#    first audio) and full (whole replies: underruns while a transcription shares the Thinker), SESSIONS 1 32.
source loadtest/gpu/common.sh
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
timeout 300 python3 loadtest/gpu/grammar_check.py > "$OUT/grammar-kernels.jsonl" 2> "$OUT/grammar-kernels.log"
cat "$OUT/grammar-kernels.jsonl"
start_server agent --realtime-max-sessions 160 || exit 1
timeout 300 python3 loadtest/gpu/grammar_check.py --skip-kernels --url http://127.0.0.1:8091 --model $MODEL \
  --concurrency ${CONC:-64} > "$OUT/grammar-serve.jsonl" 2> "$OUT/grammar-serve.log"
cat "$OUT/grammar-serve.jsonl"
for mode in ${MODES:-cancel full}; do
  for n in ${SESSIONS:-1 32}; do
    timeout ${POINT_LIMIT:-300} python3 -m app.cli bench realtime --url http://127.0.0.1:8091 --model $MODEL \
      --sessions $n --turns 3 --mode $mode --clients 8 --transcription both --name "h200-transcripts-$mode-$n" \
      --out "$OUT" 2>&1 | grep -E "^\| [0-9]|Error|error"
  done
done
stop_server
cd "$OUT" && tar czf results.tgz --exclude results.tgz * && find . -type f ! -name results.tgz -delete
