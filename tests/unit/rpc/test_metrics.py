"""The metrics registry on prometheus_client: buckets, labels, scrape-time values, the HTTP endpoint."""

from __future__ import annotations

import urllib.request

from specdec.core.kpolicy import MIN_RECORDED_POSITIONS, DraftRecord, RoundOutcome
from specdec.rpc.metrics import (
    LATENCY_BUCKETS,
    GenerationMetrics,
    MetricsInterceptor,
    Registry,
    observe_draft_records,
    sample_value,
    serve_metrics,
)


def test_a_round_counts_drafts_tokens_and_acceptance_per_position_as_vllm_does():
    registry = Registry()
    metrics = GenerationMetrics(registry)
    # Two sequences in one round: one drafted 3 and kept 2 (+1 recovered), one drafted nothing.
    metrics.round(0.004, 0.02, [(3, 2, 3), (0, 0, 1)])
    metrics.round(None, 0.03, [(2, 0, 1)])  # no Propose this round (e.g. the draft was backing off)
    value = registry.value
    assert value("specdec_spec_decode_num_drafts_total") == 2  # the K=0 sequence is no draft
    assert value("specdec_spec_decode_num_draft_tokens_total") == 5
    assert value("specdec_spec_decode_num_accepted_tokens_total") == 2
    per_pos = {p: value("specdec_spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(3)}
    assert per_pos == {0: 1, 1: 1, 2: None}  # position 2 was never accepted: no series
    # With the largest K known, every position is exported from the start.
    exported = Registry()
    GenerationMetrics(exported, positions=4)
    assert exported.value("specdec_spec_decode_num_accepted_tokens_per_pos_total", position="3") == 0
    assert value("specdec_tokens_per_round_count") == 3 and value("specdec_tokens_per_round_sum") == 5
    assert value("specdec_round_draft_seconds_count") == 1  # only the round that made a Propose
    assert value("specdec_round_verify_seconds_count") == 2
    assert abs(value("specdec_round_verify_seconds_sum") - 0.05) < 1e-12


def test_latency_buckets_resolve_sub_millisecond_steps_and_minute_long_requests():
    registry = Registry()
    metrics = GenerationMetrics(registry)
    metrics.round(0.0003, 0.0003, [])  # a GPU-sized Propose / Verify
    bucket = "specdec_round_draft_seconds_bucket"
    assert registry.value(bucket, le="0.00025") == 0 and registry.value(bucket, le="0.0005") == 1
    metrics.first_token(45.0)  # a first token after a long CPU prefill still lands below +Inf
    assert registry.value("specdec_time_to_first_token_seconds_bucket", le="25.0") == 0
    assert registry.value("specdec_time_to_first_token_seconds_bucket", le="60.0") == 1
    assert list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS) and LATENCY_BUCKETS[0] <= 0.0001


def test_finished_requests_add_token_counters_and_rounds():
    registry = Registry()
    metrics = GenerationMetrics(registry)
    metrics.finished(prompt=5, generated=12, drafted=9, accepted=6, rounds=4)
    metrics.finished(prompt=1, generated=2, drafted=0, accepted=0, rounds=2)
    tokens = {k: registry.value("specdec_tokens_total", kind=k) for k in ("prompt", "generated", "drafted", "accepted")}
    assert tokens == {"prompt": 6, "generated": 14, "drafted": 9, "accepted": 6}
    assert registry.value("specdec_rounds_total") == 6


def test_registries_are_per_service_and_scrape_time_values_are_read_at_scrape():
    first, second = Registry(), Registry()
    # The same interceptor metrics twice in one process (tests run three services so): no collision.
    MetricsInterceptor(first, "draft")
    MetricsInterceptor(second, "target")
    assert first.value("specdec_inflight_requests", service="draft") == 0
    assert first.value("specdec_inflight_requests", service="target") is None
    state = {"sessions": 1}
    first.observe("specdec_kv_cache_sessions", "sessions", "gauge", {"service": "draft"}, lambda: state["sessions"])
    first.observe("specdec_kv_cache_hits_total", "hits", "counter", {"service": "draft"}, lambda: 7)
    state["sessions"] = 3
    assert first.value("specdec_kv_cache_sessions", service="draft") == 3
    assert first.value("specdec_kv_cache_hits_total", service="draft") == 7
    # Observing a name again replaces it (a model attached again), it does not fail as a duplicate.
    first.observe("specdec_kv_cache_sessions", "sessions", "gauge", {"service": "draft"}, lambda: 5)
    assert first.value("specdec_kv_cache_sessions", service="draft") == 5


def test_the_http_endpoint_serves_the_text_format_and_sample_value_ignores_label_order():
    registry = Registry()
    counter = registry.counter("specdec_requests_total", "calls", ("service", "method", "code"))
    counter.labels(service="draft", method="Propose", code="OK").inc(3)
    server = serve_metrics(registry, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5) as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            body = response.read().decode()
    finally:
        server.shutdown()
    assert "# TYPE specdec_requests_total counter" in body
    assert "_created" not in body  # one series per counter, not two
    assert sample_value(body, "specdec_requests_total", code="OK", method="Propose", service="draft") == 3
    assert sample_value(body, "specdec_requests_total", service="draft", method="Info", code="OK") is None


def test_auto_k_records_of_the_draft_model_are_read_at_scrape_per_sampling_mode():
    records = {True: DraftRecord(), False: DraftRecord()}
    registry = Registry()
    observe_draft_records(registry, records)
    assert registry.value("specdec_draft_record_verdict", sampling="greedy") == -1
    assert registry.value("specdec_draft_record_positions", sampling="sampled") == 0
    assert registry.value("specdec_draft_record_acceptance", sampling="greedy") is None  # nothing examined yet
    # Greedy requests whose model drafts (2 a round, in 5 ms) are accepted 1 time in 4; 1-row Verifies of 6 ms.
    rounds = [RoundOutcome(2, 0.005, 0.007, 3, [(2, 2 if i % 4 == 0 else 0)], model_drawn=[True]) for i in range(40)]
    records[True].add([*rounds, RoundOutcome(0, 0.0, 0.006, 1, [(0, 0)], model_drawn=[False])])
    assert records[True].verdict(4) is False
    assert registry.value("specdec_draft_record_verdict", sampling="greedy") == 0
    assert registry.value("specdec_draft_record_positions", sampling="greedy") == 40 >= MIN_RECORDED_POSITIONS
    assert registry.value("specdec_draft_record_acceptance", sampling="greedy") == 0.25
    assert registry.value("specdec_draft_record_verdict", sampling="sampled") == -1
