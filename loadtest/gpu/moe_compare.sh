#!/usr/bin/env bash
# GPU call (issue 13, item 3): the fused Triton MoE kernels against grouped_mm on the device.
#   1. tests/test_moe.py compiled: the kernels against transformers' eager experts (fp32 and bf16);
#   2. moe_check.py: both full-size MoE blocks at b=1/16/64, every implementation captured and replayed on
#      new routing, ms per call, GB/s over the hit experts' weights, then the markdown table.
source loadtest/gpu/common.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_moe.py 2>&1 | tail -4
timeout 240 python3 loadtest/gpu/moe_check.py > "$OUT/moe-check.txt" 2> "$OUT/moe-check.log"
echo "moe_check rc=$?"
grep '^{' "$OUT/moe-check.txt" > "$OUT/h200-moe-check.jsonl"
sed -n '/^ms per block call/,$p' "$OUT/moe-check.txt"
tail -5 "$OUT/moe-check.log"
