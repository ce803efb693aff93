"""A session's engine requests (responses and transcriptions) start here: the engine's refusals become the
Realtime error each one is reported as, so that every request of a session fails the same way."""

from __future__ import annotations

from collections.abc import AsyncIterator

from omnirt.app.ops.metrics import Metrics
from omnirt.app.realtime.events import ProtocolError
from omnirt.pipeline.api import EngineClient, EngineDeadError, EngineOverloaded, OmniRequest, RequestError


async def submit(engine: EngineClient, request: OmniRequest, metrics: Metrics | None, endpoint: str) -> AsyncIterator:
    """`engine.submit(request)`; a refusal raises ProtocolError (an overload is counted as `rejected` under
    `endpoint`). A session is admitted at connect; each of its requests is admitted again here."""
    try:
        return await engine.submit(request)
    except RequestError as exc:
        raise ProtocolError(str(exc), exc.code, exc.param) from exc
    except EngineOverloaded as exc:
        if metrics is not None:
            metrics.requests.labels(endpoint, "rejected").inc()
        raise ProtocolError(f"the server is at capacity: {exc}", "rate_limit_exceeded",
                            error_type="server_error") from exc
    except EngineDeadError as exc:
        raise ProtocolError(str(exc), "engine_unavailable", error_type="server_error") from exc
