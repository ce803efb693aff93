"""The WebRTC tracks on their own: the outgoing one's pacing, pts, bounded buffer, playback events, barge-in
clear; the microphone's bounded backlog."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from omnirt.app.audio.pcm import float_to_pcm16
from omnirt.app.audio.vad import VAD_RATE
from omnirt.app.transports.webrtc_track import FRAME_SAMPLES, MicBacklog, PacedAudioTrack
from tests.conftest import HANG_GUARD_S


def tone(seconds: float, rate: int = 24000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return float_to_pcm16((0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32))


async def frames(track: PacedAudioTrack, n: int) -> list:
    return [await track.recv() for _ in range(n)]


async def test_paced_frames_bounded_buffer_and_playback_events():
    events = []
    track = PacedAudioTrack(events.append, max_buffer_s=0.5)
    writer = asyncio.create_task(track.write("resp_1", "item_1", tone(1.0)))
    await asyncio.sleep(0.05)
    assert not writer.done() and track.num_buffered_samples == 24000  # full at 0.5 s of 48 kHz: the writer waits
    t0 = time.monotonic()
    sent = await frames(track, 30)
    elapsed = time.monotonic() - t0
    assert elapsed >= 0.5, elapsed  # paced: 29 sleeps of 20 ms (the first frame goes at once)
    assert [f.pts for f in sent] == list(range(0, 30 * FRAME_SAMPLES, FRAME_SAMPLES))
    assert {(f.samples, f.sample_rate, f.layout.name, f.format.name) for f in sent} == {(960, 48000, "mono", "s16")}
    await asyncio.wait_for(writer, 30)  # room was made
    assert [e["type"] for e in events] == ["output_audio_buffer.started"] and events[0]["response_id"] == "resp_1"
    track.response_done("resp_1")
    while not any(e["type"] == "output_audio_buffer.stopped" for e in events):
        sent += await frames(track, 1)
    loud = [f for f in sent if np.abs(f.to_ndarray()).max() > 1000]
    stopped = events[-1]
    assert abs(len(loud) * 20 - 1000) <= 40 and abs(stopped["omnirt_playback"]["audio_ms"] - 1000) <= 25
    assert stopped["omnirt_playback"]["num_underruns"] == 0 and abs(track.played_ms("item_1") - 1000) <= 5
    after = await frames(track, 3)  # idle: silence, pts goes on
    assert all(not f.to_ndarray().any() for f in after) and after[0].pts == sent[-1].pts + FRAME_SAMPLES
    track.stop()


async def test_clear_drops_queued_and_late_audio_and_underruns_are_counted():
    events = []
    track = PacedAudioTrack(events.append, max_buffer_s=1.0)
    await track.write("resp_1", "item_1", tone(0.1))
    await frames(track, 5 + 6)  # 100 ms of audio, then 120 ms with nothing while the response is still owed
    assert events[-1]["type"] == "output_audio_buffer.started"
    writer = asyncio.create_task(track.write("resp_1", "item_1", tone(2.0)))  # more than the buffer holds
    await asyncio.sleep(0.05)
    await frames(track, 5)
    track.clear()  # barge-in
    await asyncio.wait_for(writer, 30)  # the waiting writer gives up
    await track.write("resp_1", "item_1", tone(0.5))  # a late write of the cleared response is ignored
    assert track.num_buffered_samples == 0
    assert all(not f.to_ndarray().any() for f in await frames(track, 3))
    assert abs(track.played_ms("item_1") - 200) <= 5
    await track.write("resp_2", "item_2", tone(0.1))  # the next response plays, with a 120 ms gap inside
    await frames(track, 5 + 6)
    await track.write("resp_2", "item_2", tone(0.1))
    track.response_done("resp_2")
    while events[-1]["type"] != "output_audio_buffer.stopped":
        await frames(track, 1)
    assert [e["type"] for e in events] == ["output_audio_buffer.started"] * 2 + ["output_audio_buffer.stopped"]
    assert events[-1]["response_id"] == "resp_2" and events[-1]["omnirt_playback"]["num_underruns"] == 1
    assert abs(events[-1]["omnirt_playback"]["audio_ms"] - 200) <= 5
    track.stop()
    assert track.readyState == "ended"


async def test_an_empty_buffer_plays_the_fill_and_counts_the_same():
    """A bench's microphone plays its room between utterances (`fill`): the same frames as a silent track where audio
    is queued, the fill where it is not, and the same playback events (underruns, audio played)."""
    played = {}
    for name, fill in (("silent", None), ("room", lambda n: np.full(n, 7, np.int16))):
        events = []
        track = PacedAudioTrack(events.append, fill=fill)
        sent = await frames(track, 2)
        await track.write("resp_1", "item_1", tone(0.1))
        sent += await frames(track, 5 + 6)  # 100 ms of audio, then 120 ms with nothing while still owed
        await track.write("resp_1", "item_1", tone(0.1))
        track.response_done("resp_1")
        while events[-1]["type"] != "output_audio_buffer.stopped":
            sent += await frames(track, 1)
        sent += await frames(track, 2)
        played[name] = (np.concatenate([f.to_ndarray()[0] for f in sent]),
                        [{k: v for k, v in e.items() if k != "event_id"} for e in events])
        track.stop()
    (silent, silent_events), (room, room_events) = played["silent"], played["room"]
    assert room_events == silent_events and room_events[-1]["omnirt_playback"]["num_underruns"] == 1
    assert len(room) == len(silent) and ((room == silent) | ((silent == 0) & (room == 7))).all()
    assert (room == 7).sum() >= 10 * FRAME_SAMPLES  # before, inside and after the response


async def test_mic_backlog_keeps_the_newest_audio_within_its_bound_and_counts_the_rest():
    """A consumer that stalls while 50 chunks of 20 ms arrive gets only the newest 0.5 s; the rest is counted."""
    backlog = MicBacklog(0.5)
    chunks = [np.full(VAD_RATE // 50, i, np.float32) for i in range(50)]  # 1 s, each chunk tagged by its index
    for chunk in chunks:
        backlog.push(chunk)
        assert backlog.num_samples <= backlog.max_samples == VAD_RATE // 2
    samples, num_dropped = await backlog.take(1)
    assert samples.size == VAD_RATE // 2 and num_dropped == VAD_RATE // 2 == backlog.num_dropped_samples
    assert np.array_equal(samples, np.concatenate(chunks[25:]))  # in order, the oldest half gone
    backlog.push(np.zeros(100, np.float32))
    waiting = asyncio.create_task(backlog.take(320))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # less than asked for: it waits
    backlog.push(np.zeros(300, np.float32))
    samples, num_dropped = await asyncio.wait_for(waiting, HANG_GUARD_S)
    assert samples.size == 400 and num_dropped == 0 and backlog.num_dropped_samples == VAD_RATE // 2
    backlog.close()
    assert await backlog.take(1) is None
