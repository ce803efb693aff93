"""Which web pages may drive the server. CORS does not apply to WebSocket upgrades, and a page may post a
form or a `text/plain` body anywhere, so without this any site a user visits could open a Realtime
session on a server on their machine or LAN. Every WebSocket handshake and every HTTP request that is
not a read (methods other than GET, HEAD, OPTIONS) that carries an `Origin` header must come from the
server's own origin (the `Origin`'s host and port are the `Host` header's, and its name is one the
server answers to, `omnirt.app.ops.hosts`: a re-pointed name is no own origin) or one listed in `--cors-origins`
(`*`: any); anything else gets 403 (`origin_not_allowed`; a handshake is refused before accept) and a
warning in the log. Clients that send no `Origin` (SDKs, curl, servers) are not affected.
Behind a proxy that rewrites `Host`, list the public origin in `--cors-origins`.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from omnirt.app.errors import APIError, error_response
from omnirt.app.ops.hosts import HostRule, hostname

log = logging.getLogger(__name__)
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
DEFAULT_PORTS = {"http": ":80", "https": ":443"}


def normalize(origin: str) -> str:
    return origin.strip().lower().rstrip("/")


def is_allowed(origin: str, host: str | None, allowed: frozenset[str], hosts: HostRule) -> bool:
    """Whether a page of `origin` may use a server reached as `host` that answers to `hosts`; "null"
    (sandboxed, file://) may not."""
    origin = normalize(origin)
    if "*" in allowed or origin in allowed:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in DEFAULT_PORTS or not parts.netloc or host is None:
        return False
    default = DEFAULT_PORTS[parts.scheme]
    same = parts.netloc.removesuffix(default) == host.strip().lower().removesuffix(default)
    return same and hosts.allows(hostname(parts.netloc))


class OriginCheck:
    def __init__(self, app, allowed: tuple[str, ...], hosts: HostRule):
        self.app, self.allowed, self.hosts = app, frozenset(normalize(o) for o in allowed), hosts

    async def __call__(self, scope, receive, send):
        is_ws = scope["type"] == "websocket"
        if not is_ws and (scope["type"] != "http" or scope["method"] in READ_METHODS):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        origin, host = headers.get(b"origin"), headers.get(b"host")
        if origin is None or is_allowed(origin.decode("latin-1"), host and host.decode("latin-1"), self.allowed,
                                          self.hosts):
            return await self.app(scope, receive, send)
        what = "WebSocket" if is_ws else scope["method"]
        log.warning("refused %s %s from origin %r: neither this server's own origin nor in --cors-origins", what,
                    scope["path"], origin.decode("latin-1")[:200])
        if is_ws:
            return await send({"type": "websocket.close", "code": 1008, "reason": "origin not allowed"})
        response = error_response(APIError(403, f"Pages from {origin.decode('latin-1')[:200]!r} may not use this "
                                           "server: it is neither the server's own origin nor one in --cors-origins.",
                                           code="origin_not_allowed"))
        return await response(scope, receive, send)
