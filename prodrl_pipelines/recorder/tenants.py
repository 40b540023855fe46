"""Who is calling the recorder: bearer tokens mapped to tenants, and each tenant's request budget.

Two sources, one of them:

* ``PRODRL_RECORDER_TOKEN`` (one token): one tenant, ``default``, whose trajectory ids are stored as
  the client sends them;
* ``--tokens-file FILE`` (JSON), re-read when it changes, so tokens rotate without a restart (list the
  new token beside the old one, move the clients, drop the old one)::

      {"tenants": {
          "support-bot": {"tokens": ["tok-1", "tok-2"], "requests_per_s": 50},
          "eval":        {"tokens": ["tok-3"]},
          "ops":         {"tokens": ["tok-4"], "admin": true}}}

  Each tenant's trajectory ids are stored as ``<tenant>/<id>``: a client names only its own
  trajectories, so it can append calls and post rewards to nothing else. ``requests_per_s`` (optional)
  is a token bucket of that rate with a burst of ``burst`` (default: one second's worth); past it, 429
  with ``Retry-After``. ``admin`` tenants see every tenant's counters in ``/stats``, others their own.

A file that cannot be read or is invalid fails the start; after the start, a bad edit is counted
(``tokens_file_errors``) and the tokens in force stay. Tokens are held as SHA-256 digests and never
appear in ``/stats``, logs or error messages.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Tenant", "Tenants", "TokensFileError", "DEFAULT_TENANT"]

DEFAULT_TENANT = "default"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # no ".": counters are named tenant.<name>.<counter>


class TokensFileError(ValueError):
    """The tokens file is unreadable or invalid; the message names the file and the entry."""


@dataclass
class Tenant:
    name: str
    admin: bool = False
    requests_per_s: float | None = None
    burst: float = 1.0
    namespaced: bool = True  # trajectory ids stored as "<name>/<id>"
    _tokens: float = field(default=0.0, repr=False)
    _at: float = field(default=0.0, repr=False)

    def stored_id(self, trajectory_id: str) -> str:
        return f"{self.name}/{trajectory_id}" if self.namespaced else trajectory_id

    def take(self, now: float) -> float:
        """Spend one request from the bucket: 0.0 when allowed, else seconds until one is available."""
        if self.requests_per_s is None:
            return 0.0
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.requests_per_s)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.requests_per_s


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def parse_tokens_file(text: str, where: str) -> dict[bytes, Tenant]:
    """Token digest -> tenant, from the tokens file's text (``where`` names it in errors)."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise TokensFileError(f"{where}: not JSON ({exc})") from None
    tenants = doc.get("tenants") if isinstance(doc, dict) else None
    if not isinstance(tenants, dict) or not tenants:
        raise TokensFileError(f'{where}: expected {{"tenants": {{"<name>": {{"tokens": [...]}}, ...}}}}')
    out: dict[bytes, Tenant] = {}
    for name, spec in tenants.items():
        at = f"{where}: tenant {name!r}"
        if not _NAME.match(name):
            raise TokensFileError(f"{at}: a tenant name is 1-64 characters of [A-Za-z0-9_-]")
        if not isinstance(spec, dict):
            raise TokensFileError(f"{at}: expected an object with `tokens`")
        unknown = sorted(set(spec) - {"tokens", "requests_per_s", "burst", "admin"})
        if unknown:
            raise TokensFileError(f"{at}: unknown field(s) {unknown}")
        tokens = spec.get("tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and len(t) >= 16 for t in tokens):
            raise TokensFileError(f"{at}: `tokens` must be a non-empty list of strings of at least 16 characters")
        rate, burst = spec.get("requests_per_s"), spec.get("burst")
        for what, v in (("requests_per_s", rate), ("burst", burst)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise TokensFileError(f"{at}: `{what}` must be a positive number, got {v!r}")
        if not isinstance(spec.get("admin", False), bool):
            raise TokensFileError(f"{at}: `admin` must be true or false")
        tenant = Tenant(name, admin=spec.get("admin", False), requests_per_s=float(rate) if rate else None,
                        burst=float(burst or max(1.0, float(rate or 1.0))))
        tenant._tokens = tenant.burst
        for t in tokens:
            d = _digest(t.encode())
            if d in out:
                raise TokensFileError(f"{at}: a token is listed twice (also for {out[d].name!r})")
            out[d] = tenant
    return out


class Tenants:
    """Bearer token -> ``Tenant``; the tokens file is checked for changes (one ``stat``) per lookup."""

    def __init__(self, token: str | None = None, tokens_file: str | os.PathLike | None = None) -> None:
        if bool(token) == bool(tokens_file):
            raise ValueError("the recorder needs exactly one source of bearer tokens: PRODRL_RECORDER_TOKEN "
                             "(one tenant) or --tokens-file (tenants)")
        self.path = Path(tokens_file) if tokens_file else None
        self.errors = 0
        self._lock = threading.Lock()
        self._key = None
        if token:
            self._by_digest = {_digest(token.encode()): Tenant(DEFAULT_TENANT, admin=True, namespaced=False)}
        else:
            self._by_digest = {}
            self._reload(strict=True)

    def _reload(self, strict: bool) -> None:
        try:
            st = os.stat(self.path)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key == self._key:
                return
            text = self.path.read_text()
        except OSError as exc:
            if strict:
                raise TokensFileError(f"{self.path}: cannot be read ({exc.strerror})") from None
            self.errors += 1
            return
        try:
            fresh = parse_tokens_file(text, str(self.path))
        except TokensFileError:
            if strict:
                raise
            self.errors += 1
            self._key = key  # counted once per bad edit, not per request
            return
        old = {t.name: t for t in self._by_digest.values()}
        for t in fresh.values():  # a rotation keeps each tenant's bucket where it was
            if t.name in old and old[t.name].requests_per_s == t.requests_per_s:
                t._tokens, t._at = old[t.name]._tokens, old[t.name]._at
        self._by_digest, self._key = fresh, key

    def names(self) -> list[str]:
        return sorted({t.name for t in self._by_digest.values()})

    def authenticate(self, token: bytes) -> Tenant | None:
        if self.path is not None:
            with self._lock:
                self._reload(strict=False)
        return self._by_digest.get(_digest(token))

    def admit(self, tenant: Tenant) -> float:
        """0.0 when the tenant may make a request now, else seconds to wait (its rate limit)."""
        with self._lock:
            return tenant.take(time.monotonic())
