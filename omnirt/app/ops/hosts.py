"""Which names the server answers to: the guard against DNS rebinding. A page at
`http://attacker.example:8091` whose name its owner re-points at 127.0.0.1 is, to the browser, still that
origin, so it may read the answers; what gives it away is the `Host` header, which names the attacker's
name. So every HTTP request and WebSocket handshake whose `Host` is not one of these is refused first
(403 `host_not_allowed`; a handshake is closed before accept with 1008), as Jupyter and Vite do:

- `localhost` and `*.localhost` (browsers resolve them to loopback themselves, never through DNS);
- any IP address literal, IPv4 or bracketed IPv6 (`[::1]`): a page whose origin is an IP address was served
  from that address, so no name was re-pointed;
- the name `--host` binds to, when it is a name;
- the names in `--allowed-hosts` (`.example.com` also matches its subdomains; `*`: any name, the guard off).

Only the name is compared; the port may be any (a proxy or a port mapping changes it). A request without
`Host` (HTTP/1.0) passes: browsers always send one.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass

from omnirt.app.errors import APIError, error_response

log = logging.getLogger(__name__)


def hostname(host: str) -> str | None:
    """The name or address of a `Host` value (`name`, `name:port`, `1.2.3.4:80`, `[::1]:8091`), lower-case
    and without a trailing dot; None when it is malformed (an IPv6 address without brackets, say)."""
    host = host.strip().lower()
    if host.startswith("["):
        name, sep, rest = host[1:].partition("]")
        return name if sep and (not rest or rest.startswith(":")) and _is_ip(name) else None
    name, _, port = host.partition(":")
    return name.rstrip(".") if name and ":" not in port else None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(slots=True, frozen=True)
class HostRule:
    """The names allowed besides localhost and IP literals: `--allowed-hosts` and `--host`."""

    names: frozenset[str]

    @classmethod
    def of(cls, allowed: tuple[str, ...]) -> HostRule:
        return cls(frozenset(hostname(n) or n for n in allowed))

    def allows(self, name: str | None) -> bool:
        if name is None:
            return False
        if "*" in self.names or name in self.names or _is_ip(name):
            return True
        return name == "localhost" or name.endswith(".localhost") or any(
            n.startswith(".") and (name == n[1:] or name.endswith(n)) for n in self.names)


class HostCheck:
    """Refuse every request and handshake whose `Host` the rule does not allow, before anything else runs."""

    def __init__(self, app, rule: HostRule):
        self.app, self.rule = app, rule

    async def __call__(self, scope, receive, send):
        host = dict(scope["headers"]).get(b"host") if scope["type"] in ("http", "websocket") else None
        if host is None or self.rule.allows(hostname(host.decode("latin-1"))):
            return await self.app(scope, receive, send)
        shown = host.decode("latin-1")[:200]
        log.warning("refused %s %s for Host %r: not localhost, an IP address or a name in --allowed-hosts",
                    "WebSocket" if scope["type"] == "websocket" else scope["method"], scope["path"], shown)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008, "reason": "host not allowed"})
        message = (f"This server does not answer to the name {shown!r} (a guard against DNS rebinding): reach it "
                   "as localhost or by IP address, or start it with --allowed-hosts naming it.")
        return await error_response(APIError(403, message, code="host_not_allowed"))(scope, receive, send)
