"""The access pieces on their own, with injected clocks: the keys file (parsing, reload, a bad file keeping
the keys in force), client secrets (expiry to the second, the per-key cap), the origin rule, per-key
request limits, and who a credential makes the caller."""

from __future__ import annotations

import hashlib
import os

import pytest

from omnirt.app.errors import APIError
from omnirt.app.ops.hosts import HostRule
from omnirt.app.ops.keys import ApiKey, KeyLimits, KeyRing, KeysFileError, read_keys_file
from omnirt.app.ops.limits import TokenBucket
from omnirt.app.ops.metrics import Metrics
from omnirt.app.ops.origins import is_allowed, normalize
from omnirt.app.ops.quotas import KeyQuotas, LimitExceeded
from omnirt.app.ops.secret_store import SecretStore
from omnirt.app.ops.security import authenticate
from omnirt.app.ops.shared import SharedLimits
from omnirt.app.realtime.config import initial_config
from omnirt.app.realtime.registry import limit_error

KEY_A, KEY_B = "sk-alpha-0001", "sk-bravo-0002"


def write(path, text: str) -> None:
    path.write_text(text)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a later mtime, as an edit makes


def scope(path: str, credential: str | None = None, method: str = "POST", kind: str = "http") -> dict:
    headers = [] if credential is None else [(b"authorization", f"Bearer {credential}".encode())]
    return {"type": kind, "method": method, "path": path, "headers": headers}


@pytest.fixture
def config(engine):
    return initial_config(engine.info(), "tiny", "")


@pytest.mark.parametrize("text, error", [
    ("keys: {}", "a list of keys"),
    ("[]", "one field, `keys`"),
    ("keys: [{id: a, key: sk-123456789, max_session: 2}]", "keys[0].max_session is not a known field"),
    ("keys: [{id: 'a b', key: sk-123456789}]", "keys[0].id must be"),
    ("keys: [{id: a}]", "exactly one of `key` and `key_sha256`"),
    ("keys: [{id: a, key: short}]", "keys[0].key must be a string of 8"),
    ("keys: [{id: a, key: ek_123456789}]", "not starting with ek_"),
    ("keys: [{id: a, key_sha256: abc}]", "64 hex digits"),
    ("keys: [{id: a, key: sk-123456789, requests_per_minute: 0}]", "requests_per_minute must be a whole number"),
    ("keys: [{id: a, key: sk-123456789, max_requests: true}]", "max_requests must be a whole number"),
    ("keys: [{id: a, key: sk-123456789}, {id: a, key: sk-987654321}]", "keys[1].id 'a' is used twice"),
    ("keys: [{id: a, key: sk-123456789}, {id: b, key: sk-123456789}]", "the same key as 'a'"),
    ("keys: [{id: a, key: sk-1234", "not YAML/JSON"),
])
def test_keys_file_errors_name_the_entry(tmp_path, text, error):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(KeysFileError, match=error.replace("[", r"\[").replace("]", r"\]")):
        read_keys_file(path, set())


def test_keys_file_and_cli_keys(tmp_path):
    path = tmp_path / "keys.json"  # JSON is YAML
    sha = hashlib.sha256(KEY_B.encode()).hexdigest()
    path.write_text(f'{{"keys": [{{"id": "a", "key": "{KEY_A}", "max_sessions": 2}}, '
                    f'{{"id": "b", "key_sha256": "{sha.upper()}", "requests_per_minute": 60}}]}}')
    ring = KeyRing(("sk-from-the-command-line",), path)
    assert not ring.is_open and ring.find("sk-from-the-command-line").id == "cli-1"
    assert ring.find(KEY_A).limits.max_sessions == 2 and ring.find(KEY_B).limits.requests_per_minute == 60
    assert ring.find("sk-wrong") is None and ring.get("b").id == "b" and ring.get("nope") is None
    with pytest.raises(KeysFileError, match="cli-1"):  # the file may not reuse a command-line key's id
        path.write_text(f"keys: [{{id: cli-1, key: {KEY_A}}}]")
        KeyRing(("sk-from-the-command-line",), path)
    with pytest.raises(KeysFileError, match="must not start with ek_"):
        KeyRing(("ek_looks_like_a_secret",))
    assert KeyRing().is_open and not KeyRing(path=_empty(tmp_path)).is_open  # an empty file closes the server


def _empty(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("keys: []")
    return path


def test_keys_file_reloads_on_change_and_keeps_the_keys_when_broken(tmp_path, caplog):
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys: [{{id: a, key: {KEY_A}}}]")
    ring = KeyRing((), path)
    write(path, f"keys: [{{id: b, key: {KEY_B}, max_requests: 3}}]")
    assert ring.find(KEY_A) is None and ring.find(KEY_B).limits.max_requests == 3  # seen at the next lookup
    write(path, "keys: [{id: c, key: short}]")
    assert ring.find(KEY_B) is not None  # a broken file: the keys in force stay
    assert "keys file not reloaded" in caplog.text and "keys[0].key" in caplog.text
    path.unlink()
    assert ring.find(KEY_B) is not None  # a missing file too
    path.write_text(f"keys: [{{id: a, key: {KEY_A}}}]")
    ring.reload()  # what SIGHUP does, whatever the file's stamp
    assert ring.find(KEY_A) is not None and ring.find(KEY_B) is None


def test_a_secret_starts_sessions_until_its_expiry_second(config):
    now = [1000.25]
    store = SecretStore(clock=lambda: now[0])
    secret = store.mint("a", config, 10)
    assert secret.value.startswith("ek_") and secret.expires_at == 1010 and secret.config is config
    now[0] = 1009.99
    assert store.find(secret.value) is secret
    now[0] = 1010.0
    assert store.find(secret.value) is None and store.find(secret.value) is None
    assert store.find("ek_never_minted") is None


def test_each_key_holds_a_bounded_number_of_live_secrets(config):
    now = [0.0]
    store = SecretStore(clock=lambda: now[0], max_live_per_key=3)
    first = [store.mint("a", config, 10) for _ in range(3)]
    assert store.mint("a", config, 10) is None  # the route answers 429 rate_limit_exceeded
    assert store.mint("b", config, 10)  # another key's secrets are its own
    now[0] = 10.0  # the first three have expired: minting drops them and goes on
    assert store.mint("a", config, 10) and all(store.find(s.value) is None for s in first)


@pytest.mark.parametrize("origin, host, allowed, ok", [
    ("http://127.0.0.1:8091", "127.0.0.1:8091", (), True),
    ("http://127.0.0.1:8091/", "127.0.0.1:8091", (), True),
    ("HTTP://LocalHost:8091", "localhost:8091", (), True),
    ("https://voice.example", "voice.example:443", (), True),  # default ports are the same origin
    ("http://voice.example:80", "voice.example", (), True),
    ("http://evil.example", "127.0.0.1:8091", (), False),
    ("http://127.0.0.1:9999", "127.0.0.1:8091", (), False),  # another port is another origin
    ("null", "127.0.0.1:8091", (), False),  # sandboxed frames and file:// pages
    ("ws://127.0.0.1:8091", "127.0.0.1:8091", (), False),
    ("http://127.0.0.1:8091", None, (), False),
    ("http://app.example", "127.0.0.1:8091", ("http://app.example",), True),
    ("http://other.example", "127.0.0.1:8091", ("http://app.example",), False),
    ("http://other.example", "127.0.0.1:8091", ("*",), True),
    ("http://attacker.example:8091", "attacker.example:8091", (), False),  # a re-pointed name is no own origin
])
def test_origin_rule(origin, host, allowed, ok):
    hosts = HostRule.of(("voice.example",))  # names the server answers to, besides localhost and IP addresses
    assert is_allowed(origin, host, frozenset(normalize(o) for o in allowed), hosts) is ok


def test_key_quotas_per_minute_and_in_flight(engine):
    metrics, now = Metrics(engine), [0.0]
    quotas = KeyQuotas(metrics, SharedLimits(clock=lambda: now[0]))
    rpm = ApiKey("rpm", KeyLimits(requests_per_minute=2))
    for _ in range(2):
        quotas.take_request(rpm)
    with pytest.raises(LimitExceeded) as exc:
        quotas.take_request(rpm)
    assert exc.value.limit == "requests_per_minute" and exc.value.http().headers["Retry-After"] == "30"
    now[0] = 30.0  # one request's worth has come back (2 per minute)
    quotas.take_request(rpm)
    quotas.take_request(ApiKey("rpm", KeyLimits(requests_per_minute=100)))  # a reloaded limit: a new bucket
    busy = ApiKey("busy", KeyLimits(max_requests=1))
    quotas.begin(busy)
    with pytest.raises(LimitExceeded) as exc:
        quotas.begin(busy)
    assert exc.value.limit == "max_requests" and limit_error(exc.value).code == "rate_limit_exceeded"
    quotas.end(busy)
    quotas.begin(busy)
    sample = metrics.registry.get_sample_value
    assert sample("omnirt_key_limited_total", {"key": "rpm", "limit": "requests_per_minute"}) == 1
    assert sample("omnirt_key_limited_total", {"key": "busy", "limit": "max_requests"}) == 1
    assert sample("omnirt_key_requests_total", {"key": "rpm"}) == 4
    assert sample("omnirt_key_active", {"key": "busy", "kind": "requests"}) == 1


def test_token_bucket_wait():
    now = [0.0]
    bucket = TokenBucket(rate=0.5, burst=1, clock=lambda: now[0])
    assert bucket.wait_s(1) == 0 and bucket.take(1) and bucket.wait_s(1) == 2.0
    now[0] = 1.5
    assert not bucket.take(1) and bucket.wait_s(1) == pytest.approx(0.5)


def test_who_a_credential_makes_the_caller(tmp_path, config):
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys: [{{id: a, key: {KEY_A}}}, {{id: b, key: {KEY_B}}}]")
    ring, store = KeyRing((), path), SecretStore()
    secret = store.mint("a", config, 60)
    ws = authenticate(scope("/v1/realtime", secret.value, kind="websocket"), ring, store)
    assert ws.key_id == "a" and ws.secret is secret
    assert authenticate(scope("/v1/realtime/calls", secret.value), ring, store).secret is secret
    assert authenticate(scope("/v1/realtime", secret.value), ring, store).secret is secret  # beta WebRTC
    for path_, method in (("/v1/realtime/client_secrets", "POST"), ("/v1/realtime/sessions", "POST"),
                          ("/v1/models", "GET"), ("/v1/chat/completions", "POST"),
                          ("/v1/realtime/calls/rtc_x/hangup", "POST"), ("/v1/realtime/calls", "GET")):
        with pytest.raises(APIError) as exc:
            authenticate(scope(path_, secret.value, method), ring, store)
        assert exc.value.status == 403 and exc.value.code == "client_secret_not_allowed", path_
    with pytest.raises(APIError) as exc:
        authenticate(scope("/v1/realtime/calls", "ek_not_minted"), ring, store)
    assert exc.value.status == 401
    write(path, f"keys: [{{id: b, key: {KEY_B}}}]")  # key a leaves the file: its secrets stop working
    with pytest.raises(APIError) as exc:
        authenticate(scope("/v1/realtime/calls", secret.value), ring, store)
    assert exc.value.status == 401
    open_secret = store.mint(None, config, 60)  # minted while the server had no keys
    assert authenticate(scope("/v1/realtime/calls", open_secret.value), KeyRing(), store).key is None
    with pytest.raises(APIError):
        authenticate(scope("/v1/realtime/calls", open_secret.value), ring, store)  # keys on since: void
