"""Transport limits. As pure ASGI middlewares (so that client disconnects still reach the routes):
request bodies over a size (declared or streamed in chunks) get 413, and a client that stops reading
a streamed response is disconnected once one write has waited `timeout_s`, without slowing others.
A `TokenBucket` bounds how far ahead of real time a Realtime session's input audio may come, and an
API key's requests per minute."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from fastapi import HTTPException
from starlette.requests import ClientDisconnect

from omnirt.app.errors import APIError, error_response

log = logging.getLogger(__name__)


class BodyTooLarge(HTTPException):
    code = "payload_too_large"

    def __init__(self, max_bytes: int):
        super().__init__(413, f"request body over {max_bytes} bytes")


class BodySizeLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            response = error_response(APIError(413, f"request body over {self.max_bytes} bytes",
                                               code="payload_too_large"))
            return await response(scope, receive, send)
        num_received = 0

        async def limited_receive():
            nonlocal num_received
            message = await receive()
            num_received += len(message.get("body", b""))
            if num_received > self.max_bytes:  # a chunked body without (or lying about) its length
                raise BodyTooLarge(self.max_bytes)
            return message

        return await self.app(scope, limited_receive, send)


class TokenBucket:
    """A bucket of `burst` units that refills at `rate` units per second. For a Realtime session's input
    audio (units: seconds of audio) a microphone (1x) never empties it; a client that pushes audio as fast
    as the network takes it does within seconds, and would otherwise spend the event loop's time
    (decoding, resampling, VAD) that every other session shares. For an API key's requests per minute
    (units: requests) it allows a burst of a minute's worth, then the steady rate."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self._clock = rate, burst, clock
        self._level, self._at = burst, clock()

    def take(self, amount: float) -> bool:
        """Spend `amount`; False (and nothing spent) if the bucket does not hold that much."""
        self._refill()
        if amount > self._level:
            return False
        self._level -= amount
        return True

    def wait_s(self, amount: float) -> float:
        """How long until the bucket holds `amount` (0 if it does now)."""
        self._refill()
        return max(0.0, amount - self._level) / self.rate

    def _refill(self) -> None:
        now = self._clock()
        self._level, self._at = min(self.burst, self._level + (now - self._at) * self.rate), now


class ClientTooSlow(OSError):
    """Raised from `send`: Starlette treats an OSError there as a client that went away."""


class SlowClientGuard:
    def __init__(self, app, timeout_s: float):
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        timed_out = False

        async def bounded_send(message):
            nonlocal timed_out
            try:
                async with asyncio.timeout(self.timeout_s):  # no extra task per chunk, unlike wait_for
                    await send(message)
            except TimeoutError:
                timed_out = True
                log.warning("%s %s: client not reading for %.1f s; disconnecting", scope["method"], scope["path"],
                            self.timeout_s)
                raise ClientTooSlow("client not reading") from None

        try:
            await self.app(scope, receive, bounded_send)
        except (ClientTooSlow, ClientDisconnect):
            if not timed_out:
                raise
            # returning with the response incomplete makes the server close the connection
