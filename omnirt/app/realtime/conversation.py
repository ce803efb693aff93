"""A session's conversation: ordered items, their wire shapes, truncation, and the history the
Thinker gets on each response (earlier user audio and assistant text included). When the engine had to
leave the oldest messages out of a response's prompt (the session's `truncation`), later histories start
after them too: the cut stays put until the conversation overflows again, so the prompt's start is stable.

User audio is kept at the Thinker's input rate (float32), user images as RGB pixels. Assistant audio is not
kept: the Thinker is fed the assistant's transcript, which is also what a truncation cuts.
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnirt.app.audio.pcm import AudioFormatError
from omnirt.app.audio.resample import resample
from omnirt.app.audio.wire import AudioFormat, decode
from omnirt.app.fields import rule
from omnirt.app.images import DETAILS, ImageError, ImageLimits, decode_data_url
from omnirt.app.realtime.events import ProtocolError, check_fields, new_id, require

_ROLES = {"user": ("input_text", "input_audio", "input_image"), "system": ("input_text",),
          "assistant": ("output_text", "output_audio", "text", "audio")}
_BETA_TYPES = {"output_text": "text", "output_audio": "audio"}
_GA_TYPES = {"text": "output_text", "audio": "output_audio"}
ITEM_FIELDS = rule(("type", "role", "content", "id", "call_id", "name", "arguments", "output"),
                   ignored=("object", "status"))  # status: an item sent back
CONTENT_FIELDS = rule(("type", "text", "audio", "transcript", "image_url", "detail"))


@dataclass(slots=True)
class Content:
    type: str  # input_text | input_audio | input_image | output_text | output_audio
    text: str | None = None
    transcript: str | None = None
    audio: np.ndarray | None = None  # user audio at the Thinker's input rate
    image: np.ndarray | None = None  # a user image: RGB uint8 [height, width, 3]
    detail: str = "auto"  # an image's (accepted, echoed)
    audio_ms: int = 0  # assistant audio delivered so far
    is_truncated: bool = False  # cut where the client stopped playing: its response's later output is not added

    @property
    def spoken_text(self) -> str:
        return self.text if self.text is not None else self.transcript or ""


@dataclass(slots=True)
class Item:
    id: str
    role: str
    content: list[Content] = field(default_factory=list)
    status: str = "completed"
    type: str = "message"  # message | function_call (the model's) | function_call_output (the client's result)
    call_id: str | None = None
    name: str | None = None  # function_call: the function
    arguments: str = ""  # function_call: JSON text
    output: str = ""  # function_call_output: the result


class Conversation:
    def __init__(self):
        self.items: list[Item] = []
        self.start: str | None = None  # the first item the history holds (None: the first of all)
        self._sent: list[str] = []  # the item behind each non-system message of the last history

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Insert after `previous_item_id` ("root": first; None: last); returns the id it follows."""
        if any(i.id == item.id for i in self.items):
            raise ProtocolError(f"an item with id {item.id!r} already exists", "duplicate_item_id", "item.id")
        if item.type == "function_call_output" and not any(
                i.type == "function_call" and i.call_id == item.call_id for i in self.items):
            raise ProtocolError(f"no function_call in the conversation has call_id {item.call_id!r}",
                                "invalid_value", "item.call_id")
        if previous_item_id is None:
            index = len(self.items)
        elif previous_item_id == "root":
            index = 0
        else:
            index = self.items.index(self.get(previous_item_id, "previous_item_id")) + 1
        self.items.insert(index, item)
        return self.items[index - 1].id if index else None

    def check_images(self, item: Item, max_images: int) -> None:
        """The conversation is every response's prompt: it holds at most `max_images` images."""
        held = sum(c.image is not None for i in self.items for c in i.content)
        new = sum(c.image is not None for c in item.content)
        if new and held + new > max_images:
            raise ProtocolError(f"the conversation would hold {held + new} images, more than the limit of "
                                f"{max_images}; delete an item with an image first", "too_many_images", "item.content")

    def get(self, item_id: str, param: str = "item_id") -> Item:
        for item in self.items:
            if item.id == item_id:
                return item
        raise ProtocolError(f"no item with id {item_id!r}", "item_not_found", param)

    def delete(self, item_id: str) -> None:
        self.items.remove(self.get(item_id))
        if item_id == self.start:
            self.start = None  # back to the whole conversation; the engine cuts again if it must

    def leave_out(self, num_messages: int) -> None:
        """The engine left the first `num_messages` messages of the last history out of the prompt."""
        if 0 < num_messages < len(self._sent):
            self.start = self._sent[num_messages]

    def truncate(self, item_id: str, content_index: int, audio_end_ms: int) -> int:
        """Cut an assistant audio item at what the client played; returns where it was cut. The transcript is
        cut at the same fraction of its length (the engine does not report word timings), so no unheard text
        stays in the history. A point past the audio sent is its end (as OpenAI clamps it: clients round
        their playback position up). An item still being generated stays cut: what its response sends after
        this is not added to it (the response runs on until it is cancelled)."""
        item = self.get(item_id)
        if item.role != "assistant":
            raise ProtocolError("only assistant items can be truncated", "invalid_value", "item_id")
        if not 0 <= content_index < len(item.content) or item.content[content_index].type != "output_audio":
            raise ProtocolError("content_index does not point at an audio part", "invalid_value", "content_index")
        part = item.content[content_index]
        if audio_end_ms < 0:
            raise ProtocolError("audio_end_ms must be >= 0", "invalid_value", "audio_end_ms")
        end_ms = min(audio_end_ms, part.audio_ms)
        if end_ms < part.audio_ms:
            text = part.transcript or ""
            part.transcript = text[:round(len(text) * end_ms / part.audio_ms)]
            part.audio_ms = end_ms
        part.is_truncated = True
        return end_ms

    def history(self, instructions: str) -> list[dict[str, Any]]:
        """Engine messages: the instructions as the system turn, then every item in order."""
        pairs = self._pairs(instructions)
        leading = next((n for n, (m, _) in enumerate(pairs) if m["role"] != "system"), len(pairs))
        self._sent = [item_id for _, item_id in pairs[leading:]]  # what the engine may leave out, in order
        return [m for m, _ in pairs]

    def preview(self, instructions: str) -> list[dict[str, Any]]:
        """The messages `history` would give now, without taking them as sent (a speculative prefill's)."""
        return [m for m, _ in self._pairs(instructions)]

    def _pairs(self, instructions: str) -> list[tuple[dict[str, Any], str | None]]:
        ids = [i.id for i in self.items]
        pairs = [({"role": "system", "content": instructions}, None)] if instructions else []
        for item in self.items[ids.index(self.start) if self.start in ids else 0:]:
            m = _message(item)
            if m is None:
                continue
            if m.get("tool_calls") and pairs and pairs[-1][0]["role"] == "assistant":  # calls after their text
                last = pairs[-1][0]
                pairs[-1] = ({**last, "tool_calls": last.get("tool_calls", []) + m["tool_calls"]}, pairs[-1][1])
            else:
                pairs.append((m, item.id))
        return pairs


def _message(item: Item) -> dict[str, Any] | None:
    """An item as an engine message (assistant items as their text, calls as tool_calls, results as a tool
    message); None when it holds nothing to say, or is a call cut short (its arguments may not be JSON)."""
    if item.type == "function_call":
        return None if item.status == "incomplete" else {
            "role": "assistant", "content": "", "tool_calls": [{"name": item.name, "arguments": item.arguments}]}
    if item.type == "function_call_output":
        return {"role": "tool", "content": item.output}
    if item.role == "assistant":
        text = "".join(c.spoken_text for c in item.content)
        return {"role": "assistant", "content": text} if text else None
    parts = [_part(c) for c in item.content if c.type != "input_audio" or (c.audio is not None and c.audio.size)]
    return {"role": item.role, "content": parts} if parts else None


def _part(c: Content) -> dict[str, Any]:
    if c.type == "input_audio":
        return {"type": "audio", "audio": c.audio}
    if c.type == "input_image":
        return {"type": "image", "image": c.image}
    return {"type": "text", "text": c.text or ""}


def item_object(item: Item, beta: bool) -> dict[str, Any]:
    """The wire shape of an item (audio and image bytes are never echoed back)."""
    if item.type == "function_call":
        return {"id": item.id, "object": "realtime.item", "type": "function_call", "status": item.status,
                "name": item.name, "call_id": item.call_id, "arguments": item.arguments}
    if item.type == "function_call_output":
        return {"id": item.id, "object": "realtime.item", "type": "function_call_output", "status": item.status,
                "call_id": item.call_id, "output": item.output}
    content = []
    for c in item.content:
        kind = _BETA_TYPES.get(c.type, c.type) if beta else c.type
        if c.type in ("input_text", "output_text"):
            content.append({"type": kind, "text": c.text})
        elif c.type == "input_image":
            content.append({"type": kind, "detail": c.detail})
        else:
            content.append({"type": kind, "transcript": c.transcript})
    return {"id": item.id, "object": "realtime.item", "type": "message", "role": item.role, "status": item.status,
            "content": content}


def parse_item(obj: dict[str, Any], input_format: AudioFormat, audio_rate: int, images: ImageLimits) -> Item:
    """`conversation.item.create`'s `item` -> an Item (audio decoded and resampled to `audio_rate`, images decoded
    within `images`' limits)."""
    check_fields(ITEM_FIELDS, obj, "item")
    kind = require(obj, "type", (str,), "item", "message")
    if kind in ("function_call", "function_call_output"):
        return _function_item(obj, kind)
    if kind != "message":
        raise ProtocolError(f"item type {kind!r} is not supported (message, function_call, function_call_output)",
                            "invalid_value", "item.type")
    _only(obj, ("call_id", "name", "arguments", "output"), "a message")
    role = require(obj, "role", (str,), "item")
    if role not in _ROLES:
        raise ProtocolError("item.role must be user, assistant or system", "invalid_value", "item.role")
    item_id = _item_id(obj)
    parts = require(obj, "content", (list,), "item")
    if not parts:
        raise ProtocolError("item.content must be a non-empty list", "invalid_value", "item.content")
    return Item(item_id, role, [_content(p, role, f"item.content.{i}", input_format, audio_rate, images)
                                for i, p in enumerate(parts)])


def _function_item(obj: dict[str, Any], kind: str) -> Item:
    """A function_call (a call the model made, sent back as history) or a function_call_output (its result)."""
    _only(obj, ("role", "content") + (("output",) if kind == "function_call" else ("name", "arguments")), f"a {kind}")
    item = Item(_item_id(obj), "assistant" if kind == "function_call" else "user", type=kind)
    item.call_id = require(obj, "call_id", (str,), "item")
    if not item.call_id:
        raise ProtocolError(f"a {kind} item needs its `call_id`", "missing_required_parameter", "item.call_id")
    if kind == "function_call_output":
        item.output = require(obj, "output", (str,), "item")
        if item.output is None:
            raise ProtocolError("a function_call_output item needs its `output` (a string: the result, e.g. JSON)",
                                "missing_required_parameter", "item.output")
        return item
    item.name, item.arguments = require(obj, "name", (str,), "item"), require(obj, "arguments", (str,), "item", "")
    if not item.name:
        raise ProtocolError("a function_call item needs its `name`", "missing_required_parameter", "item.name")
    return item


def _only(obj: dict[str, Any], refused: tuple[str, ...], what: str) -> None:
    for key in refused:
        if key in obj:
            raise ProtocolError(f"{what} item has no `{key}`", "unknown_parameter", f"item.{key}")


def _item_id(obj: dict[str, Any]) -> str:
    item_id = require(obj, "id", (str,), "item") or new_id("item")
    if len(item_id) > 64:
        raise ProtocolError("item.id is at most 64 characters", "invalid_value", "item.id")
    return item_id


def _content(part: Any, role: str, where: str, fmt: AudioFormat, audio_rate: int, images: ImageLimits) -> Content:
    if not isinstance(part, dict):
        raise ProtocolError(f"`{where}` must be an object", "invalid_type", where)
    check_fields(CONTENT_FIELDS, part, where)
    kind = require(part, "type", (str,), where)
    if kind not in _ROLES[role]:
        raise ProtocolError(f"a {role} item cannot hold {kind!r} content", "invalid_value", f"{where}.type")
    kind = _GA_TYPES.get(kind, kind)
    if kind in ("input_text", "output_text"):
        return Content(kind, text=require(part, "text", (str,), where, ""))
    if kind == "output_audio":
        return Content(kind, transcript=require(part, "transcript", (str,), where, ""))
    if kind == "input_image":
        return _image(part, where, images)
    data = require(part, "audio", (str,), where)
    if data is None:
        raise ProtocolError(f"`{where}.audio` is required", "missing_required_parameter", f"{where}.audio")
    samples = decode_audio_b64(data, fmt, f"{where}.audio")
    return Content(kind, transcript=require(part, "transcript", (str,), where),
                   audio=resample(samples, fmt.sample_rate, audio_rate))


def decode_audio_b64(data: str, fmt: AudioFormat, param: str) -> np.ndarray:
    try:
        raw = binascii.a2b_base64(data, strict_mode=True)  # base64.b64decode(validate=True), without its regex pass
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError("audio is not valid base64", "invalid_base64", param) from exc
    try:
        return decode(raw, fmt)
    except AudioFormatError as exc:
        raise ProtocolError(f"audio does not match the session's format {fmt.name}: {exc}", "invalid_audio_format",
                            param) from exc


def _image(part: dict[str, Any], where: str, limits: ImageLimits) -> Content:
    """GA's `{"type": "input_image", "image_url": "data:image/...;base64,...", "detail"}`."""
    url = require(part, "image_url", (str,), where)
    if url is None:
        raise ProtocolError(f"`{where}.image_url` is required (a data URL)", "missing_required_parameter",
                            f"{where}.image_url")
    detail = require(part, "detail", (str,), where, "auto")
    if detail not in DETAILS:
        raise ProtocolError(f"`{where}.detail` must be one of {', '.join(DETAILS)}", "invalid_value", f"{where}.detail")
    try:
        return Content("input_image", image=decode_data_url(url, limits), detail=detail)
    except ImageError as exc:
        raise ProtocolError(exc.message, exc.code, f"{where}.image_url") from exc
