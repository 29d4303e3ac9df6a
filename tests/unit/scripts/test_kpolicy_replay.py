"""scripts/kpolicy_replay.py: the replay's token accounting is exact greedy speculation, and its
table compares policies on the same trace."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))

import kpolicy_replay as replay_mod
from kpolicy_replay import Costs, accepted_length, replay, table

from specdec.core.kpolicy import FixedK, RoundOutcome


class Recording(FixedK):
    def __init__(self, k):
        super().__init__(k)
        self.outcomes: list[RoundOutcome] = []

    def observe(self, outcome):
        self.outcomes.append(outcome)


def test_accepted_length_is_the_common_prefix():
    assert accepted_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert accepted_length([], [1]) == 0 and accepted_length([1, 2], [1]) == 1


def test_a_round_gains_its_accepted_tokens_plus_one_and_pays_its_rows():
    generated = [5, 6, 7, 8, 9, 10]
    # After t tokens the drafter proposes the right next two, except at t = 3 (a wrong first token).
    proposals = [[*generated[t : t + 2]] for t in range(len(generated))]
    proposals[3] = [0, 9]
    costs = Costs((0.010, 0.015, 0.020), call_s=0.0)
    policy = Recording(2)
    seconds = replay(generated, proposals, policy, costs, random.Random(0), prefill_s=1.0)
    # t=0: 2 accepted + bonus -> t=3: rejected at once, + correction -> t=4: 1 left to draft
    # (k is capped at len - t - 1 = 1), accepted + bonus -> t=6, done.
    assert [(o.rows, o.drafts[0]) for o in policy.outcomes] == [(3, (2, 2)), (3, (2, 0)), (2, (1, 1))]
    assert seconds == pytest.approx(1.0 + 0.020 + 0.020 + 0.015)
    assert replay(generated, proposals, FixedK(0), costs, random.Random(0)) == pytest.approx(6 * 0.010)


def test_the_table_has_every_policy_and_k0_is_the_unit(monkeypatch):
    monkeypatch.setattr(replay_mod, "DRAFTERS", ("ngram",))
    generated = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    trace = {
        "conversations": [
            {
                "workload": "w",
                "name": "a",
                "prefill_ms": 5.0,
                "generated": generated,
                "proposals": {"ngram": [generated[t : t + 4] for t in range(len(generated))]},
            }
        ]
    }
    flat = Costs((0.01,) * 5, call_s=0.0)
    (row,) = table(trace, flat, 4, 1)
    assert row["K=0"] == 1.0 and row["K=4"] > row["K=1"] > 1.0  # perfect drafts, free extra rows
    assert 1.0 <= row["auto"] <= row["K=4"] and row["auto_min"] == row["auto"]


def test_proposals_are_the_drafter_s_after_each_prefix_of_the_generation():
    from specdec.core.lookup import NgramDrafter

    ids, generated = [7, 8, 9, 7], [8, 9, 5]
    made = replay_mod.proposals(NgramDrafter(1, 2), "conversation", ids, generated, 3)
    # After [7, 8, 9, 7] the last 7 matched at 0: propose 8, 9, 7; then [.., 7, 8] matched at 0-1: 9, 7, 8.
    assert made[:2] == [[8, 9, 7], [9, 7, 8]] and len(made) == len(generated)
