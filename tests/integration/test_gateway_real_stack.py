"""`make up` as a user runs it: scripts/stack.py starts Redis's client, the real default pair
(the packaged SmolLM2-135M-Instruct target, the suffix draft) and the gateway as processes; the
official openai client then talks to the gateway from outside (one chat completion, one streamed
completion). Free ports and a private state folder, so a developer's own `make up` is untouched.
One departure: the target skips its start-up kernel measurements (a minute on a busy 2-core
machine; they choose matmul layouts, not what is served)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import openai
import pytest

from specdec.local_redis import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("SPECDEC_COORDINATOR_", "SPECDEC_DRAFT_", "SPECDEC_TARGET_")


@pytest.fixture(scope="module")
def made_up(tmp_path_factory, redis_url):
    """stack.up() (what `make up` runs) on free ports with the session's Redis; its state dict."""
    spec = importlib.util.spec_from_file_location("specdec_stack_under_test", ROOT / "scripts" / "stack.py")
    stack = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stack)  # a module of its own: its ports and folders are ours to set
    stack.RUN_DIR = tmp_path_factory.mktemp("make-up")
    stack.STATE = stack.RUN_DIR / "stack.json"
    stack.COORDINATOR_PORT, stack.DRAFT_PORT, stack.TARGET_PORT = free_port(), free_port(), free_port()
    stack.GATEWAY_PORT = 0  # chosen when the gateway starts
    with pytest.MonkeyPatch.context() as env:
        env.setenv("REDIS_URL", redis_url)
        for prefix in SERVICES:
            env.setenv(prefix + "METRICS_PORT", "0")  # no clash with a running `make up`'s 9101..9103
        env.setenv("SPECDEC_TARGET_CALIBRATE_MAX_ROWS", "0")
        env.setenv("SPECDEC_TARGET_LINEAR_LAYOUT", "linear")
        try:
            yield stack.up()
        finally:
            stack.down()


def test_the_openai_client_talks_to_the_gateway_make_up_serves(made_up):
    with openai.OpenAI(base_url=made_up["gateway"], api_key="unused", max_retries=0, timeout=120) as client:
        assert [m.id for m in client.models.list()] == [made_up["model"]]
        reply = client.chat.completions.create(
            model=made_up["model"], messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, seed=0
        )
        assert reply.choices[0].message.content.strip() and 0 < reply.usage.completion_tokens <= 8
        assert reply.model_extra["specdec"]["generated_tokens"] == reply.usage.completion_tokens
        chunks = list(
            client.completions.create(
                model=made_up["model"],
                prompt="The sky is blue because",
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
    assert "".join(c.choices[0].text for c in chunks if c.choices).strip()
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-2].choices[0].finish_reason == "length"
