#!/usr/bin/env bash
# GPU call (issue: the engine core process): the headline bench at prompt 160, c 1/16/64, against a server
# with the engine core in its own process (the default) and against one with the engine in the API process,
# each with a server of its own, in the same call. Then the dummy-weight load of one stage alone (what a
# replica worker holds). Results: the `| 160 |` rows on stdout, every file in $OUT/results.tgz.
source loadtest/gpu/common.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
point core "1 16 64"
point inproc "1 16 64" --engine-process inproc
timeout 120 python3 - <<'PY' 2>&1 | grep -v Warning | tail -4
import gc
import torch
from pipeline.config import load_profile
from pipeline.models import load_models
from pipeline.platform import get_platform
cfg = load_profile("deploy/qwen3_omni_moe_1gpu.yaml", "cuda", {"model": "qwen3-omni-30b-a3b", "load_format": "dummy"})
for stages in (("code2wav",), ("talker",), ("thinker", "talker", "code2wav")):
    before = torch.cuda.memory_allocated()
    m = load_models(cfg, get_platform("cuda"), stages)
    print("+".join(stages), "GiB on the GPU:", round((torch.cuda.memory_allocated() - before) / 2**30, 2))
    del m
    gc.collect()
    torch.cuda.empty_cache()
PY
cd "$OUT" && tar czf results.tgz --exclude results.tgz * && find . -type f ! -name results.tgz -delete
