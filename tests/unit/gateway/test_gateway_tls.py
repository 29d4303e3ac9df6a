"""The gateway's HTTPS certificate follows its files: a real uvicorn serving TLS, the files
rewritten under it as a renewal does, and the certificate new connections get."""

from __future__ import annotations

import shutil
import socket
import ssl

import httpx
from gateway_server import serve_gateway
from tls_certs import Authority


def served_certificate(url: str, ca: str) -> bytes:
    """The DER certificate a new connection is shown (checked against `ca`)."""
    host, port = url.removeprefix("https://").split(":")
    context = ssl.create_default_context(cafile=ca)
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        return tls.getpeercert(binary_form=True)


def der(pem_file: str) -> bytes:
    with open(pem_file) as f:
        return ssl.PEM_cert_to_DER_cert(f.read())


class StandIn:
    async def serving(self) -> bool:
        return True

    async def close(self) -> None:
        pass


def test_a_renewed_certificate_reaches_new_connections_without_a_restart(tmp_path):
    ca = Authority.create(tmp_path, "ca")
    first, second, third = ca.issue("first"), ca.issue("second"), ca.issue("third")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(first.cert, cert)
    shutil.copy(first.key, key)
    with serve_gateway("unused:1", client=StandIn(), tls_cert_file=str(cert), tls_key_file=str(key)) as url:
        assert url.startswith("https://") and served_certificate(url, ca.cert) == der(first.cert)
        with httpx.Client(verify=ssl.create_default_context(cafile=ca.cert)) as client:
            assert client.get(url + "/health").json() == {"status": "serving"}  # an open connection
            shutil.copy(second.cert, cert)
            shutil.copy(second.key, key)
            assert served_certificate(url, ca.cert) == der(second.cert)
            assert client.get(url + "/health").status_code == 200  # the open one goes on
        # Half a renewal (the new certificate, the old key): the pair that works stays served.
        shutil.copy(third.cert, cert)
        assert served_certificate(url, ca.cert) == der(second.cert)
        shutil.copy(third.key, key)
        assert served_certificate(url, ca.cert) == der(third.cert)
        cert.unlink()  # and a missing file is no outage either
        assert served_certificate(url, ca.cert) == der(third.cert)
