"""The messages between the API process and the engine core process, and their wire encoding.

Both directions are closed unions of msgspec structs encoded as msgpack (as vLLM's EngineCore
client does): no pickled objects cross per request or per step. Audio in request messages
(float32 numpy arrays) travels as a msgpack extension of raw little-endian bytes, images (uint8 RGB arrays) as
one of their height, width and pixels.
"""

from __future__ import annotations

import msgspec
import numpy as np

from omnirt.pipeline.types import AudioChunk, EngineInfo, EngineStats, Finished, OmniRequest, TextDelta, ToolCallDelta

FLOAT32_AUDIO = 1  # msgpack extension code: a 1-D float32 array
RGB_IMAGE = 2  # msgpack extension code: a uint8 [height, width, 3] array, after its height and width (2 x uint32)


class Abort(msgspec.Struct, tag=True):
    request_id: str
    error: str | None = None


class Shutdown(msgspec.Struct, tag=True):
    pass


class ClientGone(msgspec.Struct, tag=True):
    """An API process exited (on the control socket): abort its requests."""

    client: int


ToCore = OmniRequest | Abort | Shutdown | ClientGone


class Ready(msgspec.Struct, tag=True):
    info: EngineInfo


class StartFailed(msgspec.Struct, tag=True):
    message: str


class Accepted(msgspec.Struct, tag=True):
    request_id: str


class Rejected(msgspec.Struct, tag=True):
    """`submit` raised: RequestError (kind "invalid"), EngineOverloaded ("overloaded") or anything else
    ("internal": a bug, raised in the API process as a RuntimeError, i.e. a 500)."""

    request_id: str
    kind: str
    message: str
    param: str | None = None
    code: str = "invalid_request"
    stage: str = ""
    capacity: int = 0
    retry_after_s: float = 0.0


class EventBatch(msgspec.Struct, tag=True):
    """Everything the core had for the API process since its last send, in order."""

    items: list[Accepted | Rejected | TextDelta | ToolCallDelta | AudioChunk | Finished]


FromCore = Ready | StartFailed | EventBatch | EngineStats


def num_bytes(item) -> int:
    """What an output item weighs in the byte bounds on either side (its PCM, plus a fixed cost)."""
    return 64 + len(item.pcm16) if isinstance(item, AudioChunk) else 64


def _enc_hook(obj):
    if isinstance(obj, np.ndarray) and obj.ndim == 1:
        return msgspec.msgpack.Ext(FLOAT32_AUDIO, obj.astype("<f4", copy=False).tobytes())
    if isinstance(obj, np.ndarray) and obj.dtype == np.uint8 and obj.ndim == 3 and obj.shape[2] == 3:
        return msgspec.msgpack.Ext(RGB_IMAGE, np.asarray(obj.shape[:2], "<u4").tobytes() + obj.tobytes())
    raise TypeError(f"cannot send {type(obj).__name__} to the engine core")


def _ext_hook(code: int, data: memoryview):
    if code == FLOAT32_AUDIO:
        return np.frombuffer(data, dtype="<f4").copy()
    if code == RGB_IMAGE:
        height, width = np.frombuffer(data[:8], dtype="<u4")
        return np.frombuffer(data[8:], dtype=np.uint8).reshape(int(height), int(width), 3).copy()
    raise ValueError(f"unknown msgpack extension {code}")


encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
to_core = msgspec.msgpack.Decoder(ToCore, ext_hook=_ext_hook)
from_core = msgspec.msgpack.Decoder(FromCore)
