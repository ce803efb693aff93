"""A tool call's marker ends the speech only where the request offers tools: without tools `<tool_call>` is text
like any other, and a reply that opens with it (sampled, as a random prompt at temperature 0.7 can) is spoken."""

from __future__ import annotations

import pytest

from omnirt.pipeline.api import OmniRequest, collect_reply

TOOLS = [{"type": "function", "function": {"name": "roll_dice", "description": "Roll a die",
                                           "parameters": {"type": "object", "properties": {}}}}]


async def _reply(engine, rid: str, tools: list[dict]):
    """A reply whose first Thinker token is forced to the marker, then a few ordinary tokens."""
    marker = engine.models.thinker.tool_call_id
    text = (marker, 200, 201, 202, 203, 204)
    req = OmniRequest(rid, [{"role": "user", "content": "Tell me about the sea."}], ("text", "audio"),
                      thinker_sampling={"max_tokens": len(text)}, talker_sampling={"max_tokens": 12, "min_tokens": 12},
                      tools=tools, forced={"thinker": text})
    return await collect_reply(await engine.submit(req))


@pytest.mark.parametrize("offers_tools", [False, True])
async def test_the_marker_ends_speech_only_where_tools_are_offered(engine, offers_tools):
    reply = await _reply(engine, f"marker-tools-{offers_tools}", TOOLS if offers_tools else [])
    assert (reply.pcm16 == b"") == offers_tools
