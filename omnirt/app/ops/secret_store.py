"""The live client secrets (`ek_…`): minted for an API key, found by digest until they expire, at most
`MAX_LIVE_PER_KEY` per key. What a secret is for and its routes are `omnirt.app.client_secrets`'s; the settings
it carries are opaque here. With `--api-workers` the store lives in the supervising process
(`omnirt.app.ops.shared`), so that any worker finds a secret another minted."""

from __future__ import annotations

import collections
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from omnirt.app.ops.keys import SECRET_PREFIX, digest

MAX_LIVE_PER_KEY = 1000  # unexpired secrets of one key; beyond, minting answers 429 (memory stays bounded)
Settings = TypeVar("Settings")  # what a secret starts its sessions with (omnirt.app.realtime.config.SessionConfig)


@dataclass(slots=True, frozen=True)
class ClientSecret(Generic[Settings]):
    value: str
    key_id: str | None  # the key that minted it; None: minted while the server had no keys (open)
    config: Settings
    expires_at: int  # unix seconds: it starts sessions while the clock is before this


class SecretStore(Generic[Settings]):
    """The live secrets, by digest; expired ones are dropped when found or when a key reaches its cap. Shared
    by every API worker (`omnirt.app.ops.shared`): its methods return values and hold a lock."""

    def __init__(self, clock: Callable[[], float] = time.time, max_live_per_key: int = MAX_LIVE_PER_KEY):
        self._clock, self.max_live_per_key = clock, max_live_per_key
        self._lock = threading.Lock()
        self._secrets: dict[bytes, ClientSecret[Settings]] = {}
        self._num_by_key: collections.Counter[str | None] = collections.Counter()

    def mint(self, key_id: str | None, config: Settings, ttl_s: int) -> ClientSecret[Settings] | None:
        """A new secret, or None when the key has `max_live_per_key` live ones."""
        with self._lock:
            if self._num_by_key[key_id] >= self.max_live_per_key:
                self._drop_expired()
            if self._num_by_key[key_id] >= self.max_live_per_key:
                return None
            value = SECRET_PREFIX + secrets.token_urlsafe(32)
            secret = ClientSecret(value, key_id, config, int(self._clock()) + ttl_s)
            self._secrets[digest(value)] = secret
            self._num_by_key[key_id] += 1
            return secret

    def find(self, value: str) -> ClientSecret[Settings] | None:
        """The secret, while it has not expired."""
        d = digest(value)
        with self._lock:
            secret = self._secrets.get(d)
            if secret is not None and self._clock() >= secret.expires_at:
                del self._secrets[d]
                self._num_by_key[secret.key_id] -= 1
                return None
            return secret

    def _drop_expired(self) -> None:
        now = self._clock()
        self._secrets = {d: s for d, s in self._secrets.items() if now < s.expires_at}
        self._num_by_key = collections.Counter(s.key_id for s in self._secrets.values())
