# Sourced by the GPU scripts: install the carried wheels, keep NVLink multicast off, helpers.
set -u
# once per call (scripts run one after another share it); each call starts with `rm -rf /tmp/site`
if [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.installed || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMNIRT_CACHE=/tmp/omnirt-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
MODEL=qwen3-omni-30b-a3b

start_server() {  # start_server NAME [serve args...]: background server on :8091, wait until healthy (SRC: the
  local name=$1; shift  # source tree it runs from, default this one; ab_builds.sh runs another build's)
  (cd "${SRC:-.}" && PYTHONPATH=${EXTRA_PATH:+$EXTRA_PATH:}/tmp/site:$PWD exec python3 -m app.cli serve --model $MODEL --load-format dummy \
    --deploy-config deploy/qwen3_omni_moe_1gpu.yaml --port 8091 --log-level warning "$@") > "$OUT/server-$name.log" 2>&1 &
  SERVER_PID=$!
  local t0=$(date +%s)
  until python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8091/health',timeout=2).status_code!=200)" 2>/dev/null; do
    kill -0 $SERVER_PID 2>/dev/null || { echo "server $name died"; tail -30 "$OUT/server-$name.log"; return 1; }
    (( $(date +%s) - t0 < ${START_LIMIT:-600} )) || { echo "server $name not ready in ${START_LIMIT:-600} s";
      tail -5 "$OUT/server-$name.log"; stop_server; return 1; }
    sleep 2
  done
  echo "server $name ready after $(( $(date +%s) - t0 )) s"
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | sed "s/^/$name process /"
}

stop_server() { kill $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null; }

bench() {  # bench NAME [bench args...]
  local name=$1; shift
  python3 -m app.cli bench --model $MODEL --name "$name" --out "$OUT" "$@" 2>&1 | tail -20
}

point() {  # point NAME "CONCURRENCY..." [serve args...]: a server of its own, the bench at prompt 160, the rows
  local name=$1 conc=$2; shift 2
  start_server "$name" "$@" || return 1
  timeout "${PT_LIMIT:-200}" python3 -m app.cli bench --model $MODEL --name "h200-$name" --out "$OUT" --prompt-lens 160 \
    --concurrency $conc --requests-per-point 2 --rounds ${ROUNDS:-1} --warmup "${WARM:-2}" 2>&1 | grep -E "^\| 160|Error" | sed "s/^/$name /"
  stop_server
}
