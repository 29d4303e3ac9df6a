"""The suffix draft and the hybrid draft (suffix lookup, then the draft model) through the REAL
services and in one process.

Both are lossless: the suffix draft's proposals are point masses whose tokens depend only on the
prefixes it was sent (this session's and, through its cross-session cache, earlier sessions'); the
hybrid draft picks, per sequence per round, the suffix proposal or the model's from the prefix
alone. So greedy output equals the target's alone, and T=1 samples follow the target's exact law
(chi-square at significance 0.001, fixed seeds, with at least the samples needed to detect a
total-variation deviation of 0.05 with power 0.9), with proposals rejected often.

Before the suffix law test, single-sample sessions fill the draft's cross-session cache with sampled
continuations of the same prompt: the samples (no cache key: they read the cache, never write it)
then get proposals from other sessions' outputs as well as from their own prefix.
"""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from law import assert_draft_follows_law

from specdec.client import build_request

PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats: the lookup has something to propose from the start
LENGTH = 3
WARM_SESSIONS = 24


def _suffix_settings(tokenizer_dir: str, **overrides):
    from draft_service.settings import DraftSettings
    from specdec.settings import load_settings

    fields = {"model": "suffix", "tokenizer": tokenizer_dir, "host": "127.0.0.1", "port": 0, "metrics_port": 0}
    return load_settings(DraftSettings, [], {}, **{**fields, **overrides})


class CountingLookup:
    """The hybrid's lookup, counting the sequences it proposed for and those it left to the model."""

    def __init__(self, lookup):
        self.lookup = lookup
        self.matched = self.unmatched = 0

    def propose(self, requests, sampling, deadline):
        proposals = self.lookup.propose(requests, sampling, deadline)
        found = sum(1 for p in proposals if p.draft_token_ids)
        self.matched += found
        self.unmatched += len(proposals) - found
        return proposals


def _stub(stack):
    from specdec.v1 import coordinator_pb2_grpc

    channel = stack.channel()
    return channel, coordinator_pb2_grpc.CoordinatorStub(channel)


def _warm(stub, seed: int) -> None:
    """Single-sample sessions (each with its cache key): their prefixes stay in the draft's cache."""
    for i in range(WARM_SESSIONS):
        request = build_request(
            PROMPT, max_new_tokens=8, temperature=1.0, seed=seed + i, num_speculative_tokens=3, ignore_eos=True
        )
        stub.Generate(request, timeout=60)


@pytest.fixture(scope="module")
def suffix_stack(tiny_loaded, tiny_model_dirs, redis_url):
    from service_stack import start_stack, stop_stack

    from draft_service.loading import load_lookup

    served = load_lookup("suffix", _suffix_settings(tiny_model_dirs["target"]))
    stack = start_stack(tiny_loaded, tiny_model_dirs["target"], redis_url, draft_loaded=served)
    channel, stub = _stub(stack)
    yield stub, served.drafter
    channel.close()
    stop_stack(stack)


@pytest.fixture(scope="module")
def hybrid_stack(tiny_loaded, tiny_model_dirs, redis_url):
    from service_stack import start_stack, stop_stack

    from draft_service.hybrid import HybridDrafter
    from draft_service.served import ServedDraft, served
    from specdec.core.lookup import lookup_drafter

    model = served(tiny_loaded["draft"])
    lookup = CountingLookup(lookup_drafter("suffix", _suffix_settings(tiny_model_dirs["target"])))
    hybrid = ServedDraft(HybridDrafter(lookup, model.drafter), model.info, model.runner)
    stack = start_stack(tiny_loaded, tiny_model_dirs["target"], redis_url, draft_loaded=hybrid)
    channel, stub = _stub(stack)
    yield stub, lookup
    channel.close()
    stop_stack(stack)


def _wait_serving(channel, what: str) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 60
    while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, f"the {what} draft never reported SERVING"
        time.sleep(0.05)


def test_a_draft_server_started_with_model_suffix_serves_point_masses(tiny_model_dirs, tiny_loaded):
    """`SPECDEC_DRAFT_MODEL=suffix` as the service starts it: SERVING once the tokenizer loads."""
    from draft_service.server import create_server
    from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

    server, port = create_server(_suffix_settings(tiny_model_dirs["target"], suffix_cache_max_tokens=12))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            _wait_serving(channel, "suffix")
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            info = stub.Info(common_pb2.InfoRequest(), timeout=10)
            target = tiny_loaded["target"].info
            assert (info.vocab_size, info.tokenizer_fingerprint) == (target.vocab_size, target.tokenizer_fingerprint)
            assert info.role == "draft" and not info.needs_target_hidden_states and info.max_position_embeddings == 0
            assert info.model_id.startswith("suffix:depth24-match2")

            def propose(*sequences, k=3):
                sequences = [
                    draft_pb2.DraftSequence(cache_key=key, prefix_token_ids=p, num_draft_tokens=k)
                    for key, p in sequences
                ]
                return stub.Propose(draft_pb2.ProposeRequest(sequences=sequences), timeout=10).proposals

            # Session "a" has seen (1, 2) followed by 3, 4, 5; session "b" gets that from the cache.
            (own,) = propose(("a", [1, 2, 3, 4, 5, 6, 1, 2]))
            (shared, none) = propose(("b", [7, 1, 2]), ("", [6, 7]))
            assert own.point_mass and list(own.draft_token_ids) == [3, 4, 5]
            assert not own.HasField("draft_probs")
            assert shared.point_mass and list(shared.draft_token_ids) == [3, 4, 5]
            assert none.point_mass and list(none.draft_token_ids) == []
            for bad, k in (([1, 8], 3), ([], 3), ([5, 5, 5, 5], 0)):  # outside the vocabulary; empty; K = 0
                with pytest.raises(grpc.RpcError) as error:
                    propose(("e", bad), k=k)
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            (nothing,) = propose(("g", [0, 5, 5]))  # the refused (5, 5, 5, 5) was not stored
            assert list(nothing.draft_token_ids) == []
            # 14 tokens are over the bound of 12: "a" lost its 2 oldest; "d" makes that 6.
            (trimmed,) = propose(("d", [2, 3]))  # (2, 3) was followed by 4 at the start of "a"
            assert list(trimmed.draft_token_ids) == []
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5)
            assert 'specdec_suffix_cache_tokens{service="draft"} 12' in metrics.read().decode()
    finally:
        server.server.stop(0).wait(10)


def _greedy(stub, k):
    request = build_request(PROMPT, max_new_tokens=24, temperature=0.0, num_speculative_tokens=k, ignore_eos=True)
    return stub.Generate(request, timeout=60)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_with_the_suffix_draft_equals_the_target_alone(suffix_stack, k):
    stub, _ = suffix_stack
    alone, speculated = _greedy(stub, 0), _greedy(stub, k)
    assert list(speculated.completions[0].token_ids) == list(alone.completions[0].token_ids)
    assert len(alone.completions[0].token_ids) == 24
    assert speculated.stats.drafted_tokens > 0 and speculated.stats.accepted_tokens > 0


def test_greedy_output_with_the_hybrid_draft_equals_the_target_alone(hybrid_stack):
    stub, lookup = hybrid_stack
    before = lookup.matched
    alone, speculated = _greedy(stub, 0), _greedy(stub, 3)
    assert list(speculated.completions[0].token_ids) == list(alone.completions[0].token_ids)
    assert speculated.stats.drafted_tokens > 0 and lookup.matched > before


def test_suffix_draft_samples_follow_the_target_law(suffix_stack, tiny_loaded, record_property):
    stub, drafter = suffix_stack
    _warm(stub, seed=500)
    assert drafter.cached_tokens > len(PROMPT) * WARM_SESSIONS  # other sessions' outputs are there
    model = tiny_loaded["target"].runner.model
    fit = assert_draft_follows_law(stub, model, "suffix K4-T1", PROMPT, LENGTH, 4, seed=73)
    record_property("summary", fit.summary)


def test_hybrid_draft_samples_follow_the_target_law(hybrid_stack, tiny_loaded, record_property):
    # No warm-up here: a sample's first round is the suffix draft's (the prompt repeats itself), and
    # after a first-token rejection the prefix's new suffix was never seen: the model's round.
    stub, lookup = hybrid_stack
    matched, unmatched = lookup.matched, lookup.unmatched
    model = tiny_loaded["target"].runner.model
    fit = assert_draft_follows_law(stub, model, "hybrid K3-T1", PROMPT, LENGTH, 3, seed=79)
    mix = f"; suffix served {lookup.matched - matched} sequence-rounds, the model {lookup.unmatched - unmatched}"
    record_property("summary", fit.summary + mix)
    # Both drafts proposed.
    assert lookup.matched - matched > 14_000 * 0.1 and lookup.unmatched - unmatched > 14_000 * 0.1, fit.summary + mix


@pytest.mark.parametrize("lookup", ["suffix", "hybrid"])
def test_in_process_suffix_and_hybrid_keep_greedy_output(tiny_model_dirs, lookup):
    from specdec.inprocess import InProcessPipeline

    if lookup == "suffix":
        pipeline = InProcessPipeline(tiny_model_dirs["target"], "suffix")
    else:
        pipeline = InProcessPipeline(tiny_model_dirs["target"], tiny_model_dirs["draft"], lookup="suffix")
        assert pipeline.draft.info.model_id.endswith("+suffix")
    kwargs = {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True}
    alone = pipeline.generate(PROMPT, num_speculative_tokens=0, **kwargs)
    speculated = pipeline.generate(PROMPT, num_speculative_tokens=3, **kwargs)
    assert list(speculated.completions[0].token_ids) == list(alone.completions[0].token_ids)
    assert speculated.stats.drafted_tokens > 0


def _stack_without_a_draft_pool(tiny_loaded, tiny_model_dirs, redis_url, **overrides):
    """The stack with the coordinator's draft_address at a port where nothing listens: every proposal
    is the coordinator's or the target's own."""
    from service_stack import start_stack, stop_stack

    stack = start_stack(tiny_loaded, tiny_model_dirs["target"], redis_url, draft_address="127.0.0.1:1", **overrides)
    channel, stub = _stub(stack)
    yield stub, stack
    channel.close()
    stop_stack(stack)


@pytest.fixture(scope="module")
def local_suffix_stack(tiny_loaded, tiny_model_dirs, redis_url):
    """The coordinator drafting with its own suffix draft (LOCAL_DRAFT)."""
    yield from _stack_without_a_draft_pool(tiny_loaded, tiny_model_dirs, redis_url, local_draft="suffix")


@pytest.fixture(scope="module")
def target_suffix_stack(tiny_loaded, tiny_model_dirs, redis_url):
    """The target drafting every round itself with its own suffix draft (SPECDEC_TARGET_LOOKUP)."""
    overrides = {"target_overrides": {"lookup": "suffix"}}
    yield from _stack_without_a_draft_pool(tiny_loaded, tiny_model_dirs, redis_url, **overrides)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("where", ["local_suffix_stack", "target_suffix_stack"])
def test_greedy_output_with_a_suffix_draft_outside_the_pool_equals_the_target_alone(request, where, k):
    stub, _ = request.getfixturevalue(where)
    alone, speculated = _greedy(stub, 0), _greedy(stub, k)
    assert list(speculated.completions[0].token_ids) == list(alone.completions[0].token_ids)
    assert speculated.stats.drafted_tokens > 0 and speculated.stats.accepted_tokens > 0


def test_coordinators_own_suffix_draft_samples_follow_the_target_law(
    local_suffix_stack, tiny_loaded, record_property, monkeypatch
):
    """Also the rounds whose draft found nothing: decode steps that end where a lookup of
    DECODE_STOP_NGRAM (2) tokens matches (`SpeculativeEngine._round`)."""
    import target_service.verifier as verifier_module

    stub, stack = local_suffix_stack
    stretches = []  # (steps asked, steps run) of each stretch that ends at a lookup match, in the target
    real = verifier_module._rounds_task

    def counting(request, lookup):
        result = yield from real(request, lookup)
        if request.stop_ngram == 2:
            stretches.append((request.rounds, len(result.decoded_token_ids)))
        return result

    monkeypatch.setattr(verifier_module, "_rounds_task", counting)
    _warm(stub, seed=600)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{stack.servers[0].metrics_port}/metrics", timeout=5).read()
    cached = [line for line in metrics.decode().splitlines() if line.startswith("specdec_suffix_cache_tokens")]
    assert cached and cached[0].startswith('specdec_suffix_cache_tokens{service="coordinator"}')
    assert float(cached[0].split()[-1]) > len(PROMPT) * WARM_SESSIONS  # other sessions' outputs are there
    model = tiny_loaded["target"].runner.model
    fit = assert_draft_follows_law(stub, model, "local suffix K4-T1", PROMPT, LENGTH, 4, seed=83)
    stretched, ended = sum(run for _, run in stretches), sum(run < asked for asked, run in stretches)
    record_property("summary", f"{fit.summary}; {stretched} decode steps after empty proposals, {ended} ended early")
    # (3-token samples leave stretches of 1-2 steps: few can end before their last; the engine's
    # equality tests cover early ends token for token.)
    assert stretched > 1000 and ended >= 5, (stretched, ended)


def test_targets_own_suffix_draft_samples_follow_the_target_law(
    target_suffix_stack, tiny_loaded, record_property, monkeypatch
):
    """Rounds drafted and played in the target (VerifySequence.lookup_k), several a call: each at its
    block of the coordinator's uniforms, the target's cache rolled back after each rejection."""
    import target_service.verifier as verifier_module

    stub, stack = target_suffix_stack
    drafted = []  # the length of each of the target's own proposals
    real = verifier_module._lookup
    monkeypatch.setattr(verifier_module, "_lookup", lambda *a: drafted.append(len(p := real(*a))) or p)
    _warm(stub, seed=700)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{stack.servers[2].metrics_port}/metrics", timeout=5).read()
    cached = [line for line in metrics.decode().splitlines() if line.startswith("specdec_suffix_cache_tokens")]
    assert cached and cached[0].startswith('specdec_suffix_cache_tokens{service="target"}')
    model = tiny_loaded["target"].runner.model
    fit = assert_draft_follows_law(stub, model, "target suffix K4-T1", PROMPT, LENGTH, 4, seed=89)
    proposed = sum(1 for n in drafted if n)
    mix = f"; the target's suffix draft proposed in {proposed} of {len(drafted)} rounds"
    record_property("summary", fit.summary + mix)
    assert proposed > 1000, (proposed, len(drafted))


def test_targets_own_suffix_draft_under_auto_k_with_rounds_cut_follows_the_target_law(
    target_suffix_stack, tiny_loaded, record_property, monkeypatch
):
    """Auto K (num_speculative_tokens unset) sends its acceptance per position, and a shared step may
    then verify only a round's first drafts (`specdec.models.draft_rows`). Here every such round is
    cut at random, by a generator of its own (never the round's uniforms): each is then a round of the
    shorter draft, and the law stays the target's."""
    import random

    from specdec.models import draft_rows

    stub, _ = target_suffix_stack
    rng, cuts = random.Random(11), []

    def cut_at_random(self, items, rows):
        drops = [len(item.gains) - rng.randint(0, len(item.gains)) for item in items]
        cuts.extend(drop for item, drop in zip(items, drops, strict=True) if item.gains)
        return [draft_rows._cut(item, drop) for item, drop in zip(items, drops, strict=True)], rows - sum(drops)

    monkeypatch.setattr(draft_rows.DraftRows, "trim", cut_at_random)
    model = tiny_loaded["target"].runner.model
    fit = assert_draft_follows_law(stub, model, "target suffix auto K, cut", PROMPT, LENGTH, None, seed=97)
    cut = sum(1 for drop in cuts if drop)
    record_property("summary", f"{fit.summary}; {cut} of {len(cuts)} drafted rounds cut")
    assert cut > 1000, (cut, len(cuts))
