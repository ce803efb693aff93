"""Which ICE candidates a WebRTC call offers: the host addresses it gathers on, the address it advertises
for them (a server behind a 1:1 NAT, such as a cloud VM with a public IP), and the STUN/TURN servers it
asks for server-reflexive and relay candidates.

The default is loopback-only, with no server at all: the host candidate is the address the server listens
on (127.0.0.1), and nothing is asked of the network. Configured ICE servers are given to the server's
peer connections (aiortc uses the first STUN and the first TURN URL) and to the demo page, whose browser
uses them all.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMES = ("stun", "stuns", "turn", "turns")
_URL = re.compile(r"^(stuns?|turns?):[^\s/@]+(\?transport=(udp|tcp))?$")


@dataclass(slots=True, frozen=True)
class IceServer:
    """One RTCIceServer: its URLs and, for TURN, a username and password."""

    urls: tuple[str, ...]
    username: str | None = None
    credential: str | None = None

    def browser(self) -> dict[str, Any]:
        """As the browser's `RTCPeerConnection({iceServers})` takes it."""
        out: dict[str, Any] = {"urls": list(self.urls)}
        if self.username is not None:
            out |= {"username": self.username, "credential": self.credential}
        return out


@dataclass(slots=True, frozen=True)
class IceSettings:
    host_addresses: tuple[str, ...] = ()  # gathered on; empty: every interface but loopback (aioice's choice)
    advertised_address: str | None = None  # written into the answer's host candidates instead of theirs
    servers: tuple[IceServer, ...] = ()  # STUN/TURN; none: host candidates only, no network asked


def parse_ice_servers(text: str) -> tuple[IceServer, ...]:
    """`--webrtc-ice-servers`: a JSON list of RTCIceServer objects, or `@FILE` holding one. Raises
    ValueError saying what is wrong and what is accepted."""
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read {text[1:]} ({exc.strerror or exc})") from exc
    try:
        items = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc}); expected e.g. "
                         '\'[{"urls": "turn:turn.example.org:3478", "username": "u", "credential": "p"}]\'') from exc
    if not isinstance(items, list):
        raise ValueError("must be a JSON list of {urls, username, credential} objects")
    return tuple(_server(item, i) for i, item in enumerate(items))


def _server(item: Any, i: int) -> IceServer:
    if not isinstance(item, dict) or not set(item) <= {"urls", "username", "credential"}:
        raise ValueError(f"[{i}] must be an object with urls, and username and credential for TURN")
    urls = (item.get("urls"),) if isinstance(item.get("urls"), str) else tuple(item.get("urls") or ())
    for url in urls:
        if not isinstance(url, str) or not _URL.match(url):
            forms = ", ".join(f"{s}:HOST[:PORT]" for s in SCHEMES)
            raise ValueError(f"[{i}].urls: {url!r} is not a STUN/TURN URL ({forms}, optionally ?transport=udp|tcp)")
    if not urls:
        raise ValueError(f"[{i}].urls is required")
    needs_login = any(u.startswith("turn") for u in urls)
    username, credential = item.get("username"), item.get("credential")
    if needs_login and not (isinstance(username, str) and isinstance(credential, str)):
        raise ValueError(f"[{i}]: a TURN server needs a username and a credential (strings)")
    return IceServer(urls, username, credential)


def check_address(text: str) -> str:
    """An IP address, as `--webrtc-ice-address` and `--webrtc-advertise-address` take them."""
    try:
        return str(ipaddress.ip_address(text))
    except ValueError as exc:
        raise ValueError(f"{text!r} is not an IP address") from exc


def rtc_configuration(settings: IceSettings):
    from aiortc import RTCConfiguration, RTCIceServer  # the `webrtc` extra: the flags read this module without it

    return RTCConfiguration(iceServers=[RTCIceServer(list(s.urls), s.username, s.credential)
                                        for s in settings.servers])


def offer_host_addresses(addresses: tuple[str, ...]) -> None:
    """Make ICE gather on exactly these host addresses (process-wide: aioice reads one module function).

    aioice gathers a host candidate on every interface except loopback (it drops 127.0.0.1 and ::1),
    so a server bound to 127.0.0.1 would offer only addresses it does not listen on. Empty: aioice's
    own choice.
    """
    import aioice.ice  # the `webrtc` extra (aiortc's ICE): the flags read this module without it

    if addresses:
        aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: [
            a for a in addresses if (use_ipv4 if ipaddress.ip_address(a).version == 4 else use_ipv6)]


def advertise(sdp: str, address: str | None) -> str:
    """The answer with `address` in place of its host candidates' own (and in the `c=` lines that name
    them): behind a 1:1 NAT the peer must send to the public address, which maps to the gathered one,
    port for port."""
    if address is None:
        return sdp
    lines, hosts = sdp.split("\r\n"), set()
    for i, line in enumerate(lines):
        fields = line.split(" ")
        if line.startswith("a=candidate:") and len(fields) >= 8 and fields[7] == "host":
            hosts.add(fields[4])
            lines[i] = " ".join([*fields[:4], address, *fields[5:]])
    family = "IP6" if ipaddress.ip_address(address).version == 6 else "IP4"
    return "\r\n".join(f"c=IN {family} {address}" if line.startswith("c=IN ") and line.split(" ")[-1] in hosts
                        else line for line in lines)


def candidates(sdp: str) -> list[str]:
    """`address:port type` of each ICE candidate (for the log: what ICE had to work with)."""
    fields = [line.split() for line in sdp.splitlines() if line.startswith("a=candidate:")]
    return [f"{f[4]}:{f[5]} {f[7]}" for f in fields if len(f) >= 8]
