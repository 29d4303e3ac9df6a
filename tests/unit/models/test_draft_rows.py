"""specdec.models.draft_rows: a shared step verifies the drafted rows whose expected tokens pay."""

from __future__ import annotations

import pytest

from specdec.models.draft_rows import DraftRows
from specdec.models.runner import StepItem


def _steps(rows: DraftRows, base_s: float, per_sequence_s: float, per_row_s: float) -> DraftRows:
    """Teach the fit steps of 1-8 sequences x 1-3 rows that cost exactly base + S a + R b."""
    for sequences in range(1, 9):
        for per in (1, 2, 3):
            r = sequences * per
            rows.observe(sequences, r, base_s + per_sequence_s * sequences + per_row_s * r)
    return rows


def _round(key: str, drafts: int, gains: tuple[float, ...]) -> StepItem:
    tokens = list(range(10 + drafts))
    return StepItem(key, tokens, drafts + 1, gains=gains)


def _kept(items: list[StepItem]) -> list[int]:
    return [len(item.gains) for item in items]


def test_nothing_is_cut_without_gains_or_before_any_step_was_timed():
    plain = [StepItem("a", [1, 2, 3], 1), StepItem("b", [1, 2, 3, 4], 2)]
    trained = _steps(DraftRows(), 0.010, 0.002, 0.001)
    assert trained.trim(plain, 3) == (plain, 3)
    drafted = [_round("a", 3, (0.01, 0.001, 0.0001))]
    assert DraftRows().trim(drafted, 4) == (drafted, 4)  # (no fit yet: every row is verified)


def test_in_company_only_the_rows_worth_their_cost_to_the_step_are_verified():
    """8 sequences of 1 row cost 10 + 16 + 8 = 34 ms, 8 tokens: a row (1 ms) must bring more than
    1 x 8 / 34 = 0.235 tokens. Rows are taken best first, each item's in order."""
    rows = _steps(DraftRows(), 0.010, 0.002, 0.001)
    items = [_round(f"s{i}", 0, ()) for i in range(6)]
    items += [_round("good", 3, (0.9, 0.5, 0.2)), _round("poor", 2, (0.3, 0.1))]
    trimmed, new_rows = rows.trim(items, 8 + 5)
    assert _kept(trimmed) == [0] * 6 + [2, 1]
    good, poor = trimmed[6:]
    assert good.num_last == 3 and list(good.token_ids) == list(range(12)) and good.gains == (0.9, 0.5)
    assert poor.num_last == 2 and list(poor.token_ids) == list(range(11))
    assert trimmed[:6] == items[:6] and new_rows == 8 + 3 and rows.cut == 2


def test_a_step_of_one_sequence_is_left_as_its_request_asked():
    """Alone, the request's own K policy prices its rows by its calls' seconds: nothing is cut, even
    where the fit says a row costs more than it returns (here 50 ms for a 0.2-token draft)."""
    rows = _steps(DraftRows(), 0.010, 0.002, 0.05)
    alone = [_round("a", 2, (0.2, 0.1))]
    assert rows.trim(alone, 3) == (alone, 3) and rows.cut == 0


@pytest.mark.parametrize("per_row_s, kept", [(0.0, 3), (0.004, 1), (0.05, 0)])
def test_the_dearer_a_row_the_fewer_rows_a_step_verifies(per_row_s, kept):
    rows = _steps(DraftRows(), 0.010, 0.002, per_row_s)
    items = [_round(f"s{i}", 0, ()) for i in range(3)] + [_round("d", 3, (0.8, 0.4, 0.2))]
    trimmed, _ = rows.trim(items, 7)
    assert _kept(trimmed)[-1] == kept


def test_a_prompts_step_is_not_fitted_and_the_curve_gives_a_rows_prior():
    rows = DraftRows()
    rows.observe(1, 400, 1.5)  # (a prompt's forward)
    assert rows.fit.n == 0
    rows.use_curve([0.004, 0.0045, 0.005, 0.006, 0.007, 0.008])  # upper half: 1 ms a row
    assert rows.row_prior_s == pytest.approx(0.001)
    rows.observe(8, 8, 0.030)  # one size seen: the row slope is the prior's
    assert rows._seconds(8, 9) - rows._seconds(8, 8) == pytest.approx(0.001)


def test_the_models_scheduler_reports_each_steps_sequences_and_new_rows(tiny_loaded, monkeypatch):
    from specdec.core.protocols import NO_DEADLINE, VerifyRequest
    from specdec.core.sampling import Sampling
    from target_service.verifier import verify_scheduled

    seen = []
    monkeypatch.setattr(DraftRows, "observe", lambda self, s, r, seconds: seen.append((s, r)))
    runner, prefix = tiny_loaded["target"].runner, [i % 8 for i in range(40)]
    verify_scheduled(runner, [VerifyRequest("fit", prefix, [])], Sampling(1.0), NO_DEADLINE)
    steps = VerifyRequest("fit", prefix, [], decode_uniforms=(0.5,) * 3)
    verify_scheduled(runner, [steps], Sampling(1.0), NO_DEADLINE)
    assert seen == [(1, 40)] + [(1, 1)] * 3  # (the prompt's step too: `observe` leaves it out)
