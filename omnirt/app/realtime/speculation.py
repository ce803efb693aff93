"""Prefill while the user speaks: each time the turn's audio settles one more window of the model's audio encoder
(`EngineInfo.num_settled_windows`: 8 s in Qwen3-Omni), a `prefill_only` request prefills the conversation and the
audio heard so far. Its KV stays resident, and the turn's response at `speech_stopped` starts from it (prefix
reuse), encoding and prefilling only the last window and the turn's closing tokens; its `usage` counts the reused
part in `cached_tokens`. The engine keys audio per encoder window, so what is reused is exactly what a whole prefill
computes (or, where a louder later part moved the features' clamp, nothing of the audio: see
`omnirt/pipeline/models/qwen3_omni/audio_windows.py`).

A speculative request is sent only while a Thinker slot is free (resident ones count) and no request waits for
one, so it never makes a reply wait for a slot; it holds that slot only while it prefills, served after every
request owed output, and then parks it resident (free). A newer window supersedes the running one, and a turn that
ends or is abandoned (buffer cleared or committed, VAD turned off, session closed) aborts it: what it computed
stays resident, for reuse or for eviction, least recently used first, as free slots are.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import cached_property

from omnirt.app.realtime.events import new_id
from omnirt.pipeline.api import EngineClient, EngineDeadError, EngineInfo, EngineOverloaded, OmniRequest, RequestError

log = logging.getLogger(__name__)


class Speculation:
    """A session's speculative prefills for its turn in progress (at most one running)."""

    def __init__(self, engine: EngineClient, log_ids: dict):
        self.engine, self.log_ids = engine, log_ids
        self.num_windows = 0  # settled windows of the turn in progress already sent
        self.num_sent = 0  # speculative requests sent by this session
        self.request_id: str | None = None
        self._task: asyncio.Task | None = None

    @cached_property
    def info(self) -> EngineInfo:  # static: asked once, not on every 20 ms of audio
        return self.engine.info()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def heard(self, num_samples: int, sample_rate: int, request: Callable[[str], OmniRequest]) -> None:
        """The turn has `num_samples` samples at `sample_rate`: send `request(request_id)` if they settle a
        window more than the last one sent."""
        windows = self.info.num_settled_windows(num_samples * self.info.input_sample_rate // sample_rate)
        if windows <= self.num_windows:
            return
        self.num_windows = windows
        self.cancel()
        if not self._has_room():
            return
        req = request(new_id("prefill"))
        self.request_id, self.num_sent = req.request_id, self.num_sent + 1
        self._task = asyncio.create_task(self._drain(self.engine.submit(req)), name=f"speculate-{req.request_id}")

    def _has_room(self) -> bool:
        """A Thinker slot is free and no request waits: speculation must never take a reply's place."""
        try:
            self.engine.check_admission(wants_audio=False)
        except EngineOverloaded:
            return False
        thinker = self.engine.stats().stages[0]  # stages in graph order: the Thinker first
        return thinker.free_slots > 0 and not thinker.waiting and not thinker.admission_waiting

    async def _drain(self, submitted) -> None:
        """Its events (`Finished` alone). A refusal (a conversation past the context, say) only costs the
        speed-up; a dead engine is the turn's response's to report."""
        try:
            async for _ in await submitted:
                pass
        except (RequestError, EngineOverloaded, EngineDeadError) as exc:
            log.debug("speculative prefill not run: %s", exc, extra=self.log_ids)

    def cancel(self) -> None:
        """Abort the running one (what it computed stays resident)."""
        if self.is_running:
            self.engine.abort(self.request_id)

    def end_turn(self) -> None:
        """The turn ended or was abandoned: nothing more for it."""
        self.cancel()
        self.num_windows = 0
