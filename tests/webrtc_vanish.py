"""Run as a program: a WebRTC client that starts a long spoken answer, prints its call's location, then
dies without a goodbye (as a crashed browser or a lost network would)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from omnirt.loadtest.webrtc_client import connect


async def _call_and_vanish(base_url: str) -> None:
    """Connect, start a long spoken answer, print the call's location, then die without a goodbye."""
    call = await connect(base_url)
    await call.wait_for(lambda e: e["type"] == "session.created", 30)
    call.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Tell me a long story."}]}})
    call.send({"type": "response.create", "response": {"talker_sampling": {"min_tokens": 3000, "max_tokens": 3000}}})
    await call.wait_for(lambda e: e["type"] == "output_audio_buffer.started", 60)
    print(call.location, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no DTLS close, no hangup: as a crashed browser or a lost network


if __name__ == "__main__":
    asyncio.run(_call_and_vanish(sys.argv[1]))
