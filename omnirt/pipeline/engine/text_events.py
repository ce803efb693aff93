"""A reply's detokenized text as client events: plain text deltas, and, where the request has tools, the
model's tool calls parsed out of the text (by the model package's parser) as tool-call deltas."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from omnirt.pipeline.types import Event, Finished, TextDelta, ToolCallDelta


class TextEvents:
    """Per request, on the consumer's side of the queue (never on a stage's step path)."""

    def __init__(self, request_id: str, parser: Any | None):
        self.request_id, self.parser = request_id, parser
        self._call_ids: list[str] = []

    def feed(self, text: str, token_ids: list[int], final: bool = False) -> list[Event]:
        """The events that `text` (the new text of `token_ids`) completes; `final` at the reply's end."""
        if self.parser is None:
            return [TextDelta(self.request_id, text, tuple(token_ids))] if text or token_ids else []
        pieces = self.parser.feed(text) + (self.parser.close() if final else [])
        out: list[Event] = []
        ids = tuple(token_ids)  # they go with the first text piece
        for piece in pieces:
            if isinstance(piece, str):
                out.append(TextDelta(self.request_id, piece, ids))
                ids = ()
                continue
            if piece.name is not None:
                self._call_ids.append(f"call_{uuid.uuid4().hex[:24]}")
            out.append(ToolCallDelta(self.request_id, piece.index, piece.arguments, self._call_ids[piece.index]
                                     if piece.name is not None else None, piece.name))
        return out

    def finished(self, fin: Finished) -> Finished:
        """A reply that stopped after calling tools ends with finish_reason "tool_calls", as OpenAI's."""
        if self._call_ids and fin.finish_reason == "stop":
            return msgspec.structs.replace(fin, finish_reason="tool_calls")
        return fin
