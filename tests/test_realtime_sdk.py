"""The official `openai` SDK's realtime client against a real server on a loopback port."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest

from omnirt.app.audio.pcm import float_to_pcm16
from omnirt.app.audio.resample import resample
from omnirt.app.audio.wire import G711_ALAW, G711_ULAW, decode, encode
from tests.realtime_helpers import LEAD_S, b64_chunks, collect_until, response_done

MANUAL_TEXT = {"type": "realtime", "output_modalities": ["text"], "audio": {"input": {"turn_detection": None}}}
LONG_AUDIO = {"max_output_tokens": 40, "talker_sampling": {"min_tokens": 2000, "max_tokens": 2000}}


@pytest.fixture(scope="module")
def client(server):
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", websocket_base_url=server.url.replace("http", "ws") + "/v1",
                              api_key="unused", max_retries=0)


def is_done(ev) -> bool:
    return ev.type == "response.done"


async def user_text(conn, text: str) -> None:
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})


async def open_session(client, session: dict | None = None):
    conn = await client.realtime.connect(model="tiny").enter()
    created = await conn.recv()
    assert created.type == "session.created"
    if session is not None:
        await conn.session.update(session=session)
        assert (await conn.recv()).type == "session.updated"
    return conn, created


async def test_text_turn(client):
    conn, created = await open_session(client, MANUAL_TEXT)
    try:
        assert created.session.audio.input.turn_detection.threshold == 0.5  # OpenAI's server VAD defaults
        assert created.session.audio.input.turn_detection.silence_duration_ms == 500
        assert created.session.audio.input.format.rate == 24000
        await user_text(conn, "Hello! Tell me about the sea.")
        await conn.response.create(response={"max_output_tokens": 12})
        events = await collect_until(conn, is_done)
    finally:
        await conn.close()
    types = [e.type for e in events]
    assert types[:2] == ["conversation.item.added", "conversation.item.done"]
    assert types.index("response.created") < types.index("response.output_item.added") < \
        types.index("response.content_part.added") < types.index("response.output_text.delta")
    assert types[-5:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "conversation.item.done", "response.done"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert text and text == next(e.text for e in events if e.type == "response.output_text.done")
    assert done.output[0].content[0].text == text and done.status in ("completed", "incomplete")
    assert done.usage.output_tokens <= 12 and done.usage.input_tokens > 5
    assert not any(t.startswith("response.output_audio") for t in types)


async def test_audio_turn_with_server_vad(client, utterance):
    samples, speech_s = utterance
    conn, _ = await open_session(client)  # defaults: server VAD, audio out
    try:
        for chunk in b64_chunks(samples):
            await conn.input_audio_buffer.append(audio=chunk)
        events = await collect_until(conn, is_done)
    finally:
        await conn.close()
    by_type = {e.type: e for e in events}
    started, stopped = by_type["input_audio_buffer.speech_started"], by_type["input_audio_buffer.speech_stopped"]
    # the VAD finds the real speech: onset ~1 s in (less the 300 ms prefix padding), end ~ after the speech
    assert abs(started.audio_start_ms - (LEAD_S * 1000 - 300)) < 250, started
    assert abs(stopped.audio_end_ms - (LEAD_S + speech_s) * 1000) < 400, (stopped, speech_s)
    assert started.item_id == stopped.item_id == by_type["input_audio_buffer.committed"].item_id
    user_item = next(e.item for e in events if e.type == "conversation.item.added" and e.item.role == "user")
    assert user_item.id == started.item_id and user_item.content[0].type == "input_audio"
    done = response_done(events).response
    assert done.status in ("completed", "incomplete")
    pcm = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    audio = np.frombuffer(pcm, "<i2")
    assert audio.size > 24000 * 0.3 and np.abs(audio).max() > 100  # real speech-codec output, not silence
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    assert transcript == done.output[0].content[0].transcript
    assert done.usage.input_tokens > 40  # ~4 s of speech became audio tokens in the Thinker's prompt
    details = done.usage.input_token_details
    assert details.audio_tokens > 40 and details.image_tokens == 0
    assert details.text_tokens == done.usage.input_tokens - details.audio_tokens


async def test_user_transcript_with_server_vad(client, server, utterance):
    """GA `audio.input.transcription`: the SDK parses the transcription events into its own types; the
    deltas come after the user item and add up to `.completed`'s transcript, which the item then holds."""
    from openai.types.realtime import (
        ConversationItemInputAudioTranscriptionCompletedEvent,
        ConversationItemInputAudioTranscriptionDeltaEvent,
    )

    samples, _ = utterance
    conn, _ = await open_session(client)
    try:
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 12, "audio": {
            "input": {"transcription": {"model": "gpt-4o-transcribe", "language": "en"}}}})
        updated = await conn.recv()
        assert updated.session.audio.input.transcription.model == "gpt-4o-transcribe"
        assert updated.session.audio.input.transcription.language == "en"
        for chunk in b64_chunks(samples):
            await conn.input_audio_buffer.append(audio=chunk)
        seen = {"response.done": False, "completed": False}

        def both(ev) -> bool:
            seen["response.done"] |= ev.type == "response.done"
            seen["completed"] |= ev.type == "conversation.item.input_audio_transcription.completed"
            return all(seen.values())

        events = await collect_until(conn, both)
        item_id = next(e.item_id for e in events if e.type == "input_audio_buffer.committed")
        await conn.conversation.item.retrieve(item_id=item_id)
        retrieved = (await collect_until(conn, lambda e: e.type == "conversation.item.retrieved"))[-1].item
    finally:
        await conn.close()
    types = [e.type for e in events]
    deltas = [e for e in events if isinstance(e, ConversationItemInputAudioTranscriptionDeltaEvent)]
    (done,) = [e for e in events if isinstance(e, ConversationItemInputAudioTranscriptionCompletedEvent)]
    assert deltas and all(d.item_id == item_id for d in deltas) and done.item_id == item_id
    assert "".join(d.delta for d in deltas) == done.transcript and done.transcript
    assert types.index("conversation.item.done") < types.index(deltas[0].type)
    assert types.index("response.output_audio.delta") < types.index(deltas[0].type)  # after the reply's first audio
    assert done.usage.type == "tokens" and done.usage.output_tokens >= 1
    assert retrieved.content[0].type == "input_audio" and retrieved.content[0].transcript == done.transcript
    assert not [e for e in events if e.type == "error"]
    assert server.metric("omnirt_requests_total", endpoint="realtime_transcription") >= 1


async def test_manual_commit(client, utterance):
    samples, _ = utterance
    conn, _ = await open_session(client, {"type": "realtime", "audio": {"input": {"turn_detection": None}}})
    try:
        await conn.input_audio_buffer.commit()
        err = (await collect_until(conn, lambda e: e.type == "error"))[-1]
        assert err.error.code == "input_audio_buffer_commit_empty"
        for chunk in b64_chunks(samples, 200):
            await conn.input_audio_buffer.append(audio=chunk)
        await conn.input_audio_buffer.commit()
        events = await collect_until(conn, lambda e: e.type == "conversation.item.done")
        assert [e.type for e in events] == ["input_audio_buffer.committed", "conversation.item.added",
                                            "conversation.item.done"]
        with pytest.raises(TimeoutError):  # no VAD: nothing happens until the client asks for a response
            await collect_until(conn, lambda e: True, timeout=1.5)
        await conn.response.create(response={"max_output_tokens": 8, "talker_sampling": {"max_tokens": 30}})
        done = response_done(await collect_until(conn, is_done)).response
        assert done.status in ("completed", "incomplete") and done.usage.input_tokens > 40
    finally:
        await conn.close()


async def test_g711_in_and_out(client, utterance):
    """mu-law speech in (8 kHz) is heard by the VAD; the answer comes back as A-law (8 kHz)."""
    samples, speech_s = utterance
    ulaw = encode(resample(samples, 24000, 8000), G711_ULAW)
    conn, _ = await open_session(client, {"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}},
                                                                        "output": {"format": {"type": "audio/pcma"}}}})
    try:
        for i in range(0, len(ulaw), 1600):
            await conn.input_audio_buffer.append(audio=base64.b64encode(ulaw[i:i + 1600]).decode())
        events = await collect_until(conn, is_done)
    finally:
        await conn.close()
    stopped = next(e for e in events if e.type == "input_audio_buffer.speech_stopped")
    assert abs(stopped.audio_end_ms - (LEAD_S + speech_s) * 1000) < 400
    alaw = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    frames = response_done(events).response.usage.output_token_details.audio_tokens
    assert abs(len(alaw) - frames * 640) <= 640  # one byte per 8 kHz sample, 80 ms per codec frame
    assert np.abs(decode(alaw, G711_ALAW)).max() > 0.003


async def test_audio_item_create(client, utterance):
    samples, _ = utterance
    conn, _ = await open_session(client, MANUAL_TEXT)
    try:
        audio = base64.b64encode(float_to_pcm16(samples)).decode()
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_audio", "audio": audio}]})
        added = (await collect_until(conn, lambda e: e.type == "conversation.item.added"))[-1]
        assert added.item.content[0].type == "input_audio"
        await conn.response.create(response={"max_output_tokens": 4})
        done = response_done(await collect_until(conn, is_done)).response
        assert done.usage.input_tokens > 40  # the 6.8 s item became audio tokens
        await user_text(conn, "And then?")
        await conn.response.create(response={"max_output_tokens": 4})
        second = response_done(await collect_until(conn, is_done)).response
        assert second.usage.input_tokens > done.usage.input_tokens  # the earlier user audio is still in the history
    finally:
        await conn.close()


async def test_barge_in_cancels_mid_answer(client, utterance, server):
    samples, _ = utterance
    conn, _ = await open_session(client)
    try:
        await user_text(conn, "Tell me a very long story.")
        await conn.response.create(response=LONG_AUDIO)
        first = await collect_until(conn, lambda e: e.type == "response.output_audio.delta")
        long_id = first[-1].response_id
        for chunk in b64_chunks(samples, 200):
            await conn.input_audio_buffer.append(audio=chunk)
        events = await collect_until(conn, lambda e: is_done(e) and e.response.id != long_id, timeout=180)
    finally:
        await conn.close()
    types = [e.type for e in events]
    cancelled = response_done(events, long_id)
    cancel_at = events.index(cancelled)
    assert cancelled.response.status == "cancelled"
    assert cancelled.response.status_details.reason == "turn_detected"
    assert types.index("input_audio_buffer.speech_started") < cancel_at
    assert not any(e.type == "response.output_audio.delta" and e.response_id == long_id for e in events[cancel_at:])
    # 2000 codec frames (160 s of speech) were asked for; far fewer left before the cancellation
    sent = sum(len(base64.b64decode(e.delta)) // 2 for e in first + events if e.type == "response.output_audio.delta"
               and e.response_id == long_id)
    assert sent < 24000 * 60
    assert events[-1].response.status in ("completed", "incomplete")  # the new turn's answer
    h = server.wait_idle()
    assert h["free_slots"] == h["slots"]


async def test_truncate_cuts_item_and_transcript(client):
    conn, _ = await open_session(client, {"type": "realtime", "audio": {"input": {"turn_detection": None}}})
    try:
        await user_text(conn, "Say something.")
        await conn.response.create(response={"max_output_tokens": 16})
        done = response_done(await collect_until(conn, is_done)).response
        item = done.output[0]
        full = item.content[0].transcript
        await conn.conversation.item.truncate(item_id=item.id, content_index=0, audio_end_ms=10**7)
        clamped = (await collect_until(conn, lambda e: e.type == "conversation.item.truncated"))[-1]
        assert 300 < clamped.audio_end_ms < 10**7  # past the audio: clamped to its end, nothing cut
        await conn.conversation.item.retrieve(item_id=item.id)
        retrieved = (await collect_until(conn, lambda e: e.type == "conversation.item.retrieved"))[-1]
        assert retrieved.item.content[0].transcript == full
        await conn.conversation.item.truncate(item_id=item.id, content_index=0, audio_end_ms=300)
        truncated = (await collect_until(conn, lambda e: e.type == "conversation.item.truncated"))[-1]
        assert (truncated.item_id, truncated.audio_end_ms) == (item.id, 300)
        await conn.conversation.item.retrieve(item_id=item.id)
        cut = (await collect_until(conn, lambda e: e.type == "conversation.item.retrieved"))[-1]
        assert full.startswith(cut.item.content[0].transcript)
        assert len(cut.item.content[0].transcript) < len(full)
    finally:
        await conn.close()


async def test_truncate_leaves_the_response_running_until_it_is_cancelled(client):
    """The Agents SDK's interrupt(): truncate (its playback position rounded up, past the audio sent), then
    response.cancel. The truncate cuts the item and nothing else; the cancel finds the response running."""
    conn, _ = await open_session(client, {"type": "realtime", "audio": {"input": {"turn_detection": None}}})
    try:
        await user_text(conn, "Tell me a very long story.")
        await conn.response.create(response=LONG_AUDIO)
        events = await collect_until(conn, lambda e: e.type == "response.output_audio.delta")
        item_id = events[-1].item_id
        sent_ms = sum(len(base64.b64decode(e.delta)) // 2 for e in events if e.type == "response.output_audio.delta"
                      ) * 1000 // 24000
        await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=sent_ms + 1)
        after = await collect_until(conn, lambda e: e.type == "conversation.item.truncated")
        cut_ms = after[-1].audio_end_ms
        after += await collect_until(conn, lambda e: e.type == "response.output_audio.delta")  # still running
        await conn.response.cancel()
        after += await collect_until(conn, is_done)
    finally:
        await conn.close()
    assert not [e for e in after if e.type == "error"]
    assert sent_ms <= cut_ms <= sent_ms + 1  # at most the audio sent when the truncate arrived
    done = after[-1].response
    assert done.status == "cancelled" and done.status_details.reason == "client_cancelled"


async def test_second_turn_depends_on_first(client, server):
    """The second answer is exactly what the chat API gives for [user1, assistant1, user2]: the
    first turn's transcript was fed back to the Thinker as history."""
    conn, _ = await open_session(client, MANUAL_TEXT)
    try:
        await user_text(conn, "My name is Ada. Remember it.")
        await conn.response.create(response={"max_output_tokens": 10})
        first = response_done(await collect_until(conn, is_done)).response
        await user_text(conn, "What is my name?")
        await conn.response.create(response={"max_output_tokens": 10})
        second = response_done(await collect_until(conn, is_done)).response
    finally:
        await conn.close()
    answer1, answer2 = first.output[0].content[0].text, second.output[0].content[0].text
    body = {"model": "tiny", "max_tokens": 10, "messages": [
        {"role": "system", "content": "You are a helpful voice assistant."},
        {"role": "user", "content": "My name is Ada. Remember it."}, {"role": "assistant", "content": answer1},
        {"role": "user", "content": "What is my name?"}]}
    ref = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert answer2 == ref["choices"][0]["message"]["content"]
    assert second.usage.input_tokens == ref["usage"]["prompt_tokens"] > first.usage.input_tokens


async def test_concurrent_sessions_are_isolated(client):
    async def one(prompt: str) -> tuple[str, bytes, set[str]]:
        conn, _ = await open_session(client, {"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        try:
            await user_text(conn, prompt)
            await conn.response.create(response={"max_output_tokens": 10, "talker_sampling": {"max_tokens": 30}})
            events = await collect_until(conn, is_done)
        finally:
            await conn.close()
        done = response_done(events).response
        ids = {getattr(e, "response_id", None) for e in events} - {None}
        pcm = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
        return done.output[0].content[0].transcript, pcm, ids | {done.id}

    prompts = ["Tell me about dragons and castles.", "What is two plus two?"]
    alone = [await one(p) for p in prompts]
    together = await asyncio.gather(*(one(p) for p in prompts))
    assert alone[0][0] != alone[1][0] or alone[0][1] != alone[1][1]  # the two sessions' outputs differ
    for (text_a, pcm_a, _), (text_t, pcm_t, ids) in zip(alone, together):
        assert text_t == text_a and len(pcm_t) == len(pcm_a) and len(ids) == 1
        diff = np.abs(np.frombuffer(pcm_t, "<i2").astype(int) - np.frombuffer(pcm_a, "<i2").astype(int)).max()
        assert diff <= 2  # batched float math may differ in the last bits
    assert together[0][2] != together[1][2]


async def test_closing_mid_response_frees_every_stage(client, server):
    conn, _ = await open_session(client)
    await user_text(conn, "Talk for a long time.")
    await conn.response.create(response=LONG_AUDIO)
    await collect_until(conn, lambda e: e.type == "response.output_audio.delta")
    busy = server.health()
    assert busy["free_slots"]["talker"] < busy["slots"]["talker"]
    await conn.close()
    h = server.wait_idle()
    assert h["free_slots"] == h["slots"] and h["active_requests"] == 0
