"""Per-key request limits (`omnirt.app.ops.keys.KeyLimits`): requests per minute, as a bucket of a minute's worth
of requests that refills at that rate (so N at once, then one every 60/N s), and HTTP requests in flight.
HTTP requests are held to both by `QuotaGuard`; a WebSocket session start counts as a request per minute
(`take_request`, from the handshake). A key's open sessions are the session registry's to count. Over a
limit: 429 in OpenAI's shape (`rate_limit_exceeded`, `Retry-After`) or a Realtime `error` and close
(`omnirt.app.realtime.registry.limit_error`).
/metrics counts by key id, never the key."""

from __future__ import annotations

import logging
import math

from omnirt.app.errors import APIError, error_response
from omnirt.app.ops.keys import ApiKey
from omnirt.app.ops.metrics import Metrics
from omnirt.app.ops.shared import SharedLimits

log = logging.getLogger(__name__)


class LimitExceeded(Exception):
    def __init__(self, key_id: str, limit: str, message: str, retry_after_s: float):
        super().__init__(message)
        self.key_id, self.limit, self.message, self.retry_after_s = key_id, limit, message, retry_after_s

    def http(self) -> APIError:
        return APIError(429, self.message, None, "rate_limit_exceeded",
                        headers={"Retry-After": str(max(1, math.ceil(self.retry_after_s)))})


class KeyQuotas:
    """This process's view of the keys' limits; the counts are `shared`'s (every API worker's requests)."""

    def __init__(self, metrics: Metrics, shared: SharedLimits | None = None, worker: int = 0):
        self.metrics, self.shared, self.worker = metrics, shared or SharedLimits(), worker

    def take_request(self, key: ApiKey) -> None:
        """One request (or session start) against the key's requests per minute; LimitExceeded if none is left."""
        rpm = key.limits.requests_per_minute
        if rpm is not None and (wait_s := self.shared.take_request(key.id, rpm)):
            raise refused(self.metrics, LimitExceeded(
                key.id, "requests_per_minute", f"Rate limit reached for API key {key.id!r} on requests per min "
                f"(RPM): limit {rpm}. Please try again in {math.ceil(wait_s)} s.", wait_s))
        self.metrics.key_requests.labels(key.id).inc()

    def begin(self, key: ApiKey) -> None:
        """An HTTP request starts: within the key's requests in flight and per minute, or LimitExceeded."""
        limit = key.limits.max_requests
        if not self.shared.begin_request(self.worker, key.id, limit):
            raise refused(self.metrics, LimitExceeded(
                key.id, "max_requests", f"API key {key.id!r} has {limit} requests in flight, its limit "
                "(max_requests); retry when one has finished.", 1.0))
        try:
            self.take_request(key)
        except LimitExceeded:
            self.shared.end_request(self.worker, key.id)
            raise
        self.metrics.key_active.labels(key.id, "requests").inc()

    def end(self, key: ApiKey) -> None:
        self.shared.end_request(self.worker, key.id)
        self.metrics.key_active.labels(key.id, "requests").dec()


def refused(metrics: Metrics, exc: LimitExceeded) -> LimitExceeded:
    """Count and log a refusal by a key's limit; returns it, to be raised."""
    metrics.key_limited.labels(exc.key_id, exc.limit).inc()
    log.warning("refused by the key's %s limit: %s", exc.limit, exc.message, extra={"key_id": exc.key_id})
    return exc


class QuotaGuard:
    """Holds each HTTP request of a key to its limits (ASGI, inside the access check that names the key)."""

    def __init__(self, app, quotas: KeyQuotas):
        self.app, self.quotas = app, quotas

    async def __call__(self, scope, receive, send):
        principal = scope.get("state", {}).get("principal") if scope["type"] == "http" else None
        if principal is None or principal.key is None:
            return await self.app(scope, receive, send)
        key = principal.key
        try:
            self.quotas.begin(key)
        except LimitExceeded as exc:
            return await error_response(exc.http())(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        finally:
            self.quotas.end(key)
