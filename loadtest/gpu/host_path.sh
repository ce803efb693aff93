#!/usr/bin/env bash
# GPU calls (issues 13 and 15): one H200, full-size dummy weights, 1-GPU profile. PARTS picks what runs, in
# this order (default: all):
#   parity  hf_parity.py: the served engine against transformers' generate() on the same weights, 5 prompts
#           (2 text, 2 spoken, 1 image), 16 text tokens and 8 codec frames -> $OUT/hf-parity.json;
#   diag    step times per stage and req/s at c=1/16/64 in process (diag.py), as served; with SPY=1 a py-spy
#           record of every thread during the c=64 round -> $OUT/pyspy-served.txt (raw, one line per stack);
#   switch  the same with the interpreter's GIL switch interval at SWITCH_MS (default 0.5 ms, Python's 5);
#   bench   `omnirt bench` against a server as served, prompt 160, c=1/16/64;
#   procs   the same with Code2Wav, then Talker and Code2Wav, in worker processes of their own on the same GPU
#           (`own_process`: their host work out of the engine core's interpreter lock);
#   c2w     c2w_variants.py: Code2Wav eager / cuDNN benchmark / compiled / compiled+graphs at b=16 and 64.
source loadtest/gpu/common.sh
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
PARTS=${PARTS:-parity diag switch bench}
has() { [[ " $PARTS " == *" $1 "* ]]; }
ARGS=(--model $MODEL --load-format dummy --deploy-config deploy/qwen3_omni_moe_1gpu.yaml)

diag() {  # diag NAME [SWITCH_MS] [SPY]: diag.py in the background, py-spy on its c=64 round when SPY is 1
  local name=$1 spy=${3:-}
  SWITCH_MS=${2:-} DIAG_CONC="1 16 64" DIAG_TIMEOUT=200 timeout ${LIMIT:-200} python3 loadtest/gpu/diag.py "${ARGS[@]}" > "$OUT/diag-$name.txt" \
    2> "$OUT/diag-$name.log" &
  local pid=$!
  if [ "$spy" = 1 ]; then
    until grep -q "^c=16" "$OUT/diag-$name.txt" 2>/dev/null || ! kill -0 $pid 2>/dev/null; do sleep 0.5; done
    /tmp/site/bin/py-spy record -p $pid -d 12 -r 50 -f raw --threads -o "$OUT/pyspy-$name.txt" \
      > "$OUT/pyspy-$name.log" 2>&1 || tail -3 "$OUT/pyspy-$name.log"
  fi
  wait $pid
  echo "diag $name rc=$?"
  grep -v "graph/s" "$OUT/diag-$name.txt"
  grep -E "capture failed|Error" "$OUT/diag-$name.log" | head -3
}

if has parity; then
  timeout ${PARITY_LIMIT:-240} python3 loadtest/gpu/hf_parity.py -- "${ARGS[@]}" > "$OUT/hf-parity.json" \
    2> "$OUT/hf-parity.log"
  echo "hf_parity rc=$?"
  python3 -c "import json; d=json.load(open('$OUT/hf-parity.json')); print(json.dumps(d))" || tail -5 "$OUT/hf-parity.log"
fi
has diag && diag served "" "${SPY:-}"
has switch && diag switch "${SWITCH_MS:-0.5}"
if has bench; then
  PT_LIMIT=${PT_LIMIT:-200} point served "1 16 64"
fi
if has procs; then
  PT_LIMIT=${PT_LIMIT:-200} point c2w-process "1 16 64" --stage-overrides '{"2": {"own_process": true}}'
  PT_LIMIT=${PT_LIMIT:-200} point speech-processes "1 16 64" \
    --stage-overrides '{"1": {"own_process": true}, "2": {"own_process": true}}'
fi
if has c2w; then
  timeout ${C2W_LIMIT:-200} python3 loadtest/gpu/c2w_variants.py --shapes ${C2W_SHAPES:-16x50 64x50} \
    > "$OUT/c2w-variants.jsonl" 2> "$OUT/c2w-variants.log"
  echo "c2w_variants rc=$?"; cat "$OUT/c2w-variants.jsonl"; grep -E "Error" "$OUT/c2w-variants.log" | tail -3
fi
