"""Health check over TLS: exit 0 when the local server answers SERVING (gRPC) or 200 (HTTP), 1 otherwise.

Kubernetes' `grpc:` probes and Docker healthchecks speak plaintext only, and every specdec
server here serves TLS (mutual TLS at the pools), so the probe runs inside the container and
shows the pod's own certificate (issued for client auth too, and for the name `localhost`).
Mounted from a ConfigMap in Kubernetes and bind-mounted by docker-compose.yml.

    python health_probe.py --port 50052 [--ca CA --cert CERT --key KEY] [--server-name NAME]
    python health_probe.py --port 8000 --ca CA --http-path /health     (the gateway: HTTPS GET)

Without --ca it checks over plaintext.
"""

from __future__ import annotations

import argparse
import http.client
import ssl
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="health_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ca", default="", help="CA that signed the server's certificate (empty = plaintext)")
    parser.add_argument("--cert", default="", help="client certificate (mutual TLS)")
    parser.add_argument("--key", default="", help="key of --cert")
    parser.add_argument("--server-name", default="localhost", help="name the server's certificate must carry")
    parser.add_argument("--http-path", default="", help="GET this path over HTTP(S) instead of gRPC health")
    parser.add_argument("--timeout", type=float, default=4.0)
    return parser.parse_args(argv)


def read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as handle:
        return handle.read()


def channel(args: argparse.Namespace) -> grpc.Channel:
    target = f"127.0.0.1:{args.port}"
    if not args.ca:
        return grpc.insecure_channel(target)
    credentials = grpc.ssl_channel_credentials(read(args.ca), read(args.key), read(args.cert))
    # Dialled by address; the certificate is checked against the name it was issued for.
    return grpc.secure_channel(target, credentials, options=[("grpc.ssl_target_name_override", args.server_name)])


class _NamedHTTPS(http.client.HTTPSConnection):
    """HTTPS to 127.0.0.1 that checks the certificate against `server_name`, like the gRPC probe."""

    def __init__(self, port: int, context: ssl.SSLContext, server_name: str, timeout: float):
        super().__init__("127.0.0.1", port, timeout=timeout, context=context)
        self._tls, self._server_name = context, server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._tls.wrap_socket(self.sock, server_hostname=self._server_name)


def http_connection(args: argparse.Namespace) -> http.client.HTTPConnection:
    if not args.ca:
        return http.client.HTTPConnection("127.0.0.1", args.port, timeout=args.timeout)
    context = ssl.create_default_context(cafile=args.ca)
    if args.cert:
        context.load_cert_chain(args.cert, args.key or None)
    return _NamedHTTPS(args.port, context, args.server_name, args.timeout)


def http_main(args: argparse.Namespace) -> int:
    try:
        connection = http_connection(args)
        try:
            connection.request("GET", args.http_path)
            status = connection.getresponse().status
        finally:
            connection.close()
    except (OSError, http.client.HTTPException) as exc:  # files, refused, TLS, timeout, bad reply
        print(f"health: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"health: HTTP {status}")
    return 0 if status == 200 else 1


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.http_path:
        return http_main(args)
    try:
        with channel(args) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
    except grpc.RpcError as exc:
        print(f"health: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except OSError as exc:  # a certificate file missing or unreadable
        print(f"health: {exc}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"health: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
