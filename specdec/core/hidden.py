"""Carrying the target's hidden states to a draft that reads them (EAGLE-style drafts).

Such a draft, at prefix position t, reads the target's final hidden state at t - 1. The relay
sits between the engine and its two models for one generation: it asks each Verify for the
rows the sequence does not hold yet, keeps them, and hands every Propose the whole prefix's
rows. Until the target has returned them for the whole context (the first round), the
sequence drafts nothing, so that round is target-only.

The target's state at position t is a function of tokens 0..t alone, so rows kept from one
round are valid for any later prefix that starts with the same tokens: the rows of rejected
draft tokens fall away because the next prefix no longer matches them.

Deltas: a drafter over the wire (`keeps_hidden_states`) keeps the rows it was sent under a key
this relay names per sequence, so after the first Propose each one carries only the rows the
draft has not seen (`DraftRequest.hidden_offset`). When the draft holds none that fit (another
replica, an evicted entry) it raises HiddenStatesMiss and the relay resends from row 0, once.
A joined history is bitwise the one the relay holds: rows of positions a prefix keeps never
change within a generation, and a key never outlives its relay.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from specdec.core.errors import HiddenStatesMiss, ServiceError
from specdec.core.protocols import (
    Deadline,
    Drafter,
    DraftProposal,
    DraftRequest,
    Verifier,
    VerifyRequest,
    VerifyResult,
)
from specdec.core.sampling import Sampling
from specdec.core.tokens import common_prefix_length

_MAX_MISSES = 2


class HiddenStateRelay:
    """A Drafter and a Verifier in one, wrapping the real pair for one generation."""

    def __init__(self, drafter: Drafter, verifier: Verifier):
        self._drafter = drafter
        self._verifier = verifier
        # sequence -> (the tokens the rows were computed on, [m, H] rows of their first m positions)
        self._held: dict[int, tuple[list[int], np.ndarray]] = {}
        # In process the drafter reads the held array itself: a delta would only add a join.
        self._deltas = bool(getattr(drafter, "keeps_hidden_states", False))
        self._key_prefix = secrets.token_hex(8)  # one generation's keys never name another's rows
        # sequence -> the prefix of its last Propose the draft served (it keeps those rows)
        self._sent: dict[int, list[int]] = {}
        self._misses = 0

    def _known(self, sequence: int, prefix: list[int]) -> np.ndarray | None:
        """[m, H] rows of the prefix's positions 0..m-1 held for `sequence`, m <= len(prefix) - 1."""
        held = self._held.get(sequence)
        if held is None:
            return None
        tokens, rows = held
        m = min(rows.shape[0], common_prefix_length(tokens, prefix), len(prefix) - 1)
        return rows[:m]

    def propose(self, requests: Sequence[DraftRequest], sampling: Sampling, deadline: Deadline) -> list[DraftProposal]:
        proposals = [DraftProposal([], np.empty((0, 0), np.float32)) for _ in requests]
        ready: dict[int, DraftRequest] = {}
        for i, request in enumerate(requests):
            rows = self._known(request.sequence, request.prefix_token_ids)
            if rows is not None and rows.shape[0] == len(request.prefix_token_ids) - 1:
                ready[i] = replace(request, target_hidden=rows, hidden_key=self._key(request.sequence))
        if ready:
            drafted = self._draft(list(ready.values()), sampling, deadline)
            if len(drafted) != len(ready):
                raise ServiceError(f"draft returned {len(drafted)} proposals for {len(ready)} sequences")
            for i, proposal in zip(ready, drafted, strict=True):
                proposals[i] = proposal
        return proposals

    def _key(self, sequence: int) -> str:
        return f"{self._key_prefix}/{sequence}" if self._deltas_on() else ""

    def _deltas_on(self) -> bool:
        # A pool that spreads a session's calls over replicas misses on most rounds, and each
        # miss costs a second call: after two, this generation sends whole histories.
        return self._deltas and self._misses < _MAX_MISSES

    def _draft(self, full: list[DraftRequest], sampling: Sampling, deadline: Deadline) -> list[DraftProposal]:
        """Propose with deltas where the draft should hold the rows; on a miss, once from row 0."""
        if not self._deltas_on():
            return self._drafter.propose(full, sampling, deadline)
        deltas = [self._delta(r) for r in full]
        try:
            drafted = self._drafter.propose(deltas, sampling, deadline)
        except HiddenStatesMiss:
            if all(r.hidden_offset == 0 for r in deltas):
                raise  # nothing shorter was sent: the draft is broken, a resend would not help
            self._misses += 1
            drafted = self._drafter.propose(full, sampling, deadline)
        for request in full:
            self._sent[request.sequence] = request.prefix_token_ids
        return drafted

    def _delta(self, request: DraftRequest) -> DraftRequest:
        """`request` carrying only the rows past those the draft kept from its last Propose."""
        sent = self._sent.get(request.sequence)
        if sent is None:
            return request
        prefix = request.prefix_token_ids
        # The draft holds rows 0..len(sent)-2; row t stays valid while tokens 0..t agree.
        offset = min(len(sent) - 1, common_prefix_length(sent, prefix), len(prefix) - 1)
        return replace(request, target_hidden=request.target_hidden[offset:], hidden_offset=offset)

    def verify(self, requests: Sequence[VerifyRequest], sampling: Sampling, deadline: Deadline) -> list[VerifyResult]:
        known = [self._known(r.sequence, r.prefix_token_ids) for r in requests]
        counts = [0 if rows is None else rows.shape[0] for rows in known]
        asked = [replace(r, hidden_from=m) for r, m in zip(requests, counts, strict=True)]
        results = self._verifier.verify(asked, sampling, deadline)
        for request, rows, m, result in zip(requests, known, counts, results, strict=False):
            self._keep(request, rows, m, result)
        return results

    def _keep(self, request: VerifyRequest, rows: np.ndarray | None, m: int, result: VerifyResult) -> None:
        if result.hidden is None:
            raise ServiceError(
                "the target returned no hidden states, which this draft reads: the target service "
                "must support VerifySequence.hidden_states_from"
            )
        tokens = [*request.prefix_token_ids, *request.draft_token_ids]
        if result.hidden.ndim != 2 or result.hidden.shape[0] != len(tokens) - m:
            raise ServiceError(
                f"target returned hidden states {result.hidden.shape} for positions {m}..{len(tokens) - 1}"
            )
        full = result.hidden if rows is None or m == 0 else np.concatenate([rows, result.hidden])
        self._held[request.sequence] = (tokens, full)
