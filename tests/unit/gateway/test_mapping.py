"""gateway.mapping and gateway.errors: OpenAI JSON -> GenerateRequest, replies -> OpenAI JSON and
SSE chunks, and statuses -> HTTP error bodies."""

from __future__ import annotations

import grpc
import pytest
from pydantic import ValidationError

from gateway.errors import BadField, ModelNotFound, from_rpc_error, from_service_error
from gateway.mapping import (
    Renderer,
    chat_request,
    check_extra_fields,
    check_model,
    completion_request,
    sse,
)
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from specdec.core.errors import InvalidArgument
from specdec.v1 import coordinator_pb2

LENGTH, EOS, STOP = (
    coordinator_pb2.FINISH_REASON_LENGTH,
    coordinator_pb2.FINISH_REASON_EOS,
    coordinator_pb2.FINISH_REASON_STOP,
)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def chat(*messages, **fields) -> ChatCompletionRequest:
    messages = messages or ({"role": "user", "content": "hi"},)
    return ChatCompletionRequest.model_validate({"model": "m", "messages": list(messages), **fields})


def test_every_mapped_field_reaches_the_generate_request():
    request = completion_request(
        completion(
            max_tokens=9, temperature=0.5, top_p=0.9, top_k=40, n=3, stop="x", seed=7,
            session_id="a" * 32, num_speculative_tokens=4, ignore_eos=True,
        )
    )  # fmt: skip
    assert request.prompt == "hi" and request.max_new_tokens == 9 and request.seed == 7
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.top_k) == (
        0.5,
        pytest.approx(0.9),
        40,
    )
    assert list(request.stop) == ["x"] and request.num_samples == 3 and request.session_id == "a" * 32
    assert request.num_speculative_tokens == 4 and request.ignore_eos and not request.chat


def test_unset_fields_stay_unset_for_the_coordinators_defaults():
    request = completion_request(completion())
    for name in ("max_new_tokens", "seed", "num_speculative_tokens"):
        assert not request.HasField(name), name
    assert not request.sampling.HasField("temperature") and not request.sampling.HasField("top_p")
    assert request.sampling.top_k == 0 and request.num_samples == 1
    assert completion_request(completion(top_k=-1)).sampling.top_k == 0  # vLLM's "off"
    assert completion_request(completion(temperature=0)).sampling.HasField("temperature")  # 0 = greedy, kept


def test_prompts_as_text_token_ids_or_a_batch_of_one():
    assert completion_request(completion(prompt=["hi"])).prompt == "hi"
    assert list(completion_request(completion(prompt=[1, 2])).prompt_token_ids) == [1, 2]
    assert list(completion_request(completion(prompt=[[3]])).prompt_token_ids) == [3]
    with pytest.raises(BadField, match="a batch of prompts"):
        completion_request(completion(prompt=["a", "b"]))


def test_chat_messages_become_the_conversation():
    request = chat_request(
        chat(
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
            max_tokens=3,
            max_completion_tokens=5,
        )
    )
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "be brief"),
        ("user", "ab"),
        ("assistant", ""),
    ]
    assert request.max_new_tokens == 5 and not request.prompt and not request.chat  # max_completion_tokens wins


def test_a_session_takes_the_next_user_turn_as_a_chat_prompt():
    request = chat_request(chat({"role": "user", "content": "more"}, session_id="b" * 32))
    assert (request.chat, request.prompt, request.session_id, len(request.messages)) == (True, "more", "b" * 32, 0)
    with pytest.raises(BadField, match="next user turn only"):
        chat_request(chat({"role": "system", "content": "x"}, session_id="b" * 32))


def test_streaming_several_samples_is_refused():
    with pytest.raises(BadField, match="n > 1") as err:
        completion_request(completion(n=2, stream=True))
    assert err.value.param == "n"


@pytest.mark.parametrize(
    "fields",
    [
        {"model": 3},
        {"temperature": "0.7"},
        {"temperature": -0.1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"max_tokens": 0},
        {"max_tokens": 2**31},
        {"n": 1.0},
        {"seed": -1},
        {"stream": "yes"},
        {"prompt": [-1]},
        {"prompt": [2**31]},
        {"stream_options": {"include_usage": True, "x": 1}},
    ],
)
def test_wrong_types_and_ranges_fail_validation(fields):
    with pytest.raises(ValidationError):
        completion(**fields)


def test_chat_needs_a_message_with_a_known_shape():
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": []})
    with pytest.raises(ValidationError):
        chat({"role": "tool", "content": "x", "tool_call_id": "1"})
    with pytest.raises(ValidationError):
        chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})


def test_only_the_served_model_is_found():
    check_model("m", "m")
    with pytest.raises(ModelNotFound) as err:
        check_model("gpt-4", "m")
    status, body = from_service_error(err.value)
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"


def test_extra_fields_pass_at_neutral_values_and_are_refused_otherwise():
    check_extra_fields({"user": "u", "metadata": {"a": 1}, "presence_penalty": 0, "frequency_penalty": 0.0})
    check_extra_fields({"logit_bias": {}, "logprobs": False, "best_of": 1, "repetition_penalty": 1.0, "echo": False})
    with pytest.raises(BadField, match=r"presence_penalty=0.5 is not supported: it would change the output") as err:
        check_extra_fields({"presence_penalty": 0.5})
    assert err.value.param == "presence_penalty"
    for name, value in (
        ("logprobs", True),
        ("logit_bias", {"1": 5}),
        ("best_of", 3),
        ("tools", [{"type": "function"}]),
    ):
        with pytest.raises(BadField, match="would change the output"):
            check_extra_fields({name: value})
    with pytest.raises(BadField, match="unknown field `guided_json`"):
        check_extra_fields({"guided_json": {}})


def stats(**fields) -> coordinator_pb2.GenerationStats:
    return coordinator_pb2.GenerationStats(prompt_tokens=4, generated_tokens=6, rounds=3, acceptance_rate=0.5, **fields)


def test_a_unary_reply_has_choices_usage_and_the_speculative_stats():
    reply = coordinator_pb2.GenerateResponse(
        completions=[coordinator_pb2.Completion(text="x", finish_reason=EOS), coordinator_pb2.Completion(text="y", finish_reason=LENGTH)],
        stats=stats(),
        session_id="s",
        seed=9,
    )  # fmt: skip
    text = Renderer(chat=False, model="m", id="cmpl-1", created=5).response(reply)
    assert text["object"] == "text_completion" and (text["id"], text["created"], text["model"]) == ("cmpl-1", 5, "m")
    assert [(c["index"], c["text"], c["finish_reason"]) for c in text["choices"]] == [
        (0, "x", "stop"),
        (1, "y", "length"),
    ]
    assert text["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    assert text["specdec"]["rounds"] == 3 and text["specdec"]["acceptance_rate"] == 0.5
    assert (text["specdec"]["session_id"], text["specdec"]["seed"]) == ("s", 9)
    assert set(text["specdec"]) >= {"draft_time_s", "verify_time_s", "mean_tokens_per_round", "drafted_tokens"}
    message = Renderer(chat=True, model="m").response(reply)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "x"}


def test_a_chat_stream_is_role_then_deltas_then_the_finish_then_the_usage():
    render = Renderer(chat=True, model="m", include_usage=True)
    first, middle = render.start(), render.chunk(coordinator_pb2.GenerateChunk(text="ab"))
    quiet = render.chunk(coordinator_pb2.GenerateChunk(text=""))  # a round whose text is held back
    last = render.chunk(coordinator_pb2.GenerateChunk(text="c", done=True, finish_reason=STOP, stats=stats()))
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and quiet == []
    assert middle[0]["choices"][0]["delta"] == {"content": "ab"} and middle[0]["object"] == "chat.completion.chunk"
    text, finish, usage = last
    assert text["choices"][0]["delta"] == {"content": "c"}
    assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert finish["specdec"]["rounds"] == 3 and finish["usage"] is None
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 10
    assert len({c["id"] for c in (*first, *middle, *last)}) == 1


def test_a_completion_stream_puts_the_last_text_with_the_finish_and_no_usage_unless_asked():
    render = Renderer(chat=False, model="m")
    assert render.start() == []
    (last,) = render.chunk(coordinator_pb2.GenerateChunk(text="z", done=True, finish_reason=LENGTH, stats=stats()))
    assert last["choices"][0]["text"] == "z" and last["choices"][0]["finish_reason"] == "length"
    assert "usage" not in last and last["object"] == "text_completion"


def test_sse_events():
    assert sse({"a": 1}) == 'data: {"a":1}\n\n'
    assert sse("[DONE]") == "data: [DONE]\n\n"


class _RpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.OUT_OF_RANGE, 400),
        (grpc.StatusCode.FAILED_PRECONDITION, 400),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.PERMISSION_DENIED, 403),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.ABORTED, 409),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.UNKNOWN, 500),
    ],
)
def test_statuses_become_http_codes_and_5xx_keep_their_details_to_the_log(code, status):
    got, body = from_rpc_error(_RpcError(code, "detail at 10.0.0.7:50053"))
    assert got == status and body["error"]["code"] == code.name.lower()
    assert ("10.0.0.7" in body["error"]["message"]) == (status < 500)


def test_the_gateways_own_refusals_carry_their_param():
    status, body = from_service_error(BadField("n > 1 ...", "n"))
    assert status == 400 and body["error"]["param"] == "n" and body["error"]["type"] == "invalid_request_error"
    assert from_service_error(InvalidArgument("x"))[1]["error"]["param"] is None
