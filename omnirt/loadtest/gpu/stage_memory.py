"""Device memory of each stage's weights loaded alone, as a replica worker loads them, then of all three.

    python -m omnirt.loadtest.gpu.stage_memory --model qwen3-omni-30b-a3b --load-format dummy --deploy-config PROFILE
"""

import gc
import sys

import torch

from omnirt.app.cli import build_parser, engine_options
from omnirt.pipeline.models import load_models, model_spec
from omnirt.pipeline.platform import get_platform
from omnirt.pipeline.profile import engine_config

opts = engine_options(build_parser().parse_args(["serve", *sys.argv[1:]]))
cfg = engine_config(opts, "cuda", model_spec(opts.model))
for stages in (("code2wav",), ("talker",), ("thinker", "talker", "code2wav")):
    before = torch.cuda.memory_allocated()
    models = load_models(cfg, get_platform("cuda"), stages)
    print("+".join(stages), "GiB on the GPU:", round((torch.cuda.memory_allocated() - before) / 2**30, 2), flush=True)
    del models
    gc.collect()
    torch.cuda.empty_cache()
