"""specdec.core.kpolicy: K per round from a request's own measured acceptance and costs."""

from __future__ import annotations

import pytest

from specdec.core.kpolicy import (
    DECODE_PRIOR,
    MIN_RECORDED_POSITIONS,
    RECORD_EXPLORE_EVERY,
    RECORD_HALF_LIFE,
    AdaptiveK,
    DecodeRecord,
    DraftRecord,
    FixedK,
    RoundOutcome,
)


def _play(policy: AdaptiveK, rounds: int, acceptance: float, verify, draft_per_token: float) -> list[int]:
    """Play `rounds` rounds: each drafted token at position i is accepted while i <= acceptance * k
    (a deterministic stand-in for acceptance); verify(rows) -> seconds. Returns the Ks chosen."""
    chosen = []
    for _ in range(rounds):
        k = policy.choose()
        assert 0 <= k <= policy.k_max
        chosen.append(k)
        accepted = round(acceptance * k) if acceptance < 1 else k
        policy.observe(RoundOutcome(k, k * draft_per_token, verify(k + 1), k + 1, [(k, accepted)]))
    return chosen


def test_fixed_k_is_the_k_asked_for():
    policy = FixedK(3)
    policy.observe(RoundOutcome(3, 0.1, 0.1, 4, [(3, 0)]))
    assert policy.choose() == 3


def test_cold_start_drafts_start_k_then_measures_one_row():
    policy = AdaptiveK(8)
    assert policy.choose() == 2
    policy.observe(RoundOutcome(2, 5.0, 9.0, 3, [(2, 1)]))  # prefill timings: not kept
    assert policy.choose() == 0
    assert policy.verify_count == {}
    assert AdaptiveK(1).choose() == 1 and AdaptiveK(0).choose() == 0


@pytest.mark.parametrize(
    "verify",
    [lambda rows: 0.01 * rows, lambda rows: 0.01 if rows == 1 else 0.02],
    ids=["linear-in-rows", "two-rows-twice-one"],
)
def test_k_zero_when_two_rows_cost_twice_one(verify):
    policy = AdaptiveK(8)
    chosen = _play(policy, 40, acceptance=0.4, verify=verify, draft_per_token=0.001)
    assert set(chosen[4:]) <= {0, 1} and chosen[4:].count(0) >= 32  # K=1 only as a probe
    speeds = policy.tokens_per_second()
    assert max(speeds[1:]) < speeds[0]


def test_k_zero_when_nothing_is_accepted():
    policy = AdaptiveK(8)
    chosen = _play(policy, 40, acceptance=0.0, verify=lambda rows: 0.01, draft_per_token=0.001)
    assert chosen[-15:].count(0) >= 14


def test_k_above_zero_when_acceptance_is_high_and_verify_cheap():
    policy = AdaptiveK(8)
    chosen = _play(policy, 40, acceptance=1.0, verify=lambda rows: 0.01 + 0.0001 * rows, draft_per_token=0.0005)
    assert chosen[-10:] == [8] * 10


def test_it_probes_k_one_after_a_streak_at_zero():
    policy = AdaptiveK(4, probe_every=16)
    chosen = _play(policy, 60, acceptance=0.0, verify=lambda rows: 0.01 * rows, draft_per_token=0.005)
    later = chosen[2:]
    assert later.count(1) >= 2  # probes, and only probes
    first_probe = later.index(1, 1)
    assert later[first_probe - 16 : first_probe] == [0] * 16


def test_a_probe_that_pays_brings_speculation_back():
    policy = AdaptiveK(4, probe_every=4)
    _play(policy, 20, acceptance=0.0, verify=lambda rows: 0.01 * rows, draft_per_token=0.005)
    assert policy.choose() in (0, 1)
    # The pair changes: every draft accepted, verify flat, drafting nearly free.
    chosen = _play(policy, 60, acceptance=1.0, verify=lambda rows: 0.01, draft_per_token=0.0001)
    assert chosen[-5:] == [4] * 5


def test_k_never_exceeds_k_max_and_unmeasured_lengths_are_not_cheaper_than_measured_ones():
    policy = AdaptiveK(3)
    _play(policy, 30, acceptance=1.0, verify=lambda rows: 0.001, draft_per_token=0.0)
    assert policy.choose() == 3
    policy = AdaptiveK(6)
    policy.observe(RoundOutcome(2, 0.0, 1.0, 3, [(2, 2)]))
    policy.observe(RoundOutcome(0, 0.0, 1.0, 1, [(0, 0)]))
    policy.observe(RoundOutcome(1, 0.0, 3.0, 2, [(1, 1)]))
    assert policy.verify_cost(5) == pytest.approx(3.0)
    assert policy.verify_cost(1) == pytest.approx(1.0)


def test_acceptance_per_position_counts_only_examined_drafts():
    policy = AdaptiveK(3, prior_weight=0.0)
    policy.observe(RoundOutcome(3, 0.0, 0.0, 4, [(3, 1), (3, 3), (2, 0)]))
    assert policy.offered[1:] == [3, 2, 1] and policy.accepted[1:] == [2, 1, 1]
    assert policy.draft_acceptance(3) == pytest.approx([2 / 3, 1 / 2, 1.0])


def test_a_drafter_that_proposes_nothing_is_asked_only_when_probing():
    """A model-free drafter without a confident match proposes fewer tokens than asked, often none:
    what it did not propose counts as rejected there, and its empty Proposes as drafting's cost."""
    policy = AdaptiveK(8, probe_every=16)
    chosen = []
    for _ in range(80):
        k = policy.choose()
        chosen.append(k)
        policy.observe(RoundOutcome(k, 0.001 if k else 0.0, 0.010, 1, [(0, 0)]))  # never a match
    later = chosen[8:]
    assert later.count(0) >= len(later) - 5 and set(later) <= {0, 1}  # K = 1 only as a probe
    short = AdaptiveK(4, prior_weight=0.0)
    short.observe(RoundOutcome(4, 0.0, 0.0, 3, [(2, 2), (4, 4), (1, 0)]))  # the first stopped after 2
    assert short.offered[1:] == [3, 2, 1, 1] and short.accepted[1:] == [2, 2, 1, 1]
    assert short.reached[1:] == [3, 2, 1, 1] and short.asked_at[1:] == [3, 3, 3, 3]


def test_acceptance_where_a_draft_reaches_leaves_out_the_drafts_that_stopped_before():
    """c_i (what the target weighs a drafted row by, `VerifyRequest.lookup_acceptance`): a draft that
    stopped short of position i is not a rejection there (`reach` counts it); an explicit K sends none."""
    policy = AdaptiveK(4, prior_weight=0.0)
    policy.observe(RoundOutcome(4, 0.0, 0.0, 3, [(2, 2), (4, 4), (1, 0), (0, 0)]))
    assert policy.reach()[1:] == pytest.approx([3 / 4, 2 / 4, 1 / 4, 1 / 4])
    assert policy.draft_acceptance(4) == pytest.approx([2 / 3, 2 / 2, 1 / 1, 1 / 1])
    assert policy.draft_acceptance(2) == pytest.approx([2 / 3, 1.0])
    assert AdaptiveK(3).draft_acceptance(3) == pytest.approx([0.5] * 3)  # the prior
    assert FixedK(4).draft_acceptance(4) == ()


def test_drafts_a_shared_step_cut_are_neither_rejections_nor_short_proposals():
    """The target verified 1 of a proposal of 3 (`RoundOutcome.proposed`): position 2 was never
    examined, and the drafter did reach 3."""
    cut, whole = AdaptiveK(4, prior_weight=0.0), AdaptiveK(4, prior_weight=0.0)
    cut.observe(RoundOutcome(4, 0.0, 0.0, 2, [(1, 1)], proposed=[3]))
    whole.observe(RoundOutcome(4, 0.0, 0.0, 2, [(1, 1)]))
    assert cut.offered[1:] == [1, 0, 0, 0] and cut.reached[1:] == [1, 1, 1, 0]
    assert whole.offered[1:] == [1, 0, 0, 0] and whole.reached[1:] == [1, 0, 0, 0]


def test_rounds_without_a_proposal_cost_a_one_row_verify_not_k_plus_one_rows():
    """A drafter that proposes in every other round, all accepted: rows cost 60% of a 1-row Verify
    each. Priced at K + 1 rows every round, no K would pay (K = 1: 1.5 tokens for 1.6 rows); priced
    at K + 1 rows only when it proposes, and 1 row otherwise, drafting does."""
    policy = AdaptiveK(8, probe_every=4)
    chosen = []
    for n in range(80):
        k = policy.choose()
        chosen.append(k)
        drafted = k if n % 2 == 0 else 0
        verify = 0.010 * (1 + 0.6 * drafted)
        policy.observe(RoundOutcome(k, 0.0, verify, 1 + drafted, [(drafted, drafted)]))
    assert sum(k > 0 for k in chosen[-20:]) >= 15


def test_drafts_shorter_than_k_are_priced_at_their_length():
    """A model-free drafter proposes as far as its match is confident: here 8 tokens in 3 asks of
    10 and 2 in the others, all accepted, each row 30% of a 1-row Verify. Priced at K + 1 rows
    whenever it proposes, K = 8 (4.8 tokens for 9 rows) loses to K = 2 (3 tokens, 3 rows); priced at
    the rows its drafts really have (expected 1 + 0.3 * 8 + 0.7 * 2), K = 8 wins: 2.24 against 1.88
    tokens per unit of time."""
    curve = tuple(1 + 0.3 * rows for rows in range(9))  # the target's forward costs, as it reports them
    policy = AdaptiveK(8, prior_weight=0.5, verify_curve=curve)
    chosen = []
    for n in range(120):
        k = policy.choose()
        chosen.append(k)
        drafted = min(k, 8 if n % 10 < 3 else 2)
        verify = 0.010 * (1 + 0.3 * drafted)
        policy.observe(RoundOutcome(k, 0.0, verify, 1 + drafted, [(drafted, drafted)]))
    assert policy.reach()[3] == pytest.approx(0.3, abs=0.05)
    assert sum(k >= 6 for k in chosen[-40:]) >= 38


def test_a_propose_costs_what_empty_ones_cost_and_drafted_tokens_add_to_it():
    """A model-free drafter's call costs about the same whatever it returns (measured on the asks
    that returned nothing), a model draft's grows with the tokens it drafts."""
    lookup = AdaptiveK(4)
    lookup.observe(RoundOutcome(2, 0.9, 1.0, 3, [(2, 2)]))  # round 0: not kept
    for n in range(20):
        drafted = 4 if n % 4 == 0 else 0
        lookup.observe(RoundOutcome(4, 0.002, 0.01, 1 + drafted, [(drafted, drafted)]))
    assert lookup.draft_cost() == pytest.approx((0.002, 0.0))
    model = AdaptiveK(4)
    model.observe(RoundOutcome(2, 0.9, 1.0, 3, [(2, 2)]))
    for k in (1, 2, 4):
        model.observe(RoundOutcome(k, 0.003 * k, 0.01, k + 1, [(k, 0)]))
    assert model.draft_cost() == pytest.approx((0.0, 0.003))


def test_the_same_history_gives_the_same_choices():
    def run() -> list[int]:
        timings = iter([0.013, 0.011, 0.02, 0.017, 0.012] * 20)
        policy = AdaptiveK(5)
        chosen = []
        for r in range(60):
            k = policy.choose()
            chosen.append(k)
            policy.observe(RoundOutcome(k, 0.002 * k, next(timings), k + 1, [(k, r % (k + 1) if k else 0)]))
        return chosen

    assert run() == run()


def test_the_target_curve_shapes_lengths_not_yet_timed():
    curve = (60.0, 66.0, 72.0, 90.0)  # ms by rows, as ModelInfo.forward_cost_ms reports it
    policy = AdaptiveK(3, verify_curve=curve)
    policy.observe(RoundOutcome(2, 0.0, 9.0, 3, [(2, 2)]))  # round 0: not kept
    policy.observe(RoundOutcome(0, 0.0, 0.12, 1, []))  # a 1-row Verify: twice the curve's 60 ms
    assert policy.verify_cost(1) == pytest.approx(0.12)
    assert policy.verify_cost(3) == pytest.approx(0.12 * 72 / 60)
    policy.observe(RoundOutcome(3, 0.0, 0.2, 4, [(3, 0)]))
    assert policy.verify_cost(4) == pytest.approx(0.2)
    assert policy.verify_cost(3) == pytest.approx(0.2 * 72 / 90)  # the nearest measured length
    assert policy.verify_cost(2) == pytest.approx(0.12 * 66 / 60)  # 1 row is nearer than 4


def test_lengths_past_the_curve_cost_more_not_the_same_as_the_nearest_measured():
    # As a CPU target calibrates: 9 rows (two passes of the 8-row kernel), K up to 16.
    curve = (6.6, 7.3, 8.2, 8.9, 9.8, 10.6, 11.7, 12.8, 16.0)
    policy = AdaptiveK(16, verify_curve=curve)
    policy.observe(RoundOutcome(2, 0.0, 0.05, 3, [(0, 0)]))  # round 0: not kept
    for _ in range(30):  # target-only rounds: 1-row Verifies of ~10 ms
        policy.observe(RoundOutcome(0, 0.0, 0.010, 1, [(0, 0)]))
    policy.observe(RoundOutcome(1, 0.0001, 0.012, 2, [(1, 1)]))  # one draft, accepted
    costs = [policy.verify_cost(rows) for rows in range(1, 18)]
    assert costs == sorted(costs) and costs[11] > costs[8] * 1.2  # 12 rows: a third more than 9
    # One accepted draft is weak evidence: K grows by what the rows cost, not to the maximum.
    assert 1 <= policy.choose() <= 4
    policy.observe(RoundOutcome(16, 0.0001, 0.030, 17, [(16, 0)]))  # a long draft, measured
    assert policy.verify_cost(12) == pytest.approx(0.030 * policy._curve_at(12) / policy._curve_at(17))


def test_a_steep_curve_keeps_k_at_zero_and_a_flat_one_drafts():
    steep, flat = (60.0, 120.0, 180.0, 240.0), (60.0, 62.0, 64.0, 66.0)
    chosen = {}
    for name, curve in (("steep", steep), ("flat", flat)):
        policy = AdaptiveK(3, verify_curve=curve)
        chosen[name] = _play(policy, 6, 0.5, lambda rows, c=curve: c[rows - 1] / 1e3, 0.001)
    assert chosen["steep"][2:] == [0, 0, 0, 0]
    assert all(k > 0 for k in chosen["flat"][2:])


def test_a_curve_with_a_non_positive_entry_is_ignored():
    assert AdaptiveK(2, verify_curve=(0.0, 1.0)).verify_curve == ()


TARGET_CURVE = (5.5, 5.92, 6.03, 7.12, 8.11)  # ms, rows 1..5: the int8 target on 2 cores


def test_the_ceiling_is_the_best_speedup_with_every_draft_accepted():
    policy = AdaptiveK(2, verify_curve=(20.0, 22.0, 24.0))
    # K = 1: 2 x 20 / (2 + 22); K = 2: 3 x 20 / (4 + 24), the larger.
    assert policy.ceiling((2.0,)) == pytest.approx(60 / 28)
    assert policy.ceiling(()) == float("inf") and AdaptiveK(2).ceiling((2.0,)) == float("inf")


def test_a_draft_forward_too_short_to_time_is_not_judged():
    """Tiny models' forwards (~1 ms) time Python, not the models: no verdict from them."""
    policy = AdaptiveK(4, verify_curve=(1.0, 1.0, 1.0, 1.0, 1.0), draft_curve=(1.9,))
    assert policy.ceiling((1.9,)) == float("inf") and policy.drafts_at_all


def test_a_draft_that_costs_about_a_target_step_is_never_called():
    """The distilled 2-layer draft against the int8 target here: its forward ~5 ms, the target's
    5.5 ms. Even drafts accepted every time would gain ~2%: K = 0 from the first round, no probe."""
    policy = AdaptiveK(4, verify_curve=TARGET_CURVE, draft_curve=(5.06, 6.97, 9.31, 7.89, 7.29))
    assert not policy.drafts_at_all
    chosen = _play(policy, 60, acceptance=1.0, verify=lambda rows: TARGET_CURVE[rows - 1] / 1e3, draft_per_token=0.0)
    assert chosen == [0] * 60


def test_a_hybrid_draft_whose_model_cannot_pay_drafts_by_its_lookup_alone():
    """Its lookup costs next to nothing: drafting goes on, its model is asked for only where it pays."""
    dear = AdaptiveK(4, verify_curve=TARGET_CURVE, draft_curve=(5.06, 6.97, 9.31), draft_lookup=True)
    assert dear.drafts_at_all and dear.lookup_only and dear.choose() == dear.start_k
    cheap = AdaptiveK(4, verify_curve=TARGET_CURVE, draft_curve=(0.5, 0.6, 0.7), draft_lookup=True)
    assert cheap.drafts_at_all and not cheap.lookup_only
    assert not AdaptiveK(4, verify_curve=TARGET_CURVE, draft_curve=(5.06,)).lookup_only  # not a hybrid
    assert not FixedK(3).lookup_only  # an explicit K: the hybrid as configured


@pytest.mark.parametrize("draft_curve", [(0.5, 0.6, 0.7), ()], ids=["a-cheap-draft", "model-free"])
def test_a_draft_that_could_pay_starts_as_before(draft_curve):
    policy = AdaptiveK(4, verify_curve=TARGET_CURVE, draft_curve=draft_curve)
    assert policy.drafts_at_all and policy.choose() == policy.start_k


def _play_in_batch(policy: AdaptiveK, rounds: int, others: int) -> list[int]:
    """Each drafted token accepted with probability 0.6 (seeded) until the first rejection; a Verify
    forward is a step shared with `others` sequences of other requests, 20% slower per row."""
    import random

    rng, chosen = random.Random(0), []
    for _ in range(rounds):
        k = policy.choose()
        chosen.append(k)
        accepted = next((i for i in range(k) if rng.random() >= 0.6), k)
        step_s = 0.1 * (1 + 0.2 * (others + k))
        policy.observe(RoundOutcome(k, k * 0.001, step_s, k + 1, [(k, accepted)], others))
    return chosen


def test_drafting_that_pays_alone_stops_in_a_batch_where_its_rows_slow_everyone():
    # Alone: K=1 gives 1.6 tokens for 1.2x the time. With 7 others in the step: 8.6 tokens for
    # 2.6 / 2.4 of it, less than K = 0's 8; so the request drafts only when it probes.
    alone = _play_in_batch(AdaptiveK(4), 60, others=0)
    batched = _play_in_batch(AdaptiveK(4), 60, others=7)
    assert all(k > 0 for k in alone[10:])
    assert batched[10:].count(0) >= 40  # of 50: the others are probes and what a probe makes it try


def _play_in_reported_batch(
    policy: AdaptiveK, rounds: int, others: int, base_s: float, row_s: float, queue_s: float = 0.0
) -> list[int]:
    """As _play_in_batch, but the target reports the step's rows: `others` sequences decoding 1 row
    each, a Verify costing base_s + row_s per row of its step, plus queue_s of waiting for it."""
    import random

    rng, chosen = random.Random(0), []
    for _ in range(rounds):
        k = policy.choose()
        chosen.append(k)
        accepted = next((i for i in range(k) if rng.random() >= 0.6), k)
        rows = others + k + 1
        verify_s = base_s + row_s * rows + queue_s
        outcome = RoundOutcome(k, k * 0.001, verify_s, k + 1, [(k, accepted)], others, rows, k + 1)
        policy.observe(outcome)
    return chosen


def test_in_a_reported_batch_k_follows_what_a_row_costs_the_shared_step():
    # Rows dear (a CPU: 8 rows cost 4x one): K=1's 0.6 more tokens of 8 cost 0.03 s more of a 0.29 s
    # step; its gain (7%) is below the cost (10%). Rows cheap (a GPU's step): drafting pays.
    dear_curve = tuple(0.05 + 0.03 * r for r in range(1, 10))
    cheap_curve = tuple(0.2 + 0.001 * r for r in range(1, 10))
    dear = _play_in_reported_batch(AdaptiveK(4, verify_curve=dear_curve), 60, 7, 0.05, 0.03)
    cheap = _play_in_reported_batch(AdaptiveK(4, verify_curve=cheap_curve), 60, 7, 0.2, 0.001)
    assert dear[10:].count(0) >= 45  # of 50: the others are probes
    assert all(k > 0 for k in cheap[10:])


def test_a_wait_for_the_step_adds_the_same_to_every_k():
    # A long wait lands in the line's intercept, not its slope: with the step nearly flat in rows,
    # drafting still pays.
    curve = tuple(1.0 + 0.01 * r for r in range(1, 10))
    chosen = _play_in_reported_batch(AdaptiveK(4, verify_curve=curve), 40, 7, 0.1, 0.001, queue_s=0.5)
    assert all(k > 0 for k in chosen[10:])


def test_a_step_that_carried_a_prompt_teaches_nothing():
    policy = AdaptiveK(4)
    policy.observe(RoundOutcome(2, 0.0, 9.0, 3, [(2, 2)], 1, 400, 300))  # round 0, its own prompt
    policy.observe(RoundOutcome(0, 0.0, 0.2, 1, [(0, 0)], 3, 4, 1))
    policy.observe(RoundOutcome(0, 0.0, 5.0, 1, [(0, 0)], 3, 500, 1))  # another's prompt in the step
    assert policy.steps.n == 1 and policy.steps.means() == (4.0, 4.0, 0.2)
    assert abs(policy.others_rows - 0.3 * 3) < 1e-9


def test_the_others_tokens_are_counted_at_their_verify_length():
    # Others drafting 3 each (4 rows per sequence) make ~1 + a + a^2 + a^3 tokens a step, not 1:
    # what this request's extra rows slow down is worth that much more.
    policy = AdaptiveK(3, prior_acceptance=0.5, prior_weight=1e9)
    policy.others, policy.others_rows = 2.0, 8.0
    policy.steps.add(3, 9, 0.9)
    policy.steps.add(3, 10, 1.0)
    speeds = policy.tokens_per_second()
    assert abs(speeds[0] - (1 + 2 * 1.875) / 0.9) < 1e-9
    # The others' tokens wait for the step only, this request's for its draft too.
    assert abs(speeds[1] - (1.5 / (sum(policy.draft_cost()) + 1.0) + 2 * 1.875 / 1.0)) < 1e-9


def test_what_a_sequence_costs_a_step_is_not_taken_for_what_a_row_costs():
    # On a CPU a sequence costs a step far more than a row (measured: 8 x 1 322 ms, 8 x 2 377 ms).
    # Streams coming and going spread the steps' sequences and rows alike; a fit in rows alone
    # would price a draft row at a sequence's 35 ms and never draft.
    import random

    rng, policy, chosen = random.Random(1), AdaptiveK(4, verify_curve=tuple(0.1 + 0.002 * r for r in range(1, 10))), []
    for _ in range(60):
        k = policy.choose()
        chosen.append(k)
        others = rng.choice((4, 5, 6, 7))
        accepted = next((i for i in range(k) if rng.random() >= 0.6), k)
        rows = others + k + 1
        verify_s = 0.05 + 0.035 * (others + 1) + 0.002 * rows
        policy.observe(RoundOutcome(k, k * 0.001, verify_s, k + 1, [(k, accepted)], others, rows, k + 1))
    assert all(k > 0 for k in chosen[20:])


def test_every_lengths_cost_at_once_equals_each_lengths_cost():
    """The per-round pass over every length (no search per length) prices as verify_cost does, ties
    between two measured lengths included."""
    import random

    rng = random.Random(5)
    for k_max in (1, 3, 8, 16):
        curve = tuple(sorted(rng.uniform(5, 20) for _ in range(rng.randrange(2, 10))))
        policy = AdaptiveK(k_max, verify_curve=curve)
        policy.observe(RoundOutcome(2, 0.0, 1.0, 3, [(2, 2)]))  # round 0: not kept
        for _ in range(12):
            rows = rng.choice([1, 1, 3, min(5, k_max + 1), k_max + 1])
            policy.observe(RoundOutcome(rows - 1, 0.0, rng.uniform(0.005, 0.02), rows, [(rows - 1, 0)]))
            assert policy._verify_costs() == [policy.verify_cost(r) for r in range(1, k_max + 2)]


def _recorded_request(record: DraftRecord, acceptance: float, draft_s: float, rounds: int = 9, lookup: bool = False):
    """A request of `rounds` rounds, each drafting 2 tokens (accepted at `acceptance`, deterministic
    per round) in draft_s seconds, then a 1-row round; a 1-row Verify costs 6 ms, a 3-row one 7."""
    outcomes = []
    for i in range(rounds):
        accepted = 2 if (i % 10) < acceptance * 10 else 0
        outcomes.append(RoundOutcome(2, draft_s, 0.007, 3, [(2, accepted)], model_drawn=[not lookup]))
        outcomes.append(RoundOutcome(0, 0.0, 0.006, 1, [(0, 0)], model_drawn=[False]))
    record.add(outcomes)


def test_the_record_says_a_poor_model_draft_cannot_pay_after_enough_positions_and_still_explores(caplog):
    """The distilled draft here: accepted ~0.2, ~2.5 ms a drafted token in its round, a 6 ms Verify."""
    caplog.set_level("INFO", logger="specdec.core.kpolicy")
    record = DraftRecord()
    _recorded_request(record, 0.2, 0.005)
    assert record.verdict(4, TARGET_CURVE) is None  # 9 positions: too few to judge
    while record.offered.get(1, 0) < MIN_RECORDED_POSITIONS:
        _recorded_request(record, 0.2, 0.005)
    assert record.gain(4, TARGET_CURVE) == 1.0  # no K beats K = 0
    verdicts = [record.verdict(4, TARGET_CURVE) for _ in range(2 * RECORD_EXPLORE_EVERY)]
    assert verdicts.count(False) == 2 * RECORD_EXPLORE_EVERY - 2 and verdicts.count(None) == 2
    assert [r.message for r in caplog.records if "no longer called" in r.message] and len(caplog.records) == 1
    assert not AdaptiveK(4, verify_curve=TARGET_CURVE, draft_curve=(1.0,), recorded=False).drafts_at_all
    hybrid = AdaptiveK(4, verify_curve=TARGET_CURVE, draft_curve=(1.0,), draft_lookup=True, recorded=False)
    assert hybrid.drafts_at_all and hybrid.lookup_only


def test_the_record_lets_a_good_model_draft_draft_and_ignores_lookups():
    good = DraftRecord()
    while good.offered.get(1, 0) < MIN_RECORDED_POSITIONS:
        _recorded_request(good, 0.8, 0.002)
    assert good.gain(4, TARGET_CURVE) > 1.2 and good.verdict(4, TARGET_CURVE) is True
    lookups = DraftRecord()
    for _ in range(10):
        _recorded_request(lookups, 0.0, 0.0001, lookup=True)
    assert lookups.offered == {} and lookups.verdict(4, TARGET_CURVE) is None


def test_the_record_halves_its_counts_past_its_half_life():
    record = DraftRecord()
    while sum(record.offered.values()) <= RECORD_HALF_LIFE - 40:
        _recorded_request(record, 0.5, 0.003, rounds=20)
    before = sum(record.offered.values())
    _recorded_request(record, 0.5, 0.003, rounds=20)
    assert sum(record.offered.values()) < before


def test_k0_rounds_played_as_decode_steps_are_priced_at_their_share_of_the_call():
    """A draft accepted a third of the time, a 2-row Verify 9 ms and a 1-row one 8 ms: drafting 1
    pays (1.33 tokens / 9 ms against 1 / 8 ms). K = 0 rounds played as decode steps cost 6 ms each
    (no round trip of their own): K = 0 now pays more, and a draft that proposed nothing is still
    priced as the 8 ms Verify it paid."""

    def policy(decoded_s: float | None) -> AdaptiveK:
        p = AdaptiveK(1, start_k=1)
        p.observe(RoundOutcome(1, 0.0, 0.02, 2, [(1, 0)]))  # round 0: prefill timings, not kept
        p.observe(RoundOutcome(0, 0.0, 0.008, 1, [(0, 0)]))
        for i in range(30):
            p.observe(RoundOutcome(1, 0.0001, 0.009, 2, [(1, int(i % 3 == 0))]))
        if decoded_s is not None:
            for _ in range(4):
                p.observe(RoundOutcome(0, 0.0, decoded_s, 1, [(0, 0)], decoded=True))
        return p

    assert policy(None).choose() == 1
    decoded = policy(0.006)
    assert decoded.choose() == 0 and decoded.verify_cost(1) == pytest.approx(0.008)
    assert decoded.zero_run() == decoded.probe_every - 4


def test_the_decode_record_prices_the_next_requests_k0_rounds_by_what_earlier_ones_measured():
    record = DecodeRecord()
    assert record.prior() == DECODE_PRIOR
    prompt = RoundOutcome(2, 0.01, 0.05, 3, [(2, 1)], decoded=False)  # round 0: not read
    alone = [prompt, RoundOutcome(0, 0.0, 0.010, 1, [(0, 0)])] + [
        RoundOutcome(0, 0.0, 0.007, 1, [(0, 0)], decoded=True) for _ in range(4)
    ]
    record.add(alone)
    assert record.prior() == pytest.approx(0.7)
    record.add([prompt, RoundOutcome(0, 0.0, 0.010, 1, [(0, 0)])])  # no decode steps: nothing learnt
    in_company = [RoundOutcome(0, 0.0, 0.02, 1, [(0, 0)], 7, 8, 1, decoded=True) for _ in range(3)]
    record.add([prompt, *alone[1:2], *in_company])  # a batched step's share says nothing of transport
    step = RoundOutcome(0, 0.0, 0.009, 1, [(0, 0)], decoded=True)
    record.add([prompt, RoundOutcome(0, 0.0, 0.010, 1, [(0, 0)]), step])
    assert record.prior() == pytest.approx(0.7 + 0.2 * (0.9 - 0.7))
    priced = AdaptiveK(1, decodes=True, decode_prior=record.prior())
    priced.observe(prompt)
    priced.observe(RoundOutcome(0, 0.0, 0.010, 1, [(0, 0)]))
    assert priced.tokens_per_second()[0] == pytest.approx(1 / (0.010 * record.prior()))


def test_an_empty_ask_played_as_decode_steps_is_priced_as_one():
    """A lookup that proposes half the time (2 tokens, the first accepted 80% of the time): with
    empty asks paying a 9.5 ms Verify of their own, asking costs more than it brings against 5 ms
    decode steps; played as decode steps themselves (`stretches`), asking pays."""

    def policy(stretches: bool) -> AdaptiveK:
        p = AdaptiveK(2, decodes=True, stretches=stretches)
        p.observe(RoundOutcome(2, 0.0, 0.02, 3, [(2, 0)]))  # round 0: prefill timings, not kept
        p.observe(RoundOutcome(0, 0.0, 0.0095, 1, [(0, 0)]))
        for _ in range(4):
            p.observe(RoundOutcome(0, 0.0, 0.005, 1, [(0, 0)], decoded=True))
        for accepted in [2] * 12 + [1] * 4 + [0] * 4:
            p.observe(RoundOutcome(2, 0.00005, 0.0105, 3, [(2, accepted)]))
            p.observe(RoundOutcome(2, 0.00005, 0.0095, 1, [(0, 0)]))
        return p

    assert policy(False).choose() == 0
    assert policy(True).choose() == 2


def test_expected_tokens_chain_what_a_draft_reaches_and_what_is_accepted_there():
    """1 + sum P_i c_1..c_i: a lookup proposed at 2 of 8 asks for 1 token, both accepted. Deeper
    positions, never asked, lean on P_1 and c_1 (0.4 and 0.75 under the prior of weight 2), not on
    the 0.3 that counting the 6 empty asks as rejections at position 1 would give every depth."""
    policy = AdaptiveK(3)
    for n in range(8):
        drafted = 1 if n < 2 else 0
        policy.observe(RoundOutcome(1, 0.0, 0.01, 1 + drafted, [(drafted, drafted)]))
    assert policy.reach()[1:] == pytest.approx([0.4, 0.4, 0.4])
    assert policy.draft_acceptance(3) == pytest.approx([0.75, 0.75, 0.75])
    assert policy.expected_tokens() == pytest.approx([1, 1.3, 1.3 + 0.4 * 0.75**2, 1.3 + 0.4 * (0.75**2 + 0.75**3)])


def test_a_lookup_that_seldom_proposes_but_copies_on_once_it_does_is_soon_asked_for_several_tokens():
    """A quarter of the asks find a match, a match copies up to 4 tokens, all accepted; a drafted row
    costs a quarter of a 1-row Verify. Asking K = 4 yields 1 + 0.25 * 4 = 2 tokens for 1.25 rows'
    cost on average, K = 1 1.25 tokens for 1.06. Priced by `expected_tokens`, K reaches 3-4 by the
    8th round and stays; chaining a_i (the empty asks as rejections at every depth) kept it at 1-2
    for 16 rounds, a sixth of a 96-token answer."""
    curve = tuple(1 + 0.25 * rows for rows in range(5))
    policy = AdaptiveK(4, verify_curve=curve)
    chosen = []
    for n in range(60):
        k = policy.choose()
        chosen.append(k)
        drafted = min(k, 4) if n % 4 == 1 else 0
        policy.observe(RoundOutcome(k, 0.0, 0.010 * (1 + 0.25 * drafted), 1 + drafted, [(drafted, drafted)]))
    assert sum(k >= 3 for k in chosen[:20]) >= 10, chosen
    assert chosen[-30:] == [4] * 30
