"""The coordinator's Redis pool holds a connection for every thread that may use one at once
(redis-py's default of 100 refused commands at 128 streams: UNAVAILABLE)."""

from __future__ import annotations

from specdec.settings import load_settings


def test_the_session_store_serves_every_worker_and_heartbeat_at_once(redis_url):
    from coordinator.server import session_store
    from coordinator.settings import CoordinatorSettings

    settings = load_settings(
        CoordinatorSettings, [], {}, redis_url=redis_url, max_workers=64, max_concurrent_requests=60
    )
    pool = session_store(settings).client.connection_pool
    held = []
    try:
        for _ in range(2 * settings.max_workers):  # all at once (128 > 100), each connected
            held.append(pool.get_connection())
    finally:
        for connection in held:
            pool.release(connection)
        pool.disconnect()
