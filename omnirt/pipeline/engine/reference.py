"""The baseline engine: the model's own reference implementation (transformers' `generate()`), one request at a
time, behind the same API as `OmniEngine`, so that every benchmark figure can be measured side by side as a
ratio against it. It shares the engine's request rules, not its code: transformers has no streaming, so text and
audio arrive together at the end, and nothing can be interrupted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from omnirt.pipeline.config import EngineConfig
from omnirt.pipeline.engine.rules import RequestRules
from omnirt.pipeline.engine.text_events import TextEvents
from omnirt.pipeline.stage.graph import LoadedModels
from omnirt.pipeline.stage.sampling import SamplingParams
from omnirt.pipeline.types import (
    AudioChunk,
    EngineInfo,
    EngineStats,
    Event,
    Finished,
    OmniRequest,
    RequestError,
    StageStats,
    Usage,
)


class ReferenceEngine:
    def __init__(self, cfg: EngineConfig, models: LoadedModels):
        self.models = models
        self.rules = RequestRules(cfg, models)
        self._lock: asyncio.Lock | None = None
        self.num_active_requests = 0

    def info(self) -> EngineInfo:
        return self.rules.info("reference")

    def start(self) -> None:
        """Nothing to start: each request calls generate() in a worker thread."""

    def stop(self) -> None:
        """Nothing runs between requests."""

    def stats(self) -> EngineStats:
        """One request at a time: one slot, in the first stage."""
        first = self.models.graph.names[0]
        return EngineStats(self.num_active_requests, [StageStats(first, 1 - self.num_active_requests, 1)])

    def abort(self, request_id: str, error: str | None = None) -> None:
        """generate() cannot be interrupted; the request runs to its end."""

    def abort_all(self, error: str) -> None:
        """As `abort`: nothing to interrupt."""

    def check_admission(self, wants_audio: bool = True) -> None:
        """Every request is admitted: they wait their turn."""

    async def submit(self, req: OmniRequest) -> AsyncIterator[Event]:
        if req.prefill_only:  # it keeps no KV between requests: nothing to prepare
            return self._nothing(req)
        voice = self.rules.check_voice(req)
        if self.rules.is_constrained(req):
            raise RequestError("the reference engine has no constrained decoding (tool_choice required or a "
                               "function, response_format)", "tool_choice" if req.tools else "response_format")
        prompt = await asyncio.to_thread(self.models.encoder.encode, req.messages, self.rules.prompt_tools(req))
        params = self.rules.all_params(req, len(prompt.input_ids))
        self._lock = self._lock or asyncio.Lock()
        return self._run(req, prompt, voice, params)

    @staticmethod
    async def _nothing(req: OmniRequest) -> AsyncIterator[Event]:
        yield Finished(req.request_id, "length", Usage())

    async def _run(self, req: OmniRequest, prompt, voice: str | None,
                   params: dict[str, SamplingParams]) -> AsyncIterator[Event]:
        self.num_active_requests += 1
        try:
            async with self._lock:
                out = await asyncio.to_thread(self.models.generate, prompt, voice, params)
        finally:
            self.num_active_requests -= 1
        text_out = TextEvents(req.request_id, self.models.tool_parser() if self.rules.prompt_tools(req) else None)
        text = self.models.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        for ev in text_out.feed(text, out.token_ids, final=True):
            yield ev
        if out.pcm16:
            yield AudioChunk(req.request_id, out.pcm16, 0)
        usage = Usage(len(prompt.input_ids), out.num_tokens, out.num_frames,
                      prompt_audio_tokens=prompt.num_audio_tokens, prompt_image_tokens=prompt.num_image_tokens)
        yield text_out.finished(Finished(req.request_id, "stop" if out.stopped else "length", usage))
