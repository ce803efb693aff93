"""WebRTC off loopback: the ICE servers and the advertised address. The flags' parsing, the answer's
candidates rewritten for a 1:1 NAT, and a real server whose answer carries a server-reflexive candidate
from a STUN server and the advertised host address. Nothing leaves the machine: the STUN server is a
responder on 127.0.0.1 in this process, and the test's own peer (iceServers=[]) only signals."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from aioice import stun
from aiortc import RTCConfiguration, RTCPeerConnection

from omnirt.app.transports.ice import (
    IceServer,
    IceSettings,
    advertise,
    candidates,
    offer_host_addresses,
    parse_ice_servers,
    rtc_configuration,
)
from tests.conftest import ServerProcess

TURN = {"urls": ["turn:turn.example.org:3478?transport=udp", "turns:turn.example.org:5349?transport=tcp"],
        "username": "omnirt", "credential": "s3cret"}


def test_ice_servers_parse_as_the_browser_writes_them(tmp_path):
    servers = parse_ice_servers(json.dumps([{"urls": "stun:stun.example.org:3478"}, TURN]))
    assert servers == (IceServer(("stun:stun.example.org:3478",)),
                       IceServer(tuple(TURN["urls"]), "omnirt", "s3cret"))
    assert [s.browser() for s in servers] == [{"urls": ["stun:stun.example.org:3478"]}, TURN]
    (tmp_path / "ice.json").write_text(json.dumps([TURN]))
    assert parse_ice_servers(f"@{tmp_path / 'ice.json'}") == servers[1:]
    config = rtc_configuration(IceSettings(servers=servers))
    assert [(s.urls, s.username, s.credential) for s in config.iceServers] == [
        (["stun:stun.example.org:3478"], None, None), (TURN["urls"], "omnirt", "s3cret")]
    assert rtc_configuration(IceSettings()).iceServers == []  # the default: no server, no network


@pytest.mark.parametrize("text,error", [
    ("stun:x", "not JSON"),
    ('{"urls": "stun:x"}', "must be a JSON list"),
    ('[{"urls": "http://x"}]', "[0].urls: 'http://x' is not a STUN/TURN URL"),
    ('[{"urls": []}]', "[0].urls is required"),
    ('[{"urls": "turn:x:3478"}]', "[0]: a TURN server needs a username and a credential"),
    ('[{"urls": "stun:x", "password": "p"}]', "[0] must be an object with urls"),
    ("@/nonexistent/ice.json", "cannot read /nonexistent/ice.json"),
])
def test_bad_ice_servers_say_what_is_wrong(text, error):
    with pytest.raises(ValueError) as err:
        parse_ice_servers(text)
    assert error in str(err.value)


ANSWER = "\r\n".join([
    "v=0", "o=- 1 1 IN IP4 10.0.0.5", "s=-", "t=0 0", "m=audio 40000 UDP/TLS/RTP/SAVPF 111", "c=IN IP4 10.0.0.5",
    "a=candidate:1 1 udp 2130706431 10.0.0.5 40000 typ host",
    "a=candidate:2 1 udp 1694498815 198.51.100.1 40000 typ srflx raddr 10.0.0.5 rport 40000",
    "m=application 40001 DTLS/SCTP 5000", "c=IN IP4 198.51.100.1", ""])


def test_the_advertised_address_replaces_the_host_candidates_only():
    out = advertise(ANSWER, "203.0.113.7")
    assert candidates(out) == ["203.0.113.7:40000 host", "198.51.100.1:40000 srflx"]
    assert out.split("\r\n")[5] == "c=IN IP4 203.0.113.7"  # the c= line that named the host address
    assert "c=IN IP4 198.51.100.1" in out and "o=- 1 1 IN IP4 10.0.0.5" in out  # the others are kept
    assert advertise(ANSWER, None) == ANSWER
    assert "c=IN IP6 2001:db8::7" in advertise(ANSWER, "2001:db8::7")


class StunResponder(asyncio.DatagramProtocol):
    """A STUN server on loopback that answers every Binding request with MAPPED as the client's address."""

    MAPPED = ("203.0.113.5", 4242)

    def __init__(self):
        self.num_requests = 0

    def connection_made(self, transport):
        self.transport = transport

    def datagram_received(self, data, addr):
        request = stun.parse_message(data)
        self.num_requests += 1
        response = stun.Message(stun.Method.BINDING, stun.Class.RESPONSE, transaction_id=request.transaction_id)
        response.attributes["XOR-MAPPED-ADDRESS"] = self.MAPPED
        response.add_fingerprint()
        self.transport.sendto(bytes(response), addr)


async def test_a_server_offers_reflexive_and_advertised_candidates_and_gives_the_page_its_ice_servers():
    loop = asyncio.get_running_loop()
    transport, stun_server = await loop.create_datagram_endpoint(StunResponder, local_addr=("127.0.0.1", 0))
    port = transport.get_extra_info("sockname")[1]
    servers = [{"urls": f"stun:127.0.0.1:{port}"}]
    srv = await asyncio.to_thread(ServerProcess, ["--webrtc-ice-servers", json.dumps(servers),
                                                  "--webrtc-advertise-address", "198.51.100.9"])
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    try:
        offer_host_addresses(("127.0.0.1",))
        pc.addTransceiver("audio")
        pc.createDataChannel("oai-events")
        await pc.setLocalDescription(await pc.createOffer())
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            assert (await client.get("/demo/config")).json()["ice_servers"] == [{"urls": [f"stun:127.0.0.1:{port}"]}]
            r = await client.post("/v1/realtime/calls", content=pc.localDescription.sdp,
                                  headers={"Content-Type": "application/sdp"})
            assert r.status_code == 201, r.text
            found = candidates(r.text)
            assert (await client.post(f"{r.headers['Location']}/hangup")).status_code == 200
        assert found and all(c.startswith("198.51.100.9:") for c in found if c.endswith(" host")), found
        assert "203.0.113.5:4242 srflx" in found and stun_server.num_requests >= 1, found
        assert "127.0.0.1" not in "".join(found)  # the gathered address is not offered beside the advertised one
    finally:
        await pc.close()
        transport.close()
        await asyncio.to_thread(srv.stop)
