"""The counts that must hold across API processes: open Realtime sessions (the server's `max_sessions` and
each key's own), each key's HTTP requests in flight and its requests per minute, and the live client
secrets (`omnirt.app.ops.secret_store.SecretStore`).

With one API process they are plain objects in it. With `--api-workers N` they live in the supervising
process, served to the workers over a Unix socket by `multiprocessing.managers` (`serve` / `connect`):
a worker's call is one local round trip (a session start, a keyed HTTP request; never per audio chunk),
and its holdings are counted by worker, so that a worker that dies gives back what it held
(`forget_worker`). Every method returns a value, never raises: exceptions do not cross cleanly.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from multiprocessing.managers import BaseManager

from omnirt.app.ops.limits import TokenBucket
from omnirt.app.ops.secret_store import SecretStore


class SharedLimits:
    """Sessions and requests per worker and key; a bucket per key; which workers are up."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: collections.defaultdict[int, collections.Counter] = collections.defaultdict(
            collections.Counter)  # worker -> key id (None: no key) -> open sessions
        self._requests: collections.defaultdict[int, collections.Counter] = collections.defaultdict(
            collections.Counter)  # worker -> key id -> HTTP requests in flight
        self._buckets: dict[str, tuple[int, TokenBucket]] = {}  # key id -> (its rpm, its bucket)
        self._ready: dict[int, int] = {}  # worker -> its pid, once it serves

    def open_session(self, worker: int, key_id: str | None, max_sessions: int, key_max: int | None) -> str | None:
        """Take a session for `key_id` if the server (`max_sessions`) and the key (`key_max`) have room; else
        which of them is full: "server" or "key"."""
        with self._lock:
            if sum(sum(c.values()) for c in self._sessions.values()) >= max_sessions:
                return "server"
            if key_max is not None and sum(c[key_id] for c in self._sessions.values()) >= key_max:
                return "key"
            self._sessions[worker][key_id] += 1
            return None

    def close_session(self, worker: int, key_id: str | None) -> None:
        with self._lock:
            _drop(self._sessions[worker], key_id)

    def begin_request(self, worker: int, key_id: str, limit: int | None) -> bool:
        """Count one HTTP request of the key in flight, if under `limit` (None: no limit)."""
        with self._lock:
            if limit is not None and sum(c[key_id] for c in self._requests.values()) >= limit:
                return False
            self._requests[worker][key_id] += 1
            return True

    def end_request(self, worker: int, key_id: str) -> None:
        with self._lock:
            _drop(self._requests[worker], key_id)

    def take_request(self, key_id: str, rpm: int) -> float:
        """One request against the key's requests per minute: 0.0, or the seconds until one is left."""
        with self._lock:
            held = self._buckets.get(key_id)
            if held is None or held[0] != rpm:  # new, or its limit changed in the keys file
                held = self._buckets[key_id] = rpm, TokenBucket(rpm / 60, rpm, self._clock)
            return 0.0 if held[1].take(1) else max(held[1].wait_s(1), 1e-3)

    def worker_ready(self, worker: int, pid: int) -> None:
        with self._lock:
            self._ready[worker] = pid

    def ready_workers(self) -> dict[int, int]:
        """worker -> pid, for the workers that serve now."""
        with self._lock:
            return dict(self._ready)

    def worker_table(self, count: int) -> list[dict]:
        """Per worker: its pid once it serves (else None) and its open sessions (for /health)."""
        with self._lock:
            return [{"pid": self._ready.get(k), "sessions": sum(self._sessions.get(k, {}).values())}
                    for k in range(count)]

    def forget_worker(self, worker: int) -> None:
        """The worker exited: what it held is free again."""
        with self._lock:
            self._sessions.pop(worker, None)
            self._requests.pop(worker, None)
            self._ready.pop(worker, None)


def _drop(counts: collections.Counter, key) -> None:
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]


class _Manager(BaseManager):
    pass


def serve(address: str, authkey: bytes) -> tuple[SharedLimits, SecretStore, Callable[[], None]]:
    """In the supervising process: the shared objects, served at `address` from a thread; returns them (to
    use directly) and a function that stops serving."""
    limits, secrets = SharedLimits(), SecretStore()
    manager = _Manager(address=address, authkey=authkey)
    manager.register("limits", callable=lambda: limits)
    manager.register("secrets", callable=lambda: secrets)
    server = manager.get_server()
    thread = threading.Thread(target=server.serve_forever, name="omnirt-shared", daemon=True)
    thread.start()

    def stop() -> None:
        server.stop_event.set()
        server.listener.close()  # and removes its socket file

    return limits, secrets, stop


def connect(address: str, authkey: bytes) -> tuple[SharedLimits, SecretStore]:
    """In a worker: proxies of the supervisor's objects (the same methods, each call a round trip)."""
    _Manager.register("limits")
    _Manager.register("secrets")
    manager = _Manager(address=address, authkey=authkey)
    manager.connect()
    return manager.limits(), manager.secrets()
