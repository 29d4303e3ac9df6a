"""HiddenStateRelay: what it asks the verifier for, what it hands the drafter, and its errors."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.core.errors import HiddenStatesMiss, ServiceError
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


# ---------------------------------------------------------------- deltas


class Replica(FakeDrafter):
    """A draft service replica: joins each delta with the rows it keeps, as the servicer does."""

    keeps_hidden_states = True

    def __init__(self, store=None):
        super().__init__()
        from draft_service.hidden_rows import HiddenRowStore

        self.store = store if store is not None else HiddenRowStore(8, 1000)
        self.joined: list[np.ndarray] = []

    def propose(self, requests, sampling, deadline):
        self.seen.extend(requests)
        joined = [self.store.join(r.hidden_key, r.prefix_token_ids, r.hidden_offset, r.target_hidden) for r in requests]
        for request, rows in zip(requests, joined, strict=True):
            self.store.keep(request.hidden_key, request.prefix_token_ids, rows)
        self.joined.extend(joined)
        return [DraftProposal([1], np.full((1, 3), 1 / 3, np.float32)) for _ in requests]


class Pool:
    """A pool whose calls go to the replicas in the order `route` gives (then round robin)."""

    keeps_hidden_states = True

    def __init__(self, replicas, route=()):
        self.replicas, self.route, self.log = replicas, list(route), []

    def propose(self, requests, sampling, deadline):
        call = len(self.log)
        index = self.route[call] if call < len(self.route) else call % len(self.replicas)
        self.log.append((index, *[(r.hidden_offset, bool(r.hidden_key)) for r in requests]))
        return self.replicas[index].propose(requests, sampling, deadline)


def _rounds(relay, prefixes):
    """Verify then Propose each prefix in turn (a round drafts on the rows the last Verify held)."""
    _verify(relay, prefixes[0][:-1], [])
    for prefix in prefixes:
        _verify(relay, prefix[:-1], [prefix[-1]])
        _propose(relay, prefix)


def _history(prefix):
    return np.stack([_state(prefix, t) for t in range(len(prefix) - 1)])


PREFIXES = [[3, 1, 4], [3, 1, 4, 1, 5], [3, 1, 4, 1, 5, 9, 2]]


def test_after_the_first_propose_only_new_rows_are_sent_and_the_join_is_the_full_history():
    replica = Replica()
    _rounds(HiddenStateRelay(replica, FakeVerifier()), PREFIXES)
    assert [(r.hidden_offset, r.target_hidden.shape[0]) for r in replica.seen] == [(0, 2), (2, 2), (4, 2)]
    assert len({r.hidden_key for r in replica.seen}) == 1 and replica.seen[0].hidden_key
    for prefix, joined in zip(PREFIXES, replica.joined, strict=True):
        assert joined.dtype == np.float16 and np.array_equal(joined, _history(prefix))  # bitwise


def test_a_replica_that_never_saw_the_sequence_misses_and_the_relay_resends_once_from_row_0():
    first, second = Replica(), Replica()
    pool = Pool([first, second], route=[0, 1, 1])
    _rounds(HiddenStateRelay(pool, FakeVerifier()), PREFIXES[:2])
    # Round 1 on `first` (whole history); round 2's delta misses on `second`, which then gets row 0 on.
    assert pool.log == [(0, (0, True)), (1, (2, True)), (1, (0, True))]
    assert len(second.joined) == 1 and np.array_equal(second.joined[0], _history(PREFIXES[1]))
    assert len(second.store) == 1  # kept from the resend, nothing from the miss


def test_a_relay_that_keeps_missing_sends_whole_histories():
    pool = Pool([Replica(), Replica()])  # round robin: every delta lands on the replica a round behind
    _rounds(HiddenStateRelay(pool, FakeVerifier()), [[3, 1, 4, *range(n)] for n in range(5)])
    assert pool.log == [
        (0, (0, True)),
        (1, (2, True)),  # miss
        (0, (0, True)),
        (1, (3, True)),  # miss: from now on, whole histories, kept nowhere
        (0, (0, True)),
        (1, (0, False)),
        (0, (0, False)),
    ]


def test_a_miss_on_a_whole_history_is_not_retried():
    class Broken(FakeDrafter):
        keeps_hidden_states = True

        def propose(self, requests, sampling, deadline):
            super().propose(requests, sampling, deadline)
            raise HiddenStatesMiss("broken")

    drafter = Broken()
    relay = HiddenStateRelay(drafter, FakeVerifier())
    _verify(relay, [3, 1, 4], [])
    with pytest.raises(HiddenStatesMiss):
        _propose(relay, [3, 1, 4, 1])
    assert len(drafter.seen) == 1


def test_an_in_process_drafter_gets_the_whole_history_every_round():
    drafter = FakeDrafter()  # no keeps_hidden_states: the relay hands it the held rows as they are
    _rounds(HiddenStateRelay(drafter, FakeVerifier()), PREFIXES)
    assert [(r.hidden_offset, r.hidden_key) for r in drafter.seen] == [(0, "")] * 3
    for prefix, request in zip(PREFIXES, drafter.seen, strict=True):
        assert np.array_equal(request.target_hidden, _history(prefix))
