"""python -m coordinator [flags]  (every flag also reads SPECDEC_COORDINATOR_* env vars)."""

from __future__ import annotations

import sys

from coordinator.server import create_server
from coordinator.settings import CoordinatorSettings
from specdec.heap import keep_heap_pages
from specdec.rpc.server import configure_logging, serve_until_signal
from specdec.settings import load_settings


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(CoordinatorSettings, sys.argv[1:] if argv is None else argv, prog="coordinator")
    configure_logging(settings.log_level, settings.log_format)  # text or JSON from the first line on
    keep_heap_pages()  # a round's laws are hundreds of KB a row at T > 0
    grpc_server, _ = create_server(settings)
    sys.exit(serve_until_signal(grpc_server, settings.grace_s))


if __name__ == "__main__":
    main()
