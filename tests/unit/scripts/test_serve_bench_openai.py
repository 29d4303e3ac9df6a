"""scripts/serve_bench.py's OpenAI mode (--openai-url): what it sends, and how a stream's tokens,
known only as a total and chunk texts, are spread over its chunks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))

import serve_bench


@pytest.mark.parametrize(
    ("total", "weights", "parts"),
    [(6, [2, 2, 2], [2, 2, 2]), (5, [1, 3], [1, 4]), (7, [5, 5, 5], [3, 2, 2]), (0, [3], [0]), (4, [], [])],
)
def test_tokens_are_apportioned_by_characters_and_add_up(total, weights, parts):
    got = serve_bench.apportion(total, weights)
    assert sorted(got) == sorted(parts) and sum(got) == (total if weights else 0)


def test_requests_are_streamed_with_usage_and_k_only_when_fixed():
    endpoint = serve_bench.OpenAIEndpoint("http://h:1/v1/", model="m")
    kwargs = {"max_new_tokens": 5, "temperature": 0.0, "seed": 3, "ignore_eos": True, "chat": True}
    path, body = endpoint.request("hi", num_speculative_tokens=None, **kwargs)
    assert path == "/chat/completions" and body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and "num_speculative_tokens" not in body
    assert (body["model"], body["max_tokens"], body["seed"], body["ignore_eos"]) == ("m", 5, 3, True)
    path, body = endpoint.request("hi", num_speculative_tokens=2, **{**kwargs, "chat": False})
    assert path == "/completions" and body["prompt"] == "hi" and body["num_speculative_tokens"] == 2
    assert str(endpoint.http.base_url) == "http://h:1/v1/"


def test_openai_mode_defaults_to_the_servers_own_k_and_excludes_address():
    args = serve_bench.parse_args(["--openai-url", "http://h:1/v1"])
    assert serve_bench.build_plan(args).ks == ["auto"]
    assert serve_bench.build_plan(serve_bench.parse_args([])).ks == [0, "auto"]
    with pytest.raises(ValueError, match="not both"):
        serve_bench.build_plan(serve_bench.parse_args(["--openai-url", "http://h:1/v1", "--address", "h:2"]))
