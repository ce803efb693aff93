"""The API keys the server accepts: `--api-key` values and a keys file with an id and limits per key.

The file (YAML, so JSON works too):

    keys:
      - id: web-backend          # what logs and /metrics show; never the key itself
        key: sk-...              # or key_sha256: <64 hex digits>, so the file need not hold the key
        max_sessions: 8          # open Realtime sessions (WebSocket + WebRTC), optional
        max_requests: 16         # HTTP requests in flight, optional
        requests_per_minute: 600 # HTTP requests and session starts, optional

The file is read again when its modification time, size or inode changes (looked at on each lookup)
or on SIGHUP; a file that no longer parses keeps the keys that were in force, with an error logged.
Keys are held as SHA-256 digests only; a lookup hashes the presented key and finds it by digest.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

log = logging.getLogger(__name__)
LIMIT_FIELDS = ("max_sessions", "max_requests", "requests_per_minute")
ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
SECRET_PREFIX = "ek_"  # client secrets look like this (as OpenAI's); no API key may


class KeysFileError(ValueError):
    """The keys file cannot be used; the message names the entry and the field."""


@dataclass(slots=True, frozen=True)
class KeyLimits:
    max_sessions: int | None = None  # None: no limit of the key's own (the server's limits still apply)
    max_requests: int | None = None
    requests_per_minute: int | None = None


@dataclass(slots=True, frozen=True)
class ApiKey:
    id: str
    limits: KeyLimits = KeyLimits()


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """`--api-key` keys (ids `cli-1`, `cli-2`, ... in order, no limits) and the keys file's."""

    def __init__(self, cli_keys: tuple[str, ...] = (), path: Path | None = None):
        if any(k.startswith(SECRET_PREFIX) for k in cli_keys):
            raise KeysFileError(f"an --api-key must not start with {SECRET_PREFIX} (client secrets do)")
        self.path = path
        self._cli = {digest(k): ApiKey(f"cli-{i}") for i, k in enumerate(cli_keys, 1)}
        self._file: dict[bytes, ApiKey] = {}
        if path is not None:
            self._stamp = _stamp(path)
            self._file = read_keys_file(path, self._cli_ids)  # at start, a bad file stops the server

    @property
    def is_open(self) -> bool:
        """No keys configured: every request is let in (a keys file, even an empty one, closes the server)."""
        return not self._cli and self.path is None

    def find(self, presented: str) -> ApiKey | None:
        self._refresh()
        d = digest(presented)
        return self._cli.get(d) or self._file.get(d)

    def get(self, key_id: str) -> ApiKey | None:
        self._refresh()
        return next((k for k in (*self._cli.values(), *self._file.values()) if k.id == key_id), None)

    def reload(self) -> None:
        """Read the keys file again, changed or not (SIGHUP)."""
        if self.path is not None:
            self._stamp = _stamp(self.path)
            self._load()

    @property
    def _cli_ids(self) -> set[str]:
        return {k.id for k in self._cli.values()}

    def _refresh(self) -> None:
        if self.path is not None and (stamp := _stamp(self.path)) != self._stamp:
            self._stamp = stamp  # a file that fails is reported once, not on every request
            self._load()

    def _load(self) -> None:
        try:
            self._file = read_keys_file(self.path, self._cli_ids)
        except KeysFileError as exc:
            log.error("keys file not reloaded, the keys in force stay: %s", exc)
            return
        log.info("keys file %s reloaded: %d keys (%s)", self.path, len(self._file),
                 ", ".join(k.id for k in self._file.values()))


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """What changes when the file is edited or replaced; None while it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def read_keys_file(path: Path, taken_ids: set[str]) -> dict[bytes, ApiKey]:
    """digest -> key, checked whole: one bad entry makes the file unusable (KeysFileError)."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise KeysFileError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    except yaml.YAMLError as exc:
        raise KeysFileError(f"{path}: not YAML/JSON ({exc.__class__.__name__})") from exc
    if not isinstance(doc, dict) or set(doc) != {"keys"} or not isinstance(doc["keys"], list):
        raise KeysFileError(f"{path}: must be a mapping with one field, `keys`: a list of keys")
    keys: dict[bytes, ApiKey] = {}
    ids = set(taken_ids)
    for i, entry in enumerate(doc["keys"]):
        d, key = _entry(entry, f"{path}: keys[{i}]")
        if key.id in ids:
            raise KeysFileError(f"{path}: keys[{i}].id {key.id!r} is used twice")
        if d in keys:
            raise KeysFileError(f"{path}: keys[{i}] is the same key as {keys[d].id!r}")
        ids.add(key.id)
        keys[d] = key
    return keys


def _entry(entry, where: str) -> tuple[bytes, ApiKey]:
    if not isinstance(entry, dict):
        raise KeysFileError(f"{where} must be a mapping")
    unknown = sorted(set(entry) - {"id", "key", "key_sha256", *LIMIT_FIELDS})
    if unknown:
        raise KeysFileError(f"{where}.{unknown[0]} is not a known field (id, key, key_sha256, "
                            f"{', '.join(LIMIT_FIELDS)})")
    key_id = entry.get("id")
    if not isinstance(key_id, str) or not ID_PATTERN.fullmatch(key_id):
        raise KeysFileError(f"{where}.id must be 1-64 characters of A-Z a-z 0-9 . _ -")
    if ("key" in entry) == ("key_sha256" in entry):
        raise KeysFileError(f"{where} ({key_id}) needs exactly one of `key` and `key_sha256`")
    if "key" in entry:
        if not isinstance(entry["key"], str) or len(entry["key"]) < 8 or entry["key"].startswith(SECRET_PREFIX):
            raise KeysFileError(f"{where}.key must be a string of 8 or more characters, not starting with "
                                f"{SECRET_PREFIX}")
        d = digest(entry["key"])
    else:
        if not isinstance(entry["key_sha256"], str) or not HEX_DIGEST.fullmatch(entry["key_sha256"].lower()):
            raise KeysFileError(f"{where}.key_sha256 must be 64 hex digits (`printf %s KEY | sha256sum`)")
        d = bytes.fromhex(entry["key_sha256"])
    limits = {}
    for name in LIMIT_FIELDS:
        value = entry.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise KeysFileError(f"{where}.{name} must be a whole number >= 1, or absent for no limit")
        limits[name] = value
    return d, ApiKey(key_id, KeyLimits(**limits))
