"""uvicorn's WebSocket protocol (websockets' sans-I/O parser), reading each connection more cheaply: a microphone
sends 50 small messages a second, and the protocol's own cost per message is most of what a silent session costs.

Two changes to `WebSocketsSansIOProtocol`, the protocol uvicorn picks where `websockets` is installed:
- reads go into the connection's own buffer (`asyncio.BufferedProtocol`: `recv_into`) rather than into a new
  256 KiB `bytes` object per read (asyncio's `max_size`), which cost ~20 µs a read here against ~2 µs;
- reading pauses once `MAX_QUEUED_MESSAGES` messages, or one of `LARGE_MESSAGE_BYTES` or more, wait for the app,
  not after every message (uvicorn's pause and resume are two `epoll_ctl` calls per message). It resumes, as
  uvicorn's does, once the app has taken every queued message: what a connection holds stays bounded.

It also bounds what the kernel holds for a connection that does not read: each WebSocket's send buffer is set to
`SEND_BUFFER_BYTES`, where Linux would grow it to 4 MiB (over a minute of base64 audio). Past that a send waits, so
`--slow-client-timeout` closes a client that stopped reading within seconds of the buffer filling, and not after
the keepalive's ping timeout (40 s), which counts it as a dropped connection rather than a slow client.

Everything else (the handshake, control frames, close, UTF-8 checks, the size limit) is uvicorn's. Where uvicorn
lacks the sans-I/O protocol, `PROTOCOL` is None and uvicorn's default serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

try:
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
except ImportError:  # uvicorn before the sans-I/O protocol, or without `websockets`
    WebSocketsSansIOProtocol = None

READ_BUFFER_BYTES = 16 * 2**10  # one read's most: a 20 ms append is ~1.4 KB; larger messages take several reads
MAX_QUEUED_MESSAGES = 8
LARGE_MESSAGE_BYTES = 64 * 2**10
# ~4 s of a reply's base64 audio (64 KB/s); bounds a connection's throughput at sndbuf / RTT, 2.5 MB/s at 100 ms
SEND_BUFFER_BYTES = 256 * 2**10

if WebSocketsSansIOProtocol is not None:

    class CheapReadProtocol(WebSocketsSansIOProtocol, asyncio.BufferedProtocol):
        """`WebSocketsSansIOProtocol` reading into its own buffer, pausing only when messages pile up."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._read_buffer = memoryview(bytearray(READ_BUFFER_BYTES))

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:  # not under a test transport
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)

        def get_buffer(self, sizehint: int) -> memoryview:
            return self._read_buffer

        def buffer_updated(self, nbytes: int) -> None:
            self.data_received(bytes(self._read_buffer[:nbytes]))

        def send_receive_event_to_app(self) -> None:
            num_bytes = sum(map(len, self.frames))
            was_paused, self.read_paused = self.read_paused, True  # uvicorn's pause after every message: skipped
            super().send_receive_event_to_app()
            self.read_paused = was_paused
            if not self.read_paused and (self.queue.qsize() >= MAX_QUEUED_MESSAGES
                                         or num_bytes >= LARGE_MESSAGE_BYTES):
                self.read_paused = True
                self.transport.pause_reading()

    PROTOCOL: type | None = CheapReadProtocol
else:  # pragma: no cover
    PROTOCOL = None
