"""Conversations longer than the Thinker's context: the engine leaves the oldest messages out (the
request's `truncation`), and a Realtime session keeps the cut stable across the turns that follow."""

from __future__ import annotations

import asyncio

import pytest

from omnirt.app.audio.vad import VadBatcher
from omnirt.app.realtime.config import initial_config
from omnirt.app.realtime.session import RealtimeLimits, RealtimeSession
from omnirt.pipeline.api import Finished, OmniRequest, RequestError, TextDelta

TEXT_LIMIT = 4096 - 64  # the tiny Thinker's context less its default output budget (64 tokens)


def turn_text(i: int, words: int = 60) -> str:
    """~400 tokens of the tiny tokenizer."""
    return " ".join(f"turn{i} word{j % 37} story" for j in range(words))


def conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "Be brief."}]
    for i in range(turns):
        messages += [{"role": "user", "content": turn_text(i)}, {"role": "assistant", "content": f"reply {i}"}]
    return messages + [{"role": "user", "content": "And now?"}]


async def run(engine, req: OmniRequest) -> tuple[list[int], Finished]:
    tokens, fin = [], None
    async for ev in await engine.submit(req):
        if isinstance(ev, TextDelta):
            tokens += ev.token_ids
        elif isinstance(ev, Finished):
            fin = ev
    return tokens, fin


async def test_engine_leaves_out_the_oldest_messages_and_answers_as_without_them(engine):
    messages = conversation(14)  # ~5800 tokens
    with pytest.raises(RequestError) as exc:
        await engine.submit(OmniRequest("long-off", messages))
    assert exc.value.code == "context_length_exceeded"
    tokens, fin = await run(engine, OmniRequest("long-auto", messages, truncation=1.0))
    dropped = fin.truncated_messages
    assert fin.finish_reason != "error" and dropped > 0 and fin.usage.prompt_tokens <= TEXT_LIMIT
    # greedy: the same reply as a request that never had those messages
    same, fin_same = await run(engine, OmniRequest("long-manual", messages[:1] + messages[1 + dropped:]))
    assert tokens == same and fin_same.usage.prompt_tokens == fin.usage.prompt_tokens
    _, half = await run(engine, OmniRequest("long-half", messages, truncation=0.5))
    assert half.truncated_messages > dropped and half.usage.prompt_tokens <= TEXT_LIMIT // 2 + 50


async def test_a_short_prompt_is_never_truncated(engine):
    _, fin = await run(engine, OmniRequest("short", conversation(2), truncation=0.5))
    assert fin.truncated_messages == 0


class Driver:
    """One in-process Realtime session, text turns only."""

    def __init__(self, engine):
        config = initial_config(engine.info(), "tiny", "")
        self.session = RealtimeSession(engine, config, RealtimeLimits(), VadBatcher())
        self.events: list[dict] = []
        self.reader: asyncio.Task | None = None

    async def start(self, truncation) -> None:
        await self.session.start()
        self.reader = asyncio.create_task(self._drain())
        await self.session.handle_event({"type": "session.update", "session": {
            "output_modalities": ["text"], "truncation": truncation,
            "audio": {"input": {"turn_detection": None}}}})

    async def _drain(self) -> None:
        while (ev := await self.session.outbox.get()) is not None:
            self.events.append(ev)

    async def turn(self, i: int) -> dict:
        """A user text item, then a response; its `response.done` response."""
        await self.session.handle_event({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": turn_text(i)}]}})
        start = len(self.events)
        await self.session.handle_event({"type": "response.create", "response": {"max_output_tokens": 2}})
        return (await self.next_event("response.done", start))["response"]

    async def next_event(self, kind: str, start: int) -> dict:
        """The first `kind` event from index `start` on (a liveness wait, not a latency bound)."""
        for _ in range(6000):
            found = [e for e in self.events[start:] if e["type"] == kind]
            if found:
                return found[0]
            await asyncio.sleep(0.01)
        raise AssertionError(f"no {kind}")

    async def close(self) -> None:
        await self.session.close()
        await self.reader


async def test_fifty_long_turns_never_fail_and_the_cut_stays_put(engine):
    d = Driver(engine)
    await d.start({"type": "retention_ratio", "retention_ratio": 0.5})
    inputs = []
    for i in range(50):
        response = await d.turn(i)
        assert response["status"] in ("completed", "incomplete"), response  # incomplete: its 2 tokens
        inputs.append(response["usage"]["input_tokens"])
    await d.close()
    assert max(inputs) <= 4096 - 2  # the context less this response's output budget
    cuts = [i for i in range(1, 50) if inputs[i] < inputs[i - 1]]
    assert cuts and min(b - a for a, b in zip(cuts, cuts[1:])) >= 3, inputs  # the prompt grows again between cuts
    assert not [e for e in d.events if e["type"] == "error"]


async def test_disabled_truncation_fails_the_response_and_the_session_lives_on(engine):
    d = Driver(engine)
    await d.start("disabled")
    statuses = [(await d.turn(i))["status"] for i in range(12)]
    failed = statuses.index("failed")  # the others: "incomplete" at their 2 tokens
    assert 0 < failed and set(statuses[failed:]) == {"failed"}, statuses
    assert any(e["type"] == "error" and e["error"]["code"] == "context_length_exceeded" for e in d.events)
    start = len(d.events)
    await d.session.handle_event({"type": "session.update", "session": {"truncation": "auto"}})
    assert (await d.next_event("session.updated", start))["session"]["truncation"] == "auto"
    assert (await d.turn(12))["status"] != "failed"
    await d.close()
