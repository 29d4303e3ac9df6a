"""A model service asked to stop (SIGTERM) drains its admitted calls, then closes its scheduler and model:
calls still queued near the end of the grace period fail UNAVAILABLE with a reason, not a hang."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from specdec.models.scheduler import scheduler_for
from specdec.v1 import target_pb2, target_pb2_grpc


@pytest.fixture()
def target(tiny_model_dirs):
    """A target server on its own runner (its scheduler gets closed), and a release of its model
    thread, which is held until the test releases it."""
    from specdec.rpc.model_service import load_model
    from specdec.settings import load_settings
    from target_service.server import create_server
    from target_service.settings import TargetSettings

    def start(grace_s: float):
        settings = load_settings(
            TargetSettings,
            [],
            {},
            model=tiny_model_dirs["target"],
            host="127.0.0.1",
            port=0,
            metrics_port=-1,
            calibrate_max_rows=0,
            grace_s=grace_s,
        )
        loaded = load_model(settings, "target")
        server, port = create_server(settings, loaded)
        release = threading.Event()
        loaded.runner.submit(release.wait, 30)
        started.append((server, release))
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        channels.append(channel)
        return server, scheduler_for(loaded.runner), target_pb2_grpc.TargetServiceStub(channel), release

    started, channels = [], []
    yield start
    for server, release in started:
        release.set()
        server.server.stop(0).wait(5)
    for channel in channels:
        channel.close()


def verify(stub, key: str) -> grpc.Future:
    sequence = target_pb2.VerifySequence(cache_key=key, prefix_token_ids=[3, 1, 4], draft_token_ids=[1])
    return stub.Verify.future(target_pb2.VerifyRequest(sequences=[sequence]), timeout=30)


def wait_until(condition, seconds: float = 10) -> None:
    until = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < until
        time.sleep(0.01)


def request_stop(server, grace_s: float) -> threading.Event:
    """What serve_until_signal does on SIGTERM."""
    server.stop_requested.set()
    server.set_serving(False)
    return server.server.stop(grace_s)


def test_a_call_admitted_before_the_stop_completes_then_the_scheduler_closes(target):
    server, scheduler, stub, release = target(grace_s=5.0)
    call = verify(stub, "drained")
    wait_until(lambda: scheduler.queued == 1)
    stopped = request_stop(server, 5.0)
    time.sleep(0.3)
    assert not call.done()
    release.set()  # the model thread is free: the call runs
    assert len(call.result(timeout=10).verifications) == 1
    wait_until(lambda: scheduler._closed is not None)  # drained: closed before the grace ends
    # Then the model: `closed` is set first (new work is refused at once), its cache dropped once
    # its thread has ended; reading the cache as soon as `closed` showed raced that.
    wait_until(lambda: scheduler.runner.closed and len(scheduler.runner.cache) == 0)
    assert stopped.wait(10)


def test_calls_still_queued_near_the_end_of_the_grace_fail_unavailable_with_a_reason(target):
    server, scheduler, stub, release = target(grace_s=1.5)
    calls = [verify(stub, key) for key in ("cut-a", "cut-b")]
    wait_until(lambda: scheduler.queued == 2)
    steps = scheduler.stats.steps
    stopped = request_stop(server, 1.5)
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call.result(timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in err.value.details()
    release.set()
    assert stopped.wait(10)
    wait_until(lambda: not scheduler._scheduled)  # no iteration left on the model thread
    assert scheduler.stats.steps == steps and scheduler.queued == 0
