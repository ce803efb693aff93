"""Audio files through PyAV (FFmpeg's codecs): the chat API's output formats, encoded as the audio streams
in, and its input files, decoded with a bound on their length.

Output: `wav` and `pcm16` need no codec; `mp3`, `opus` (Ogg Opus), `aac` (ADTS) and `flac` are
encoded by one `StreamEncoder` per reply, whose pieces, concatenated, are one valid file: a streaming
reply sends each piece as soon as the encoder has it. A streamed `wav` is its PCM16 samples (a WAV
header needs the length first), as OpenAI streams `pcm16`.

Input: `wav`, `mp3` and `flac` (OpenAI takes wav and mp3), each opened as the format it says it is
(no probing), decoded to float32 mono at its own rate, and refused once it runs longer than the limit,
before the rest is decoded.

PyAV is imported where it is used: a server without it (a bare wheel set) still serves text, `pcm16` and
`wav` output.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import numpy as np

from omnirt.app.audio.pcm import AudioFormatError, encode_wav

BIT_RATE = 64000  # lossy formats: plenty for 24 kHz mono speech


@dataclass(slots=True, frozen=True)
class Codec:
    container: str  # FFmpeg's muxer
    codec: str  # FFmpeg's encoder
    mime: str
    options: dict[str, str] = field(default_factory=dict)  # the muxer's


CODECS = {
    "mp3": Codec("mp3", "libmp3lame", "audio/mpeg"),
    "opus": Codec("ogg", "libopus", "audio/ogg", {"page_duration": "20000"}),  # a page per 20 ms packet, not per 1 s
    "aac": Codec("adts", "aac", "audio/aac"),
    "flac": Codec("flac", "flac", "audio/flac"),
}
OUTPUT_FORMATS = ("wav", "pcm16", *CODECS)
INPUT_FORMATS = ("wav", "mp3", "flac")


class _Pieces:
    """A write-only file for the muxer: what it wrote since the last `take()`. It cannot seek, so no muxer
    goes back to patch a header (FLAC's sample count stays 'unknown', as in any stream)."""

    def __init__(self):
        self._parts: list[bytes] = []

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self._parts = b"".join(self._parts), []
        return out


class StreamEncoder:
    """Mono PCM16 in, the next bytes of the file out; `close()` gives the rest."""

    def __init__(self, fmt: str, sample_rate: int):
        self.fmt, self.sample_rate = fmt, sample_rate
        self._codec = CODECS.get(fmt)
        self._out = _Pieces()
        if self._codec is not None:
            self._container = _av().open(self._out, mode="w", format=self._codec.container, options=self._codec.options)
            self._stream = self._container.add_stream(self._codec.codec, rate=sample_rate, layout="mono")
            self._stream.codec_context.bit_rate = BIT_RATE

    def encode(self, pcm16: bytes) -> bytes:
        if self._codec is None or not pcm16:
            return pcm16 if self._codec is None else b""
        frame = _av().AudioFrame.from_ndarray(np.frombuffer(pcm16, "<i2").reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.sample_rate
        self._mux(frame)
        return self._out.take()

    def close(self) -> bytes:
        if self._codec is None:
            return b""
        self._mux(None)  # the encoder's last packets
        self._container.close()
        return self._out.take()

    def _mux(self, frame) -> None:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)


def encode_file(pcm16: bytes, sample_rate: int, fmt: str) -> bytes:
    """A whole reply as one file of `fmt` (`pcm16`: the raw samples)."""
    if fmt == "wav":
        return encode_wav(pcm16, sample_rate)
    encoder = StreamEncoder(fmt, sample_rate)
    return encoder.encode(pcm16) + encoder.close()


def decode_file(data: bytes, fmt: str, max_seconds: float) -> tuple[np.ndarray, int]:
    """A `fmt` file -> (float32 mono samples, sample rate). AudioFormatError if it is not a readable `fmt`
    file, holds no audio, or runs past `max_seconds` (found out frame by frame, before the rest is decoded)."""
    av = _av()
    try:
        with av.open(io.BytesIO(data), format=fmt) as container:
            return _decode(container, fmt, max_seconds)
    except AudioFormatError:
        raise
    except (av.FFmpegError, ValueError, IndexError) as exc:  # IndexError: no audio stream
        raise AudioFormatError(f"not a readable {fmt} file") from exc


def _decode(container, fmt: str, max_seconds: float) -> tuple[np.ndarray, int]:
    stream = container.streams.audio[0]
    mono = _av().AudioResampler(format="flt", layout="mono")  # FFmpeg's downmix; the file's own rate
    parts, num_samples = [], 0
    for frame in container.decode(stream):
        for out in mono.resample(frame):
            parts.append(out.to_ndarray().reshape(-1))
            num_samples += parts[-1].size
        if num_samples > max_seconds * frame.sample_rate:
            raise AudioTooLong(max_seconds)
    if not num_samples:
        raise AudioFormatError(f"the {fmt} file holds no audio")
    return np.concatenate(parts).astype(np.float32, copy=False), stream.codec_context.sample_rate


def _av():
    """PyAV, imported on first use."""
    import av  # deferred: a server without PyAV still serves text, pcm16 and wav

    return av


class AudioTooLong(AudioFormatError):
    def __init__(self, max_seconds: float):
        super().__init__(f"the audio is longer than the limit of {max_seconds:g} s")
        self.max_seconds = max_seconds
