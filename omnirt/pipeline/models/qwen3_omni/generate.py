"""transformers' own `generate()` on a Qwen3-Omni prompt: what the reference engine
(`omnirt/pipeline/engine/reference.py`) serves as the baseline, and what the GPU parity check compares the engine
with."""

from __future__ import annotations

import numpy as np
import torch

from omnirt.pipeline.models.qwen3_omni.code2wav import pcm16
from omnirt.pipeline.models.qwen3_omni.prompt import EncodedPrompt
from omnirt.pipeline.models.qwen3_omni.stages import TALKER, THINKER
from omnirt.pipeline.stage.graph import Generated
from omnirt.pipeline.stage.sampling import SamplingParams


def prompt_kwargs(hf, prompt: EncodedPrompt, device: torch.device) -> dict:
    """The encoded prompt as `generate()` takes it: ids, mask, audio features and image patches."""
    ids = torch.tensor([prompt.input_ids], device=device)
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if prompt.input_features is not None:
        kw.update(input_features=prompt.input_features.to(device, hf.dtype),
                  feature_attention_mask=prompt.feature_mask.to(device))
    if prompt.pixel_values is not None:
        kw.update(pixel_values=prompt.pixel_values.to(device), image_grid_thw=prompt.image_grid_thw.to(device))
    return kw


def sampling_kwargs(stage: str, p: SamplingParams) -> dict:
    """One stage's sampling as `generate()`'s prefixed arguments (`thinker_max_new_tokens`, ...)."""
    kw = {"max_new_tokens": p.max_tokens, "do_sample": not p.is_greedy}
    if p.min_tokens:
        kw["min_new_tokens"] = p.min_tokens
    if not p.is_greedy:
        kw.update(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or None)
    return {f"{stage}_{k}": v for k, v in kw.items() if v is not None}


@torch.inference_mode()
def generate(models, prompt: EncodedPrompt, voice: str | None, params: dict[str, SamplingParams]) -> Generated:
    """The whole reply at once: text tokens, and with a voice the waveform and its codec frames."""
    hf, thinker = models.hf, models.thinker
    kw = prompt_kwargs(hf, prompt, thinker.device) | sampling_kwargs(THINKER, params[THINKER])
    kw["thinker_eos_token_id"] = thinker.eos_ids[0]
    if voice is None:
        out = hf.generate(**kw, return_audio=False)
        seqs, wav = (out.sequences if hasattr(out, "sequences") else out), None
    else:
        talker = params[TALKER]
        kw |= sampling_kwargs(TALKER, talker) | {"talker_repetition_penalty": talker.repetition_penalty}
        seqs, wav = hf.generate(**kw, speaker=voice, return_audio=True)
    tokens = seqs[0, len(prompt.input_ids):].tolist()
    eos = set(thinker.eos_ids)
    pcm = np.zeros(0, np.float32) if wav is None else wav.reshape(-1).float().cpu().numpy()
    frames = (pcm.size + models.code2wav.tail) // models.code2wav.samples_per_frame if pcm.size else 0
    return Generated([t for t in tokens if t not in eos], len(tokens), bool(tokens) and tokens[-1] in eos,
                     pcm16(pcm), frames)
