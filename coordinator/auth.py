"""API keys at the coordinator: `authorization: Bearer <key>` metadata -> the caller's tenant.

The keys file (mounted from a Secret) holds one `key [tenant]` per line; blank lines and `#`
comments are skipped, and a key without a tenant is its own tenant, named by a short hash of it.
The file is re-read when it changes (a Secret update swaps it); a file that cannot be read or
parsed then keeps the keys already loaded. Keys are kept only as SHA-256 digests and never logged.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Iterable

from specdec.core.errors import ServiceError

log = logging.getLogger(__name__)

_SCHEME = "bearer "


class Unauthenticated(ServiceError):
    code = "UNAUTHENTICATED"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def default_tenant(key: str) -> str:
    """A stable tenant name for a key listed without one, which does not reveal the key."""
    return f"key-{_digest(key)[:12]}"


def parse_keys(text: str) -> dict[str, str]:
    """{SHA-256 of key: tenant} from the file's text; ValueError names the line (never the key)."""
    tenants = {}
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            raise ValueError(f"API keys file line {number}: expected 'key [tenant]', got {len(fields)} fields")
        key = fields[0]
        tenants[_digest(key)] = fields[1] if len(fields) == 2 else default_tenant(key)
    return tenants


class ApiKeys:
    """The tenants of the keys in `path`; an empty path turns authentication off (tenant "")."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._signature: tuple | None = None
        self._tenants: dict[str, str] = {}
        if path:
            self._signature = self._stat()
            self._load()  # raises: a coordinator never starts with an unreadable keys file
            if not self._tenants:
                log.warning("API keys file %s lists no keys: every call will be refused", path)

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def _stat(self) -> tuple | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_ino, stat.st_mtime_ns, stat.st_size

    def _load(self) -> None:
        with open(self.path, encoding="utf-8") as f:
            self._tenants = parse_keys(f.read())
        tenants = len(set(self._tenants.values()))
        log.info("loaded %d API keys (%d tenants) from %s", len(self._tenants), tenants, self.path)

    def _current(self) -> dict[str, str]:
        """The keys, re-read first if the file changed (one stat per call)."""
        with self._lock:
            signature = self._stat()
            if signature != self._signature:
                self._signature = signature  # warn once per change, not on every call
                try:
                    self._load()
                except (OSError, ValueError) as exc:  # missing or broken: keep serving the keys we have
                    log.warning(
                        "API keys file %s not reloaded, keeping %d keys: %s", self.path, len(self._tenants), exc
                    )
            return self._tenants

    def tenant_of(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The tenant of the call's bearer key; Unauthenticated without one or with an unknown one."""
        if not self.enabled:
            return ""
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        if not isinstance(value, str) or not value.lower().startswith(_SCHEME) or not value[len(_SCHEME) :].strip():
            raise Unauthenticated("missing API key: send metadata 'authorization: Bearer <key>'")
        tenant = self._current().get(_digest(value[len(_SCHEME) :].strip()))
        if tenant is None:
            raise Unauthenticated("unknown API key")
        return tenant
