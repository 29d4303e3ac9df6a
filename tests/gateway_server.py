"""The gateway's FastAPI app under a real uvicorn on a free loopback port, in a thread, in front of
a test stack's coordinator; and a tiny tokenizer with a chat template for the chat endpoint."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path

# Roles as words of the tiny vocabulary (tests/tiny_models.py), so rendered conversations tokenise.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ {'system': 'e', 'user': 'f', 'assistant': 'g'}[m['role']] }} {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}g {% endif %}"
)


def chat_tokenizer_dir(model_dir: str, directory: Path) -> str:
    """The tokenizer of `model_dir` with CHAT_TEMPLATE, saved in `directory` (same vocabulary: same fingerprint)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return str(directory)


@contextmanager
def serve_gateway(coordinator_address: str, client=None, **overrides):
    """The gateway for `coordinator_address` (or in front of `client`, a stand-in for the
    CoordinatorClient), built as `python -m gateway` builds it; yields its base URL
    (http://127.0.0.1:PORT, https:// with tls_cert_file), stopped on exit."""
    from gateway.coordinator_client import CoordinatorClient
    from gateway.server import build_server
    from gateway.settings import GatewaySettings
    from specdec.local_redis import free_port
    from specdec.settings import load_settings

    port = free_port()
    overrides = {"log_level": "warning", **overrides}
    settings = load_settings(
        GatewaySettings, [], {}, host="127.0.0.1", port=port, coordinator_address=coordinator_address, **overrides
    )
    if client is None:
        client = CoordinatorClient(coordinator_address, settings.coordinator_tls_ca_file, settings.request_timeout_s)
    server = build_server(settings, client)
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the gateway did not start")
        time.sleep(0.02)
    try:
        yield f"{'https' if settings.tls_cert_file else 'http'}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
