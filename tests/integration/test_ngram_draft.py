"""The model-free ngram (prompt-lookup) draft through the REAL services and in one process.

Its proposals are point masses (token ids only, q = one-hot), which is lossless: greedy output
equals the target's alone, and T=1 samples follow the target's exact law (chi-square at
significance 0.001, fixed seed), with proposals rejected often on a prompt that repeats.
"""

from __future__ import annotations

import time

import grpc
import pytest
from law import assert_draft_follows_law

from specdec.client import build_request

PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats: the lookup always has something to propose
LENGTH = 3


def _ngram_settings(tokenizer_dir: str, **overrides):
    from draft_service.settings import DraftSettings
    from specdec.settings import load_settings

    fields = {"model": "ngram", "tokenizer": tokenizer_dir, "host": "127.0.0.1", "port": 0, "metrics_port": 0}
    return load_settings(DraftSettings, [], {}, **{**fields, **overrides})


@pytest.fixture(scope="module")
def ngram_stack(tiny_loaded, tiny_model_dirs, redis_url):
    from service_stack import start_stack, stop_stack

    from draft_service.loading import load_lookup
    from specdec.v1 import coordinator_pb2_grpc

    ngram = load_lookup("ngram", _ngram_settings(tiny_model_dirs["target"]))
    stack = start_stack(tiny_loaded, tiny_model_dirs["target"], redis_url, draft_loaded=ngram)
    channel = stack.channel()
    yield coordinator_pb2_grpc.CoordinatorStub(channel)
    channel.close()
    stop_stack(stack)


def test_a_draft_server_started_with_model_ngram_serves_point_masses(tiny_model_dirs, tiny_loaded):
    """`SPECDEC_DRAFT_MODEL=ngram` as the service starts it: SERVING once the tokenizer loads."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from draft_service.server import create_server
    from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

    server, port = create_server(_ngram_settings(tiny_model_dirs["target"], ngram_min=2, ngram_max=3))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 60
            while (
                health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                != health_pb2.HealthCheckResponse.SERVING
            ):
                assert time.monotonic() < deadline, "the ngram draft never reported SERVING"
                time.sleep(0.05)
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            info = stub.Info(common_pb2.InfoRequest(), timeout=10)
            target = tiny_loaded["target"].info
            assert (info.vocab_size, info.tokenizer_fingerprint) == (target.vocab_size, target.tokenizer_fingerprint)
            assert info.role == "draft" and not info.needs_target_hidden_states and info.max_position_embeddings == 0
            assert list(info.eos_token_ids) == [0]

            def propose(*prefixes, k=3):
                sequences = [draft_pb2.DraftSequence(prefix_token_ids=p, num_draft_tokens=k) for p in prefixes]
                return stub.Propose(draft_pb2.ProposeRequest(sequences=sequences), timeout=10).proposals

            # (1, 2) occurred, followed by 3, 4 ...; a 1-token match is below ngram_min=2; nothing matches.
            found, too_short, none = propose([1, 2, 3, 4, 5, 1, 2], [5, 6, 5], [1, 2, 3])
            assert found.point_mass and list(found.draft_token_ids) == [3, 4, 5]
            assert not found.HasField("draft_probs")
            assert too_short.point_mass and list(too_short.draft_token_ids) == []
            assert none.point_mass and list(none.draft_token_ids) == []
            with pytest.raises(grpc.RpcError) as error:
                propose([1, 8])
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        server.server.stop(0).wait(10)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_with_the_ngram_draft_equals_the_target_alone(ngram_stack, k):
    def generate(num_speculative_tokens):
        request = build_request(
            PROMPT, max_new_tokens=24, temperature=0.0, num_speculative_tokens=num_speculative_tokens, ignore_eos=True
        )
        return ngram_stack.Generate(request, timeout=60)

    alone, speculated = generate(0), generate(k)
    assert list(speculated.completions[0].token_ids) == list(alone.completions[0].token_ids)
    assert len(alone.completions[0].token_ids) == 24
    assert speculated.stats.drafted_tokens > 0


def test_ngram_draft_samples_follow_the_target_law(ngram_stack, tiny_loaded, record_property):
    model = tiny_loaded["target"].runner.model
    fit = assert_draft_follows_law(ngram_stack, model, "ngram K3-T1", PROMPT, LENGTH, 3, seed=71)
    record_property("summary", fit.summary)


def test_in_process_ngram_emits_what_the_distributed_stack_emits(ngram_stack, tiny_model_dirs):
    from specdec.inprocess import InProcessPipeline

    pipeline = InProcessPipeline(tiny_model_dirs["target"], "ngram")
    kwargs = {"max_new_tokens": 16, "temperature": 1.0, "seed": 5, "num_speculative_tokens": 3, "ignore_eos": True}
    local = pipeline.generate(PROMPT, **kwargs)
    remote = ngram_stack.Generate(build_request(PROMPT, **kwargs), timeout=60)
    assert list(local.completions[0].token_ids) == list(remote.completions[0].token_ids)
    assert local.stats.drafted_tokens == remote.stats.drafted_tokens > 0
    assert local.stats.accepted_tokens == remote.stats.accepted_tokens
