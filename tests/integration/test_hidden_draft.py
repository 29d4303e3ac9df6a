"""A draft that reads the target's hidden states (EAGLE-style), through the REAL services.

Such a draft is fed, at position t, the target's final hidden state at t - 1 next to the
token: the coordinator carries those states from each Verify to the next Propose. The
output must still be exactly the target's law (chi-square at significance 0.001, fixed
seeds), the caches must not change any result, and a bad request gets INVALID_ARGUMENT.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from law import exact_sequence_law, fit_to_law, sample_counts

from specdec.core.sampling import Sampling

SIGNIFICANCE = 0.001
PROMPT = [3, 1, 4]
LENGTH = 3


@pytest.fixture(scope="module")
def hidden_stack(tiny_loaded, tiny_model_dirs, redis_url, tmp_path_factory):
    from service_stack import start_stack, stop_stack

    from draft_service.settings import DraftSettings
    from specdec.models.draft_artifact import CONDITIONING_TARGET_HIDDEN, build_draft, save_draft_artifact
    from specdec.models.loading import load_causal_lm
    from specdec.models.openmp_env import available_cpus
    from specdec.rpc.model_service import load_model
    from specdec.settings import load_settings
    from specdec.v1 import coordinator_pb2_grpc

    target, _ = load_causal_lm(tiny_model_dirs["target"])
    draft = build_draft(target, 1, [1], conditioning=CONDITIONING_TARGET_HIDDEN)
    with torch.no_grad():  # an untrained fuse and layer, perturbed: a draft that reads f but disagrees
        generator = torch.Generator().manual_seed(7)
        for param in [*draft.model.layers.parameters(), *draft.hidden_fuse.parameters()]:
            param.add_(0.5 * torch.randn(param.shape, generator=generator) * (param.std() + 0.05))
    artifact = save_draft_artifact(tmp_path_factory.mktemp("hidden") / "draft", draft, tiny_model_dirs["target"], [1])
    # A fixed thread count: the compared calls below must run the same kernels bit for bit (the
    # default measures thread counts per forward, which may differ between two calls); float32
    # products and caches, which cached and uncached proposals compute alike (a draft's default
    # int8 products keep float16 caches).
    fields = {"model": str(artifact), "torch_threads": available_cpus(), "matmul_dtype": "float32"}
    settings = load_settings(DraftSettings, [], {}, **fields)
    loaded = load_model(settings, "draft")
    stack = start_stack(tiny_loaded, tiny_model_dirs["target"], redis_url, draft_loaded=loaded)
    channel = stack.channel()
    yield {"stub": coordinator_pb2_grpc.CoordinatorStub(channel), "draft": loaded, "stack": stack}
    channel.close()
    stop_stack(stack)


def _target_hidden(tiny_loaded, tokens: list[int]) -> np.ndarray:
    runner = tiny_loaded["target"].runner
    return runner.last_logits("", tokens, 1, hidden_from=0).hidden.numpy()


def test_the_artifact_says_it_reads_hidden_states(hidden_stack, tiny_loaded):
    info = hidden_stack["draft"].info
    assert info.needs_target_hidden_states and info.hidden_size == tiny_loaded["target"].info.hidden_size
    assert not tiny_loaded["target"].info.needs_target_hidden_states


def test_target_hidden_states_from_the_cache_equal_a_fresh_forward(tiny_loaded):
    runner = tiny_loaded["target"].runner
    tokens = [3, 1, 4, 1, 5, 2, 6]
    fresh = runner.last_logits("", tokens, 3, hidden_from=0)
    assert fresh.hidden.shape == (len(tokens), runner.hidden_size)
    # A session grows, rolls back, and asks for rows it ran in earlier calls.
    runner.last_logits("hidden-cache", tokens[:4], 1, hidden_from=2)
    runner.last_logits("hidden-cache", tokens[:5] + [7, 7], 3, hidden_from=4)
    cached = runner.last_logits("hidden-cache", tokens, 2, hidden_from=1)
    assert cached.cached_tokens == 5
    torch.testing.assert_close(cached.hidden, fresh.hidden[1:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cached.logits, fresh.logits[-2:], rtol=1e-4, atol=1e-5)


def test_cached_proposals_equal_uncached_ones(hidden_stack, tiny_loaded):
    """The draft's cache keeps only positions fed the target's states, never its own guesses."""
    from draft_service.proposer import propose
    from specdec.core.protocols import DraftRequest

    runner = hidden_stack["draft"].runner
    sampling = Sampling(1.0)
    first, second = [3, 1, 4], [3, 1, 4, 1, 5]
    for prefix, seed in ((first, 1), (second, 2)):
        request = DraftRequest("hidden-q", prefix, 3, seed, _target_hidden(tiny_loaded, prefix)[:-1])
        (cached,) = propose(runner, [request], sampling)
        (fresh,) = propose(runner, [DraftRequest("", prefix, 3, seed, request.target_hidden)], sampling)
        # A batch of two runs the padded, cache-free path.
        batch = propose(runner, [DraftRequest("", prefix, 3, seed, request.target_hidden)] * 2, sampling)
        assert cached.draft_token_ids == fresh.draft_token_ids == batch[1].draft_token_ids
        np.testing.assert_allclose(cached.draft_probs, fresh.draft_probs, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(batch[0].draft_probs, fresh.draft_probs, rtol=1e-4, atol=1e-6)
    assert cached.cached_tokens == len(first)  # the second round reused the first's prefix


def test_pipeline_with_hidden_draft_follows_target_law(hidden_stack, tiny_loaded, record_property):
    total, k, sampling = 14_000, 3, Sampling(1.0)
    law = exact_sequence_law(tiny_loaded["target"].runner.model, PROMPT, LENGTH, sampling)
    # The first token is the target's own (its round returns the states the draft reads);
    # max_new_tokens leaves room for drafting the 2nd and 3rd.
    counts, drafted, accepted, recovered = sample_counts(
        hidden_stack["stub"], PROMPT, LENGTH, k, sampling, total, LENGTH + k, seed=515
    )
    fit = fit_to_law("hidden-draft K3-T1", counts, law, SIGNIFICANCE, drafted, accepted, recovered)
    record_property("summary", fit.summary)
    assert total >= fit.needed, fit.summary
    assert drafted >= total * k and recovered > total * 0.1 and accepted > total * 0.1, fit.summary
    assert fit.p_value > SIGNIFICANCE, fit.summary


def test_sessions_with_hidden_draft_draft_after_one_target_round(hidden_stack):
    from specdec.client import build_request

    stub = hidden_stack["stub"]
    request = build_request([3, 1, 4], max_new_tokens=12, seed=9, num_speculative_tokens=2, ignore_eos=True)
    first = stub.Generate(request, timeout=60)
    again = stub.Generate(request, timeout=60)
    assert first.completions[0].token_ids == again.completions[0].token_ids  # seeded: reproducible
    stats = first.stats
    assert stats.generated_tokens == 12 and stats.drafted_tokens > 0
    # Only the first round is target-only: it returns the states of the whole context.
    assert stats.drafted_tokens >= 2 * (stats.rounds - 1) - 2
    # Continuing the session (a new call: its hidden states are rebuilt by the target).
    follow = build_request([2], max_new_tokens=6, seed=10, num_speculative_tokens=2, ignore_eos=True)
    follow.session_id = first.session_id
    continued = stub.Generate(follow, timeout=60)
    assert continued.stats.generated_tokens == 6 and continued.stats.drafted_tokens > 0


def test_bad_hidden_state_requests_get_invalid_argument(hidden_stack):
    from specdec.rpc.wire import encode_hidden_states
    from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

    stack = hidden_stack["stack"]
    hidden = hidden_stack["draft"].runner.hidden_size
    with grpc.insecure_channel(stack.draft_address) as channel:
        draft = draft_pb2_grpc.DraftServiceStub(channel)
        for states, offset, words, lookup_only in (
            (None, 0, "is required", False),
            (None, 0, "is required", True),  # not a hybrid: the model serves whatever was asked
            (np.zeros((1, hidden)), 0, "expected [2,", False),
            (np.full((2, hidden), np.nan), 0, "non-finite", False),
            (np.zeros((0, hidden)), 3, "hidden_states_offset must be in [0, 2]", False),
            (np.zeros((1, hidden)), -1, "hidden_states_offset must be in [0, 2]", False),
        ):
            seq = draft_pb2.DraftSequence(
                prefix_token_ids=[3, 1, 4], num_draft_tokens=2, seed=1, hidden_states_offset=offset,
                lookup_only=lookup_only,
            )
            if states is not None:
                seq.target_hidden_states.CopyFrom(encode_hidden_states(states))
            with pytest.raises(grpc.RpcError) as info:
                draft.Propose(draft_pb2.ProposeRequest(sequences=[seq]), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in info.value.details()
    with grpc.insecure_channel(stack.target_address) as channel:
        target = target_pb2_grpc.TargetServiceStub(channel)
        seq = target_pb2.VerifySequence(prefix_token_ids=[3, 1, 4], hidden_states_from=3)
        with pytest.raises(grpc.RpcError) as info:
            target.Verify(target_pb2.VerifyRequest(sequences=[seq]), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "hidden_states_from" in info.value.details()


class _Counting:
    """A drafter that counts the sequences it was asked for."""

    def __init__(self, drafter):
        self.drafter, self.asked = drafter, 0

    def propose(self, requests, sampling, deadline):
        self.asked += len(requests)
        return self.drafter.propose(requests, sampling, deadline)


def test_auto_k_serves_a_hybrid_by_its_lookup_alone_where_its_model_cannot_pay(
    hidden_stack, tiny_loaded, tiny_model_dirs, redis_url
):
    """A hybrid (ngram, then this draft) whose model's forward costs 50 ms beside the target's curve:
    through the real services, auto K asks for the lookup alone. The model is never called, its
    Proposes carry no hidden states (the draft would refuse a plain model's), and greedy output is
    the target's alone. An explicit K still calls the model where the lookup has nothing."""
    from service_stack import start_stack, stop_stack

    from draft_service.hybrid import HybridDrafter
    from specdec.core.lookup import NgramDrafter
    from draft_service.served import ServedDraft, served
    from specdec.client import build_request
    from specdec.v1 import coordinator_pb2_grpc

    assert tiny_loaded["target"].info.forward_cost_ms  # the curve the model is too dear against
    model = served(hidden_stack["draft"])
    counting = _Counting(model.drafter)
    info = type(model.info)()
    info.CopyFrom(model.info)
    info.lookup = "ngram"
    info.forward_cost_ms[:] = [50.0, 60.0, 70.0]
    hybrid = ServedDraft(HybridDrafter(NgramDrafter(3, 3), counting), info, model.runner)
    stack = start_stack(tiny_loaded, tiny_model_dirs["target"], redis_url, draft_loaded=hybrid)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats: the lookup proposes from round 0
    try:
        with stack.channel() as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)

            def greedy(k):
                fields = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
                return stub.Generate(build_request(prompt, num_speculative_tokens=k, **fields), timeout=60)

            alone, auto = greedy(0), greedy(None)
            assert list(auto.completions[0].token_ids) == list(alone.completions[0].token_ids)
            assert auto.stats.drafted_tokens > 0 and counting.asked == 0
            greedy(3)
            assert counting.asked > 0
    finally:
        stop_stack(stack)


class _Recording:
    """A model client that keeps every request it forwards."""

    def __init__(self, client, method: str):
        self.client, self.method, self.requests = client, method, []

    def __getattr__(self, name):
        if name != self.method:
            return getattr(self.client, name)

        def call(requests, sampling, deadline):
            self.requests.append(list(requests))
            return getattr(self.client, name)(requests, sampling, deadline)

        return call


@pytest.mark.parametrize("num_samples", [1, 3])
def test_each_propose_carries_the_targets_states_for_its_whole_prefix(hidden_stack, tiny_loaded, num_samples):
    """The coordinator keeps exactly the rows of tokens that stayed (never a rejected draft's)."""
    from specdec.core.engine import GenerationSpec, SpeculativeEngine, Stats, new_samples
    from specdec.core.protocols import Deadline
    from specdec.rpc.clients import DraftClient, TargetClient

    stack = hidden_stack["stack"]
    draft = _Recording(DraftClient(stack.draft_address, 30, 10, 64), "propose")
    target = _Recording(TargetClient(stack.target_address, 30, 10, 64), "verify")
    engine = SpeculativeEngine(draft, target, lambda ids: " ".join(map(str, ids)))
    spec = GenerationSpec(
        context_token_ids=[3, 1, 4],
        max_new_tokens=16,
        sampling=Sampling(1.0),
        seed=21,
        num_speculative_tokens=3,
        num_samples=num_samples,
        cache_key="hidden-rows" if num_samples == 1 else "",
        draft_needs_hidden=True,
    )
    samples = new_samples(spec)
    for _ in engine.run(spec, samples, Stats(), Deadline(None)):
        pass
    assert all(len(s.generated) == 16 for s in samples)
    checked, offsets = 0, []
    for requests in draft.requests:
        for seq in requests:
            prefix = list(seq.prefix_token_ids)
            sent = seq.target_hidden.astype(np.float32)
            # After its first Propose a sequence carries only the rows the draft has not seen.
            expected = _target_hidden(tiny_loaded, prefix)[seq.hidden_offset : -1]
            np.testing.assert_allclose(sent, expected, rtol=2e-3, atol=2e-3)  # float16 on the wire
            checked += 1
            offsets.append(seq.hidden_offset)
    # Every round drafts but the first (the target's, for the whole context) and perhaps the
    # last (one token left to generate: nothing to draft).
    assert checked >= len(target.requests) - 2 and len(target.requests[0][0].draft_token_ids) == 0
    assert offsets[:num_samples] == [0] * num_samples and all(o > 0 for o in offsets[num_samples:])
    draft.client.close()
    target.client.close()


def test_a_target_that_returns_no_states_is_a_clear_error():
    from specdec.core.errors import ServiceError
    from specdec.core.hidden import HiddenStateRelay
    from specdec.core.protocols import NO_DEADLINE, VerifyRequest, VerifyResult

    class NoStates:
        def verify(self, requests, sampling, deadline):
            return [VerifyResult(np.full((1, 4), 0.25, np.float32)) for _ in requests]

    relay = HiddenStateRelay(drafter=None, verifier=NoStates())
    with pytest.raises(ServiceError, match="returned no hidden states"):
        relay.verify([VerifyRequest("", [3, 1, 4], [])], Sampling(1.0), NO_DEADLINE)


# ---------------------------------------------------------------- deltas through the real draft service


def _two_rounds(client, tiny_loaded, cache_keys, hidden_keys, delta):
    """Proposals of two rounds (prefixes of 3 then 5 tokens) for each sequence, rows whole or as a delta."""
    from specdec.core.protocols import NO_DEADLINE, DraftRequest

    first, later = [3, 1, 4], [3, 1, 4, 1, 5]
    rows = _target_hidden(tiny_loaded, later)[:-1].astype(np.float16)  # [4, H]; rows 0..1 are `first`'s
    sampling, out = Sampling(1.0), []
    for prefix, seed, offset in ((first, 1, 0), (later, 2, 2 if delta else 0)):
        requests = [
            DraftRequest(c, prefix, 3, seed + i, rows[offset : len(prefix) - 1], hidden_offset=offset, hidden_key=k)
            for i, (c, k) in enumerate(zip(cache_keys, hidden_keys, strict=True))
        ]
        out.extend(client.propose(requests, sampling, NO_DEADLINE))
    return out


@pytest.mark.parametrize("batch", [False, True])
def test_a_delta_gives_the_draft_exactly_what_the_whole_history_does(hidden_stack, tiny_loaded, batch):
    """Same calls on the draft's model either way (fresh KV-cache keys), so the results are bitwise equal."""
    from specdec.rpc.clients import DraftClient

    client = DraftClient(hidden_stack["stack"].draft_address, 30, 10, 64)
    tag = "batch" if batch else "one"
    caches = (["", ""] if batch else [f"{tag}-full"], ["", ""] if batch else [f"{tag}-delta"])
    full = _two_rounds(client, tiny_loaded, caches[0], [""] * len(caches[0]), delta=False)
    keys = [f"{tag}-delta/{i}" for i in range(len(caches[1]))]
    delta = _two_rounds(client, tiny_loaded, caches[1], keys, delta=True)
    client.close()
    for whole, joined in zip(full, delta, strict=True):
        assert whole.draft_token_ids == joined.draft_token_ids
        assert np.array_equal(whole.draft_probs, joined.draft_probs)


def test_a_delta_the_draft_cannot_join_is_failed_precondition_and_stores_nothing(hidden_stack, tiny_loaded):
    from specdec.core.errors import HiddenStatesMiss
    from specdec.core.protocols import NO_DEADLINE
    from specdec.rpc.clients import DraftClient
    from specdec.rpc.wire import encode_hidden_states
    from specdec.v1 import draft_pb2, draft_pb2_grpc

    address = hidden_stack["stack"].draft_address
    rows = _target_hidden(tiny_loaded, [3, 1, 4, 1, 5])[:-1]

    def seq(prefix, offset, key):
        states = encode_hidden_states(rows[offset : len(prefix) - 1])
        return draft_pb2.DraftSequence(
            prefix_token_ids=prefix,
            num_draft_tokens=2,
            seed=1,
            target_hidden_states=states,
            hidden_states_offset=offset,
            hidden_states_key=key,
        )

    with grpc.insecure_channel(address) as channel:
        draft = draft_pb2_grpc.DraftServiceStub(channel)
        # A batch whose second sequence misses is refused whole: its first sequence is not kept either.
        refused = draft_pb2.ProposeRequest(sequences=[seq([3, 1, 4], 0, "miss/0"), seq([3, 1, 4, 1], 2, "miss/1")])
        for request in (refused, draft_pb2.ProposeRequest(sequences=[seq([3, 1, 4, 1], 2, "miss/0")])):
            with pytest.raises(grpc.RpcError) as info:
                draft.Propose(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "resend target_hidden_states from row 0" in info.value.details()
            assert ("specdec-reason", "hidden-states-miss") in info.value.trailing_metadata()
        # A delta whose prefix diverged before its offset misses, and leaves the kept rows as they were.
        draft.Propose(draft_pb2.ProposeRequest(sequences=[seq([3, 1, 4], 0, "kept")]), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            draft.Propose(draft_pb2.ProposeRequest(sequences=[seq([3, 2, 4, 1], 2, "kept")]), timeout=10)
        assert "does not line up" in info.value.details()
        draft.Propose(draft_pb2.ProposeRequest(sequences=[seq([3, 1, 4, 1, 5], 2, "kept")]), timeout=10)
    client = DraftClient(address, 30, 10, 64)
    with pytest.raises(HiddenStatesMiss, match="resend"):
        client.call(
            client.stub.Propose, draft_pb2.ProposeRequest(sequences=[seq([3, 1, 4, 1], 2, "never")]), NO_DEADLINE
        )
    client.close()


class _Replicas:
    """A draft pool of clients to separate servers: call i goes to route[i] (the last one from then on)."""

    keeps_hidden_states = True

    def __init__(self, clients, route):
        self.clients, self.route, self.calls = clients, route, []

    def propose(self, requests, sampling, deadline):
        index = self.route[min(len(self.calls), len(self.route) - 1)]
        self.calls.append((index, [r.hidden_offset for r in requests]))
        return self.clients[index].propose(requests, sampling, deadline)


def _generate(drafter, address, cache_key):
    from specdec.core.engine import GenerationSpec, SpeculativeEngine, Stats, new_samples
    from specdec.core.protocols import NO_DEADLINE
    from specdec.rpc.clients import TargetClient

    target = TargetClient(address, 30, 10, 64)
    spec = GenerationSpec([3, 1, 4], 14, Sampling(1.0), 33, 3, cache_key=cache_key, draft_needs_hidden=True)
    samples = new_samples(spec)
    for _ in SpeculativeEngine(drafter, target, str).run(spec, samples, Stats(), NO_DEADLINE):
        pass
    target.close()
    return samples[0].generated


def test_a_replica_that_never_saw_the_session_gets_the_whole_history_and_the_output_is_unchanged(hidden_stack):
    """Deltas, misses and resends change no token: the draft reads the same rows every way."""
    from draft_service.server import create_server
    from draft_service.settings import DraftSettings
    from specdec.rpc.clients import DraftClient
    from specdec.settings import load_settings

    stack = hidden_stack["stack"]
    settings = load_settings(DraftSettings, [], {}, host="127.0.0.1", port=0, metrics_port=0)
    other, port = create_server(settings, hidden_stack["draft"])  # the same model: the same laws
    clients = [DraftClient(stack.draft_address, 30, 10, 64), DraftClient(f"127.0.0.1:{port}", 30, 10, 64)]

    class WholeHistories:  # the draft service as in-process drafters are reached: rows from 0, every time
        def propose(self, requests, sampling, deadline):
            return clients[0].propose(requests, sampling, deadline)

    whole = _generate(WholeHistories(), stack.target_address, "replicas-whole")
    one = _Replicas(clients, route=[0])
    pool = _Replicas(clients, route=[0, 1])  # the 2nd Propose lands on a replica that never saw it
    assert _generate(one, stack.target_address, "replicas-one") == whole
    assert _generate(pool, stack.target_address, "replicas-two") == whole
    assert all(offsets[0] > 0 for _, offsets in one.calls[1:])
    assert pool.calls[:3] == [(0, [0]), (1, [pool.calls[1][1][0]]), (1, [0])] and pool.calls[1][1][0] > 0
    assert all(offsets[0] > 0 for _, offsets in pool.calls[3:])  # the replica kept the resent rows
    for client in clients:
        client.close()
    other.server.stop(0).wait(10)
