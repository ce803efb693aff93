"""A WebRTC Realtime client (the tests' and `omnirt bench realtime --transport webrtc`'s): an aiortc peer,
on loopback.

Its microphone is a `PacedAudioTrack` (the server's own paced track, fed 24 kHz speech: it plays what is
written in real time and silence otherwise, and reports when a written utterance has all gone out), the
agent's audio is recorded frame by frame with its arrival time, and the `oai-events` data channel's
events are collected in order (and passed to `on_event`, if given, as they arrive).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from omnirt.app.audio.pcm import float_to_pcm16
from omnirt.app.transports.ice import offer_host_addresses
from omnirt.app.transports.webrtc_track import PacedAudioTrack


@dataclass
class ReceivedFrame:
    arrival_s: float  # time.monotonic()
    peak: int  # max |sample| (s16)
    num_samples: int  # per channel
    sample_rate: int


@dataclass
class RealtimeCall:
    pc: RTCPeerConnection
    channel: object
    mic: PacedAudioTrack
    events: list[dict] = field(default_factory=list)
    frames: list[ReceivedFrame] = field(default_factory=list)
    new_event: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task] = field(default_factory=list)
    location: str = ""

    async def say(self, samples_24k: np.ndarray) -> None:
        await self.mic.write("mic", "mic", float_to_pcm16(samples_24k))

    def send(self, event: dict) -> None:
        self.channel.send(json.dumps(event))

    async def wait_for(self, predicate, timeout: float = 120.0, start: int = 0) -> dict:
        """The first event from index `start` on for which predicate(event) holds."""
        deadline = time.monotonic() + timeout
        while True:
            for ev in self.events[start:]:
                if predicate(ev):
                    return ev
            self.new_event.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no such event; got {[e['type'] for e in self.events]}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.new_event.wait(), left)

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        self.mic.stop()
        await self.pc.close()


async def connect(base_url: str, path: str = "/v1/realtime/calls", transport=None, extra_video: bool = False,
                  on_event: Callable[[dict], None] | None = None,
                  on_mic_event: Callable[[dict], None] | None = None,
                  headers: dict[str, str] | None = None,
                  mic_fill: Callable[[int], np.ndarray] | None = None) -> RealtimeCall:
    """Offer, answer, connect; `transport`: an httpx transport (an in-process app), else real HTTP;
    `extra_video`: offer a video section as well (sendrecv, no track); `on_event`: each server event;
    `on_mic_event`: the microphone track's own playback events (`output_audio_buffer.stopped` once a
    written utterance has all been sent); `headers`: more signalling headers (`Authorization`, `Origin`);
    `mic_fill`: what the microphone sends between utterances (n 48 kHz PCM16 samples; default digital zero)."""
    offer_host_addresses(("127.0.0.1",))  # this process's ICE offers loopback, as the server does
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    mic = PacedAudioTrack(on_mic_event or (lambda ev: None), fill=mic_fill)
    call = RealtimeCall(pc, pc.createDataChannel("oai-events"), mic)

    def received(message: str) -> None:
        event = json.loads(message)
        call.events.append(event)
        call.new_event.set()
        if on_event is not None:
            on_event(event)

    call.channel.on("message", received)
    pc.addTrack(call.mic)
    if extra_video:
        pc.addTransceiver("video")

    @pc.on("track")
    def on_track(track):
        call.tasks.append(asyncio.create_task(_record(track, call.frames)))

    await pc.setLocalDescription(await pc.createOffer())
    async with httpx.AsyncClient(timeout=30, transport=transport) as http:
        r = await http.post(base_url + path, content=pc.localDescription.sdp,
                            headers={"Content-Type": "application/sdp", **(headers or {})})
    if r.status_code not in (200, 201):
        await call.close()
        raise AssertionError(f"{r.status_code}: {r.text}")
    assert r.headers["content-type"].startswith("application/sdp")
    call.location = r.headers.get("location", "")
    await pc.setRemoteDescription(RTCSessionDescription(r.text, "answer"))
    return call


async def _record(track, frames: list[ReceivedFrame]) -> None:
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        pcm = frame.to_ndarray()
        frames.append(ReceivedFrame(time.monotonic(), int(np.abs(pcm).max()), frame.samples, frame.sample_rate))

