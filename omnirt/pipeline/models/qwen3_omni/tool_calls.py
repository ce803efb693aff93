"""Qwen's tool-call format: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` in the Thinker's
text, one block per call. The parser turns the streamed text into plain text and calls with incremental
arguments; the grammar that forces calls is a structural tag of this format for xgrammar."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from omnirt.pipeline.stage.grammar import json_schema_ebnf

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


def tool_call_spec(tools: list[dict], tool_choice: str | dict, parallel: bool) -> dict:
    """The constraint that makes the reply nothing but calls (xgrammar's structural tag): of any of `tools`
    (tool_choice "required": one, or more separated by newlines if `parallel`) or of the one function
    tool_choice names; each call's arguments match that function's parameters schema, compactly."""
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    functions = [t["function"] for t in tools if named is None or t["function"]["name"] == named]
    tags = [{"type": "tag", "begin": f'{CALL_START}\n{{"name": {json.dumps(f["name"])}, "arguments": ',
             "content": {"type": "grammar", "grammar": json_schema_ebnf(f.get("parameters") or {"type": "object"})},
             "end": f"}}\n{CALL_END}"} for f in functions]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
             "stop_after_first": named is not None or not parallel}
    return {"type": "structural_tag", "tag": {"type": "structural_tag", "format": calls}}


@dataclass(slots=True)
class CallDelta:
    """A piece of the `index`th call: its name once (with empty arguments), then pieces of its arguments."""

    index: int
    name: str | None
    arguments: str


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Incremental: `feed(text)` returns the new plain text and call pieces, in order; `close()` the rest.
    Arguments stream as the model writes them, short of what may be the call's closing brace."""

    def __init__(self):
        self.num_calls = 0
        self._buf = ""
        self._in_call = False
        self._sent_args: str | None = None  # the arguments sent for the open call (None: its name not yet)
        self._args_at = 0  # where its arguments start in the buffer

    def feed(self, text: str) -> list[str | CallDelta]:
        self._buf += text
        out: list[str | CallDelta] = []
        while True:
            if not self._in_call:
                at = self._buf.find(CALL_START)
                if at < 0:
                    # held back: what may start a call marker, and the newlines a call would follow
                    sent = self._buf[:len(self._buf) - _held(self._buf, CALL_START)].rstrip("\n")
                    self._text(out, sent)
                    self._buf = self._buf[len(sent):]
                    return out
                self._text(out, self._buf[:at].rstrip("\n") if self.num_calls == 0 else self._buf[:at].strip())
                self._buf, self._in_call, self._sent_args = self._buf[at + len(CALL_START):], True, None
                continue
            end = self._buf.find(CALL_END)
            if end < 0:
                self._stream_args(out, self._buf[:len(self._buf) - _held(self._buf, CALL_END)])
                return out
            self._end_call(out, self._buf[:end])
            self._buf, self._in_call = self._buf[end + len(CALL_END):].lstrip(), False

    def close(self) -> list[str | CallDelta]:
        """At the end of the reply: a call cut short keeps what it has; held-back text is released."""
        out: list[str | CallDelta] = []
        if self._in_call:
            if self._sent_args is not None:
                self._stream_args(out, self._buf)
        else:
            self._text(out, self._buf)
        self._buf = ""
        return out

    def _text(self, out: list, text: str) -> None:
        if text and not (self.num_calls and text.isspace()):
            out.append(text)

    def _stream_args(self, out: list, body: str) -> None:
        if self._sent_args is None:
            header = _HEADER.match(body)
            if header is None:
                return
            out.append(CallDelta(self.num_calls, json.loads(f'"{header.group(1)}"'), ""))
            self._sent_args, self._args_at = "", header.end()
        args = body[self._args_at:].rstrip()
        if args.endswith("}"):  # perhaps the call's own closing brace: held back until more follows
            args = args[:-1].rstrip()
        if args.startswith(self._sent_args) and len(args) > len(self._sent_args):
            out.append(CallDelta(self.num_calls, None, args[len(self._sent_args):]))
            self._sent_args = args

    def _end_call(self, out: list, body: str) -> None:
        """The call's whole body is known: finish its arguments, or take it whole if its header was unusual
        (keys in another order); a body that is not a call at all stays text."""
        if self._sent_args is None:
            call = _whole_call(body)
            if call is None:
                self._text(out, CALL_START + body + CALL_END)
                return
            out.append(CallDelta(self.num_calls, call[0], ""))
            if call[1]:
                out.append(CallDelta(self.num_calls, None, call[1]))
        else:
            self._stream_args(out, body)
        self.num_calls += 1


def _whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a complete call body, or None if it is not one."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args: Any = call.get("arguments", {})
    return call["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
