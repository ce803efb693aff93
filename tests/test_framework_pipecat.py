"""pipecat's `OpenAIRealtimeLLMService` against a real server, in a pipecat pipeline (user context aggregator,
the service, a frame recorder, assistant aggregator) at the service's defaults (its model name, OpenAI's
server VAD) with only `base_url` changed. A text turn from the context, a spoken turn ended by the server's
turn detection, a function pipecat runs, and a barge-in that cuts an answer; no `error` event reaches
pipecat (it treats one as fatal) and it logs no error."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import pytest
from loguru import logger
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
from pipecat.frames.frames import InputAudioRawFrame, LLMRunFrame, TTSAudioRawFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.llm_service import FunctionCallParams
from pipecat.services.openai.realtime import events, llm
from pipecat.workers.runner import WorkerRunner

from tests.framework_helpers import API_KEY, WireTap, speak
from tests.realtime_helpers import LEAD_S

# What pipecat's own example (examples/realtime/realtime-openai.py) sets: transcription, semantic VAD, noise reduction
EXAMPLE = {"audio": events.AudioConfiguration(input=events.AudioInput(
    transcription=events.InputAudioTranscription(), turn_detection=events.SemanticTurnDetection(),
    noise_reduction=events.InputAudioNoiseReduction(type="near_field")))}
WEATHER = FunctionSchema(name="get_weather", description="The weather where the user is.",
                         properties={"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                         required=["unit"])


class FrameRecorder(FrameProcessor):
    """Passes every frame on; keeps those going downstream (what the output transport would play)."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list = []

    async def process_frame(self, frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM:
            self.frames.append(frame)
        await self.push_frame(frame, direction)

    def audio_bytes(self) -> int:
        return sum(len(f.audio) for f in self.frames if isinstance(f, TTSAudioRawFrame))


@pytest.fixture
def tap(monkeypatch):
    tap = WireTap()
    monkeypatch.setattr(llm, "websocket_connect", tap.wrap_connect(llm.websocket_connect))
    return tap


@asynccontextmanager
async def pipecat_pipeline(server, tap: WireTap, context: LLMContext, **session_properties):
    """The service in a running pipeline, configured by the server (`session.updated`); yields
    (service, worker, recorder). On leaving, no `error` event and no pipecat error log may have come."""
    settings = (llm.OpenAIRealtimeLLMService.Settings(session_properties=events.SessionProperties(**session_properties))
                if session_properties else None)
    service = llm.OpenAIRealtimeLLMService(api_key=API_KEY, base_url=f"ws://127.0.0.1:{server.port}/v1/realtime",
                                           settings=settings)
    aggregators = LLMContextAggregatorPair(context)
    recorder = FrameRecorder()
    worker = PipelineWorker(Pipeline([aggregators.user(), service, recorder, aggregators.assistant()]),
                            cancel_on_idle_timeout=False)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    logged: list[str] = []
    sink = logger.add(lambda message: logged.append(message), level="ERROR")
    running = asyncio.create_task(runner.run())
    try:
        await tap.until(lambda: tap.of("session.updated"), "the session configured")
        yield service, worker, recorder
    finally:
        await worker.cancel()
        await running
        logger.remove(sink)
    assert not tap.errors() and not logged, f"errors: {tap.errors() or logged}\n{tap.transcript()}"


async def test_defaults_connect_and_a_text_turn_is_answered(server, tap):
    async with pipecat_pipeline(server, tap, LLMContext([{"role": "user", "content": "Hello there!"}])) as (
            _, worker, recorder):
        await worker.queue_frame(LLMRunFrame())
        done = await tap.until_done(1, "the answer to the context's message")
        await tap.until(lambda: recorder.audio_bytes() > 0, "the answer's audio out of the service")
    (url,) = tap.urls
    session = tap.sent_of("session.update")[0]["session"]
    assert url.endswith("?model=gpt-realtime-2.1") and session["model"] == "gpt-realtime-2.1"  # pipecat's default
    assert done["status"] in ("completed", "incomplete") and done["output"][0]["type"] == "message"
    (create,) = tap.sent_of("response.create")
    assert create["response"]["output_modalities"] == ["audio"]


def microphone(worker: PipelineWorker):
    """What an input transport does with the user's audio: frames into the pipeline."""
    async def push(chunk: bytes) -> None:
        await worker.queue_frame(InputAudioRawFrame(audio=chunk, sample_rate=24000, num_channels=1))
    return push


async def test_a_spoken_turn_is_ended_by_the_server_vad(server, tap, speech):
    async with pipecat_pipeline(server, tap, LLMContext(), max_output_tokens=16) as (_, worker, recorder):
        await speak(microphone(worker), speech, lambda: bool(tap.of("input_audio_buffer.speech_stopped")))
        done = await tap.until_done(1, "the answer to the spoken turn")
        await tap.until(lambda: recorder.audio_bytes() > 0, "the answer's audio out of the service")
    assert not tap.sent_of("response.create") and not tap.sent_of("input_audio_buffer.commit")
    assert len(tap.of("input_audio_buffer.committed")) == 1
    assert done["status"] in ("completed", "incomplete")


async def test_the_examples_semantic_vad_noise_reduction_and_transcription_are_served(server, tap, speech):
    async with pipecat_pipeline(server, tap, LLMContext(), max_output_tokens=16, **EXAMPLE) as (_, worker, _):
        await speak(microphone(worker), speech, lambda: bool(tap.of("input_audio_buffer.speech_stopped")))
        await tap.until_done(1, "the answer to the spoken turn")
        await tap.until(lambda: tap.of("conversation.item.input_audio_transcription.completed"),
                        "the user's speech transcribed")
    audio_in = tap.of("session.updated")[-1]["session"]["audio"]["input"]
    assert audio_in["turn_detection"]["type"] == "semantic_vad"
    assert audio_in["noise_reduction"] == {"type": "near_field"}
    assert audio_in["transcription"]["model"] == "gpt-realtime-whisper"


async def test_a_function_is_called_and_run_by_pipecat(server, tap):
    calls: list[dict] = []

    async def get_weather(params: FunctionCallParams) -> None:
        calls.append(params.arguments)
        await params.result_callback({"temperature_c": 21, "sky": "sunny"})

    context = LLMContext([{"role": "user", "content": "What is the weather?"}], tools=ToolsSchema([WEATHER]))
    # the tiny model's words are random: `required` makes its answer a call (and every answer after it)
    async with pipecat_pipeline(server, tap, context, tool_choice="required") as (service, worker, _):
        service.register_function("get_weather", get_weather)
        await worker.queue_frame(LLMRunFrame())
        await tap.until(lambda: calls, "pipecat ran the function")
        await tap.until(lambda: len(tap.of("response.created")) >= 2, "a response to the function's result")
    call = tap.done()[0]["output"][0]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert calls[0] in ({"unit": "celsius"}, {"unit": "fahrenheit"})
    outputs = tap.function_outputs()
    assert outputs[0]["call_id"] == call["call_id"] and '"temperature_c": 21' in outputs[0]["output"]


async def test_barge_in_cuts_the_answer_and_the_spoken_turn_is_answered(server, tap, speech):
    speech = speech[int(LEAD_S * 24000):]  # straight into speech: the answer is still playing
    context = LLMContext([{"role": "user", "content": "Tell me a long story."}])
    async with pipecat_pipeline(server, tap, context) as (_, worker, recorder):
        await worker.queue_frame(LLMRunFrame())
        await tap.until(lambda: recorder.audio_bytes() > 0, "the answer's first audio")
        await speak(microphone(worker), speech, lambda: bool(tap.of("input_audio_buffer.speech_stopped")))
        await tap.until_done(2, "the answer to the spoken turn")
    first, second = tap.done()
    assert (first["status"], first["status_details"]["reason"]) == ("cancelled", "turn_detected")
    (truncate,) = tap.sent_of("conversation.item.truncate")  # pipecat cuts what was not played
    assert truncate["item_id"] == first["output"][0]["id"]
    (truncated,) = tap.of("conversation.item.truncated")
    assert truncated["item_id"] == truncate["item_id"]
    assert second["status"] in ("completed", "incomplete")
