"""What the coordinator logs at start: never the Redis password; warnings when it runs without TLS or keys."""

from __future__ import annotations

import logging

from specdec.local_redis import free_port
from specdec.settings import load_settings


def start(tiny_model_dirs, **overrides):
    from coordinator.server import create_server
    from coordinator.settings import CoordinatorSettings
    from specdec.models.sources import load_tokenizer

    settings = load_settings(
        CoordinatorSettings,
        [],
        {},
        host="127.0.0.1",
        port=0,
        metrics_port=-1,
        tokenizer=tiny_model_dirs["target"],
        **overrides,
    )
    server, _ = create_server(settings, load_tokenizer(tiny_model_dirs["target"]))
    server.server.stop(0).wait(5)


def test_an_unreachable_redis_is_logged_without_its_password(tiny_model_dirs, caplog):
    url = f"redis://app:hunter2-secret@127.0.0.1:{free_port()}/0"  # nothing listens there
    with caplog.at_level(logging.INFO):
        start(tiny_model_dirs, redis_url=url)
    warning = next(r.getMessage() for r in caplog.records if "not reachable" in r.getMessage())
    assert f"app:***@127.0.0.1:{url.rsplit(':', 1)[1]}" in warning
    assert "hunter2" not in caplog.text


def test_plaintext_and_no_keys_are_warned_about(tiny_model_dirs, caplog):
    with caplog.at_level(logging.WARNING):
        start(tiny_model_dirs, redis_url=f"redis://127.0.0.1:{free_port()}/0")
    warnings = " | ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "plaintext gRPC" in warnings
    assert "without authentication" in warnings
    assert "pools are reached in plaintext" in warnings
