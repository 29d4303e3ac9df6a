"""Nothing lost, nothing extra: what a cut-off generation leaves in Redis, and `resume`.

The coordinator's request path (`coordinator.generation.Generator`) runs here in process over a
real Redis, with a target that fails at a chosen round; the resumed half also goes through the
real gRPC coordinator (another replica, as after a crash).
"""

from __future__ import annotations

import uuid
from dataclasses import replace

import grpc
import pytest

from coordinator.generation import Generator
from coordinator.pools import PoolInfo
from coordinator.sessions import SessionStore
from coordinator.settings import CoordinatorSettings
from draft_service.served import served
from specdec.client import SpecdecClient, build_request, reassembled
from specdec.core.engine import SpeculativeEngine
from specdec.core.errors import ServiceError, Unavailable
from specdec.core.protocols import NO_DEADLINE
from specdec.core.text import TextStream
from specdec.models.sources import load_tokenizer
from specdec.v1 import coordinator_pb2
from target_service.verifier import LocalVerifier

# A fixed K and a seed at T = 1: the resumed stream must give the uninterrupted one's very tokens.
REQUEST = {"max_new_tokens": 14, "seed": 11, "num_speculative_tokens": 2, "ignore_eos": True, "temperature": 1.0}
PROMPT = [3, 1, 4, 1, 5]


class FailingVerifier:
    """The target, failing every Verify from call `fail_at` on (None: never)."""

    def __init__(self, verifier, fail_at: int | None):
        self.verifier, self.fail_at, self.calls = verifier, fail_at, 0

    def verify(self, requests, sampling, deadline):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise Unavailable("target service: replica went away")
        return self.verifier.verify(requests, sampling, deadline)


@pytest.fixture()
def generator_for(tiny_loaded, tiny_model_dirs, redis_url, tiny_stack):
    """Generator(fail_at) on the tiny pair, storing sessions where the gRPC stack reads them."""
    settings = CoordinatorSettings(tokenizer=tiny_model_dirs["target"])
    store = SessionStore.from_url(redis_url, tiny_stack.settings.session_key_prefix, 3600, 10)
    tokenizer = load_tokenizer(tiny_model_dirs["target"])
    drafter = served(tiny_loaded["draft"]).drafter
    pools = PoolInfo(tiny_loaded["target"].info, tiny_loaded["draft"].info, None)

    def make(fail_at: int | None, save_interval_s: float = settings.session_save_interval_s) -> Generator:
        verifier = FailingVerifier(LocalVerifier(tiny_loaded["target"].runner), fail_at)
        decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)
        engine = SpeculativeEngine(drafter, verifier, decode)
        chosen = replace(settings, session_save_interval_s=save_interval_s)
        return Generator(chosen, engine, lambda deadline, need_draft: pools, tokenizer, store)

    yield make
    store.client.close()


def _cut_stream(generator: Generator, request) -> tuple[str, list[int], ServiceError]:
    """(session id, tokens received, the error) of a stream that fails part-way."""
    received, session_id = [], ""
    with pytest.raises(ServiceError) as failure:
        for chunk in generator.stream(request, NO_DEADLINE, lambda: True):
            session_id = chunk.session_id
            received += chunk.token_ids
    return session_id, received, failure.value


def test_a_cut_stream_stores_exactly_what_was_sent_and_resume_finishes_it_as_if_uncut(
    generator_for, coordinator_stub, tiny_stack
):
    reference = [
        t
        for c in generator_for(None).stream(build_request(PROMPT, **REQUEST), NO_DEADLINE, lambda: True)
        for t in c.token_ids
    ]
    assert len(reference) == REQUEST["max_new_tokens"]

    session_id, received, error = _cut_stream(generator_for(fail_at=4), build_request(PROMPT, **REQUEST))
    assert 0 < len(received) < len(reference)
    assert error.session_id == session_id  # the status names the session to resume

    stored = coordinator_stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=session_id))
    assert list(stored.token_ids) == PROMPT + received, "Redis must hold exactly what the client was sent"
    assert stored.resumable_tokens == len(reference) - len(received)

    # Another replica (the gRPC coordinator) finishes it: the same tokens the uncut stream gave.
    with SpecdecClient(tiny_stack.coordinator_address) as client:
        chunks = list(client.resume(session_id))
    resume = coordinator_pb2.GenerateRequest(session_id=session_id, resume=True)
    assert received + [t for c in chunks for t in c.token_ids] == reference
    assert chunks[-1].done and chunks[-1].stats.generated_tokens == len(reference) - len(received)
    stored = coordinator_stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=session_id))
    assert list(stored.token_ids) == PROMPT + reference and stored.resumable_tokens == 0
    with pytest.raises(grpc.RpcError) as nothing_left:
        coordinator_stub.Generate(resume)
    assert nothing_left.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize("interval_s", [0.0, 9.0], ids=["every-round", "behind"])
def test_a_stream_saves_behind_its_rounds_and_when_it_ends_or_fails(generator_for, monkeypatch, interval_s):
    """SESSION_SAVE_INTERVAL_S: 0 saves every round sent; a long interval saves only when the stream
    ends, or fails (what it had sent), never what it had not sent."""
    saves = []
    original = SessionStore._save

    def save(self, lease, token_ids, record):
        saves.append(list(token_ids))
        original(self, lease, token_ids, record)

    monkeypatch.setattr(SessionStore, "_save", save)
    uncut = list(generator_for(None, interval_s).stream(build_request(PROMPT, **REQUEST), NO_DEADLINE, lambda: True))
    rounds = len(uncut) - 1  # a chunk a round, then the final one
    assert len(saves) == (rounds if interval_s == 0 else 1)
    assert saves[-1] == PROMPT + [t for c in uncut for t in c.token_ids]
    saves.clear()
    _, received, _ = _cut_stream(generator_for(4, interval_s), build_request(PROMPT, **REQUEST))
    assert len(saves) == (3 if interval_s == 0 else 1) and saves[-1] == PROMPT + received
    saves.clear()
    checks = iter([True, True, False])  # the client goes away after the third round
    stream = generator_for(None, interval_s).stream(build_request(PROMPT, **REQUEST), NO_DEADLINE, lambda: next(checks))
    received = [t for c in stream for t in c.token_ids]
    assert len(saves) == (3 if interval_s == 0 else 1) and saves[-1] == PROMPT + received


def test_chunks_say_where_their_tokens_go(generator_for):
    chunks = list(generator_for(None).stream(build_request(PROMPT, **REQUEST), NO_DEADLINE, lambda: True))
    offsets = [c.token_offset for c in chunks]
    assert offsets == [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]


@pytest.mark.parametrize("lost", [1, 3], ids=["a-token", "chunks"])
def test_a_resume_sends_first_the_stored_tokens_the_client_never_received(
    generator_for, coordinator_stub, tiny_stack, tiny_model_dirs, lost
):
    """A chunk can be stored and lost on the wire when its coordinator dies: the client says what
    it received, and the resumed stream sends the rest of what was stored again, text included."""
    uncut = list(generator_for(None).stream(build_request(PROMPT, **REQUEST), NO_DEADLINE, lambda: True))
    reference = [t for c in uncut for t in c.token_ids]
    session_id, received, _ = _cut_stream(generator_for(fail_at=4), build_request(PROMPT, **REQUEST))
    held = received[: len(received) - lost]
    with SpecdecClient(tiny_stack.coordinator_address) as client:
        chunks = list(client.resume(session_id, received_tokens=len(held)))
    assert chunks[0].token_offset == len(held) and list(chunks[0].token_ids) == received[len(held) :]
    assert held + [t for c in chunks for t in c.token_ids] == reference
    decoded = load_tokenizer(tiny_model_dirs["target"]).decode(held, skip_special_tokens=True)
    held_text = TextStream(()).delta(decoded, False)  # what the stream had sent with those tokens
    assert held_text + "".join(c.text for c in chunks) == "".join(c.text for c in uncut)
    assert chunks[-1].stats.generated_tokens == len(reference) - len(received)  # replayed, not generated


def test_a_client_holding_more_than_was_stored_is_told_where_the_resumed_stream_starts(
    generator_for, coordinator_stub, tiny_stack
):
    reference = [
        t
        for c in generator_for(None).stream(build_request(PROMPT, **REQUEST), NO_DEADLINE, lambda: True)
        for t in c.token_ids
    ]
    session_id, received, _ = _cut_stream(generator_for(fail_at=4), build_request(PROMPT, **REQUEST))
    extra = reference[len(received) : len(received) + 1]  # as if the unsaved round had arrived
    with SpecdecClient(tiny_stack.coordinator_address) as client:
        chunks = list(client.resume(session_id, received_tokens=len(received) + len(extra)))
    assert chunks[0].token_offset == len(received)
    assert reassembled(received + extra, chunks) == reference


def test_received_tokens_belongs_to_a_resumed_stream(generator_for, coordinator_stub):
    session_id, received, _ = _cut_stream(generator_for(fail_at=3), build_request(PROMPT, **REQUEST))
    unary = lambda request: coordinator_stub.Generate(request)
    stream = lambda request: list(coordinator_stub.GenerateStream(request))
    refused_calls = {
        "unary": (unary, {"resume": True, "received_tokens": 1}),
        "negative": (stream, {"resume": True, "received_tokens": -1}),
        "not a resume": (stream, {"prompt": "more", "received_tokens": 1}),
    }
    for call, fields in refused_calls.values():
        with pytest.raises(grpc.RpcError) as refused:
            call(coordinator_pb2.GenerateRequest(session_id=session_id, **fields))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "received_tokens" in refused.value.details()
    stored = coordinator_stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=session_id))
    assert list(stored.token_ids) == PROMPT + received  # refusals leave the session as it was


def test_a_chunk_whose_send_failed_is_not_stored(generator_for, coordinator_stub):
    """gRPC asks a stream for its next chunk only after sending the last one; when a send fails it
    closes the stream instead. So the session holds the chunks asked past, not the last one."""
    chunks = generator_for(None).stream(build_request(PROMPT, **REQUEST), NO_DEADLINE, lambda: True)
    taken = [next(chunks) for _ in range(4)]
    chunks.close()  # the 4th chunk never reached the client
    received = [t for c in taken[:3] for t in c.token_ids]
    stored = coordinator_stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=taken[0].session_id))
    assert list(stored.token_ids) == PROMPT + received
    assert stored.resumable_tokens == REQUEST["max_new_tokens"] - len(received)


def test_a_unary_resume_returns_only_the_rest(generator_for, coordinator_stub):
    reference = generator_for(None).generate(build_request(PROMPT, **REQUEST), NO_DEADLINE, lambda: True)
    session_id, received, _ = _cut_stream(generator_for(fail_at=3), build_request(PROMPT, **REQUEST))
    rest = coordinator_stub.Generate(coordinator_pb2.GenerateRequest(session_id=session_id, resume=True))
    completion = rest.completions[0]
    assert received + list(completion.token_ids) == list(reference.completions[0].token_ids)
    assert rest.session_id == session_id and rest.seed == REQUEST["seed"]
    assert completion.finish_reason == coordinator_pb2.FINISH_REASON_LENGTH


def test_a_failed_unary_call_leaves_the_session_as_it_was(generator_for, coordinator_stub):
    first = coordinator_stub.Generate(build_request(PROMPT, **REQUEST))
    before = coordinator_stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=first.session_id))
    continued = build_request([2, 7], session_id=first.session_id, **REQUEST)
    with pytest.raises(Unavailable):
        generator_for(fail_at=3).generate(continued, NO_DEADLINE, lambda: True)
    after = coordinator_stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=first.session_id))
    assert after.token_ids == before.token_ids and after.resumable_tokens == 0


def test_a_stream_that_fails_before_its_first_chunk_leaves_no_session(generator_for, redis_client, tiny_stack):
    pattern = f"{tiny_stack.settings.session_key_prefix}:session:*"
    before = set(redis_client.keys(pattern))
    session_id, received, error = _cut_stream(generator_for(fail_at=1), build_request(PROMPT, **REQUEST))
    assert received == [] and session_id == ""
    assert not getattr(error, "session_id", ""), "no orphan: the client is never told of a session that was not stored"
    assert set(redis_client.keys(pattern)) == before


@pytest.mark.parametrize(
    "extra",
    [{"prompt": "more"}, {"max_new_tokens": 3}, {"seed": 1}, {"num_speculative_tokens": 0}, {"stop": ["x"]}],
    ids=["prompt", "max_new_tokens", "seed", "k", "stop"],
)
def test_resume_keeps_the_interrupted_request_and_refuses_new_parameters(coordinator_stub, extra):
    request = coordinator_pb2.GenerateRequest(session_id=uuid.uuid4().hex, resume=True, **extra)
    with pytest.raises(grpc.RpcError) as refused:
        coordinator_stub.Generate(request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "leave" in refused.value.details() and next(iter(extra)) in refused.value.details()


def test_resume_needs_a_session_and_an_interrupted_generation(coordinator_stub):
    with pytest.raises(grpc.RpcError) as no_session:
        coordinator_stub.Generate(coordinator_pb2.GenerateRequest(resume=True))
    assert no_session.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    done = coordinator_stub.Generate(build_request(PROMPT, **REQUEST))
    with pytest.raises(grpc.RpcError) as finished:
        coordinator_stub.Generate(coordinator_pb2.GenerateRequest(session_id=done.session_id, resume=True))
    assert finished.value.code() == grpc.StatusCode.FAILED_PRECONDITION
