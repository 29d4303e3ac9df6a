"""python -m gateway [flags]  (every flag also reads SPECDEC_GATEWAY_* env vars)."""

from __future__ import annotations

import logging
import sys

from gateway.coordinator_client import CoordinatorClient
from gateway.server import build_server
from gateway.settings import GatewaySettings
from specdec.rpc.logs import configure_logging
from specdec.rpc.tracing import configure_tracing
from specdec.settings import load_settings

log = logging.getLogger("gateway")


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(GatewaySettings, sys.argv[1:] if argv is None else argv, prog="gateway")
    configure_logging(settings.log_level, settings.log_format)
    configure_tracing("specdec-gateway", settings.otlp_endpoint)
    if not settings.tls_cert_file:
        log.warning("serving plain HTTP (no tls_cert_file): only for loopback, tests and `make up`")
    client = CoordinatorClient(
        settings.coordinator_address, settings.coordinator_tls_ca_file, settings.request_timeout_s
    )
    build_server(settings, client).run()


if __name__ == "__main__":
    main()
