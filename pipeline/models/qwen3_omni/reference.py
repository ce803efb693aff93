"""The baseline engine: transformers' own `generate()`, one request at a time, behind the same API.

It serves the same HTTP routes as OmniEngine so that every benchmark figure can be measured side by
side as a ratio against it. transformers has no streaming: text and audio arrive together at the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import torch

from pipeline.engine.omni import EngineBase
from pipeline.engine.text_events import TextEvents
from pipeline.stage.sampling import SamplingParams
from pipeline.types import (
    AudioChunk,
    EngineStats,
    Event,
    Finished,
    OmniRequest,
    RequestError,
    StageStats,
    Usage,
)


class ReferenceEngine(EngineBase):
    kind = "reference"

    def __init__(self, cfg, models):
        super().__init__(cfg, models)
        self._lock: asyncio.Lock | None = None
        self.num_active_requests = 0

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def stats(self) -> EngineStats:
        """One request at a time: one slot."""
        return EngineStats(self.num_active_requests, [StageStats("thinker", 1 - self.num_active_requests, 1)])

    def abort(self, request_id: str, error: str | None = None) -> None:
        """generate() cannot be interrupted; the request runs to its end."""

    def abort_all(self, error: str) -> None:
        """As `abort`: nothing to interrupt."""

    async def submit(self, req: OmniRequest) -> AsyncIterator[Event]:
        voice = self._check_voice(req)
        if self._is_constrained(req):
            raise RequestError("the reference engine has no constrained decoding (tool_choice required or a "
                               "function, response_format)", "tool_choice" if req.tools else "response_format")
        prompt = await asyncio.to_thread(self.models.encoder.encode, req.messages, self._prompt_tools(req))
        params = self._all_params(req, len(prompt.input_ids))
        th, tk = params["thinker"], params.get("talker")
        self._lock = self._lock or asyncio.Lock()
        return self._run(req, prompt, voice, th, tk)

    async def _run(self, req, prompt, voice, th: SamplingParams, tk: SamplingParams | None) -> AsyncIterator[Event]:
        self.num_active_requests += 1
        try:
            async with self._lock:
                tokens, wav = await asyncio.to_thread(self._generate, prompt, voice, th, tk)
        finally:
            self.num_active_requests -= 1
        eos = set(self.models.thinker.eos_ids)
        text_ids = [t for t in tokens if t not in eos]
        text_out = TextEvents(req.request_id, self.models.tool_parser() if self._prompt_tools(req) else None)
        for ev in text_out.feed(self.models.decode_text(text_ids), text_ids, final=True):
            yield ev
        frames = 0
        if wav is not None and wav.size:
            pcm = (np.clip(wav, -1, 1) * 32767).round().astype("<i2").tobytes()
            yield AudioChunk(req.request_id, pcm, 0)
            frames = (wav.size + self.models.code2wav.tail) // self.models.code2wav.samples_per_frame
        reason = "stop" if tokens and tokens[-1] in eos else "length"
        yield text_out.finished(Finished(req.request_id, reason, Usage(len(prompt.input_ids), len(tokens), frames)))

    @torch.inference_mode()
    def _generate(self, prompt, voice, th: SamplingParams, tk: SamplingParams | None):
        hf, device = self.models.hf, self.models.thinker.device
        ids = torch.tensor([prompt.input_ids], device=device)
        kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if prompt.input_features is not None:
            kw.update(input_features=prompt.input_features.to(device, hf.dtype),
                      feature_attention_mask=prompt.feature_mask.to(device))
        if prompt.pixel_values is not None:
            kw.update(pixel_values=prompt.pixel_values.to(device), image_grid_thw=prompt.image_grid_thw.to(device))
        kw.update(_stage_kwargs("thinker", th))
        kw["thinker_eos_token_id"] = self.models.thinker.eos_ids[0]
        if tk is None:
            out = hf.generate(**kw, return_audio=False)
            seqs = out.sequences if hasattr(out, "sequences") else out
            return seqs[0, ids.shape[1]:].tolist(), None
        kw.update(_stage_kwargs("talker", tk))
        kw["talker_repetition_penalty"] = tk.repetition_penalty
        seqs, wav = hf.generate(**kw, speaker=voice, return_audio=True)
        return seqs[0, ids.shape[1]:].tolist(), wav.reshape(-1).float().cpu().numpy()


def _stage_kwargs(stage: str, p: SamplingParams) -> dict:
    kw = {"max_new_tokens": p.max_tokens, "do_sample": not p.is_greedy}
    if p.min_tokens:
        kw["min_new_tokens"] = p.min_tokens
    if not p.is_greedy:
        kw.update(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or None)
    return {f"{stage}_{k}": v for k, v in kw.items() if v is not None}
