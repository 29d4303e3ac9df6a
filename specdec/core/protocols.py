"""What the engine asks of its two models, independent of how it reaches them.

A `Drafter` proposes tokens with the laws it drew them from; a `Verifier` scores a prefix plus
proposed tokens in one forward. The gRPC clients (`specdec.rpc.clients`) and the in-process
adapters (`draft_service.proposer`, `target_service.verifier`) implement them; the dataclasses
are what both sides of the wire convert to and from (`specdec.rpc.wire`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specdec.core.errors import DeadlineExceeded
from specdec.core.sampling import Sampling


@dataclass(frozen=True)
class Deadline:
    """An absolute deadline (from the client's, when it set one)."""

    at: float | None  # time.monotonic() value, None = no deadline

    def timeout(self, cap_s: float) -> float:
        """Seconds a call may take now: at most cap_s; DeadlineExceeded once the deadline passed."""
        if self.at is None:
            return cap_s
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("the request's deadline passed")
        return min(cap_s, left)

    def check(self) -> None:
        """DeadlineExceeded once the deadline has passed."""
        self.timeout(0.0)


NO_DEADLINE = Deadline(None)


# Most decode steps (VerifyRequest.decode_uniforms) a target runs for one sequence in one call: its
# time on the model thread, 64 steps, as a few prompt chunks take.
MAX_DECODE_STEPS = 64
# Longest VerifyRequest.stop_ngram: a lookup draft's longest match (draft settings' NGRAM_MAX /
# SUFFIX_MIN_MATCH are at most this).
MAX_STOP_NGRAM = 64


@dataclass(frozen=True)
class DraftRequest:
    cache_key: str  # the model service's KV-cache key ("" = no cache)
    prefix_token_ids: list[int]
    num_draft_tokens: int  # K: propose at most this many
    seed: int  # seeds the K uniforms the draft samples with
    # [len(prefix) - 1 - hidden_offset, H]: the target's final hidden states at prefix positions
    # hidden_offset.., for a draft conditioned on them.
    target_hidden: np.ndarray | None = None
    # Which of the engine's sequences this is (its sample index); never sent over the wire.
    # Lets an adapter carry per-sequence state from one round's Verify to the next Propose.
    sequence: int = 0
    # > 0: target_hidden is a delta; the draft joins it with rows 0..hidden_offset-1 it keeps
    # under hidden_key from an earlier request (HiddenStatesMiss when it holds none that fit).
    hidden_offset: int = 0
    hidden_key: str = ""  # names the caller's copy of the rows ("" = the draft keeps nothing)
    # A hybrid draft proposes from its lookup alone: its model is too dear to pay (set by auto K).
    lookup_only: bool = False


@dataclass(frozen=True)
class DraftProposal:
    draft_token_ids: list[int]  # [k], k <= K
    # [k, V] float32: exactly the law each token was drawn from; None with point_mass.
    draft_probs: np.ndarray | None
    cached_tokens: int = 0
    # A model-free draft: q_i is the one-hot law of draft_token_ids[i] (lossless: accepted with
    # probability p(x), the residual on rejection is p without x), so no [k, V] array is sent.
    point_mass: bool = False


@dataclass(frozen=True)
class VerifyRequest:
    cache_key: str  # the model service's KV-cache key ("" = no cache)
    prefix_token_ids: list[int]
    draft_token_ids: list[int]
    hidden_from: int | None = None  # also return final hidden states from this position on
    sequence: int = 0  # as DraftRequest.sequence
    # Decode steps (no drafts): the target samples a token per uniform from its own laws and runs on
    # from it, stopping after one of stop_token_ids; the tokens come back, not the laws.
    decode_uniforms: tuple[float, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    # ... and after a step where the sequence's last stop_ngram tokens occur earlier in it (0: off)
    stop_ngram: int = 0
    # > 0: the uniforms are rounds drafted by the target's own lookup, lookup_k + 1 a round (one per
    # examined draft, then the final draw); at most max_tokens tokens in all (0: no such bound)
    lookup_k: int = 0
    max_tokens: int = 0
    # with lookup_k under auto K: c_1..c_lookup_k, its acceptance at each position where a draft
    # reaches it; a shared step may then verify only the drafts worth their rows (`draft_rows`).
    # Empty: every draft is verified (an explicit K).
    lookup_acceptance: tuple[float, ...] = ()

    @property
    def rounds(self) -> int:
        """Rounds its decode uniforms play (0: a Verify of its drafts)."""
        return len(self.decode_uniforms) // (self.lookup_k + 1)

    @property
    def most_tokens(self) -> int:
        """Tokens its rounds may add: K + 1 each, at most max_tokens where set."""
        most = self.rounds * (self.lookup_k + 1)
        return min(most, self.max_tokens) if self.max_tokens else most


@dataclass(frozen=True)
class VerifyResult:
    target_probs: np.ndarray  # [K + 1, V] float32
    cached_tokens: int = 0
    hidden: np.ndarray | None = None  # [len(prefix) + K - hidden_from, H], when asked
    step_sequences: int = 1  # sequences in the batched forward it ran in, itself included
    step_rows: int = 0  # new rows of all those sequences (0: not reported)
    decoded_token_ids: tuple[int, ...] = ()  # with decode_uniforms: the tokens sampled (target_probs empty)
    # with lookup_k: per round played, (tokens its lookup drafted and the step verified, of which accepted)
    round_drafts: tuple[tuple[int, int], ...] = ()
    # ... and per round what the lookup proposed, where a shared step verified fewer (empty: none did)
    round_proposed: tuple[int, ...] = ()
    # ... and per round its seconds on the model's thread: lookup, step and play (empty: not reported)
    round_seconds: tuple[float, ...] = ()


class Drafter(Protocol):
    def propose(
        self, requests: Sequence[DraftRequest], sampling: Sampling, deadline: Deadline
    ) -> list[DraftProposal]: ...


class Verifier(Protocol):
    def verify(
        self, requests: Sequence[VerifyRequest], sampling: Sampling, deadline: Deadline
    ) -> list[VerifyResult]: ...
