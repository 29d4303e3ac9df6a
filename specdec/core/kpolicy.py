"""How many tokens to draft each round: a fixed K, or one chosen from what this request measured.

`AdaptiveK` maximises expected tokens per second from the request's own history:

    E[tokens | K] = 1 + sum_{i=1..K} prod_{j<=i} a_j          (Leviathan et al.)
    time(K)       = c_ask + d(K) c_token + sum_{i=0..K} P(rows = i + 1 | K) verify(i + 1) + overhead
    d(K)          = sum_{i=1..K} P_i,  P(rows = i + 1 | K) = P_i - P_{i+1} (i < K), P_K (i = K)

a_i is the acceptance of draft position i given 1..i-1 were accepted (accepted / offered at i,
under a weak prior that leans on position i - 1; a position a draft stopped short of counts as
rejected), P_i the chance that a draft asked for at least i tokens proposes at least i (P_0 = 1;
a model draft proposes what it is asked for, a model-free one only as far as its match is
confident, often nothing), so d(K) is the expected tokens drafted and a round verifies 1 + its
draft's length; c_ask a Propose's cost whatever it drafts (measured on the asks that drafted
nothing: a model-free drafter's call costs that much for any length) and c_token what each drafted
token adds (a model draft's forward), verify(r) the measured cost of a Verify of r rows. A length
not measured yet is estimated from the nearest measured one, scaled by the target's forward-cost
curve (what the target service measured at start, `ModelInfo.forward_cost_ms`, extended past its
rows by its upper half's slope); without a curve, the 1-row cost times a default factor, never
below a measured shorter length. time(0) is what its K = 0 rounds cost where the engine plays them
as decode steps (several a call, without a round trip each: `zero_run`), else verify(1).

In a batch (the target reports the sequences and rows of each Verify's whole step) the cost that
matters is the shared step's: K draft rows lengthen a step that carries the others' rows too. The
policy fits its Verify's seconds as a plane in the step's sequences and rows (`StepFit`: on a CPU
a sequence costs several rows, and streams coming and going move both), prices K at the others'
rows + its own, and counts the others' tokens at their mean verify length under its own
acceptance: drafting pays only if its gain beats what its rows cost the whole step. The whole
Verify, not the step's forward alone: on a shared machine a row also costs its laws' warping,
transport and checks, which the forward leaves out.

Across requests, an engine's `DraftRecord` pools what a model draft's proposals yielded: where the
record says they cannot pay, auto K never calls the model, so that each request does not pay the
draft's prefill and probes to learn it again.

It reads only past rounds' outcomes and timings (this request's, and earlier requests' through the
record), so the output law stays exactly the target's: every round is lossless for any K fixed
before it starts. No randomness: the same history gives
the same choices (timings differ from run to run, so an auto-K request's tokens may too; its law
does not).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundOutcome:
    """One round as a K policy sees it."""

    k: int  # the K chosen for the round
    draft_s: float  # seconds of the Propose call (0 when nothing was drafted)
    verify_s: float  # seconds of the Verify call and the round's accept/reject work on its laws
    rows: int  # rows verified: the longest draft of the round + 1
    drafts: Sequence[tuple[int, int]]  # per sample: (tokens drafted, tokens accepted)
    others: int = 0  # other requests' sequences in the Verify's batched forward
    step_rows: int = 0  # new rows of that whole forward, this request's included (0: not reported)
    own_rows: int = 0  # of which this request's sequences ran
    # per sample, as drafts: whether its draft was drawn by a model (not a lookup's point masses)
    model_drawn: Sequence[bool] = ()
    # played in a call of several decode steps (K = 0): verify_s is its share of that call
    decoded: bool = False
    # per sample, as drafts: what its lookup proposed where a shared step verified fewer (the
    # target's `draft_rows`; empty: as drafted). Positions cut are not examined, nor rejections.
    proposed: Sequence[int] = ()


UNBOUNDED = 1 << 30  # a run of K = 0 rounds with no end (`zero_run`)
# A K = 0 round played as a decode step against a Verify of its own, before any is measured (in a
# request or its engine's `DecodeRecord`): 0.85-0.9 in process, ~0.7 served on 2 CPU cores.
DECODE_PRIOR = 0.85
OTHERS_SMOOTHING = 0.3  # weight of the latest round in the batch estimate: streams come and go
# Others' rows per sequence beyond any Verify's: a prompt's forward shared the step. Its cost is
# not the others' usual step, and no K of this request changes it: such rounds teach nothing.
PREFILL_ROWS_PER_SEQUENCE = 17
MIN_STEP_SHARE = 0.2  # a step never costs less than this share of the measured ones' mean
# A draft pays for a request only where drafts accepted every time would gain more than this over
# K = 0, by the two services' start-up curves: below it, real acceptance (~0.4 for a distilled
# draft) and each call's own costs (the draft's prefill of the prompt: ~100 ms for a 2-layer
# draft of SmolLM2 on 2 CPU cores) lose more than drafting can win.
MIN_CEILING = 1.1
# ... judged only on a draft forward of at least this many ms (the curves' unit): below it a forward's
# time is mostly Python dispatch and noise (a tiny test model's: ~1 ms), not what a draft step
# costs against a target step.
MIN_JUDGED_DRAFT_MS = 2.0


# DraftRecord: model-drawn positions examined across requests before the record gives a verdict (at
# acceptance ~0.2 against the ~0.5 a draft needs here, 32 positions are 4 standard errors apart)
MIN_RECORDED_POSITIONS = 32
RECORD_EXPLORE_EVERY = 16  # after a "cannot pay", one request in this many learns by its own rounds
RECORD_HALF_LIFE = 4096  # positions: past this many, every count halves (workloads change)
MIN_RECORDED_GAIN = 1.03  # the best K's speed over K = 0's the record must show to let a model draft


def curve_at(curve: Sequence[float], rows: int) -> float:
    """A forward-cost curve ([r - 1]: cost of r rows) at `rows`, extended past its end by its upper
    half's slope: past calibration, rows cost about that."""
    n = len(curve)
    if rows <= n:
        return curve[rows - 1]
    half = n // 2
    slope = max(0.0, (curve[-1] - curve[half - 1]) / (n - half))
    return curve[-1] + slope * (rows - n)


class DraftRecord:
    """What finished requests measured of a draft's model-drawn proposals, pooled per engine (a
    coordinator): acceptance per position, the seconds a drafted token cost in its round (forward,
    sampling, its laws) and a 1-row Verify's. A new request then need not pay again to learn that
    drafting by the model cannot pay here: its draft's prefill of the prompt and its probes cost
    ~10% of a 96-token answer with the distilled draft (accepted ~0.2 of the time, its forward a
    fifth of the target's). `verdict` is False where the record's best K is under
    MIN_RECORDED_GAIN x K = 0's speed: auto K then never calls the model (a hybrid asks its lookup
    alone). Reading other requests' outcomes keeps the law exact (K is still fixed before each round
    from what has been played). Lookup proposals are not recorded: they cost next to nothing and
    their yield is the request's own text."""

    def __init__(self):
        self._lock = threading.Lock()
        self.offered: dict[int, float] = {}  # position (1-based) -> model-drawn drafts examined there
        self.accepted: dict[int, float] = {}
        self.draft_s = self.draft_tokens = 0.0  # rounds whose every draft was the model's
        self.verify_s = self.verify_rounds = 0.0  # 1-row Verifies
        self.asked = 0  # verdicts asked for
        self.pays: bool | None = None  # the latest verdict, logged when it changes

    def add(self, outcomes: Sequence[RoundOutcome]) -> None:
        """A finished request's rounds (its first round's timings include prefills: not kept)."""
        with self._lock:
            for index, outcome in enumerate(outcomes):
                drawn = outcome.model_drawn or [False] * len(outcome.drafts)
                model = [d for d, by_model in zip(outcome.drafts, drawn, strict=True) if by_model]
                for drafted, accepted in model:
                    for i in range(1, min(drafted, accepted + 1) + 1):
                        self.offered[i] = self.offered.get(i, 0.0) + 1
                        self.accepted[i] = self.accepted.get(i, 0.0) + (i <= accepted)
                if index == 0:
                    continue
                if model and len(model) == len(outcome.drafts):
                    self.draft_s += outcome.draft_s
                    self.draft_tokens += max(drafted for drafted, _ in model)
                if outcome.rows == 1 and not outcome.decoded:  # (a decode step's share pays no round trip)
                    self.verify_s += outcome.verify_s
                    self.verify_rounds += 1
            if sum(self.offered.values()) > RECORD_HALF_LIFE:
                self._halve()

    def summary(self) -> tuple[float, float | None, bool | None]:
        """(model-drawn drafts examined at the first position, their acceptance, None before any,
        the latest verdict, None before one): what the metrics show of the record."""
        with self._lock:
            offered = self.offered.get(1, 0.0)
            return offered, self.accepted.get(1, 0.0) / offered if offered else None, self.pays

    def _halve(self) -> None:
        for counts in (self.offered, self.accepted):
            for i in counts:
                counts[i] /= 2
        self.draft_s, self.draft_tokens = self.draft_s / 2, self.draft_tokens / 2
        self.verify_s, self.verify_rounds = self.verify_s / 2, self.verify_rounds / 2

    def verdict(self, k_max: int, verify_curve: Sequence[float] = ()) -> bool | None:
        """Whether a model draft can pay, by the record: None before MIN_RECORDED_POSITIONS, and on
        every RECORD_EXPLORE_EVERY-th ask after a False (that request learns by its own rounds, and
        its outcomes renew the record)."""
        with self._lock:
            if self.offered.get(1, 0) < MIN_RECORDED_POSITIONS or not self.draft_tokens or not self.verify_rounds:
                return None
            gain = self.gain(k_max, verify_curve)
            pays = gain >= MIN_RECORDED_GAIN
            if pays != self.pays:  # an operator's answer to "why does auto K not draft?"
                log.info(
                    "auto K: by %d recorded positions (first accepted %.2f), the model draft's best K gains "
                    "%.2fx over K = 0: %s",
                    self.offered[1],
                    self.accepted.get(1, 0.0) / self.offered[1],
                    gain,
                    "it drafts" if pays else f"it is no longer called, but by one request in {RECORD_EXPLORE_EVERY}",
                )
            self.pays, self.asked = pays, self.asked + 1
            return None if not pays and self.asked % RECORD_EXPLORE_EVERY == 0 else pays

    def gain(self, k_max: int, verify_curve: Sequence[float] = ()) -> float:
        """The best K's expected tokens/s over K = 0's under the record: (1 + sum_i prod_j a_j) /
        (K d + v(K + 1)) x v(1), v scaled along the target's curve (1.1 a row without one)."""
        one, per_token = self.verify_s / self.verify_rounds, self.draft_s / self.draft_tokens
        curve = verify_curve if verify_curve and all(c > 0 for c in verify_curve) else ()
        best, expected, run = 1.0, 1.0, 1.0
        for k in range(1, k_max + 1):
            offered = self.offered.get(k, 0.0)
            run *= (self.accepted.get(k, 0.0) + 0.5) / (offered + 1)  # a weak prior of 1/2
            expected += run
            verify = one * (curve_at(curve, k + 1) / curve[0] if curve else 1 + 0.1 * k)
            best = max(best, expected * one / (k * per_token + verify))
        return best


class DecodeRecord:
    """What a K = 0 round played as a decode step cost against a Verify of its own, as finished
    auto-K requests measured it, pooled per engine: the new request's price of K = 0 before it has
    chosen any (it learns that cost only by choosing K = 0, and a price too high keeps it asking the
    draft round after round). The ratio is the deployment's (the transport a Verify pays: ~0.85 in
    process, ~0.7 served on 2 CPU cores), so an average of the latest requests serves."""

    GAIN = 0.2  # weight of the latest request in the average

    def __init__(self):
        self._lock = threading.Lock()
        self.ratio: float | None = None

    def add(self, outcomes: Sequence[RoundOutcome]) -> None:
        """A finished request's rounds (the first, its prompt's, not read)."""
        single = [o.verify_s for o in outcomes[1:] if o.rows == 1 and not o.decoded and not o.others]
        decoded = [o.verify_s for o in outcomes[1:] if o.decoded and not o.others]
        if not single or not decoded:
            return
        ratio = min(1.0, (sum(decoded) / len(decoded)) / (sum(single) / len(single)))
        with self._lock:
            self.ratio = ratio if self.ratio is None else self.ratio + self.GAIN * (ratio - self.ratio)

    def prior(self) -> float:
        return DECODE_PRIOR if self.ratio is None else self.ratio


class StepFit:
    """A Verify's seconds in a shared step as mean + b_seq (S - mean S) + b_row (R - mean R), S the
    step's sequences and R its rows, by least squares over running sums. Both slopes are shrunk, by
    ridge weights in units of the regressor's spread: b_row toward a prior (the curve's), firmly,
    b_seq toward 0, weakly. Rounds at K = 0 have R = S and show only the sum of the slopes; rows
    added at a fixed S (this request's drafts) tell them apart."""

    ROW_PRIOR_WEIGHT = 4.0  # as much as steps spread this much in rows (rows^2)
    SEQUENCE_PRIOR_WEIGHT = 0.25

    def __init__(self, forget: float = 1.0):
        self.forget = forget  # each step's weight against the next one's (1: all steps alike)
        self.n = 0.0
        self.sums = dict.fromkeys(("s", "r", "y", "ss", "rr", "sr", "sy", "ry"), 0.0)

    def add(self, sequences: int, rows: int, seconds: float) -> None:
        if self.forget < 1.0:
            self.n *= self.forget
            self.sums = {key: value * self.forget for key, value in self.sums.items()}
        self.n += 1
        for key, value in zip(
            self.sums,
            (sequences, rows, seconds, sequences**2, rows**2, sequences * rows, sequences * seconds, rows * seconds),
            strict=True,
        ):
            self.sums[key] += value

    def means(self) -> tuple[float, float, float]:
        """(mean sequences, mean rows, mean seconds)."""
        return self.sums["s"] / self.n, self.sums["r"] / self.n, self.sums["y"] / self.n

    def predict(self, sequences: int, rows: int, row_slope_prior: float) -> float:
        s, r, y = self.means()
        n, sums = self.n, self.sums
        ss = sums["ss"] - n * s * s + self.SEQUENCE_PRIOR_WEIGHT
        rr = sums["rr"] - n * r * r + self.ROW_PRIOR_WEIGHT
        sr = sums["sr"] - n * s * r
        sy = sums["sy"] - n * s * y
        ry = sums["ry"] - n * r * y + self.ROW_PRIOR_WEIGHT * row_slope_prior
        det = ss * rr - sr * sr
        b_seq, b_row = (sy * rr - ry * sr) / det, (ry * ss - sy * sr) / det
        return max(y * MIN_STEP_SHARE, y + b_seq * (sequences - s) + max(0.0, b_row) * (rows - r))


class FixedK:
    """The K a request asked for, every round."""

    drafts_at_all = True
    lookup_only = False  # an explicit K with a hybrid draft: its model serves where its lookup cannot

    def __init__(self, k: int):
        self.k = k

    def choose(self) -> int:
        return self.k

    def zero_run(self) -> int:
        """Rounds at K = 0 from this one on, as the policy will choose them: at K = 0, all."""
        return UNBOUNDED if self.k == 0 else 0

    def observe(self, outcome: RoundOutcome) -> None:
        pass

    def draft_acceptance(self, k: int) -> tuple[float, ...]:
        """Nothing: every draft of an explicit K is verified (`AdaptiveK.draft_acceptance`)."""
        return ()


class AdaptiveK:
    """K in [0, k_max] per round, maximising this request's expected tokens per second.

    Round 0 drafts `start_k` (its timings include the prefill and are not kept); round 1 drafts
    nothing, to measure a 1-row Verify; later rounds take the best K under the model. After
    `probe_every` rounds at K = 0 it drafts 1 once, so a request can leave K = 0 again.

    `draft_curve`: the draft's own forward costs (its ModelInfo.forward_cost_ms, same unit as
    `verify_curve`; empty for a model-free draft, whose call costs next to nothing). Where the two
    curves say drafting cannot gain MIN_CEILING even if every draft were accepted, every round is
    K = 0 and the draft is never called (`drafts_at_all`). `draft_lookup`: the draft is a hybrid, a
    lookup that costs next to nothing before its model (`draft_curve` is the model's): it drafts
    whatever the model costs, and where the model cannot pay it asks for the lookup alone
    (`lookup_only`). `recorded`: a `DraftRecord`'s verdict on the model from earlier requests (False:
    it cannot pay, whatever the curves say). `decodes`: the engine plays K = 0 rounds as decode steps,
    which cost less than a Verify of their own (`decode_prior` of one until some are measured: a
    `DecodeRecord`'s). `stretches`: so does a round whose draft proposed nothing (`GenerationSpec.stop_ngram`).
    """

    def __init__(
        self,
        k_max: int,
        start_k: int = 2,
        probe_every: int = 16,
        prior_acceptance: float = 0.5,
        prior_weight: float = 2.0,
        default_verify_factor: float = 1.1,
        default_draft_ratio: float = 0.1,
        overhead_s: float = 0.0,
        verify_curve: Sequence[float] = (),
        draft_curve: Sequence[float] = (),
        draft_lookup: bool = False,
        recorded: bool | None = None,
        decodes: bool = False,
        decode_prior: float = DECODE_PRIOR,
        stretches: bool = False,
    ):
        if k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {k_max}")
        self.k_max = k_max
        self.start_k = min(start_k, k_max)
        self.probe_every = probe_every
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.default_verify_factor = default_verify_factor
        self.default_draft_ratio = default_draft_ratio
        self.overhead_s = overhead_s
        self.decodes = decodes  # K = 0 rounds are played as decode steps (`zero_run`)
        self.decode_prior = decode_prior  # their cost against a 1-row Verify's, until measured
        self.stretches = decodes and stretches  # an empty draft's round is a decode step too
        # [r - 1]: the target's cost of a forward over r rows, any unit (only ratios are read).
        self.verify_curve = tuple(c for c in verify_curve) if all(c > 0 for c in verify_curve) else ()
        # [r - 1]: the curve at r rows (extended past its end), for every length a round can verify
        self._curve_points = [self._curve_at(r) for r in range(1, k_max + 2)] if self.verify_curve else []
        model_pays = self.ceiling(draft_curve) >= MIN_CEILING and recorded is not False
        self.drafts_at_all = model_pays or draft_lookup
        self.lookup_only = draft_lookup and not model_pays
        self.offered = [0] * (k_max + 1)  # [i]: drafts examined at position i (1-based)
        self.accepted = [0] * (k_max + 1)
        self.asked_at = [0] * (k_max + 1)  # [i]: sequences asked for a draft of at least i tokens
        self.reached = [0] * (k_max + 1)  # [i]: of which the drafter proposed at least i
        self.draft_s = 0.0  # seconds of the Proposes that drafted tokens (rounds after the first)
        self.draft_steps = 0  # their tokens (the longest draft of each round)
        self.draft_calls = 0  # and their number
        self.empty_s = 0.0  # seconds of the Proposes that drafted nothing
        self.empty_calls = 0
        self.verify_sum: dict[int, float] = {}  # rows -> summed seconds
        self.verify_count: dict[int, int] = {}
        # K = 0 rounds played as decode steps: a round's share of its call, without the round trip
        # a Verify of its own pays (a draft that proposed nothing still pays it: verify_sum[1])
        self.decoded_s = 0.0
        self.decoded_rounds = 0
        self.rounds = 0
        self.zero_streak = 0  # consecutive rounds the model chose K = 0
        self.own = 1  # this request's sequences per round
        self.others = 0.0  # smoothed: other requests' sequences sharing its Verify forwards
        self.others_rows = 0.0  # smoothed: their rows (0 while the target reports no step rows)
        self.steps = StepFit()  # this request's Verifies in steps that reported their rows

    # ------------------------------------------------------------ the model

    def draft_acceptance(self, k: int) -> tuple[float, ...]:
        """(c_1..c_k): acceptance at each position where a draft reaches it, given the ones before it
        were accepted, each leaning on the one before under a weak prior: what a drafted row there
        yields (`expected_tokens`; a target that verifies in a shared step only the rows worth their
        cost, `VerifyRequest.lookup_acceptance`)."""
        rates, prior = [], self.prior_acceptance
        for i in range(1, k + 1):
            prior = (self.accepted[i] + self.prior_weight * prior) / (self.offered[i] + self.prior_weight)
            rates.append(prior)
        return tuple(rates)

    def reach(self) -> list[float]:
        """[P_0..P_kmax]: the chance a draft asked for at least i tokens proposes at least i, under
        the same weak prior, leaning on P_{i-1} (P_0 = 1: before any ask, drafts are as long as asked)."""
        rates, prior = [1.0], 1.0
        for i in range(1, self.k_max + 1):
            prior = min(prior, (self.reached[i] + self.prior_weight * prior) / (self.asked_at[i] + self.prior_weight))
            rates.append(prior)
        return rates

    def expected_tokens(self, reach: Sequence[float] | None = None) -> list[float]:
        """[K = 0..k_max]: a round's expected tokens when it asks for K: 1 + sum over i <= K of
        P_i c_1 ... c_i, the i-th draft emitted where the draft reaches i (`reach`, or as given) and
        it and every draft before it are accepted (`draft_acceptance`). A draft that stopped short
        is not a rejection at every depth: chaining one acceptance that counted such stops as
        rejections, a position few drafts had reached leaned on the first position's, and a lookup
        that proposes at a quarter of its rounds but copies on once it starts looked a quarter as
        good at every depth (on document QA at T = 0 auto K then asked for 1-2 tokens for a whole
        answer)."""
        reaches = self.reach() if reach is None else reach
        expected, run = [1.0], 1.0
        for p, rate in zip(reaches[1:], self.draft_acceptance(self.k_max), strict=True):
            run *= rate
            expected.append(expected[-1] + p * run)
        return expected

    def verify_cost(self, rows: int, measured: dict[int, float] | None = None) -> float:
        """Seconds of a Verify of `rows` rows per sequence: alone, measured, else estimated from
        measured ones; in company, at a shared step of the others' rows + ours. measured: the mean
        seconds by rows, where the caller has them (`_measured`)."""
        if self._priced_by_steps():
            _, mean_rows, mean_s = self.steps.means()
            prior = self._prior_slope(mean_rows, mean_s)
            return self.steps.predict(round(self.others) + self.own, round(self.others_rows) + self.own * rows, prior)
        if measured is None:
            measured = self._measured()
        if rows in measured:
            return measured[rows]
        if measured and self.verify_curve:
            # Scale the nearest measured length by the curve (extended past its calibrated rows):
            # what this call's timing adds (transport, a busier machine) scales with it.
            nearest = min(measured, key=lambda r: (abs(r - rows), -r))
            return measured[nearest] * self._curve_at(rows) / self._curve_at(nearest)
        one = measured.get(1, 1.0)
        if rows == 1:
            return one
        shorter = [cost for r, cost in measured.items() if r < rows]
        return max([one * self.default_verify_factor, *shorter])

    def _verify_costs(self) -> list[float]:
        """[verify_cost(rows) for rows = 1..k_max + 1], alone with measured lengths and a curve (the
        usual case) without a search per length: every round's choice computes them all."""
        measured, n = self._measured(), self.k_max + 1
        lengths, curve = sorted(measured), self._curve_points
        if self._priced_by_steps() or not curve or not lengths or lengths[-1] > n:
            return [self.verify_cost(rows, measured) for rows in range(1, n + 1)]
        costs, above = [], 0  # lengths[above]: the shortest measured length >= rows
        for rows in range(1, n + 1):
            while above < len(lengths) and lengths[above] < rows:
                above += 1
            nearest = lengths[above] if above < len(lengths) else lengths[-1]
            if above and (above == len(lengths) or rows - lengths[above - 1] < lengths[above] - rows):
                nearest = lengths[above - 1]  # strictly nearer below: ties go to the longer
            scaled = measured[nearest] * curve[rows - 1] / curve[nearest - 1]
            costs.append(measured[rows] if nearest == rows else scaled)
        return costs

    def _priced_by_steps(self) -> bool:
        """A Verify priced as its share of a batched step (`StepFit`), not by its own timings."""
        return bool(self.steps.n) and (self._in_company() or not self.verify_count)

    def _measured(self) -> dict[int, float]:
        return {r: self.verify_sum[r] / self.verify_count[r] for r in self.verify_count if self.verify_count[r]}

    def _in_company(self) -> bool:
        return self.others_rows >= 0.5  # the target reports step rows, and others share them

    def _prior_slope(self, rows: float, seconds: float) -> float:
        """Seconds per row at `rows`, by the curve's shape, for steps of `seconds` there."""
        if len(self.verify_curve) < 2:
            return seconds / rows
        r = max(2, round(rows))
        return seconds * (self._curve_at(r + 1) - self._curve_at(r - 1)) / 2 / self._curve_at(r)

    def ceiling(self, draft_curve: Sequence[float]) -> float:
        """The most drafting could multiply tokens/s by, every draft accepted: max over K of
        (K + 1) v(1) / (K d(1) + v(K + 1)), v the target's curve and d the draft's (a draft step
        costs at least its 1-row forward). inf where either curve is missing, or the draft's forward
        is too short to judge by (MIN_JUDGED_DRAFT_MS)."""
        if not self._curve_points or not draft_curve or min(draft_curve) <= 0 or draft_curve[0] < MIN_JUDGED_DRAFT_MS:
            return float("inf")
        one, step = self._curve_points[0], draft_curve[0]
        return max(((k + 1) * one / (k * step + self._curve_points[k]) for k in range(1, self.k_max + 1)), default=0.0)

    def _curve_at(self, rows: int) -> float:
        return curve_at(self.verify_curve, rows)

    def draft_cost(self) -> tuple[float, float]:
        """(seconds of a Propose whatever it drafts, seconds per drafted token on top): the first
        from the Proposes that drafted nothing (0 before any), the second from the others, else a
        default fraction of a 1-row Verify (in company, of this request's share of the step: the
        whole step is not what one draft costs)."""
        per_ask = self.empty_s / self.empty_calls if self.empty_calls else 0.0
        if self.draft_steps:
            return per_ask, max(0.0, self.draft_s - per_ask * self.draft_calls) / self.draft_steps
        share = 1 + self.others if self._in_company() else 1
        return per_ask, self.default_draft_ratio * self.verify_cost(1) / share

    def tokens_per_second(self) -> list[float]:
        """[K = 0..k_max]: expected tokens per second under the current estimates: this request's
        (its tokens over its draft and its Verify), plus the other requests' sequences batched with
        it (their tokens over the Verify alone: they do not wait for this request's draft, but its
        rows lengthen their step). Alone, that is this request's own speed; in a batch, drafting
        pays only if its gain beats what its extra rows cost the whole step."""
        per_ask, per_token = self.draft_cost()
        reach = self.reach()
        expected = self.expected_tokens(reach)
        others = self.others
        if self._in_company() and self.others >= 1:  # the others draft too: as this request accepts
            mean_k = min(float(self.k_max), max(0.0, self.others_rows / self.others - 1))
            low = int(mean_k)
            high = min(low + 1, self.k_max)
            others *= expected[low] + (mean_k - low) * (expected[high] - expected[low])
        # A round verifies 1 + its draft's length rows, and a model-free drafter's length is its own
        # (up to K): K + 1 rows are paid only as often as its drafts reach K.
        costs = self._verify_costs()
        out, shorter, drafted = [], 0.0, 0.0  # shorter: the cost of rounds whose draft stopped before K
        zero = costs[0] * (self.decode_prior if self.decodes else 1.0)
        if self.decoded_rounds:  # never above a Verify of its own: a share of one call without its round trip
            zero = min(self.decoded_s / self.decoded_rounds, costs[0])
        empty = zero if self.stretches else costs[0]  # a round whose draft proposed nothing
        for k in range(self.k_max + 1):
            verify = (shorter + reach[k] * costs[k] if k else zero) + self.overhead_s
            draft = per_ask + drafted * per_token if k else 0.0
            own = self.own * expected[k] / (draft + verify)
            out.append(own + others / verify)  # the others do not wait for our draft
            if k < self.k_max:
                shorter += (reach[k] - reach[k + 1]) * (costs[k] if k else empty)
                drafted += reach[k + 1]
        return out

    # ------------------------------------------------------------ the policy

    def choose(self) -> int:
        if not self.drafts_at_all:
            return 0
        if self.rounds == 0:
            return self.start_k
        if self.rounds == 1 or self.k_max == 0:
            return 0
        speeds = self.tokens_per_second()
        best = 0
        for k, speed in enumerate(speeds):
            if speed > speeds[best]:  # ties go to the smaller K
                best = k
        if best == 0 and self.zero_streak >= self.probe_every:
            return 1
        return best

    def zero_run(self) -> int:
        """Rounds at K = 0 from this one on (called where `choose` gave 0): until the next probe, as
        K = 0 rounds teach it no acceptance; all where the draft is never called; 1 in round 1
        (round 2 reads round 0's drafts)."""
        if not self.drafts_at_all or self.k_max == 0:
            return UNBOUNDED
        if self.rounds < 2:
            return 1
        return max(1, self.probe_every - self.zero_streak)

    def observe(self, outcome: RoundOutcome) -> None:
        self.own = max(1, len(outcome.drafts))
        others_rows = max(0, outcome.step_rows - outcome.own_rows)
        prefill = others_rows > PREFILL_ROWS_PER_SEQUENCE * max(1, outcome.others)
        if not prefill:
            self.others += OTHERS_SMOOTHING * (outcome.others - self.others)
            if outcome.step_rows:
                self.others_rows += OTHERS_SMOOTHING * (others_rows - self.others_rows)
        if self.rounds >= 2:  # rounds 0 and 1 are fixed, not the model's choices
            self.zero_streak = self.zero_streak + 1 if outcome.k == 0 else 0
        asked = min(outcome.k, self.k_max)
        for n, (drafted, accepted) in enumerate(outcome.drafts):
            proposed = outcome.proposed[n] if outcome.proposed else drafted
            examined = min(drafted, accepted + 1, self.k_max)  # drafts after a rejection are never examined
            for i in range(1, examined + 1):
                self.offered[i] += 1
                self.accepted[i] += i <= accepted
            # A draft that stopped short of the K asked for (a model-free drafter without a confident
            # match proposes fewer, often none) gained nothing past its end: `reach` counts it, so a
            # drafter that never proposes is not asked round after round. (Not a draft the target's
            # step cut: its lookup did reach past the cut.)
            for i in range(1, asked + 1):
                self.asked_at[i] += 1
                self.reached[i] += proposed >= i
        if self.rounds > 0:  # round 0's timings include the prefill
            steps = max((drafted for drafted, _ in outcome.drafts), default=0)
            if steps:
                self.draft_s += outcome.draft_s
                self.draft_steps += steps
                self.draft_calls += 1
            elif asked:  # an empty proposal's call: what asking costs, whatever comes back
                self.empty_s += outcome.draft_s
                self.empty_calls += 1
            if outcome.decoded:
                self.decoded_s += outcome.verify_s
                self.decoded_rounds += 1
            elif not outcome.others or not outcome.step_rows:  # the Verify's own cost at its length
                self.verify_sum[outcome.rows] = self.verify_sum.get(outcome.rows, 0.0) + outcome.verify_s
                self.verify_count[outcome.rows] = self.verify_count.get(outcome.rows, 0) + 1
            if outcome.step_rows and not prefill and not outcome.decoded:
                self.steps.add(outcome.others + self.own, outcome.step_rows, outcome.verify_s)
        self.rounds += 1
