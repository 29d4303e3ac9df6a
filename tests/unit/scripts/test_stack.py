"""scripts/stack.py's readiness check: the gateway is ready when its own /health body says so, not
when anything on its port answers 200 (a Prometheus exporter answers every path; once one took the
gateway's port in CI and the openai client read metrics text as the model list)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, start_http_server

from specdec.local_redis import free_port

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))

import stack


def test_an_exporter_on_the_gateways_port_does_not_pass_for_the_gateway(tmp_path, monkeypatch):
    monkeypatch.setattr(stack, "RUN_DIR", tmp_path)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=CollectorRegistry())
    try:
        # The gateway that lost its port to the exporter: it exits, and the check says so.
        lost = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
        with pytest.raises(RuntimeError, match="gateway exited"):
            stack._wait_http_healthy("gateway", port, lost, timeout_s=20)
        lost.wait()
    finally:
        server.shutdown()
        thread.join()


def test_the_gateways_own_health_body_passes(tmp_path, monkeypatch):
    monkeypatch.setattr(stack, "RUN_DIR", tmp_path)
    port = free_port()
    gateway = subprocess.Popen([sys.executable, "-c", _SERVING.format(port=port)])
    try:
        stack._wait_http_healthy("gateway", port, gateway, timeout_s=20)
    finally:
        gateway.kill()
        gateway.wait()


_SERVING = """
from http.server import BaseHTTPRequestHandler, HTTPServer
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{{"status": "serving"}}'
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
HTTPServer(("127.0.0.1", {port}), Health).serve_forever()
"""
