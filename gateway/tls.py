"""The gateway's HTTPS certificate, re-read when its files change.

uvicorn builds one SSLContext at start and never reads the files again. OpenSSL calls that
context's SNI callback on every ClientHello (with or without a server name); the callback hands
the connection a context made from the files as they are now. A renewal (cert-manager swaps a
mounted Secret's files at once) reaches new connections without a restart; open ones keep
theirs. Files that do not load (mid-rotation, a key that does not match) keep the previous
context until they change again, as `specdec.rpc.tls` does for the gRPC servers.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable

log = logging.getLogger(__name__)


def _signature(paths: tuple[str, ...]) -> tuple:
    """What changes when a file is replaced or rewritten (stat follows the Secret's symlinks)."""
    return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in (os.stat(p) for p in paths))


class ReloadingCertificate:
    """The served SSLContext, swapped per handshake for one made by `make_context` once `paths` change."""

    def __init__(self, served: ssl.SSLContext, make_context: Callable[[], ssl.SSLContext], paths: tuple[str, ...]):
        self.make_context, self.paths = make_context, paths
        self.current, self._seen = served, _signature(paths)
        served.sni_callback = self._on_handshake

    def refresh(self) -> ssl.SSLContext:
        """The context of the files as they are now (a stat per call; a load only after a change)."""
        try:
            signature = _signature(self.paths)
            if signature != self._seen:
                self._seen = signature  # a bad pair is tried again only once the files change again
                self.current = self.make_context()
                log.info("HTTPS certificate reloaded from %s", self.paths[0])
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.warning("HTTPS certificate files %s unusable, keeping the current one: %s", self.paths, exc)
        return self.current

    def _on_handshake(self, connection, server_name, served: ssl.SSLContext) -> None:
        context = self.refresh()
        if context is not served:
            connection.context = context
