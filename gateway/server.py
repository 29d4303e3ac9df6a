"""The gateway's uvicorn server: the app, its HTTPS certificate (followed across renewals) and
logging left to the root logger (`specdec.rpc.logs`), so uvicorn's lines are JSON too when asked."""

from __future__ import annotations

import ssl

import uvicorn
from uvicorn.config import create_ssl_context

from gateway.app import create_app
from gateway.coordinator_client import CoordinatorClient
from gateway.settings import GatewaySettings
from gateway.tls import ReloadingCertificate


def build_server(settings: GatewaySettings, client: CoordinatorClient) -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(settings, client),
        host=settings.host,
        port=settings.port,
        ssl_certfile=settings.tls_cert_file or None,
        ssl_keyfile=settings.tls_key_file or None,
        log_level=settings.log_level.lower(),
        log_config=None,  # the root logger's handlers (text or JSON), not uvicorn's own
        access_log=False,  # RequestScope logs each request, with its request id
        # In-flight streams get this long to finish on SIGTERM (uvicorn then cancels them).
        timeout_graceful_shutdown=30,
    )
    if settings.tls_cert_file:
        config.load()  # builds config.ssl, which the server then serves (it loads a config once)
        ReloadingCertificate(config.ssl, lambda: _ssl_context(config), (settings.tls_cert_file, settings.tls_key_file))
    return uvicorn.Server(config)


def _ssl_context(config: uvicorn.Config) -> ssl.SSLContext:
    """A context like the one uvicorn built at start, from the files as they are now."""
    return create_ssl_context(
        certfile=config.ssl_certfile,
        keyfile=config.ssl_keyfile,
        password=config.ssl_keyfile_password,
        ssl_version=config.ssl_version,
        cert_reqs=config.ssl_cert_reqs,
        ca_certs=config.ssl_ca_certs,
        ciphers=config.ssl_ciphers,
    )
