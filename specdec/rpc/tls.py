"""TLS for the project's gRPC servers and clients, and redaction of secrets in what is logged.

Server certificates are re-read when their files change (cert-manager rotates a mounted Secret
by swapping all its files at once): gRPC asks `ServerCertificateFiles.fetch` before every new
connection's handshake, so new connections get the new certificate without a restart.
Channel credentials are fixed per channel in grpc Python, so a client whose files rotate builds a
new channel (`ChannelCertificateFiles.changed`, `specdec.rpc.clients.ModelClient`).
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import grpc

from specdec.settings import setting

log = logging.getLogger(__name__)


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _signature(paths: tuple[str, ...]) -> tuple:
    """What changes when a file is replaced or rewritten (stat follows the Secret's symlinks)."""
    return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in (os.stat(p) for p in paths))


@dataclass(frozen=True)
class ServerTlsSettings:
    """The TLS settings every server of the project shares (a base of each service's settings).

    A server certificate turns TLS on (files re-read when they change, as cert-manager rotates
    them); empty keeps plaintext, which only `make run` and tests use."""

    tls_cert_file: str = setting("", "TLS_CERT_FILE", "PEM certificate chain of this server (empty = plaintext)")
    tls_key_file: str = setting("", "TLS_KEY_FILE", "PEM private key of tls_cert_file")
    tls_client_ca_file: str = setting(
        "", "TLS_CLIENT_CA_FILE", "require client certificates signed by this CA (mutual TLS; empty = not required)"
    )

    def validate_tls(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")


@dataclass(frozen=True)
class TlsFiles:
    """A server's certificate chain, its key, and the CA its clients' certificates must chain to
    (empty = clients show none)."""

    cert_file: str
    key_file: str
    client_ca_file: str = ""

    @classmethod
    def from_settings(cls, settings) -> TlsFiles | None:
        """From `tls_cert_file`, `tls_key_file`, `tls_client_ca_file`; None (plaintext) when no certificate."""
        if not settings.tls_cert_file:
            return None
        return cls(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.cert_file, self.key_file) + ((self.client_ca_file,) if self.client_ca_file else ())


class ServerCertificateFiles:
    """The certificate configuration of `TlsFiles`, re-read when one of the files changes."""

    def __init__(self, files: TlsFiles):
        self.files = files
        self._lock = threading.Lock()
        self._signature, self.initial = self._load()  # raises: a server never starts with bad files

    def _load(self) -> tuple[tuple, grpc.ServerCertificateConfiguration]:
        files = self.files
        signature = _signature(files.paths)
        # The key must match the certificate: a half-rotated pair would fail every handshake.
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(files.cert_file, files.key_file)
        pair = (read_file(files.key_file), read_file(files.cert_file))
        ca = read_file(files.client_ca_file) if files.client_ca_file else None
        if _signature(files.paths) != signature:
            raise OSError("certificate files changed while being read")
        return signature, grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before each handshake: a new configuration when the files changed, else None."""
        with self._lock:
            try:
                if _signature(self.files.paths) == self._signature:
                    return None
                self._signature, config = self._load()
            except (OSError, ssl.SSLError) as exc:  # mid-rotation: keep the current one, retry next time
                log.warning("TLS files %s unreadable, keeping the current certificate: %s", self.files.paths, exc)
                return None
            log.info("TLS certificate reloaded from %s", self.files.cert_file)
            return config


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Server credentials that follow the files; with a client CA, clients must show a certificate it signed."""
    certificates = ServerCertificateFiles(files)
    return grpc.dynamic_ssl_server_credentials(
        certificates.initial, certificates.fetch, require_client_authentication=bool(files.client_ca_file)
    )


def channel_credentials(ca_file: str = "", cert_file: str = "", key_file: str = "") -> grpc.ChannelCredentials:
    """TLS channel credentials: servers verified against `ca_file` (empty = the system's roots), and the
    client certificate `cert_file` + `key_file` shown for mutual TLS (empty = none)."""
    if bool(cert_file) != bool(key_file):
        raise ValueError("a client certificate and its key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=read_file(ca_file) if ca_file else None,
        private_key=read_file(key_file) if key_file else None,
        certificate_chain=read_file(cert_file) if cert_file else None,
    )


class ChannelCertificateFiles:
    """A client's TLS files (the servers' CA, and its certificate + key for mutual TLS), with a
    cheap check of whether they were replaced since the credentials were last built."""

    CHECK_EVERY_S = 1.0  # at most one stat of the files a second, however many calls

    def __init__(self, ca_file: str, cert_file: str = "", key_file: str = ""):
        self.ca_file, self.cert_file, self.key_file = ca_file, cert_file, key_file
        self.paths = tuple(p for p in (ca_file, cert_file, key_file) if p)
        self._signature: tuple = ()
        self._checked_at = 0.0

    def credentials(self) -> grpc.ChannelCredentials:
        """Credentials from the files as they are now; OSError / ssl.SSLError when they are unreadable
        or the certificate does not match its key (a half-rotated pair)."""
        signature = _signature(self.paths)
        if self.cert_file:
            ssl.create_default_context().load_cert_chain(self.cert_file, self.key_file)
        credentials = channel_credentials(self.ca_file, self.cert_file, self.key_file)
        if _signature(self.paths) != signature:
            raise OSError("certificate files changed while being read")
        self._signature, self._checked_at = signature, time.monotonic()
        return credentials

    def changed(self) -> bool:
        """Whether the files differ from those the last credentials were built from (checked at most
        every CHECK_EVERY_S; unreadable files count as unchanged until they can be read)."""
        now = time.monotonic()
        if now - self._checked_at < self.CHECK_EVERY_S:
            return False
        self._checked_at = now
        try:
            return _signature(self.paths) != self._signature
        except OSError:
            return False


_SECRET_QUERY_KEYS = {"password", "pass", "pwd", "token"}


def redact_url(url: str) -> str:
    """`url` with its password (user-info or query) replaced by `***`: safe to log."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, has_password, _ = userinfo.partition(":")
        netloc = f"{user}:***@{host}" if has_password else netloc
    query = urlencode(
        [
            (k, "***" if k.lower() in _SECRET_QUERY_KEYS else v)
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
        ],
        safe="*",
    )
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
