"""Hostile requests at the real coordinator process: oversize requests refused quickly with
INVALID_ARGUMENT naming their limit, calls without a valid API key refused, and another tenant's
session invisible, while the process keeps serving."""

from __future__ import annotations

import uuid
from pathlib import Path

import grpc
import pytest

from faults import fault_harness as harness
from specdec.client import build_request
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

KEYS, PREFIX = harness.KEYS, harness.SHARED_PREFIX
PROMPT = [3, 1, 4, 1, 5]
SMALL = {"max_new_tokens": 6, "num_speculative_tokens": 2, "temperature": 0.0, "ignore_eos": True}
INVALID = grpc.StatusCode.INVALID_ARGUMENT
MB = 1 << 20


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _oversize_calls(stub, metadata) -> dict:
    """{case: (call, words its INVALID_ARGUMENT must contain)}."""
    valid_id = uuid.uuid4().hex

    def generate(prompt, **kwargs):
        return lambda: stub.Generate(build_request(prompt, **kwargs), metadata=metadata, timeout=60)

    def stream(prompt, **kwargs):
        return lambda: list(stub.GenerateStream(build_request(prompt, **kwargs), metadata=metadata, timeout=60))

    def get(session_id):
        request = coordinator_pb2.GetSessionRequest(session_id=session_id)
        return lambda: stub.GetSession(request, metadata=metadata, timeout=60)

    def delete(session_id):
        request = coordinator_pb2.DeleteSessionRequest(session_id=session_id)
        return lambda: stub.DeleteSession(request, metadata=metadata, timeout=60)

    long_id = "a" * (20 * MB)
    return {
        "8 MB text prompt": (generate("a " * (4 * MB), max_new_tokens=4), ["max_prompt_bytes"]),
        "8 MB text prompt, stream": (stream("a " * (4 * MB), max_new_tokens=4), ["max_prompt_bytes"]),
        "8 MB of prompt token ids": (generate([1] * (2 * MB), max_new_tokens=4), ["max_prompt_bytes"]),
        "17 stop strings": (generate(PROMPT, stop=["x"] * 17, **SMALL), ["max_stop_strings"]),
        "400 stop strings of 5 KB": (generate(PROMPT, stop=["b" * 5000] * 400, **SMALL), ["max_stop_strings"]),
        "a 5 KB stop string": (generate(PROMPT, stop=["b" * 5000], **SMALL), ["max_stop_bytes"]),
        "20 MB session id, Generate": (generate(PROMPT, session_id=long_id, **SMALL), ["session_id"]),
        "20 MB session id, GetSession": (get(long_id), ["session_id"]),
        "20 MB session id, DeleteSession": (delete(long_id), ["session_id"]),
        "33-char session id": (get(valid_id + "0"), ["session_id", "32"]),
        "upper-case session id": (get(valid_id.upper()), ["session_id", "32"]),
        "DeleteSession('<id>:lock')": (delete(f"{valid_id}:lock"), ["session_id"]),
        "num_samples 257": (generate(PROMPT, num_samples=257, max_new_tokens=2), ["max_num_samples"]),
        "num_samples 1024": (generate(PROMPT, num_samples=1024, max_new_tokens=2), ["max_num_samples"]),
        "work 256 x (5 + 4096) token ids": (
            generate(PROMPT, num_samples=256, max_new_tokens=4096),
            ["max_request_tokens"],
        ),
        # Under the limit until the text is tokenised: 64 x (0 + 4096) = 262144, then 64 x (3 + 4096).
        "work 64 x (3 + 4096), text prompt": (
            generate("a b c", num_samples=64, max_new_tokens=4096),
            ["max_request_tokens"],
        ),
    }


def test_oversize_requests_are_refused_quickly_naming_their_limit(shared_coordinator):
    """Fault: an 8 MB prompt (text and token ids), too many and too long stop strings, 20 MB and
    malformed session ids (and DeleteSession('<id>:lock')), num_samples over the limit, and a
    request whose work num_samples x (context + max_new_tokens) is over max_request_tokens.
    Expect: each INVALID_ARGUMENT naming its limit (the setting), within 3 s; the coordinator's
    memory grows by far less than the requests' size; it keeps serving."""
    pid = shared_coordinator.proc.pid
    metadata = (("authorization", f"Bearer {KEYS['tenant-a']}"),)
    options = [("grpc.max_send_message_length", 256 * MB), ("grpc.max_receive_message_length", 256 * MB)]
    rss_before = _rss_mb(pid)
    results, failures = {}, []
    with grpc.insecure_channel(shared_coordinator.address, options=options) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        for name, (call, words) in _oversize_calls(stub, metadata).items():
            code, details, seconds = harness.status_of(call)
            results[name] = (code, seconds)
            if code != INVALID or not all(w in details for w in words) or seconds > 3:
                failures.append(f"{name}: {code} in {seconds:.2f} s, {details[:200]!r} (expected {words})")
        ok = stub.Generate(build_request(PROMPT, **SMALL), metadata=metadata, timeout=60)
    rss_growth = _rss_mb(pid) - rss_before
    for name, (code, seconds) in results.items():
        print(f"{name}: {code.name if code else 'OK'} in {seconds * 1000:.0f} ms")
    print(f"coordinator RSS grew {rss_growth:.0f} MB over these requests")
    assert not failures, "\n".join(failures)
    assert len(ok.completions[0].token_ids) == SMALL["max_new_tokens"]
    assert shared_coordinator.running and rss_growth < 300


@pytest.mark.parametrize(
    ("metadata", "message"),
    [((), "missing API key"), ((("authorization", "Bearer not-a-key"),), "unknown API key")],
    ids=["no key", "unknown key"],
)
def test_calls_without_a_valid_api_key_are_unauthenticated(shared_coordinator, metadata, message):
    """Fault: calls with no `authorization` metadata, and with an unknown bearer key.
    Expect: UNAUTHENTICATED ('missing API key' / 'unknown API key', the key never echoed) on every
    Coordinator method, quickly, creating nothing; a valid key is served."""
    session_id = uuid.uuid4().hex
    with grpc.insecure_channel(shared_coordinator.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        calls = {
            "Generate": lambda: stub.Generate(build_request(PROMPT, **SMALL), metadata=metadata, timeout=30),
            "GenerateStream": lambda: list(
                stub.GenerateStream(build_request(PROMPT, **SMALL), metadata=metadata, timeout=30)
            ),
            "GetSession": lambda: stub.GetSession(
                coordinator_pb2.GetSessionRequest(session_id=session_id), metadata=metadata, timeout=30
            ),
            "DeleteSession": lambda: stub.DeleteSession(
                coordinator_pb2.DeleteSessionRequest(session_id=session_id), metadata=metadata, timeout=30
            ),
        }
        for name, call in calls.items():
            code, details, seconds = harness.status_of(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED and message in details, (name, code, details)
            assert "not-a-key" not in details and seconds < 3, (name, seconds)
    with harness.client(shared_coordinator, api_key=KEYS["tenant-a"]) as client:
        assert client.generate(PROMPT, **SMALL).completions[0].token_ids


def test_another_tenants_session_does_not_exist_for_it(shared_coordinator, redis_url):
    """Fault: tenant B reads, continues, resumes and deletes tenant A's session (a valid id it
    learned).
    Expect: NOT_FOUND on GetSession, a continue (unary and stream) and a resume, each with the
    very answer an id that never existed gets; DeleteSession answers as for an id that never
    existed (deleted = false) and deletes nothing; A still reads its session intact and can
    continue it."""
    owner = harness.client(shared_coordinator, api_key=KEYS["tenant-a"])
    other = harness.client(shared_coordinator, api_key=KEYS["tenant-b"])
    with owner, other:
        created = owner.generate(PROMPT, seed=1, **SMALL)
        session_id = created.session_id
        history = PROMPT + list(created.completions[0].token_ids)
        unknown = uuid.uuid4().hex
        for name, call in {
            "GetSession": lambda s: other.get_session(s),
            "continue": lambda s: other.generate([2], session_id=s, **SMALL),
            "continue stream": lambda s: list(other.stream([2], session_id=s, **SMALL)),
            "resume": lambda s: list(other.resume(s)),
        }.items():
            code, details, _ = harness.status_of(lambda c=call: c(session_id))
            never_code, never_details, _ = harness.status_of(lambda c=call: c(unknown))
            assert code == grpc.StatusCode.NOT_FOUND, (name, code, details)
            assert (code, details.replace(session_id, unknown)) == (never_code, never_details), name
        assert other.delete_session(session_id) is False and other.delete_session(unknown) is False
        assert list(owner.get_session(session_id).token_ids) == history
        assert harness.stored_tokens(redis_url, PREFIX, session_id) == history
        more = owner.generate([2], session_id=session_id, **SMALL)
        assert list(owner.get_session(session_id).token_ids) == history + [2] + list(more.completions[0].token_ids)
        assert owner.delete_session(session_id) is True
