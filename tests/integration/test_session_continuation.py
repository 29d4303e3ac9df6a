"""A session continued after a turn that ended mid-round, through the REAL services.

A turn that ends on EOS or on a stop string can end before its last round's drafts do: the
model services' KV caches then hold positions past the session's history (rejected drafts,
tokens after the cut). The next turn diverges from them by more than the one position each
round re-runs anyway, so only a continuation shows a cache that keeps a stale position.
Its tokens must equal those of one call on a fresh session over the whole history: the
engine's randomness depends on (seed, sample, round) only, the models' outputs on the tokens only.
"""

from __future__ import annotations

import pytest

from specdec.client import build_request
from specdec.core.tokens import common_prefix_length
from specdec.v1 import coordinator_pb2

PROMPT = [3, 1, 4, 1, 5]
NEXT_PROMPT = [2, 6]
SEEDS = range(16)  # one stale position changes the sampled tokens of some seeds only
SCENARIOS = {
    "eos": ([], coordinator_pb2.FINISH_REASON_EOS),
    "stop string": (["b"], coordinator_pb2.FINISH_REASON_STOP),  # "b": a likely token of the tiny target
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_continuing_after_a_turn_cut_mid_round_equals_one_call_on_the_history(scenario, coordinator_stub, tiny_loaded):
    stop, finish_reason = SCENARIOS[scenario]
    params = {"temperature": 1.0, "num_speculative_tokens": 3, "ignore_eos": False, "stop": stop}
    cut_mid_round, mismatches = [], []
    for seed in SEEDS:
        first = coordinator_stub.Generate(build_request(PROMPT, max_new_tokens=20, seed=seed, **params))
        session = first.session_id
        history = list(coordinator_stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=session)).token_ids)
        assert history == PROMPT + list(first.completions[0].token_ids)
        # The case under test: the target's cache holds positions the history does not.
        cached = tiny_loaded["target"].runner.cache.token_ids(session)
        ended = first.completions[0].finish_reason == finish_reason
        if ended and cached is not None and common_prefix_length(cached, history) < len(cached):
            cut_mid_round.append(seed)
        continued = coordinator_stub.Generate(
            build_request(NEXT_PROMPT, session_id=session, max_new_tokens=24, seed=seed, **params)
        )
        single = coordinator_stub.Generate(build_request(history + NEXT_PROMPT, max_new_tokens=24, seed=seed, **params))
        if continued.completions[0].token_ids != single.completions[0].token_ids:
            mismatches.append((seed, list(continued.completions[0].token_ids), list(single.completions[0].token_ids)))
    assert len(cut_mid_round) >= len(SEEDS) // 2, f"too few turns ended mid-round: seeds {cut_mid_round}"
    assert not mismatches, f"(seed, continued, single call) that differ: {mismatches}"
