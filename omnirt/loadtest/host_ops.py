"""Host work of a step's new requests, counted on the CPU with the tiny model: the tensor ops (each a kernel
launch or more on a GPU) that build 64 new requests' Thinker states and Talker prompts, and the time to encode
each turn of a voice conversation (every turn carries the earlier turns' audio again).

    python -m omnirt.loadtest.host_ops
"""

from __future__ import annotations

import time
import types

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omnirt.pipeline.models import load_models
from omnirt.pipeline.models.qwen3_omni.stages import STAGES
from omnirt.pipeline.models.qwen3_omni.talker import TalkerState
from omnirt.pipeline.models.qwen3_omni.thinker import ThinkerInput, ThinkerRows
from omnirt.pipeline.platform import get_platform
from omnirt.pipeline.profile import DEPLOY_DIR, load_profile

NUM_REQUESTS = 64


class OpCount(TorchDispatchMode):
    """Counts the tensor ops dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _counted(fn) -> int:
    with torch.inference_mode(), OpCount() as ops:
        fn()
    return ops.count


def thinker_ops(models, prompt) -> int:
    reqs = [types.SimpleNamespace(state=ThinkerInput(prompt, True), num_computed_tokens=0)
            for _ in range(NUM_REQUESTS)]
    return _counted(lambda: models.thinker.prepare(reqs))


def talker_ops(models, prompt) -> int:
    width, n = models.hf.config.thinker_config.text_config.hidden_size, len(prompt.input_ids)
    states = []
    for _ in range(NUM_REQUESTS):
        st = TalkerState(models.voices["ethan"], prompt.input_ids, None, None)
        st.add(ThinkerRows(prompt_embeds=torch.randn(n, width), prompt_hidden=torch.randn(n, width)))
        st.add(ThinkerRows(token_embed=torch.randn(width)))
        models.talker.plan_prompt(st)
        states.append(st)
    return _counted(lambda: models.talker.prepare([types.SimpleNamespace(state=st) for st in states]))


def turn_encoding_ms(encoder, seed: int, turns: int = 6, seconds: float = 2.0) -> list[float]:
    """Milliseconds to encode each turn of a conversation of `seconds`-long spoken turns."""
    rng, conversation, out = np.random.default_rng(seed), [{"role": "system", "content": "You are helpful."}], []
    for turn in range(turns):
        audio = (rng.standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32)
        conversation.append({"role": "user", "content": [{"type": "audio", "audio": audio}]})
        started = time.perf_counter()
        encoder.encode(conversation)
        out.append(1e3 * (time.perf_counter() - started))
        conversation.append({"role": "assistant", "content": f"An answer to turn {turn + 1}."})
    return out


def main() -> None:
    torch.set_num_threads(1)
    models = load_models(load_profile(DEPLOY_DIR / "tiny.yaml", "cpu", STAGES), get_platform("cpu"))
    prompt = models.encoder.encode([{"role": "user", "content": "hello " * 150}])
    models.encoder.encode([{"role": "user", "content": "warm-up"}])
    print(f"{NUM_REQUESTS} new requests of {len(prompt.input_ids)} tokens: Thinker states "
          f"{thinker_ops(models, prompt)} tensor ops, Talker prompts {talker_ops(models, prompt)} tensor ops")
    runs = np.array([turn_encoding_ms(models.encoder, seed) for seed in range(7)])
    print("voice conversation, 2 s per spoken turn: encoding ms per turn (median of 7 conversations) "
          + ", ".join(f"{ms:.1f}" for ms in np.median(runs, axis=0)))


if __name__ == "__main__":
    main()
