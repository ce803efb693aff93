"""pipecat's own OpenAI Realtime STT service (`OpenAIRealtimeSTTService`, pipecat-ai 1.14) at its defaults against
a real omnirt server on the tiny model, with only the URL changed.

The pipeline is pipecat's usual one for this service: its Silero VAD processor, the STT service, and a sink
(with server VAD on, no VAD processor), fed espeak-ng speech as `InputAudioRawFrame`s at 16 kHz. The service
opens a transcription session (`/v1/realtime?intent=transcription`, then `session.update` with
`type: "transcription"`, model `gpt-realtime-whisper`, language `en` and turn detection off), streams the
audio resampled to 24 kHz, commits the buffer when pipecat's VAD says the user stopped, and turns each
`.completed` into a `TranscriptionFrame` (each `.delta` into an `InterimTranscriptionFrame`). It takes any
`error` event as fatal (and reconnects), so the test also asserts that none came. The tiny model's text is
random tokens: a transcript must arrive, not any given words.
"""

from __future__ import annotations

import asyncio

import pytest
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    InterimTranscriptionFrame,
    TranscriptionFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.audio.vad_processor import VADProcessor
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.stt import OpenAIRealtimeSTTService
from pipecat.workers.runner import WorkerRunner

from omnirt.app.audio.pcm import float_to_pcm16
from omnirt.app.audio.resample import resample
from tests.conftest import HANG_GUARD_S, until
from tests.realtime_helpers import espeak_utterance

RATE, CHUNK_MS = 16000, 20  # what a pipecat transport delivers


class Recorder(FrameProcessor):
    """Keeps the transcription and error frames that pass it (either way) and lets every frame through."""

    def __init__(self):
        super().__init__()
        self.frames: list[Frame] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, TranscriptionFrame | InterimTranscriptionFrame | ErrorFrame):
            self.frames.append(frame)
        await self.push_frame(frame, direction)

    def of(self, kind: type) -> list[Frame]:
        return [f for f in self.frames if type(f) is kind]


@pytest.mark.parametrize("server_vad", [False, True], ids=["pipecat-vad", "server-vad"])
async def test_pipecat_realtime_stt_gets_transcripts_from_omnirt(server, tmp_path, server_vad):
    """At its defaults (pipecat's VAD commits each turn), and with `turn_detection={"type": "server_vad"}`
    (omnirt's VAD finds the turns; no VAD in the pipeline)."""
    pcm = float_to_pcm16(resample(espeak_utterance(tmp_path)[0], 24000, RATE))
    url = f"ws://127.0.0.1:{server.port}/v1/realtime"
    stt = OpenAIRealtimeSTTService(api_key="unused", base_url=url, turn_detection={"type": "server_vad"}) \
        if server_vad else OpenAIRealtimeSTTService(api_key="unused", base_url=url)
    head, tail = Recorder(), Recorder()  # head: the errors pushed upstream; tail: the transcripts
    vad = [] if server_vad else [VADProcessor(vad_analyzer=SileroVADAnalyzer())]
    worker = PipelineWorker(Pipeline([head, *vad, stt, tail]), cancel_on_idle_timeout=False)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    try:
        # pipecat sends its session.update once omnirt's session.created arrives; the audio waits for the answer
        await until(lambda: stt._session_ready or head.of(ErrorFrame), "pipecat's transcription session configured")
        step = RATE * CHUNK_MS // 1000 * 2
        for i in range(0, len(pcm), step):
            await worker.queue_frame(InputAudioRawFrame(audio=pcm[i:i + step], sample_rate=RATE, num_channels=1))
        await until(lambda: tail.of(TranscriptionFrame) or head.of(ErrorFrame), "a TranscriptionFrame")
    finally:
        await worker.queue_frame(EndFrame())
        await asyncio.wait_for(running, HANG_GUARD_S)
    assert not head.of(ErrorFrame) and not tail.of(ErrorFrame), [f.error for f in head.of(ErrorFrame)]
    final = tail.of(TranscriptionFrame)[0]
    assert isinstance(final.text, str) and final.text
    assert final.result["type"] == "conversation.item.input_audio_transcription.completed"
    assert final.result["usage"]["output_tokens"] >= 1
    assert "".join(f.text for f in tail.of(InterimTranscriptionFrame)).startswith(final.text)
