"""HiddenStateRelay: what it asks the verifier for, what it hands the drafter, and its errors."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.core.errors import ServiceError
from specdec.core.hidden import HiddenStateRelay
from specdec.core.protocols import NO_DEADLINE, DraftProposal, DraftRequest, VerifyRequest, VerifyResult
from specdec.core.sampling import Sampling

H = 4
SAMPLING = Sampling(1.0)


def _state(tokens: list[int], position: int) -> np.ndarray:
    """A fake target's hidden state: a function of tokens 0..position, as a real one is."""
    return np.full(H, sum(tokens[: position + 1]) * 10 + position, np.float16)


class FakeVerifier:
    def __init__(self):
        self.asked: list[int | None] = []

    def verify(self, requests, sampling, deadline):
        results = []
        for r in requests:
            self.asked.append(r.hidden_from)
            tokens = r.prefix_token_ids + r.draft_token_ids
            rows = np.stack([_state(tokens, t) for t in range(r.hidden_from, len(tokens))])
            results.append(VerifyResult(np.full((len(r.draft_token_ids) + 1, 3), 1 / 3, np.float32), 0, rows))
        return results


class FakeDrafter:
    def __init__(self):
        self.seen: list[DraftRequest] = []

    def propose(self, requests, sampling, deadline):
        self.seen.extend(requests)
        return [DraftProposal([1], np.full((1, 3), 1 / 3, np.float32)) for _ in requests]


def _propose(relay, prefix, sequence=0):
    (proposal,) = relay.propose([DraftRequest("", prefix, 2, seed=1, sequence=sequence)], SAMPLING, NO_DEADLINE)
    return proposal


def _verify(relay, prefix, drafts, sequence=0):
    return relay.verify([VerifyRequest("", prefix, drafts, sequence=sequence)], SAMPLING, NO_DEADLINE)


def test_the_first_round_drafts_nothing_and_asks_for_the_whole_contexts_states():
    drafter, verifier = FakeDrafter(), FakeVerifier()
    relay = HiddenStateRelay(drafter, verifier)
    assert _propose(relay, [3, 1, 4]).draft_token_ids == [] and drafter.seen == []
    _verify(relay, [3, 1, 4], [])
    assert verifier.asked == [0]


def test_later_rounds_hand_the_draft_every_prefix_row_and_ask_only_for_new_ones():
    drafter, verifier = FakeDrafter(), FakeVerifier()
    relay = HiddenStateRelay(drafter, verifier)
    _verify(relay, [3, 1, 4], [])  # rows 0..2
    prefix = [3, 1, 4, 1]
    assert _propose(relay, prefix).draft_token_ids == [1]
    np.testing.assert_array_equal(drafter.seen[-1].target_hidden, np.stack([_state(prefix, t) for t in range(3)]))
    _verify(relay, prefix, [5, 9])  # holds rows 0..2, so asks from 3
    assert verifier.asked[-1] == 3


def test_rows_of_rejected_drafts_are_never_handed_on():
    drafter, verifier = FakeDrafter(), FakeVerifier()
    relay = HiddenStateRelay(drafter, verifier)
    _verify(relay, [3, 1], [])
    _verify(relay, [3, 1, 4], [5, 9])  # rows for 3 1 4 5 9; say 5 is accepted, 9 rejected, 2 recovered
    prefix = [3, 1, 4, 5, 2]
    _propose(relay, prefix)
    np.testing.assert_array_equal(drafter.seen[-1].target_hidden, np.stack([_state(prefix, t) for t in range(4)]))
    _verify(relay, prefix, [])
    assert verifier.asked[-1] == 4


def test_sequences_keep_their_own_rows():
    drafter, verifier = FakeDrafter(), FakeVerifier()
    relay = HiddenStateRelay(drafter, verifier)
    _verify(relay, [3, 1], [], sequence=0)
    assert _propose(relay, [3, 1, 2], sequence=1).draft_token_ids == []  # sequence 1 holds nothing yet
    assert _propose(relay, [3, 1, 2], sequence=0).draft_token_ids == [1]


def test_a_target_that_returns_too_few_rows_is_an_error():
    class Short(FakeVerifier):
        def verify(self, requests, sampling, deadline):
            results = super().verify(requests, sampling, deadline)
            return [VerifyResult(r.target_probs, 0, r.hidden[:-1]) for r in results]

    with pytest.raises(ServiceError, match="hidden states"):
        _verify(HiddenStateRelay(FakeDrafter(), Short()), [3, 1, 4], [])


def test_a_draft_that_answers_for_the_wrong_number_of_sequences_is_an_error():
    class Extra(FakeDrafter):
        def propose(self, requests, sampling, deadline):
            return super().propose(requests, sampling, deadline) * 2

    relay = HiddenStateRelay(Extra(), FakeVerifier())
    _verify(relay, [3, 1], [])
    with pytest.raises(ServiceError, match="proposals for"):
        _propose(relay, [3, 1, 2])


def test_rows_past_the_point_where_a_prefix_diverges_are_not_reused():
    """Only rows whose tokens still match count; a prefix that diverged re-asks from there."""
    drafter, verifier = FakeDrafter(), FakeVerifier()
    relay = HiddenStateRelay(drafter, verifier)
    _verify(relay, [3, 1, 4], [5, 9])  # rows for 3 1 4 5 9
    diverged = [3, 1, 7, 7, 7]  # same length class, but only 3 1 match
    assert _propose(relay, diverged).draft_token_ids == [] and drafter.seen == []
    _verify(relay, diverged, [])
    assert verifier.asked[-1] == 2
