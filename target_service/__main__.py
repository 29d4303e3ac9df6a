"""python -m target_service [flags]  (every flag also reads SPECDEC_TARGET_* env vars)."""

from __future__ import annotations

import sys

from specdec.models.openmp_env import set_openmp_defaults

set_openmp_defaults()  # before anything imports torch

from specdec.rpc.server import configure_logging, serve_until_signal
from specdec.settings import load_settings
from target_service.server import create_server
from target_service.settings import TargetSettings


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(TargetSettings, sys.argv[1:] if argv is None else argv, prog="target_service")
    configure_logging(settings.log_level, settings.log_format)  # text or JSON from the first line on
    grpc_server, _ = create_server(settings)
    sys.exit(serve_until_signal(grpc_server, settings.grace_s))


if __name__ == "__main__":
    main()
