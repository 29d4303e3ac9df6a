"""TLS of the project's gRPC servers (specdec.rpc.tls via build_grpc_server), against real servers:
plaintext refused, mutual TLS, certificates re-read when their files change, redacted URLs."""

from __future__ import annotations

import shutil
import socket
import ssl

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tls_certs import make_pki

from specdec.core.errors import ServiceError
from specdec.rpc.server import build_grpc_server
from specdec.rpc.tls import ServerCertificateFiles, TlsFiles, channel_credentials, redact_url

# A fresh connection per channel: grpc otherwise shares subchannels between equal channels.
_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def serve(tls: TlsFiles):
    grpc_server = build_grpc_server("127.0.0.1", 0, 4, 4, lambda server: None, ["test.Service"], "test", tls=tls)
    grpc_server.server.start()
    grpc_server.set_serving(True)
    return grpc_server


@pytest.fixture()
def copied_server_files(pki, tmp_path):
    """The server's certificate and key in files of their own, which a test may rotate."""
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(pki["server"].cert, cert)
    shutil.copy(pki["server"].key, key)
    return str(cert), str(key)


def health_check(port: int, credentials: grpc.ChannelCredentials | None) -> int:
    address = f"127.0.0.1:{port}"
    if credentials is None:
        channel = grpc.insecure_channel(address, options=_OPTIONS)
    else:
        channel = grpc.secure_channel(address, credentials, options=_OPTIONS)
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def served_certificate(port: int, ca_file: str) -> bytes:
    """The DER certificate the server shows a new connection (verified against ca_file)."""
    context = ssl.create_default_context(cafile=ca_file)
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        return tls.getpeercert(binary_form=True)


def der_of(path: str) -> bytes:
    with open(path) as f:
        return ssl.PEM_cert_to_DER_cert(f.read())


def test_tls_server_serves_tls_clients_and_refuses_plaintext(pki):
    server = serve(TlsFiles(pki["server"].cert, pki["server"].key))
    try:
        assert health_check(server.port, channel_credentials(pki["ca"].cert)) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as plaintext:
            health_check(server.port, None)
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as untrusted:  # a server the client's CA did not sign
            health_check(server.port, channel_credentials(pki["other"].cert))
        assert untrusted.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.server.stop(0).wait(5)


def test_mutual_tls_requires_a_client_certificate_signed_by_the_client_ca(pki):
    ca, client, stranger = pki["ca"].cert, pki["client"], pki["stranger"]
    server = serve(TlsFiles(pki["server"].cert, pki["server"].key, ca))
    try:
        for refused in (channel_credentials(ca), channel_credentials(ca, stranger.cert, stranger.key)):
            with pytest.raises(grpc.RpcError) as error:
                health_check(server.port, refused)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        served = health_check(server.port, channel_credentials(ca, client.cert, client.key))
        assert served == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.server.stop(0).wait(5)


def replace(path: str, source: str) -> None:
    """Swap in the new file at once, as a Secret volume does (a rename, never a half-written file)."""
    shutil.copy(source, path + ".new")
    shutil.move(path + ".new", path)


def test_a_rotated_certificate_is_served_to_new_connections_without_a_restart(pki, copied_server_files):
    cert, key = copied_server_files
    server = serve(TlsFiles(cert, key))
    try:
        assert served_certificate(server.port, pki["ca"].cert) == der_of(pki["server"].cert)
        same_ca = pki["ca"].issue("server-renewed")  # a renewal: same CA, new key and serial
        replace(key, same_ca.key)
        replace(cert, same_ca.cert)
        assert served_certificate(server.port, pki["ca"].cert) == der_of(same_ca.cert)
        new_ca = pki["other"].issue("server-reissued")  # a new CA: only its clients connect now
        replace(key, new_ca.key)
        replace(cert, new_ca.cert)
        assert served_certificate(server.port, pki["other"].cert) == der_of(new_ca.cert)
        served = health_check(server.port, channel_credentials(pki["other"].cert))
        assert served == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError):
            health_check(server.port, channel_credentials(pki["ca"].cert))
    finally:
        server.server.stop(0).wait(5)


def test_a_rotated_client_ca_is_enforced_for_new_connections(pki, copied_server_files, tmp_path):
    cert, key = copied_server_files
    client_ca = str(tmp_path / "client-ca.crt")
    shutil.copy(pki["ca"].cert, client_ca)
    server = serve(TlsFiles(cert, key, client_ca))
    try:
        client, stranger = pki["client"], pki["stranger"]
        assert health_check(server.port, channel_credentials(pki["ca"].cert, client.cert, client.key))
        replace(client_ca, pki["other"].cert)
        served = health_check(server.port, channel_credentials(pki["ca"].cert, stranger.cert, stranger.key))
        assert served == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError):
            health_check(server.port, channel_credentials(pki["ca"].cert, client.cert, client.key))
    finally:
        server.server.stop(0).wait(5)


def test_reload_only_when_files_change_and_keep_the_certificate_while_a_pair_is_half_written(pki, copied_server_files):
    cert, key = copied_server_files
    files = ServerCertificateFiles(TlsFiles(cert, key))
    assert files.fetch() is None  # unchanged: gRPC keeps its current configuration
    renewed = pki["ca"].issue("server-half")
    replace(cert, renewed.cert)  # the new certificate, still the old key: not a pair
    assert files.fetch() is None
    replace(key, renewed.key)
    assert isinstance(files.fetch(), grpc.ServerCertificateConfiguration)
    assert files.fetch() is None


def test_a_server_with_unreadable_or_mismatched_files_does_not_start(pki):
    with pytest.raises(OSError):
        build_grpc_server("127.0.0.1", 0, 2, 4, lambda s: None, [], "test", tls=TlsFiles("/nonexistent", "/none"))
    with pytest.raises(ssl.SSLError):
        ServerCertificateFiles(TlsFiles(pki["server"].cert, pki["client"].key))


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        ("redis://:s3cret@redis:6379/0", "redis://:***@redis:6379/0"),
        ("rediss://app:s3cret@redis.example:6380/1", "rediss://app:***@redis.example:6380/1"),
        ("redis://redis:6379/0?password=s3cret&db=2", "redis://redis:6379/0?password=***&db=2"),
        ("redis://localhost:6379/0", "redis://localhost:6379/0"),
        ("unix:///run/redis.sock", "unix:///run/redis.sock"),
    ],
)
def test_redact_url_hides_passwords(url, redacted):
    assert redact_url(url) == redacted
    assert "s3cret" not in redact_url(url)


def test_a_pool_client_follows_its_rotated_client_certificate_without_a_restart(pki, tmp_path, monkeypatch):
    """The coordinator's side of cert-manager rotation: grpc Python fixes a channel's credentials,
    so the pool client builds a new channel when its files change (checked at most once a second)."""
    from specdec.core.protocols import NO_DEADLINE
    from specdec.rpc.clients import ModelClient
    from specdec.rpc.tls import ChannelCertificateFiles
    from specdec.v1 import common_pb2, target_pb2_grpc

    monkeypatch.setattr(ChannelCertificateFiles, "CHECK_EVERY_S", 0.0)
    cert, key = str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")
    shutil.copy(pki["stranger"].cert, cert)  # a certificate the pool does not accept
    shutil.copy(pki["stranger"].key, key)

    class Target(target_pb2_grpc.TargetServiceServicer):
        def Info(self, request, context):  # noqa: N802
            return common_pb2.ModelInfo(model_id="pool")

    server = build_grpc_server(
        "127.0.0.1", 0, 4, 4, lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(Target(), s),
        ["specdec.v1.TargetService"], "test", tls=TlsFiles(pki["server"].cert, pki["server"].key, pki["ca"].cert),
    )  # fmt: skip
    server.server.start()
    files = ChannelCertificateFiles(pki["ca"].cert, cert, key)
    client = ModelClient("target", f"127.0.0.1:{server.port}", target_pb2_grpc.TargetServiceStub, 2, 2, 4, files, 1)
    try:
        with pytest.raises(ServiceError):
            client.info(NO_DEADLINE)
        replace(key, pki["client"].key)
        replace(cert, pki["client"].cert)
        assert client.info(NO_DEADLINE).model_id == "pool"
    finally:
        client.close()
        server.server.stop(0).wait(5)
