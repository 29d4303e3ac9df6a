"""Throwaway certificates for TLS tests, made with the openssl command line."""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@dataclass(frozen=True)
class Pair:
    cert: str
    key: str


@dataclass(frozen=True)
class Authority:
    """A self-signed CA that signs server (127.0.0.1, localhost) and client certificates."""

    root: Path
    name: str

    @property
    def cert(self) -> str:
        return str(self.root / f"{self.name}.pem")

    @classmethod
    def create(cls, root: Path, name: str) -> Authority:
        ca = cls(root, name)
        _openssl(
            "req", "-x509", *_EC, "-keyout", str(root / f"{name}.key"), "-out", ca.cert, "-days", "2",
            "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip
        return ca

    def issue(self, name: str, usage: str = "serverAuth") -> Pair:
        """A certificate for 127.0.0.1 / localhost with a random serial; `usage`: serverAuth | clientAuth."""
        key, csr, cert, ext = (self.root / f"{name}.{suffix}" for suffix in ("key", "csr", "pem", "ext"))
        ext.write_text(
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
            f"keyUsage=digitalSignature\nextendedKeyUsage={usage}\n"
        )
        _openssl("req", *_EC, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", self.cert, "-CAkey", str(self.root / f"{self.name}.key"),
            "-set_serial", str(secrets.randbits(63)), "-days", "2", "-extfile", str(ext), "-out", str(cert),
        )  # fmt: skip
        return Pair(str(cert), str(key))


def make_pki(root: Path) -> dict:
    """Two CAs; a server certificate, a client certificate, and a client certificate of the other CA."""
    ca, other = Authority.create(root, "ca"), Authority.create(root, "other-ca")
    return {
        "ca": ca,
        "other": other,
        "server": ca.issue("server"),
        "client": ca.issue("client", "clientAuth"),
        "stranger": other.issue("stranger", "clientAuth"),
    }
