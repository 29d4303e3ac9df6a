"""/metrics of the coordinator, draft and target, scraped over HTTP around one generation, agree
with the stats the generation's response reports."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from specdec.client import build_request

PROMPT = [3, 1, 4, 1, 5]


def _scrape(server) -> dict[tuple[str, frozenset], float]:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


class Delta:
    """What one service's samples gained between two scrapes."""

    def __init__(self, server, before):
        self.server, self.before, self.after = server, before, _scrape(server)

    def __call__(self, name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        assert key in self.after, f"{name}{labels} is not exported"
        return self.after[key] - self.before.get(key, 0.0)

    def now(self, name: str, **labels: str) -> float:
        return self.after[(name, frozenset(labels.items()))]


def _settled(servers, before, expected: dict[int, tuple[tuple[str, frozenset], float]]) -> list[Delta]:
    """Scrape until the services count the calls expected (a server counts a call as its response
    leaves, a moment after the client may already have it)."""
    deadline = time.monotonic() + 5
    while True:
        deltas = [Delta(s, b) for s, b in zip(servers, before, strict=True)]
        counted = all(
            deltas[i].after.get(key, 0.0) - deltas[i].before.get(key, 0.0) == n for i, (key, n) in expected.items()
        )
        if counted or time.monotonic() > deadline:
            return deltas
        time.sleep(0.05)


def _calls(service: str, method: str) -> tuple[str, frozenset]:
    labels = {"service": service, "method": method, "code": "OK"}
    return ("specdec_requests_total", frozenset(labels.items()))


def test_scraped_metrics_agree_with_the_response_stats(tiny_stack, coordinator_stub):
    servers = tiny_stack.servers  # coordinator, draft, target
    before = [_scrape(s) for s in servers]
    request = build_request(PROMPT, max_new_tokens=16, seed=11, num_speculative_tokens=3, ignore_eos=True)
    chunks = list(coordinator_stub.GenerateStream(request, timeout=120))
    stats = chunks[-1].stats
    with_tokens = sum(1 for c in chunks if c.token_ids)
    assert stats.rounds == with_tokens and stats.drafted_tokens > 0  # one chunk per round

    expected = {0: (_calls("coordinator", "GenerateStream"), 1.0), 2: (_calls("target", "Verify"), stats.rounds)}
    coordinator, draft, target = _settled(servers, before, expected)

    # Rounds and tokens, as the response counts them.
    assert coordinator("specdec_rounds_total") == stats.rounds
    for kind, value in (
        ("prompt", stats.prompt_tokens),
        ("generated", stats.generated_tokens),
        ("drafted", stats.drafted_tokens),
        ("accepted", stats.accepted_tokens),
    ):
        assert coordinator("specdec_tokens_total", kind=kind) == value, kind
    # The spec-decode counters: one draft per round that proposed (the last may propose nothing).
    drafts = coordinator("specdec_spec_decode_num_drafts_total")
    proposes = coordinator("specdec_round_draft_seconds_count")
    assert drafts == proposes == draft("specdec_requests_total", service="draft", method="Propose", code="OK")
    assert stats.rounds - 1 <= drafts <= stats.rounds
    assert coordinator("specdec_spec_decode_num_draft_tokens_total") == stats.drafted_tokens
    assert coordinator("specdec_spec_decode_num_accepted_tokens_total") == stats.accepted_tokens
    per_pos = [coordinator("specdec_spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(3)]
    assert sum(per_pos) == stats.accepted_tokens and per_pos == sorted(per_pos, reverse=True)
    # Histograms: a count per round, sums that are the response's totals.
    assert coordinator("specdec_round_verify_seconds_count") == stats.rounds
    assert abs(coordinator("specdec_round_verify_seconds_sum") - stats.verify_time_s) < 1e-6
    assert abs(coordinator("specdec_round_draft_seconds_sum") - stats.draft_time_s) < 1e-6
    assert coordinator("specdec_tokens_per_round_count") == stats.rounds
    assert abs(coordinator("specdec_tokens_per_round_sum") - stats.mean_tokens_per_round * stats.rounds) < 1e-6
    assert coordinator("specdec_time_to_first_token_seconds_count") == 1
    assert coordinator("specdec_inter_token_latency_seconds_count") == with_tokens - 1
    duration = {"service": "coordinator", "method": "GenerateStream"}
    assert coordinator("specdec_request_duration_seconds_count", **duration) == 1
    assert coordinator("specdec_request_duration_seconds_sum", **duration) >= stats.total_time_s
    # auto K's record of the draft model: one 16-token request is too few positions for a verdict.
    assert [coordinator.now("specdec_draft_record_verdict", sampling=s) for s in ("greedy", "sampled")] == [-1, -1]

    # The pools: one Verify per round, each at least one batched step, and their caches' state.
    assert target("specdec_requests_total", service="target", method="Verify", code="OK") == stats.rounds
    assert target("specdec_request_duration_seconds_count", service="target", method="Verify") == stats.rounds
    for pool, role in ((draft, "draft"), (target, "target")):
        steps = pool("specdec_steps_total", service=role)
        assert pool("specdec_step_seconds_count", service=role) == steps >= 1
        assert pool("specdec_step_sequences_count", service=role) == steps
        assert pool.now("specdec_kv_cache_sessions", service=role) >= 1
        assert pool.now("specdec_queued_sequences", service=role) == 0
        assert pool.now("specdec_inflight_requests", service=role) == 0
    assert target("specdec_steps_total", service="target") >= stats.rounds
    assert draft("specdec_steps_total", service="draft") >= drafts
