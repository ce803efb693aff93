"""Incremental detokenisation: each step's text costs O(new tokens), not a re-decode of the reply.

As vLLM's `detokenize_incrementally`: decode a short window of recent ids with and without the new
ones and emit the difference. Text that ends in an incomplete UTF-8 sequence (U+FFFD) waits for the
next token, so a multi-byte character split across tokens is never emitted as a replacement character.
"""

from __future__ import annotations

MAX_HELD_TOKENS = 6  # a UTF-8 character has at most 4 bytes: past this the bytes are invalid, emit them


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = 0  # end of the text already emitted

    def add(self, token_ids: list[int]) -> str:
        """The text the new ids complete ('' while a character is still incomplete)."""
        self.token_ids.extend(token_ids)
        prefix, text = self._window()
        if text.endswith("\ufffd") and len(self.token_ids) - self.read_offset < MAX_HELD_TOKENS:
            return ""
        return self._advance(prefix, text)

    def flush(self) -> str:
        """Whatever is still held back, at the end of the reply."""
        return self._advance(*self._window()) if self.read_offset < len(self.token_ids) else ""

    def _window(self) -> tuple[str, str]:
        ids = self.token_ids
        prefix = self._decode(ids[self.prefix_offset:self.read_offset])
        return prefix, self._decode(ids[self.prefix_offset:])

    def _advance(self, prefix: str, text: str) -> str:
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return text[len(prefix):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
