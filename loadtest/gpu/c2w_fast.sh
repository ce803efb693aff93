#!/usr/bin/env bash
# GPU call (issue 14, items 1 and 3): one H200, full-size dummy weights, 1-GPU profile. PARTS picks what runs,
# in this order (default: all):
#   variants  c2w_variants.py at full size, every variant (or C2W_VARIANTS) at batch 1/16/64 (or C2W_SHAPES),
#             25 new + 25 context frames
#             -> $OUT/c2w-variants.jsonl;
#   bench     `omnirt bench` at prompt 160, c=1 and c=64, one server per row of ROWS (default: fast c2w-eager
#             no-priority fixed-ramp): `fast` the profile as shipped (Code2Wav's Triton kernels in graphs, adaptive
#             pacing, first-packet priority),
#             `c2w-graphs` with graphs of the compiled Code2Wav (its start-up took over 4 min on an H200: set
#             START_LIMIT), `c2w-graphs-no-compile` graphs of the uncompiled one, `gemm` / `channels-last` its
#             convolutions re-expressed, `fixed-ramp` the doubling ramp instead of adaptive pacing,
#             `no-priority` first-packet priority off, `before` both off, `triton`
#             SnakeBeta fused into Code2Wav's convolutions with graphs of the uncompiled decoder, `triton-eager` the
#             same without graphs, `c2w-eager` Code2Wav eager with transformers' convolutions (the profile before
#             the Triton kernels); server
#             logs at info: start-up's Code2Wav graph memory, each reply's chunk decisions. A command may run
#             600 s: split PARTS / ROWS over calls.
source loadtest/gpu/common.sh
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
PARTS=${PARTS:-variants bench}
has() { [[ " $PARTS " == *" $1 "* ]]; }
C2W_GRAPHS='{"2":{"enforce_eager":false}}'  # no spaces: the serve args below split on them
C2W_GRAPHS_NO_COMPILE='{"2":{"enforce_eager":false,"compile":"off"}}'
C2W_EAGER='{"2":{"enforce_eager":true}}'
FIXED_RAMP=$(mktemp --suffix .yaml)
sed 's/codec_chunk_pacing: adaptive/codec_chunk_pacing: fixed/' deploy/qwen3_omni_moe_1gpu.yaml > "$FIXED_RAMP"

row() {  # row NAME [serve args...]: c=1 and c=64 against a server of its own, with its chunk/graph log lines
  local name=$1; shift
  PT_LIMIT=${PT_LIMIT:-240} point "$name" "1 64" --log-level info "$@"
  grep -E "code2wav: (graphs captured|convolutions)|graphs captured on" "$OUT/server-$name.log" | sed "s/^/$name /"
  grep -c "least audio queued" "$OUT/server-$name.log" | sed "s/^/$name replies logged: /"
}

if has variants; then
  # shellcheck disable=SC2086  # the lists split on spaces
  timeout ${C2W_LIMIT:-300} python3 loadtest/gpu/c2w_variants.py --shapes ${C2W_SHAPES:-1x50 16x50 64x50} \
    ${C2W_VARIANTS:+--variants $C2W_VARIANTS} ${C2W_PROFILE:+--profile $C2W_PROFILE} \
    > "$OUT/c2w-variants.jsonl" 2> "$OUT/c2w-variants.log"
  echo "c2w_variants rc=$?"; cat "$OUT/c2w-variants.jsonl"; grep -E "Error" "$OUT/c2w-variants.log" | tail -3
fi
declare -A SERVE=([fast]="" [gemm]="--conv-backend gemm" [channels-last]="--conv-backend channels_last"
                  [c2w-graphs]="--stage-overrides $C2W_GRAPHS"
                  [c2w-graphs-no-compile]="--stage-overrides $C2W_GRAPHS_NO_COMPILE"
                  [fixed-ramp]="--deploy-config $FIXED_RAMP" [no-priority]="--no-first-packet-priority"
                  [before]="--deploy-config $FIXED_RAMP --no-first-packet-priority"
                  [triton]="--conv-backend triton --stage-overrides $C2W_GRAPHS_NO_COMPILE"
                  [triton-eager]="--conv-backend triton"
                  [c2w-eager]="--conv-backend native --stage-overrides $C2W_EAGER")
if has bench; then
  for name in ${ROWS:-fast c2w-eager no-priority fixed-ramp}; do
    # shellcheck disable=SC2086  # the serve args split on spaces
    row "$name" ${SERVE[$name]}
  done
fi
