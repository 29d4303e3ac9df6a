"""serve_until_signal returns only once the threads that finish a stop (a model's close) are done:
a process that exited under them died in C++ (`terminate called without an active exception`,
exit 134) whenever its model was still open."""

from __future__ import annotations

import signal
import threading
import time


def test_serve_until_signal_waits_for_the_stop_s_closers():
    from specdec.rpc.server import build_grpc_server, serve_until_signal

    server = build_grpc_server("127.0.0.1", 0, 2, 4, lambda s: None, [], "test")
    server.server.start()
    closed = threading.Event()

    def close() -> None:
        server.stop_requested.wait(10)
        time.sleep(0.3)  # a model's close, after its calls drained
        closed.set()

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    server.closers.append(closer)
    server.stop_requested.set()  # as SIGTERM does
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert serve_until_signal(server, grace_s=1.0) == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert closed.is_set()
