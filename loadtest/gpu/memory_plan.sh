#!/usr/bin/env bash
# GPU call (issue 15, memory from the device): one H200, full-size dummy weights, 1-GPU profile
# (gpu_memory_utilization 0.9). Prints the start-up memory plan (weights, KV per stage, graphs/workspace
# estimate, headroom) and what graph capture measured; the free memory after start-up (torch's view and
# nvidia-smi's); the same after a burst of requests at c=64, which brings the prefill and vocoder
# workspaces in (the estimate covers them); then two starts that must fail, each naming its key and the
# numbers: the whole engine in half the device, and the Thinker in 30 % of it. ~6 min. PARTS picks
# (default "plan fail"): plan = the server, its plan, the burst; fail = the two starts that must fail.
source loadtest/gpu/common.sh
PARTS=${PARTS:-plan fail}
free_now() { nvidia-smi --query-gpu=memory.used,memory.free,memory.total --format=csv,noheader | sed "s/^/$1: used, free, total /"; }

if [[ " $PARTS " == *" plan "* ]]; then
start_server plan --log-level info || exit 1
grep -E "omnirt.memory|KV cache:" "$OUT/server-plan.log" | sed -E "s/^[^ ]+ (INFO|WARNING) //"
free_now "after start-up"
timeout 200 python3 -m app.cli bench --model $MODEL --name h200-memory-plan --out "$OUT" --prompt-lens 160 512 \
  --concurrency 64 --requests-per-point 64 --rounds 1 --warmup 2 2>&1 | grep -E "^\| [0-9]|Error" | sed "s/^/burst /"
free_now "after 64 concurrent requests"
python3 -c "import httpx; print('\n'.join(l for l in httpx.get('http://127.0.0.1:8091/metrics').text.splitlines()
            if l.startswith('omnirt_stage_free_slots')))"
stop_server
fi

must_fail() {  # must_fail NAME [serve args...]: the start fails (exit 1) with one error line naming the key
  local name=$1; shift
  timeout 300 python3 -m app.cli serve --model $MODEL --load-format dummy --deploy-config deploy/qwen3_omni_moe_1gpu.yaml \
    --port 8091 --log-level warning "$@" > "$OUT/server-$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc (expected 1): $(grep -E '^omnirt: ' "$OUT/server-$name.log" | tail -1)"
}
if [[ " $PARTS " == *" fail "* ]]; then
  must_fail half --gpu-memory-utilization 0.5
  must_fail thinker-30 --stage-overrides '{"thinker": {"gpu_memory_utilization": 0.3}}'
fi
cd "$OUT" && tar czf results.tgz --exclude results.tgz * && find . -type f ! -name results.tgz -delete
