"""The whole stack over TLS: mutual TLS between the coordinator and its pools, TLS from the client
(SpecdecClient and the CLI) to the coordinator, and plaintext refused everywhere."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_stack import start_stack, stop_stack
from tls_certs import make_pki

from specdec.cli import main
from specdec.client import SpecdecClient, build_request
from specdec.rpc.tls import channel_credentials
from specdec.v1 import coordinator_pb2_grpc

GREEDY = {"temperature": 0, "num_speculative_tokens": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_stack(tiny_loaded, tiny_model_dirs, redis_url, pki):
    ca, server, client = pki["ca"].cert, pki["server"], pki["client"]
    stack = start_stack(
        tiny_loaded,
        tiny_model_dirs["target"],
        redis_url,
        model_tls={"tls_cert_file": server.cert, "tls_key_file": server.key, "tls_client_ca_file": ca},
        credentials=channel_credentials(ca),
        tls_cert_file=server.cert,
        tls_key_file=server.key,
        pool_tls_ca_file=ca,
        pool_tls_cert_file=client.cert,
        pool_tls_key_file=client.key,
    )
    yield stack
    stop_stack(stack)


def test_generates_over_mutual_tls_to_the_pools_and_tls_from_the_client(tls_stack, pki):
    with tls_stack.channel() as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        response = stub.Generate(build_request([1, 2, 3], max_new_tokens=8, seed=1, **GREEDY), timeout=60)
    assert len(response.completions[0].token_ids) == 8
    assert response.stats.drafted_tokens > 0  # the draft pool answered too, not only the target
    with SpecdecClient(tls_stack.coordinator_address, tls_ca_file=pki["ca"].cert) as client:
        streamed = [
            t for chunk in client.stream([1, 2, 3], max_new_tokens=8, seed=1, **GREEDY) for t in chunk.token_ids
        ]
    assert streamed == list(response.completions[0].token_ids)


def test_plaintext_clients_are_refused_by_the_coordinator_and_the_pools(tls_stack):
    for address in (tls_stack.coordinator_address, tls_stack.draft_address, tls_stack.target_address):
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as error:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_pools_refuse_a_tls_client_without_a_client_certificate(tls_stack, pki):
    credentials = channel_credentials(pki["ca"].cert)
    with grpc.secure_channel(tls_stack.target_address, credentials) as channel, pytest.raises(grpc.RpcError) as error:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def test_cli_generates_over_tls_with_the_ca_from_the_environment(tls_stack, pki, capsys, monkeypatch):
    args = ["generate", "a b c", "--address", tls_stack.coordinator_address, "--max-new-tokens", "4", "--seed", "1"]
    assert main(args) == 1  # plaintext to a TLS coordinator
    assert "UNAVAILABLE" in capsys.readouterr().err
    monkeypatch.setenv("SPECDEC_TLS_CA_FILE", pki["ca"].cert)
    assert main(args) == 0
    assert "acceptance rate" in capsys.readouterr().err
