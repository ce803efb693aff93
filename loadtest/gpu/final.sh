#!/usr/bin/env bash
# GPU call: graphed-vs-eager check (tiny), then at prompt 160 the headline server (c 1/16/64), the blog-style
# ablations at c=64 (no async chunk, no async output, no graphs) and the reference engine at c=1, each with a
# server of its own. Results: the `| 160 |` rows on stdout, every file in $OUT/results.tgz.
source loadtest/gpu/common.sh
timeout 100 python3 -m loadtest.gpu_check --num-requests 6 -- --model tiny --dtype float32 > "$OUT/check_tiny.json" 2> "$OUT/check_tiny.log"
echo "tiny check rc=$?"; tr -d "\n " < "$OUT/check_tiny.json" | cut -c1-600; echo

PT_LIMIT=150 point graphs "1 16 64"
point no-async-chunk 64 --no-async-chunk
point no-async-output 64 --no-async-output
WARM=1 point eager 64 --enforce-eager
WARM=1 PT_LIMIT=120 point reference 1 --engine reference
cd "$OUT" && tar czf results.tgz --exclude results.tgz * && find . -type f ! -name results.tgz -delete
