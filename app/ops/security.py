"""API keys and CORS. One check serves every transport: HTTP takes `Authorization: Bearer <key>`;
WebSocket (and the WebRTC signalling POST) take the same header, or the subprotocol
`openai-insecure-api-key.<key>` that browsers use since they cannot set headers on a WebSocket."""

from __future__ import annotations

import hmac

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from app.errors import APIError, error_response

KEY_SUBPROTOCOL = "openai-insecure-api-key."
PROTECTED_PREFIXES = ("/v1/",)  # /health, /metrics and the demo page stay open


def presented_key(scope) -> str | None:
    """The API key a request or WebSocket handshake carries, if any."""
    headers = {k.lower(): v for k, v in scope.get("headers", ())}
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    for proto in headers.get(b"sec-websocket-protocol", b"").decode("latin-1").split(","):
        if proto.strip().startswith(KEY_SUBPROTOCOL):
            return proto.strip()[len(KEY_SUBPROTOCOL):]
    return None


def is_authorized(scope, api_keys: tuple[str, ...]) -> bool:
    if not api_keys or not scope["path"].startswith(PROTECTED_PREFIXES):
        return True
    key = presented_key(scope)
    return key is not None and any(hmac.compare_digest(key.encode(), k.encode()) for k in api_keys)


class ApiKeyAuth:
    """401 in OpenAI's shape on HTTP; a WebSocket handshake is refused (close 1008 before accept -> 403)."""

    def __init__(self, app, api_keys: tuple[str, ...]):
        self.app, self.api_keys = app, api_keys

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or is_authorized(scope, self.api_keys):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008, "reason": "invalid or missing API key"})
        message = ("You didn't provide an API key (Authorization: Bearer <key>)." if presented_key(scope) is None
                   else "Incorrect API key provided.")
        response = error_response(APIError(401, message, code="invalid_api_key",
                                           headers={"WWW-Authenticate": "Bearer"}))
        return await response(scope, receive, send)


def install(app: FastAPI, api_keys: tuple[str, ...], cors_origins: tuple[str, ...]) -> None:
    """CORS is closed unless origins are listed; keys off when none are given."""
    if api_keys:
        app.add_middleware(ApiKeyAuth, api_keys=api_keys)
    if cors_origins:  # added last, so it runs first and answers preflights before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
