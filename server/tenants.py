"""Who may share what: tenants are identities the server issues, never ones a client claims.

What the engine keeps across requests (the KV cache's prefix, the suffix drafter's recent outputs)
is shared only within one *scope*: the API key's tenant, narrowed by the request's ``user`` and
``cache_salt``. A client can name any ``user`` or salt, so they can only narrow sharing within its
key, never reach another key's. Without keys, every client is one tenant: sharing then follows
``--share-cache`` (auto: on for a server bound to a loopback address, the one-user case; off
elsewhere, where every request gets a scope of its own and shares nothing).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import uuid
from dataclasses import dataclass
from pathlib import Path

from engine.config import ConfigError

SEPARATOR = "\x1f"  # between a scope's parts: no part can forge another's boundary


@dataclass(frozen=True, slots=True)
class Tenancy:
    keys: dict[str, str]  # API key -> tenant name
    share: bool  # whether requests of one tenant share cross-request state at all

    @classmethod
    def from_settings(cls, keys: list[str], keys_file: str | None, share: str, host: str) -> Tenancy:
        """``keys``: "KEY" or "KEY:TENANT" each; ``keys_file``: such lines (blank lines and # comments
        skipped); ``share``: "auto", "on" or "off"."""
        lines = list(keys)
        if keys_file is not None:
            path = Path(keys_file)
            if not path.is_file():
                raise ConfigError(f"api_key_file: no file at {keys_file}")
            lines += [line.strip() for line in path.read_text().splitlines()]
        table: dict[str, str] = {}
        for line in filter(None, (line.strip() for line in lines)):
            if line.startswith("#"):
                continue
            key, _, name = line.partition(":")
            if not key:
                raise ConfigError("api_key: an empty key; give KEY or KEY:TENANT")
            if key in table:
                raise ConfigError(f"api_key: a key is given twice (tenant {table[key]!r})")
            # unnamed: a name derived from the key, stable across restarts and revealing nothing of it
            table[key] = name.strip() or "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]
        shared = share == "on" or (share == "auto" and (bool(table) or is_loopback(host)))
        return cls(table, shared)

    def tenant_of(self, authorization: str | None) -> str | None:
        """The tenant a request's ``Authorization`` header names; None if it names none (refused).
        Without keys, every request is the one tenant ""."""
        if not self.keys:
            return ""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        found = None
        for key, name in self.keys.items():  # every key compared, each in constant time
            if hmac.compare_digest(token.strip().encode(), key.encode()):
                found = name
        return found

    def scope(self, tenant: str, user: str | None, cache_salt: str | None) -> str:
        """What a request may share cross-request state within: its tenant, narrowed by ``user``
        and ``cache_salt``; a scope of its own where sharing is off."""
        if not self.share:
            return "request" + SEPARATOR + uuid.uuid4().hex
        return SEPARATOR.join((tenant, user or "", cache_salt or ""))

    def describe(self) -> str:
        """For the start-up line: who shares what."""
        if self.keys:
            count = len(set(self.keys.values()))
            within = "within each" if self.share else "by no"
            return f"API key required ({count} tenant{'s' * (count != 1)}); caches shared {within} tenant, user and cache_salt"
        if self.share:
            return "no API key: caches shared by all clients (per user and cache_salt)"
        return "no API key: caches shared by no two requests (--share-cache on to share)"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
