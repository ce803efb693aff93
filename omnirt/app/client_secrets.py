"""Ephemeral client secrets, as OpenAI's: a backend that holds a real API key mints a short-lived secret
(`ek_…`) for a browser or a phone, which then starts Realtime sessions with it (WebSocket or WebRTC)
without ever seeing the key.

- `POST /v1/realtime/client_secrets` (GA): `{"expires_after": {"anchor": "created_at", "seconds": N},
  "session": {...}}` -> `{"value", "expires_at", "session"}`.
- `POST /v1/realtime/sessions` (beta): the flat beta session fields, `client_secret.expires_after`
  -> the beta session object with `client_secret: {"value", "expires_at"}`.

A secret carries its session's settings (checked when minted, as a `session.update` would be), starts
sessions until `expires_at` (default 60 s, 10 s to 2 h; a started session outlives it), counts against
the limits of the key that minted it, and stops working when that key leaves the keys file. It starts
sessions and nothing else (`omnirt.app.ops.security`). Secrets live in memory (`omnirt.app.ops.secret_store`; with
`--api-workers`, in the supervising process, so that any worker finds a secret another minted): a restart
voids them.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from pydantic import BaseModel, ConfigDict

from omnirt.app.errors import APIError
from omnirt.app.model_names import served_model
from omnirt.app.ops.secret_store import MAX_LIVE_PER_KEY, ClientSecret
from omnirt.app.realtime.config import SessionConfig, apply_session_update, initial_config, session_object
from omnirt.app.realtime.events import ProtocolError, new_id
from omnirt.app.state import AppState, app_state

log = logging.getLogger(__name__)
router = APIRouter()
DEFAULT_TTL_S, MIN_TTL_S, MAX_TTL_S = 60, 10, 7200
MAX_INSTRUCTIONS_CHARS = 100_000  # in a secret's settings; longer ones go in a session.update once connected


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ClientSecretRequest(_Open):
    expires_after: dict[str, Any] | None = None
    session: dict[str, Any] | None = None


@router.post("/v1/realtime/client_secrets")
async def create_client_secret(request: Request,
                               body: Annotated[ClientSecretRequest | None, Body()] = None) -> dict:
    body = body or ClientSecretRequest()
    session = body.session or {}
    config = _config(request, session, session.get("model"), "session")
    return ga_body(mint(request, request.state.principal.key_id, config, _ttl_s(body.expires_after,
                                                                                "expires_after")))


@router.post("/v1/realtime/sessions")
async def create_session_beta(request: Request, body: Annotated[dict[str, Any] | None, Body()] = None) -> dict:
    body = body or {}
    client_secret = body.get("client_secret") or {}
    if not isinstance(client_secret, dict):
        raise APIError(400, "`client_secret` must be an object", "client_secret", "invalid_type")
    config = _config(request, body, body.get("model"), "")
    secret = mint(request, request.state.principal.key_id, config,
                  _ttl_s(client_secret.get("expires_after"), "client_secret.expires_after"))
    return {**session_object(config, new_id("sess"), beta=True), "expires_at": secret.expires_at,
            "client_secret": {"value": secret.value, "expires_at": secret.expires_at}}


def starting_config(st: AppState, secret: ClientSecret[SessionConfig] | None, model: str | None) -> SessionConfig:
    """A new session's settings: its client secret's, else the server's for `model` (default: the served
    one; an alias of it names it too: `omnirt.app.model_names`). ProtocolError for a model that is not served, or not
    the one the secret is for."""
    served, info = st.settings.model_names, st.engine.info()
    resolved = served_model(model or served[0], served, info.model_aliases)
    if secret is not None:
        if model is not None and resolved != secret.config.model:
            raise ProtocolError(f"this client secret is for the model {secret.config.model!r}, not {model!r}",
                                "invalid_value", "model")
        return secret.config
    if resolved is None:
        raise ProtocolError(f"the model {model!r} does not exist; served: {', '.join(served)} (or an alias: "
                            "GET /v1/models)", "model_not_found", "model")
    return initial_config(info, resolved, st.settings.system_prompt or "")


def http_error(exc: ProtocolError) -> APIError:
    """A Realtime protocol error in OpenAI's HTTP shape (404 for an unknown model, else 400)."""
    return APIError(404 if exc.code == "model_not_found" else 400, exc.message, exc.param, exc.code)


def _config(request: Request, session: dict[str, Any], model: Any, where: str) -> SessionConfig:
    st = app_state(request)
    prefix = f"{where}." if where else ""
    if model is not None and not isinstance(model, str):
        raise APIError(400, f"`{prefix}model` must be a string", f"{prefix}model", "invalid_type")
    if isinstance(session.get("instructions"), str) and len(session["instructions"]) > MAX_INSTRUCTIONS_CHARS:
        raise APIError(400, f"the instructions of a client secret may be {MAX_INSTRUCTIONS_CHARS} characters; send "
                       "longer ones in a session.update once connected", f"{prefix}instructions", "invalid_value")
    try:
        info = st.engine.info()
        return apply_session_update(starting_config(st, None, model), session, info.voice_names, info.model_aliases)
    except ProtocolError as exc:
        if exc.param == "model":
            exc.param = f"{prefix}model"
        elif where == "" and exc.param and exc.param.startswith("session."):
            exc.param = exc.param[len("session."):]  # the beta body is the session itself
        raise http_error(exc) from exc


def mint(request: Request, key_id: str | None, config: SessionConfig, ttl_s: int) -> ClientSecret[SessionConfig]:
    """A new secret of `key_id` (its limits apply to the sessions it starts)."""
    secret = app_state(request).client_secrets.mint(key_id, config, ttl_s)
    if secret is None:
        raise APIError(429, f"this key has as many live client secrets as it may ({MAX_LIVE_PER_KEY}); let some "
                       "expire first", None, "rate_limit_exceeded", headers={"Retry-After": "10"})
    log.info("client secret minted (model %s, expires in %d s)", config.model, ttl_s, extra={"key_id": key_id})
    return secret


def ga_body(secret: ClientSecret[SessionConfig]) -> dict[str, Any]:
    """The GA answer: the secret and the session settings it carries."""
    session = {**session_object(secret.config, new_id("sess"), beta=False), "expires_at": secret.expires_at}
    return {"value": secret.value, "expires_at": secret.expires_at, "session": session}


def _ttl_s(expires_after: Any, where: str) -> int:
    if expires_after is None:
        return DEFAULT_TTL_S
    if not isinstance(expires_after, dict):
        raise APIError(400, f"`{where}` must be an object", where, "invalid_type")
    unknown = sorted(set(expires_after) - {"anchor", "seconds"})
    if unknown:
        raise APIError(400, f"unknown parameter {where}.{unknown[0]}", f"{where}.{unknown[0]}", "unknown_parameter")
    if expires_after.get("anchor", "created_at") != "created_at":
        raise APIError(400, f"`{where}.anchor` must be 'created_at'", f"{where}.anchor", "invalid_value")
    seconds = expires_after.get("seconds", DEFAULT_TTL_S)
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not MIN_TTL_S <= seconds <= MAX_TTL_S:
        raise APIError(400, f"`{where}.seconds` must be a whole number of seconds, {MIN_TTL_S} to {MAX_TTL_S}",
                       f"{where}.seconds", "invalid_value")
    return seconds
