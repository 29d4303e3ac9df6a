"""The services as real processes: health only after the model loads, metrics, graceful SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.local_redis import free_port
from specdec.rpc.metrics import sample_value


def _wait_serving(port: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError("not serving")


def test_draft_process_serves_after_load_exposes_metrics_and_stops_on_sigterm(tiny_model_dirs):
    port, metrics_port = free_port(), free_port()
    env = dict(
        os.environ,
        SPECDEC_DRAFT_MODEL=tiny_model_dirs["draft"],
        SPECDEC_DRAFT_METRICS_PORT=str(metrics_port),
        SPECDEC_DRAFT_LOG_FORMAT="json",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "draft_service", "--port", str(port), "--host", "127.0.0.1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_serving(port, proc)
        from specdec.v1 import common_pb2, draft_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = draft_pb2_grpc.DraftServiceStub(channel).Info(common_pb2.InfoRequest(), timeout=5)
        assert info.vocab_size == 8 and info.role == "draft" and info.tokenizer_fingerprint
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert sample_value(body, "specdec_requests_total", service="draft", method="Info", code="OK") == 1
        assert sample_value(body, "specdec_inflight_requests", service="draft") == 0
        assert sample_value(body, "specdec_kv_cache_sessions", service="draft") == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        # LOG_FORMAT=json: the service's own log lines are JSON objects.
        lines = [json.loads(line) for line in proc.stdout.read().splitlines() if line.startswith("{")]
        loaded = [
            line for line in lines if line["logger"] == "specdec.rpc.model_service" and "loaded" in line["message"]
        ]
        assert loaded and loaded[0]["level"] == "INFO" and loaded[0]["timestamp"].endswith("+00:00")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_model_path_exits_instead_of_hanging(tmp_path):
    port = free_port()
    env = dict(os.environ, SPECDEC_TARGET_MODEL=str(tmp_path / "missing"), SPECDEC_TARGET_METRICS_PORT="-1")
    proc = subprocess.run(
        [sys.executable, "-m", "target_service", "--port", str(port), "--host", "127.0.0.1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "does not exist" in proc.stdout + proc.stderr
