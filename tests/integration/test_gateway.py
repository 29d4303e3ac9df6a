"""The OpenAI-compatible gateway in front of the real stack (tiny models, real Redis, real gRPC
servers, the gateway under a real uvicorn), through the official `openai` client and raw SSE."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from gateway_server import chat_tokenizer_dir, serve_gateway
from service_stack import start_stack, stop_stack

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"  # the gateway's default model_name, as the README's examples use
FIXED_K = {"num_speculative_tokens": 2}  # a fixed K: with auto K a seed repeats the law, not the tokens
EXACT = {**FIXED_K, "ignore_eos": True}  # exactly max_tokens tokens


@pytest.fixture(scope="module")
def gateway_stack(tiny_loaded, tiny_model_dirs, redis_url, tmp_path_factory):
    tokenizer = chat_tokenizer_dir(tiny_model_dirs["target"], tmp_path_factory.mktemp("chat-tokenizer"))
    stack = start_stack(tiny_loaded, tokenizer, redis_url)
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="module")
def base_url(gateway_stack):
    with serve_gateway(gateway_stack.coordinator_address) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def chat(client, content: str = "a b", **kwargs):
    kwargs.setdefault("max_tokens", 6)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


# ---------------------------------------------------------------- unary


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_unary_returns_the_message_usage_and_the_speculative_stats(client):
    reply = chat(client, max_tokens=7, temperature=0, extra_body=EXACT)
    (choice,) = reply.choices
    assert reply.object == "chat.completion" and reply.model == MODEL and reply.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    stats = reply.model_extra["specdec"]
    # "f a b g": the template's user turn and generation prompt.
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (4, 7, 11)
    assert (stats["prompt_tokens"], stats["generated_tokens"]) == (4, 7)
    assert stats["rounds"] >= 3 and 0 < stats["drafted_tokens"] <= 2 * stats["rounds"]  # K = 2, the last may draft less
    assert stats["acceptance_rate"] == pytest.approx(stats["accepted_tokens"] / stats["drafted_tokens"])
    assert len(stats["session_id"]) == 32


def test_a_whole_conversation_is_rendered_by_the_template(client):
    messages = [
        {"role": "system", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "b "}, {"type": "text", "text": "c"}]},
        {"role": "assistant", "content": "d"},
        {"role": "user", "content": "e"},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=EXACT)
    assert reply.usage.prompt_tokens == 10  # e a | f b c | g d | f e | g


def test_completions_take_text_or_token_ids_alike(client):
    greedy = {"max_tokens": 6, "temperature": 0, "extra_body": EXACT}
    text = client.completions.create(model=MODEL, prompt="a b c", **greedy)
    ids = client.completions.create(model=MODEL, prompt=[1, 2, 3], **greedy)
    batch_of_one = client.completions.create(model=MODEL, prompt=["a b c"], **greedy)
    assert text.object == "text_completion" and text.id.startswith("cmpl-")
    assert text.choices[0].text == ids.choices[0].text == batch_of_one.choices[0].text
    assert text.usage.prompt_tokens == ids.usage.prompt_tokens == 3


def test_n_samples_are_choices_and_their_tokens_add_up(client):
    reply = client.completions.create(model=MODEL, prompt="a", n=3, max_tokens=4, seed=1, extra_body=EXACT)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == 12 == reply.model_extra["specdec"]["generated_tokens"]
    assert reply.model_extra["specdec"]["session_id"] == ""  # samples make no session


def test_the_same_seed_gives_the_same_text(client):
    sampled = {"temperature": 3.0, "max_tokens": 12, "extra_body": EXACT}
    texts = [chat(client, seed=seed, **sampled).choices[0].message.content for seed in (5, 5, 6, 7, 8)]
    assert texts[0] == texts[1]
    assert len(set(texts)) > 1  # and the seed is what decides it


def test_a_stop_string_ends_the_text_before_it(client):
    greedy = {"model": MODEL, "prompt": "a b", "max_tokens": 12, "temperature": 0, "extra_body": EXACT}
    full = client.completions.create(**greedy).choices[0].text
    stop = full.split()[3]
    stopped = client.completions.create(stop=[stop, "zz"], **greedy).choices[0]
    assert stopped.text == full[: full.index(stop)] and stopped.finish_reason == "stop"


def test_a_session_continues_with_the_next_user_turn(client):
    first = chat(client, temperature=0, extra_body=EXACT)
    session_id = first.model_extra["specdec"]["session_id"]
    second = chat(client, "c", temperature=0, extra_body={**EXACT, "session_id": session_id})
    assert second.model_extra["specdec"]["session_id"] == session_id
    assert second.usage.prompt_tokens == 3  # "f c g": the new turn only, the rest is the session's
    with pytest.raises(openai.BadRequestError, match="the next user turn only"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            extra_body={"session_id": session_id},
        )


# ---------------------------------------------------------------- streaming


def test_chat_stream_starts_with_the_role_and_ends_with_the_finish_and_usage(client):
    unary = chat(client, seed=3, temperature=1.0, extra_body=EXACT).choices[0].message.content
    chunks = list(
        chat(client, seed=3, temperature=1.0, stream=True, stream_options={"include_usage": True}, extra_body=EXACT)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == unary  # the same seed and K, streamed or not
    finish, last = chunks[-2], chunks[-1]
    assert finish.choices[0].finish_reason == "length" and finish.model_extra["specdec"]["generated_tokens"] == 6
    assert last.choices == [] and last.usage.completion_tokens == 6 and last.usage.prompt_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_without_usage(client):
    greedy = {"model": MODEL, "prompt": "a b", "max_tokens": 8, "temperature": 0, "extra_body": EXACT}
    chunks = list(client.completions.create(stream=True, **greedy))
    assert "".join(c.choices[0].text for c in chunks) == client.completions.create(**greedy).choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_raw_sse_is_data_lines_ending_with_done(base_url):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 5, "stream": True, **EXACT}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    objects = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert objects[-1]["choices"][0]["finish_reason"] == "length"
    assert objects[-1]["specdec"]["generated_tokens"] == 5


def test_n_over_one_does_not_stream(client):
    with pytest.raises(openai.BadRequestError, match="n > 1"):
        client.completions.create(model=MODEL, prompt="a", n=2, stream=True)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model": "gpt-4"}, openai.NotFoundError, "does not exist"),
        ({"temperature": -1}, openai.BadRequestError, "temperature"),
        ({"top_p": 0}, openai.BadRequestError, "top_p"),
        ({"max_tokens": 100000}, openai.BadRequestError, "max_new_tokens"),  # the coordinator's limit
        ({"presence_penalty": 0.5}, openai.BadRequestError, "would change the output"),
        ({"logprobs": True}, openai.BadRequestError, "would change the output"),
        ({"extra_body": {"guided_json": {}}}, openai.BadRequestError, "unknown field `guided_json`"),
        ({"extra_body": {"session_id": "f" * 32}}, openai.NotFoundError, "session"),
    ],
)
def test_refusals_are_openai_errors_with_the_right_status(client, kwargs, error, match):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, **kwargs}
    with pytest.raises(error, match=match) as raised:
        client.chat.completions.create(**request)
    body = raised.value.body
    assert set(body) == {"message", "type", "param", "code"}
    if error is openai.NotFoundError and "model" in kwargs:
        assert body["code"] == "model_not_found" and body["param"] == "model"


def test_harmless_openai_fields_are_accepted(client):
    harmless = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u1", "logprobs": False}
    assert chat(client, max_tokens=2, **harmless).choices[0].message.content


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b'{"model": "x", "prompt": ', "not valid JSON"),
        (b"[1, 2]", "the body"),
        (json.dumps({"model": MODEL, "prompt": "a", "max_tokens": "5"}).encode(), "max_tokens"),
        (json.dumps({"model": MODEL}).encode(), "prompt"),
    ],
)
def test_malformed_bodies_are_400_in_openais_shape(base_url, content, match):
    response = httpx.post(
        base_url + "/v1/completions", content=content, headers={"content-type": "application/json"}, timeout=30
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert match in error["message"] and error["type"] == "invalid_request_error"


def test_unknown_routes_and_oversized_bodies_get_error_bodies(base_url):
    missing = httpx.get(base_url + "/v1/nothing", timeout=30)
    assert missing.status_code == 404 and "message" in missing.json()["error"]
    huge = httpx.post(base_url + "/v1/completions", content=b"x" * (9 << 20), timeout=30)
    assert huge.status_code == 413


# ---------------------------------------------------------------- health, metrics, authentication


def test_health_and_metrics(base_url, client):
    assert httpx.get(base_url + "/health", timeout=30).json() == {"status": "serving"}
    chat(client, max_tokens=2)
    text = httpx.get(base_url + "/metrics", timeout=30).text
    assert 'specdec_http_requests_total{code="200",route="/v1/chat/completions"}' in text
    assert 'specdec_http_request_duration_seconds_count{route="/v1/chat/completions"}' in text


def test_health_is_503_when_the_coordinator_does_not_answer():
    from specdec.local_redis import free_port

    with serve_gateway(f"127.0.0.1:{free_port()}") as url:
        response = httpx.get(url + "/health", timeout=30)
        assert response.status_code == 503 and response.json()["error"]["code"] == "unavailable"
        unreachable = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with unreachable, pytest.raises(openai.InternalServerError) as error:
            chat(unreachable)
        assert error.value.status_code == 503 and "127.0.0.1" not in str(error.value.body)


def test_the_callers_key_is_what_the_coordinator_checks(tiny_loaded, tmp_path, gateway_stack, redis_url):
    keys = tmp_path / "keys"
    keys.write_text("key-of-a tenant-a\n")
    stack = start_stack(tiny_loaded, gateway_stack.settings.tokenizer, redis_url, api_keys_file=str(keys))
    try:
        with serve_gateway(stack.coordinator_address) as url:
            for key, outcome in (("key-of-a", None), ("key-of-nobody", "unknown API key"), ("", "missing API key")):
                headers = {} if key else {"Authorization": ""}  # no key at all
                with openai.OpenAI(
                    base_url=url + "/v1", api_key=key or "x", max_retries=0, default_headers=headers
                ) as c:
                    if outcome is None:
                        assert chat(c, max_tokens=2).choices[0].message.content
                        continue
                    with pytest.raises(openai.AuthenticationError, match=outcome):
                        chat(c, stream=True)
    finally:
        stop_stack(stack)


# ---------------------------------------------------------------- load spreading, logs


def test_calls_go_round_robin_over_every_coordinator_of_the_address(gateway_stack):
    """Two coordinators over the same pools behind one comma list (a headless Service's DNS
    answer is the same to the channel): both serve, not only the first."""
    from coordinator.server import create_server
    from specdec.models.sources import load_tokenizer

    first = gateway_stack.servers[0]
    second, port = create_server(gateway_stack.settings, load_tokenizer(gateway_stack.settings.tokenizer))
    try:

        def served() -> list[float]:
            labels = {"service": "coordinator", "method": "Generate", "code": "OK"}
            return [server.registry.value("specdec_requests_total", **labels) or 0.0 for server in (first, second)]

        before = served()
        with (
            serve_gateway(f"{gateway_stack.coordinator_address},127.0.0.1:{port}") as url,
            openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as c,
        ):
            for _ in range(6):
                c.completions.create(model=MODEL, prompt="a", max_tokens=1)
        counts = [after - was for after, was in zip(served(), before, strict=True)]
        assert sum(counts) == 6 and min(counts) >= 1, counts
    finally:
        second.server.stop(0).wait(10)


def test_python_m_gateway_writes_json_logs_with_the_request_id(tmp_path):
    """The process as deployed (LOG_FORMAT=json): every line JSON, uvicorn's too, and the access
    line of a request carries the id the client sent."""
    import os
    import time

    from specdec.local_redis import free_port

    port = free_port()
    env = dict(os.environ, SPECDEC_GATEWAY_LOG_FORMAT="json")
    argv = ["--host", "127.0.0.1", "--port", str(port), "--coordinator-address", f"127.0.0.1:{free_port()}"]
    stderr = tmp_path / "gateway.log"
    with open(stderr, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", *argv], cwd=ROOT, env=env, stderr=out)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/health", headers={"x-request-id": "probe-1"}, timeout=5)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, stderr.read_text()
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(30)
    assert response.status_code == 503 and response.headers["x-request-id"] == "probe-1"
    lines = [json.loads(line) for line in stderr.read_text().splitlines()]
    assert any(line["logger"].startswith("uvicorn") for line in lines)
    (access,) = [line for line in lines if line["message"].startswith("GET /health 503")]
    assert access["request_id"] == "probe-1" and access["logger"] == "gateway.access"


# ---------------------------------------------------------------- the benchmark through the gateway


def test_serve_bench_measures_the_gateway_as_any_openai_server(base_url, tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    import serve_bench

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"workload": "w", "prompt": p}) + "\n" for p in ("a b c", "c d e f")))
    argv = ["--openai-url", base_url + "/v1", "--prompts", str(prompts), "--concurrency", "1,2", "--ks", "0,2"]
    assert serve_bench.main([*argv, "--num-prompts", "2", "--max-new-tokens", "5", "--temperature", "1", "--json"]) == 0
    objects = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    run, rows = objects[0], objects[1:]
    assert run["openai_url"] == base_url + "/v1" and run["ks"] == [0, 2]
    assert {(r["k"], r["load"]) for r in rows} == {(k, c) for k in (0, 2) for c in ("c=1", "c=2")}
    for r in rows:
        assert r["errors"] == 0 and r["requests"] == 2 and r["tokens"] == 10  # ignore_eos: exactly 5 each
        assert r["ttft_ms_p50"] > 0 and r["itl_ms_p50"] is not None
        # From the gateway's specdec extension: K = 0 drafts nothing, one token per round.
        if r["k"] == 0:
            assert r["acceptance_rate"] is None and r["tokens_per_round"] == 1.0
        else:
            assert 0 <= r["acceptance_rate"] <= 1 and r["tokens_per_round"] >= 1.0


# ---------------------------------------------------------------- the README's examples, as written


def readme_examples(language: str) -> list[str]:
    """The code blocks of README.md's gateway section in `language`."""
    section = (ROOT / "README.md").read_text().split("\n## OpenAI-compatible gateway\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, re.DOTALL)


def test_the_readme_curl_examples_work_as_written(base_url):
    (block,) = readme_examples("bash")
    commands = ["curl" + c for c in block.replace("localhost:8000", base_url.removeprefix("http://")).split("curl")[1:]]
    assert len(commands) == 2
    outputs = [
        subprocess.run(["bash", "-c", c], capture_output=True, text=True, timeout=60, check=True).stdout
        for c in commands
    ]
    reply = json.loads(outputs[0])
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] <= 16
    events = outputs[1].strip().split("\n\n")
    assert events[-1] == "data: [DONE]" and json.loads(events[0].removeprefix("data: "))["object"] == "text_completion"


def test_the_readme_openai_example_works_as_written(base_url, capsys):
    (block,) = readme_examples("python")
    exec(compile(block.replace("http://localhost:8000", base_url), "README.md", "exec"), {})  # noqa: S102
    assert capsys.readouterr().out.strip()
