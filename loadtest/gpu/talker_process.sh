#!/usr/bin/env bash
# GPU call (issue: the engine core process, "a stage in another process costs little"): c=64 at prompt 160
# with every stage in the engine core, then with the Talker in a worker process of its own on the same GPU
# (`own_process`), each with a server of its own, in the same call.
source loadtest/gpu/common.sh
point inline 64
point talker-worker 64 --stage-overrides '{"1": {"own_process": true}}'
cd "$OUT" && tar czf results.tgz --exclude results.tgz * && find . -type f ! -name results.tgz -delete
