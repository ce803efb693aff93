"""Who is calling: API keys, client secrets, and the order of the access checks. One check serves every
transport: HTTP takes `Authorization: Bearer <credential>`; WebSocket (and the WebRTC signalling POST)
take the same header, or the subprotocol `openai-insecure-api-key.<credential>` that browsers use since
they cannot set headers on a WebSocket.

A credential is an API key (`omnirt.app.ops.keys`) or a client secret (`ek_…`, `omnirt.app.client_secrets`).
A client secret starts Realtime sessions (`SECRET_ROUTES`) and does nothing else: minting more, chat,
models, hangups get 403 `client_secret_not_allowed`. The resolved caller rides the request's state
(`request.state.principal`) to the quotas and the routes.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from omnirt.app.errors import APIError, error_response
from omnirt.app.ops.hosts import HostCheck, HostRule
from omnirt.app.ops.keys import SECRET_PREFIX, ApiKey, KeyRing
from omnirt.app.ops.origins import OriginCheck
from omnirt.app.ops.quotas import KeyQuotas, QuotaGuard
from omnirt.app.ops.secret_store import ClientSecret, SecretStore

KEY_SUBPROTOCOL = "openai-insecure-api-key."
PROTECTED_PREFIXES = ("/v1/",)  # /health, /metrics, the demo page and its /demo/ routes stay open
SECRET_ROUTES = {("websocket", "/v1/realtime"), ("POST", "/v1/realtime"), ("POST", "/v1/realtime/calls")}


@dataclass(slots=True, frozen=True)
class Principal:
    """The caller: whose id and limits apply (`key`; None on an open server) and, when it came with one,
    the client secret whose session settings a new session starts with."""

    key: ApiKey | None = None
    secret: ClientSecret | None = None

    @property
    def key_id(self) -> str | None:
        return None if self.key is None else self.key.id


def presented_key(scope) -> str | None:
    """The credential a request or WebSocket handshake carries, if any."""
    headers = {k.lower(): v for k, v in scope.get("headers", ())}
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    for proto in headers.get(b"sec-websocket-protocol", b"").decode("latin-1").split(","):
        if proto.strip().startswith(KEY_SUBPROTOCOL):
            return proto.strip()[len(KEY_SUBPROTOCOL):]
    return None


def authenticate(scope, keys: KeyRing, store: SecretStore) -> Principal:
    """The caller of a request or handshake, or the APIError (401, 403) that refuses it."""
    if not scope["path"].startswith(PROTECTED_PREFIXES):
        return Principal()
    credential = presented_key(scope)
    if credential is not None and credential.startswith(SECRET_PREFIX):
        return _secret_principal(scope, credential, keys, store)
    if keys.is_open:
        return Principal()
    key = None if credential is None else keys.find(credential)
    if key is None:
        message = ("You didn't provide an API key (Authorization: Bearer <key>)." if credential is None
                   else "Incorrect API key provided.")
        raise APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return Principal(key)


def _secret_principal(scope, value: str, keys: KeyRing, store: SecretStore) -> Principal:
    secret = store.find(value)
    key = None if secret is None or secret.key_id is None else keys.get(secret.key_id)
    # a secret works while its key is in force (or, minted on an open server, while the server is open)
    if secret is None or not (key is not None if secret.key_id else keys.is_open):
        raise APIError(401, "The client secret is unknown or has expired; mint a new one.", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    route = ("websocket" if scope["type"] == "websocket" else scope["method"], scope["path"])
    if route not in SECRET_ROUTES:
        raise APIError(403, "A client secret only starts Realtime sessions (GET /v1/realtime as a WebSocket, POST "
                       "/v1/realtime/calls); this needs an API key.", code="client_secret_not_allowed")
    return Principal(key, secret)


class AccessCheck:
    """Resolve the caller of every HTTP request and WebSocket handshake into `state.principal`. A refusal is
    OpenAI's error shape on HTTP; a handshake is refused before accept (close 1008 -> HTTP 403)."""

    def __init__(self, app, keys: KeyRing, store: SecretStore):
        self.app, self.keys, self.store = app, keys, store

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        try:
            principal = authenticate(scope, self.keys, self.store)
        except APIError as exc:
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008, "reason": exc.message[:123]})
            return await error_response(exc)(scope, receive, send)
        scope.setdefault("state", {})["principal"] = principal
        return await self.app(scope, receive, send)


def install(app: FastAPI, keys: KeyRing, store: SecretStore, quotas: KeyQuotas, cors_origins: tuple[str, ...],
            allowed_hosts: tuple[str, ...]) -> None:
    """Outermost first: the Host check, CORS (answers preflights), the origin check, the caller, the key's
    request limits. CORS is closed unless origins are listed."""
    hosts = HostRule.of(allowed_hosts)
    app.add_middleware(QuotaGuard, quotas=quotas)
    app.add_middleware(AccessCheck, keys=keys, store=store)
    app.add_middleware(OriginCheck, allowed=cors_origins, hosts=hosts)
    if cors_origins:  # added after those, so it runs before them and answers preflights before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], expose_headers=["Location", "Retry-After"],
                           max_age=600)
    app.add_middleware(HostCheck, rule=hosts)  # added last: runs first
