"""Where does device memory go at start-up? Loads the engine as `serve` would and reports."""
import logging
import sys

import torch

from app.cli import build_parser, engine_options
from pipeline.serving.core import build_engine

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
engine = build_engine(engine_options(build_parser().parse_args(["serve", *sys.argv[1:]])))
print("after capture GiB", torch.cuda.memory_allocated() / 2**30, "reserved", torch.cuda.memory_reserved() / 2**30)
models = engine.models
print({n: len(g) for n, g in [("thinker", models.thinker.cuda_graphs), ("talker", models.talker.decode_graphs),
                              ("predictor", models.talker.predictor_graphs)]})
engine.stop()
