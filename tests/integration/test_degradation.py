"""Degrade, don't fail: the real services (three gRPC servers + Redis) with a draft that stops,
a draft that fails half its calls, and a hung target replica."""

from __future__ import annotations

import random
import threading
import time

import grpc
import numpy as np
import pytest
from law import exact_sequence_law, fit_to_law
from service_stack import start_stack, stop_stack

from specdec.client import build_request
from specdec.core.sampling import Sampling
from specdec.rpc.server import build_grpc_server
from specdec.v1 import coordinator_pb2_grpc

PROMPT = [3, 1, 4]


@pytest.fixture()
def stacks(tiny_loaded, tiny_model_dirs, redis_url):
    started = []

    def start(**overrides):
        started.append(start_stack(tiny_loaded, tiny_model_dirs["target"], redis_url, **overrides))
        return started[-1]

    yield start
    for stack in started:
        stop_stack(stack)


def _stream(stub, **fields):
    request = build_request(PROMPT, seed=7, num_speculative_tokens=3, ignore_eos=True, temperature=1.0, **fields)
    return stub.GenerateStream(request, timeout=120)


def _start_draft(loaded, port: int):
    from draft_service.server import create_server
    from draft_service.settings import DraftSettings
    from specdec.settings import load_settings

    server, _ = create_server(
        load_settings(DraftSettings, [], {}, host="127.0.0.1", port=port, metrics_port=-1), loaded
    )
    return server


def test_a_draft_stopped_mid_stream_the_stream_completes_at_k0_and_speculation_resumes(stacks, tiny_loaded):
    stack = stacks(draft_backoff_s=1.0, draft_timeout_s=1.0, call_attempts=2)
    coordinator, draft, _ = stack.servers
    stub = coordinator_pb2_grpc.CoordinatorStub(stack.channel())
    tokens, chunk_times, final = [], [], None
    stopped_at = None
    for chunk in _stream(stub, max_new_tokens=56):
        tokens += chunk.token_ids
        chunk_times.append(time.perf_counter())
        if len(chunk_times) == 4:  # a few speculative rounds in: the draft goes away
            draft.server.stop(0).wait(5)
            stopped_at = time.perf_counter()
        if chunk.done:
            final = chunk
    assert final is not None and len(tokens) == 56 and final.stats.generated_tokens == 56
    assert final.stats.drafted_tokens > 0 and final.stats.draft_fallback_rounds > 0
    # The first round after the stop: one failed Propose (refused at once), then the round at K=0.
    fallback_s = chunk_times[4] - stopped_at
    assert fallback_s < 2.0
    rounds, fallbacks = final.stats.rounds, final.stats.draft_fallback_rounds
    assert coordinator.registry.value("specdec_draft_fallback_rounds_total") == final.stats.draft_fallback_rounds
    assert coordinator.registry.value("specdec_draft_healthy") == 0

    # The draft comes back on its port: after the back-off a request probes it and speculates.
    port = int(stack.draft_address.rsplit(":", 1)[1])
    restarted = _start_draft(tiny_loaded["draft"], port)
    stack.servers.append(restarted)
    deadline, resumed = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        *_, final = _stream(stub, max_new_tokens=24)
        if final.stats.draft_fallback_rounds == 0 and final.stats.drafted_tokens > 0:
            resumed = final
            break
        time.sleep(0.2)
    assert resumed is not None, "speculation did not resume after the draft came back"
    assert coordinator.registry.value("specdec_draft_healthy") == 1
    print(f"fallback round after the stop: {fallback_s:.3f}s; stream: {rounds} rounds, {fallbacks} at K=0")


class FlakyDraftProxy:
    """A DraftService in front of the real one that fails a pseudo-random half of the Proposes
    (INTERNAL, chosen from its own seeded stream, so independent of the pipeline's draws)."""

    def __init__(self, seed: int = 0):
        self.upstream: grpc.Channel | None = None
        self.failed = self.forwarded = 0
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        methods = {name: grpc.unary_unary_rpc_method_handler(self._forwarder(name)) for name in ("Propose", "Info")}
        handler = grpc.method_handlers_generic_handler("specdec.v1.DraftService", methods)
        self.server = build_grpc_server(
            "127.0.0.1", 0, 8, 256, lambda s: s.add_generic_rpc_handlers((handler,)), [], "flaky"
        )
        self.server.server.start()
        self.address = f"127.0.0.1:{self.server.port}"

    def _forwarder(self, name: str):
        def forward(request: bytes, context) -> bytes:
            if name == "Propose":
                with self._lock:
                    fail = self._random.random() < 0.5
                    self.failed += fail
                    self.forwarded += not fail
                if fail:
                    context.abort(grpc.StatusCode.INTERNAL, "injected draft failure")
            return self.upstream.unary_unary(f"/specdec.v1.DraftService/{name}")(request, timeout=60)

        return forward


def test_samples_through_a_draft_that_fails_half_its_rounds_follow_the_target_law(stacks, tiny_loaded, record_property):
    """Chi-square of the first 3 tokens against the target's exact law (T=1), with every other
    Propose (pseudo-randomly) failing and no back-off: 20 requests of 700 samples, whose rounds
    (a Propose for all samples of a request) fall back at K=0 or speculate at K<=3, in varying
    orders. n = 14,000: the power calculation (law.samples_to_detect: noncentrality >= 4 n TV^2)
    asks for 11,830 samples to see a total-variation distance of 0.05 at power 0.9 and
    significance 0.001 over the 274 bins with expected count >= 5 (asserted with the actual bins).
    ~25 s on 2 cores."""
    proxy = FlakyDraftProxy()
    stack = stacks(draft_address=proxy.address, draft_backoff_s=0.0, call_attempts=1)
    proxy.upstream = grpc.insecure_channel(stack.draft_address)
    stub = coordinator_pb2_grpc.CoordinatorStub(stack.channel())
    total, chunk, length = 14_000, 700, 3
    counts = np.zeros((8,) * length)
    drafted = accepted = recovered = fallback = 0
    try:
        for call in range(total // chunk):
            request = build_request(
                PROMPT, max_new_tokens=length, seed=900 + call, num_speculative_tokens=3, ignore_eos=True
            )
            request.num_samples = chunk
            response = stub.Generate(request, timeout=600)
            for completion in response.completions:
                counts[tuple(completion.token_ids[:length])] += 1
            stats = response.stats
            drafted, accepted = drafted + stats.drafted_tokens, accepted + stats.accepted_tokens
            recovered, fallback = recovered + stats.recovered_tokens, fallback + stats.draft_fallback_rounds
    finally:
        proxy.server.server.stop(0)
        proxy.upstream.close()
    law = exact_sequence_law(tiny_loaded["target"].runner.model, PROMPT, length, Sampling(1.0))
    fit = fit_to_law("flaky draft K3", counts, law, 0.001, drafted, accepted, recovered)
    summary = (
        f"{fit.summary} fallback_rounds={fallback} failed_proposes={proxy.failed}/{proxy.failed + proxy.forwarded}"
    )
    record_property("summary", summary)
    print(summary)
    assert total >= fit.needed, summary
    assert fallback > 0 and proxy.failed > 0 and proxy.forwarded > 0, summary
    assert drafted > 0 and recovered > total * 0.1, summary
    assert fit.p_value > 0.001, summary


def _hung_target():
    """A TargetService whose every call blocks (a hung pod: its connection stays up)."""
    release = threading.Event()

    def hang(request: bytes, context) -> bytes:
        release.wait(60)
        context.abort(grpc.StatusCode.UNAVAILABLE, "released")

    methods = {name: grpc.unary_unary_rpc_method_handler(hang) for name in ("Info", "Verify")}
    handler = grpc.method_handlers_generic_handler("specdec.v1.TargetService", methods)
    server = build_grpc_server("127.0.0.1", 0, 16, 16, lambda s: s.add_generic_rpc_handlers((handler,)), [], "hung")
    server.server.start()
    return server, release


def test_one_hung_target_replica_of_two_does_not_fail_new_requests(stacks, tiny_loaded):
    from specdec.settings import load_settings
    from target_service.server import create_server
    from target_service.settings import TargetSettings

    hung, release = _hung_target()
    healthy, port = create_server(
        load_settings(TargetSettings, [], {}, host="127.0.0.1", port=0, metrics_port=-1), tiny_loaded["target"]
    )
    timeout_s = 0.5
    stack = stacks(
        target_address=f"127.0.0.1:{port},127.0.0.1:{hung.port}",
        verify_timeout_s=timeout_s,
        info_timeout_s=timeout_s,
        draft_timeout_s=timeout_s,
    )
    stack.servers += [healthy, hung]
    stub = coordinator_pb2_grpc.CoordinatorStub(stack.channel())
    took = []
    try:
        for i in range(12):
            started = time.perf_counter()
            request = build_request(PROMPT, max_new_tokens=8, seed=i, num_speculative_tokens=0, ignore_eos=True)
            response = stub.Generate(request, timeout=60)
            took.append(time.perf_counter() - started)
            assert len(response.completions[0].token_ids) == 8
    finally:
        release.set()
    print("request seconds with one of two targets hung: " + " ".join(f"{t:.2f}" for t in took))
    # Every request succeeds; a hung pod costs a timed-out attempt per call that meets it, and
    # once ejected none: the last requests run at healthy speed.
    assert max(took) < 8 * 2 * timeout_s + 2
    assert max(took[-4:]) < timeout_s


def test_a_draft_down_before_the_request_runs_it_at_k0_and_says_so(stacks):
    """The draft's Info fails (nothing listens): the request is served target-only, every round
    counted as a fallback, rather than refused."""
    stack = stacks(draft_address="127.0.0.1:1", draft_timeout_s=0.5, info_timeout_s=0.5, call_attempts=1)
    stub = coordinator_pb2_grpc.CoordinatorStub(stack.channel())
    response = stub.Generate(build_request(PROMPT, max_new_tokens=6, num_speculative_tokens=3, ignore_eos=True))
    stats = response.stats
    assert len(response.completions[0].token_ids) == 6
    assert stats.drafted_tokens == 0 and stats.draft_fallback_rounds == stats.rounds > 0
