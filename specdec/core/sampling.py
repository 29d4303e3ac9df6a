"""The seed's math: sampling and the lossless accept/reject round (numpy only; the warping
that turns logits into laws is `specdec.models.warping`).

Pure functions, no I/O. Randomness is always passed in (a uniform or a
numpy Generator), so a round is reproducible from its seed.

Terms follow the article (shared/seed) and Leviathan et al.:
  draft_probs  q_i  - the law the draft sampled x_i from, after warping
  target_probs p_i  - the target's law at the same position, same warping
  accepted tokens   - x_i kept with probability min(1, p_i(x_i) / q_i(x_i))
  recovered token   - drawn from normalize(max(0, p_i - q_i)) at the first rejection
  bonus token       - drawn from p_{K+1} when all K draft tokens were accepted

Why it is lossless, per position:
  P(x) = q(x) * min(1, p(x)/q(x)) + (1 - alpha) * max(0, p(x) - q(x)) / (1 - alpha)
       = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x),   alpha = sum_x min(p(x), q(x)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.core.errors import InconsistentDraftError


@dataclass(frozen=True)
class Sampling:
    """Warping parameters. temperature 0 = greedy; top_k 0 = off; top_p 1 = off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# ---------------------------------------------------------------- laws


def normalize(probs: np.ndarray) -> np.ndarray:
    """[..., V] non-negative weights -> float64 law (last axis sums to 1).

    Both ends apply this to the float32 wire array, so the law the draft
    sampled from and the law the coordinator scores with are the same numbers.
    """
    probs = np.asarray(probs, dtype=np.float64)
    return probs / probs.sum(axis=-1, keepdims=True)


def sample_token(probs: np.ndarray, uniform: float) -> int:
    """Inverse-CDF draw. probs: [V] float64 law; uniform in [0, 1).

    side='right' gives zero-probability tokens an empty interval, so they are
    never drawn, whatever the uniform.
    """
    cdf = np.cumsum(probs)
    index = int(np.searchsorted(cdf, uniform * cdf[-1], side="right"))
    return min(index, probs.shape[-1] - 1)


BLOCK = 256  # tokens per block of `draw`'s two-level inverse CDF


def draw(weights: np.ndarray, uniform: float) -> int:
    """sample_token(normalize(weights), uniform) in two levels. weights: [V] non-negative, not all zero.

    The token whose interval of the cumulative weights holds uniform * total, found among the
    blocks' float64 sums and then inside one block: every token's interval is its weight, as in
    the one-level draw, and the token is the same but where the uniform lies within float64
    rounding of an interval's end. It spares the float64 passes over the whole vocabulary
    (49,152 tokens: 0.33 -> 0.03 ms a draw, every round at T > 0). Zero weights (and blocks of
    them) have empty intervals: never drawn.
    """
    weights = np.asarray(weights)
    size = weights.shape[-1]
    whole = size - size % BLOCK
    sums = weights[:whole].reshape(-1, BLOCK).sum(axis=1, dtype=np.float64)  # [blocks]
    if whole < size:
        sums = np.append(sums, weights[whole:].sum(dtype=np.float64))
    ends = np.cumsum(sums)
    target = uniform * ends[-1]
    block = int(np.searchsorted(ends, target, side="right"))  # target < the total for uniform < 1
    start = block * BLOCK
    inside = np.cumsum(weights[start : start + BLOCK], dtype=np.float64)
    index = int(np.searchsorted(inside, target - (ends[block - 1] if block else 0.0), side="right"))
    if index == inside.shape[0]:  # the block's running sum rounded below its (pairwise) sum
        index = int(np.flatnonzero(weights[start : start + BLOCK])[-1])
    return start + index


# ---------------------------------------------------------------- the round


def acceptance_probs(draft_probs: np.ndarray, target_probs: np.ndarray) -> np.ndarray:
    """A(x) = min(1, p(x) / q(x)).  draft_probs, target_probs: [V] float64 laws.

    Where q(x) = 0 the draft never proposes x; A is set to 1 there (unused).
    p(x) = 0 < q(x) gives A = 0: such a proposal is always rejected.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(draft_probs > 0, target_probs / draft_probs, 1.0)
    return np.minimum(1.0, ratio)


def recovered_probs(draft_probs: np.ndarray, target_probs: np.ndarray) -> np.ndarray:
    """p'(x) = max(0, p(x) - q(x)) / (1 - alpha).  draft_probs, target_probs: [V].

    Normalised by its own sum, which equals 1 - alpha up to rounding. If that
    mass is zero (p == q, alpha = 1) a rejection has probability zero in exact
    arithmetic and can only come from rounding; falling back to p keeps the law
    exact to rounding and never divides by zero.
    """
    residual = np.maximum(0.0, target_probs - draft_probs)
    mass = residual.sum()
    if not mass > 0.0:
        return target_probs
    return residual / mass


def recovered_probs_point_mass(token: int, target_probs: np.ndarray) -> np.ndarray:
    """recovered_probs(one_hot(token), target_probs), number for number, without the one-hot:
    p without x, renormalised (p itself when p is the point mass on x). target_probs: [V] float64 law."""
    residual = target_probs.copy()
    residual[token] = 0.0  # max(0, p(x) - 1) = 0; elsewhere max(0, p - 0) = p
    mass = residual.sum()
    if not mass > 0.0:
        return target_probs
    return residual / mass


def acceptance_rate(draft_probs: np.ndarray, target_probs: np.ndarray) -> float:
    """alpha = sum_x min(p(x), q(x)): the chance one draft token is accepted."""
    return float(np.minimum(draft_probs, target_probs).sum())


def output_law(draft_probs: np.ndarray, target_probs: np.ndarray) -> np.ndarray:
    """The law of the token a position emits, computed from the functions above.

    P(x) = q(x) A(x) + (1 - sum_y q(y) A(y)) p'(x). Equals p (tests check it).
    """
    accepted_mass = draft_probs * acceptance_probs(draft_probs, target_probs)
    return accepted_mass + (1.0 - accepted_mass.sum()) * recovered_probs(draft_probs, target_probs)


@dataclass(frozen=True)
class RoundResult:
    """What one speculative round emits: accepted tokens, then one recovered or bonus token."""

    accepted_tokens: list[int]
    recovered_token: int | None
    bonus_token: int | None

    @property
    def tokens(self) -> list[int]:
        extra = self.recovered_token if self.recovered_token is not None else self.bonus_token
        return [*self.accepted_tokens, extra]


def speculative_round(
    draft_token_ids: list[int],  # [K]
    draft_probs: np.ndarray | None,  # [K, V] float32 wire laws the draft sampled from; None: point masses
    target_probs: np.ndarray,  # [K + 1, V] float32 wire laws of the target
    rng: np.random.Generator,
) -> RoundResult:
    """Accept/reject x_1..x_K in order; recover at the first rejection; else bonus.

    Emits 1..K+1 tokens. With K = 0 this is plain target sampling from p_1.
    Uniforms are drawn in a fixed order (one per examined position, then one
    for the recovered/bonus draw), so a seeded rng makes the round reproducible.

    draft_probs None: each q_i is the point mass on x_i (a model-free draft), so A = min(1, p(x))
    and the residual is p without x; the same numbers as the one-hot laws would give, without
    building and normalising them (a drafted row then costs one pass over p, not six).
    """
    num_draft = len(draft_token_ids)
    point_mass = draft_probs is None
    draft_rows = num_draft if point_mass else draft_probs.shape[0]
    if target_probs.shape[0] != num_draft + 1 or (num_draft and draft_rows != num_draft):
        shape = None if point_mass else draft_probs.shape
        raise ValueError(
            f"shape mismatch: {num_draft} draft tokens, draft_probs {shape}, target_probs {target_probs.shape}"
        )
    accepted: list[int] = []
    for i, token in enumerate(draft_token_ids):
        if point_mass:
            weights = np.asarray(target_probs[i], dtype=np.float64)
            total = weights.sum(axis=-1, keepdims=True)  # as normalize sums them
            q_token, p_token = np.ones(1), weights[token : token + 1] / total
        else:
            q, p = normalize(draft_probs[i]), normalize(target_probs[i])
            if not q[token] > 0.0:
                raise InconsistentDraftError(f"draft proposed token {token} with q = 0 at position {i + 1}")
            q_token, p_token = q[token : token + 1], p[token : token + 1]
        r = rng.random()
        # The same A(x) the exact-algebra tests check, for the one token that was proposed.
        if r < acceptance_probs(q_token, p_token)[0]:
            accepted.append(token)
            continue
        recovered = recovered_probs_point_mass(token, weights / total) if point_mass else recovered_probs(q, p)
        return RoundResult(accepted, draw(recovered, rng.random()), None)
    bonus = draw(target_probs[num_draft], rng.random())
    return RoundResult(accepted, None, bonus)


def greedy_round(draft_token_ids: list[int], target_tokens: np.ndarray) -> RoundResult:
    """`speculative_round` of point masses against greedy target laws, given by their tokens alone.

    draft_token_ids: [K]; target_tokens: [K + 1], p_i the point mass on target_tokens[i]. Then
    A(x_i) = p_i(x_i) is 1 or 0, so every uniform in [0, 1) gives the same verdict: x_i is accepted
    iff it is the target's token. At the first rejection the residual, p_i without x_i, is p_i itself
    (x_i has no mass there), so the recovered token is the target's, as is the bonus. No pass over
    the vocabulary: the same tokens as `speculative_round` on the one-hot laws (tests check it).
    """
    if len(target_tokens) != len(draft_token_ids) + 1:
        raise ValueError(f"shape mismatch: {len(draft_token_ids)} draft tokens, {len(target_tokens)} target tokens")
    for i, token in enumerate(draft_token_ids):
        if token != target_tokens[i]:
            return RoundResult(list(draft_token_ids[:i]), int(target_tokens[i]), None)
    return RoundResult(list(draft_token_ids), None, int(target_tokens[-1]))


# ---------------------------------------------------------------- randomness


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed from (request seed, keys...): e.g. (sample, round, stream).

    Pure function of its inputs, so any coordinator replica derives the same
    randomness for the same round of the same request.
    """
    state = np.random.SeedSequence(entropy=int(seed), spawn_key=tuple(int(k) for k in keys))
    return int(state.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def rng_for(seed: int, *keys: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(derive_seed(seed, *keys)))
