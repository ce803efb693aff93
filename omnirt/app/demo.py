"""What the demo page (`omnirt/web/`, served at `/`) calls besides the Realtime API, so that it works with keys on
while the real key never reaches the browser.

- `GET /demo/config` -> `{"model", "voices", "default", "aliases", "auth", "ice_servers"}`: the served model
  (shown on load), the voices (`GET /v1/voices`), the STUN/TURN servers its peer connection should use
  (`--webrtc-ice-servers`; none by default), and `auth`, how the page gets in: `none` (the server has no
  keys), `client_secret` (the operator started it with `--demo-key-id ID`: before each call the page
  fetches a client secret), or `api_key` (keys are on and the demo is not enabled: the page says so
  instead of calling).
- `POST /demo/client_secret` (with `--demo-key-id ID` only; 404 `demo_not_enabled` otherwise) -> a client
  secret as `POST /v1/realtime/client_secrets` answers it, minted under the key `ID`: each one counts as a
  request against ID's `requests_per_minute`, and the sessions it starts against ID's `max_sessions`.

The origin check refuses this POST from pages of other origins, and CORS keeps them from reading the
answer; a client that sends no `Origin` (curl) gets a secret like the page does. So enabling the demo lets
anyone who can reach the server talk to the agent, within key ID's limits: give it a key of its own.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from omnirt.app.client_secrets import DEFAULT_TTL_S, ga_body, mint, starting_config
from omnirt.app.errors import APIError
from omnirt.app.ops.quotas import LimitExceeded
from omnirt.app.state import app_state
from omnirt.pipeline.api import EngineInfo

router = APIRouter(prefix="/demo", include_in_schema=False)


def voice_list(info: EngineInfo) -> dict:
    """The model's voices, the default, and the other names each answers to (OpenAI's, from the profile)."""
    return {"voices": list(info.voices), "default": info.default_voice, "aliases": dict(info.voice_aliases)}


@router.get("/config")
async def config(request: Request) -> dict:
    st = app_state(request)
    auth = "none" if st.keys.is_open else "client_secret" if st.settings.demo_key_id else "api_key"
    return {"model": st.settings.model_names[0], **voice_list(st.engine.info()), "auth": auth,
            "ice_servers": [s.browser() for s in st.settings.ice.servers]}


@router.post("/client_secret")
async def client_secret(request: Request) -> dict:
    st = app_state(request)
    key_id = st.settings.demo_key_id
    if key_id is None:
        raise APIError(404, "the demo has no client secrets: start the server with --demo-key-id ID", None,
                       "demo_not_enabled")
    key = st.keys.get(key_id)
    if key is None:
        raise APIError(503, f"the demo's key {key_id!r} is not in the keys file", None, "demo_not_enabled")
    try:
        st.quotas.take_request(key)
    except LimitExceeded as exc:
        raise exc.http() from exc
    return ga_body(mint(request, key.id, starting_config(st, None, None), DEFAULT_TTL_S))
