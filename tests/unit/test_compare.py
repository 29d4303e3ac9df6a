"""specdec.compare: timing a stream's decode, and the report."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specdec.compare import TimedRun, compare, first_difference, format_comparison


class FakeClient:
    """Streams canned chunks: two tokens in the first, one in each after, then a final chunk."""

    def __init__(self):
        self.requests, self.deleted = [], []

    def stream(self, prompt, **kwargs):
        self.requests.append(kwargs)
        k = kwargs["num_speculative_tokens"]
        stats = SimpleNamespace(acceptance_rate=0.5, drafted_tokens=4 if k != 0 else 0, mean_tokens_per_round=1.5)
        yield SimpleNamespace(token_ids=[1, 2], session_id="", stats=None)
        yield SimpleNamespace(token_ids=[3], session_id="", stats=None)
        yield SimpleNamespace(token_ids=[], session_id=f"s{len(self.requests)}", stats=stats)

    def delete_session(self, session_id):
        self.deleted.append(session_id)


def test_compare_runs_speculation_first_then_k0_with_the_same_request_and_deletes_both_sessions():
    client = FakeClient()
    speculative, alone = compare(client, "p", None, seed=3, temperature=0.0)
    assert [r["num_speculative_tokens"] for r in client.requests] == [None, 0]
    assert all(r["seed"] == 3 and r["temperature"] == 0.0 for r in client.requests)
    assert client.deleted == ["s1", "s2"]
    assert speculative.token_ids == alone.token_ids == [1, 2, 3] and speculative.first_chunk_tokens == 2


def test_decode_speed_leaves_the_first_chunk_out():
    stats = SimpleNamespace(acceptance_rate=0.0, drafted_tokens=0, mean_tokens_per_round=1.0)
    assert TimedRun([1, 2, 3, 4], 1, 0.5, stats).decode_tokens_per_s == pytest.approx(6.0)
    assert TimedRun([1], 1, 0.0, stats).decode_tokens_per_s == 0.0  # nothing after the first chunk


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_the_report_gives_the_ratio_and_where_greedy_runs_part():
    spec = SimpleNamespace(acceptance_rate=0.75, drafted_tokens=8, mean_tokens_per_round=2.5)
    solo = SimpleNamespace(acceptance_rate=0.0, drafted_tokens=0, mean_tokens_per_round=1.0)
    fast, slow = TimedRun([1, 2, 3, 4, 5], 1, 0.5, spec), TimedRun([1, 2, 9, 4, 5], 1, 1.0, solo)
    report = format_comparison(fast, slow, None, greedy=True).splitlines()
    assert report[1].split()[-4:] == ["8.00", "2.50", "0.75", "5"] and report[1].startswith("speculation, auto K")
    assert report[2].split()[-4:] == ["4.00", "1.00", "-", "5"]
    assert report[3] == (
        "2.00x the target alone; the tokens part at token 2 (at T = 0 only a near-tie tipped by float rounding should)"
    )
    assert format_comparison(fast, slow, 4, greedy=False).splitlines()[3] == "2.00x the target alone"


def test_a_run_over_in_its_first_round_has_no_speed_to_compare():
    stats = SimpleNamespace(acceptance_rate=0.0, drafted_tokens=0, mean_tokens_per_round=1.0)
    timed, short = TimedRun([1, 2, 3], 1, 0.5, stats), TimedRun([1], 1, 0.0, stats)
    assert format_comparison(timed, short, 2, greedy=False).splitlines()[3].startswith("no decode speed to compare")
