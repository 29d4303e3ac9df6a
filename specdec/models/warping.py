"""Logits -> laws: the ONE warping both model services apply, and the float32 wire form.

Torch side of the seed's math (`specdec.core.sampling` holds the numpy side).
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.core.errors import NonFiniteLogitsError
from specdec.core.sampling import Sampling


def warp_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Logits -> the law both services sample / score with.

    logits: [N, V] raw model logits (any float dtype).
    Returns [N, V] float32 probabilities, each row summing to 1 within float32 rounding.

    The ONE warping function of the project: the draft's q and the target's p
    come from it with the same parameters. Order: temperature, top-k, top-p
    (as Hugging Face's samplers). Greedy is the one-hot law on the argmax
    (first index on ties), so speculative greedy is the same algorithm.

    In float32, the precision the laws travel in (`to_wire`) and the coordinator's draws renormalise
    in float64: a float64 softmax cost 3x as much (49,152 logits, one thread: 160 against 56 us a
    row), rounded to float32 a moment later. The nucleus's masses are summed in float64.
    """
    if sampling.greedy:
        return _greedy(logits)
    _check_finite(logits)
    if sampling.temperature != 1.0:  # (dividing by 1 is exact: a pass and a copy of the rows saved)
        scaled = logits.to(torch.float32) / sampling.temperature
    else:
        scaled = logits.to(torch.float32)
    vocab = scaled.shape[-1]
    if 0 < sampling.top_k < vocab:
        # Ties with the k-th value are kept: the cut is a pure function of the logits.
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1.0:
        probs = _nucleus(probs, sampling.top_p)
    return probs


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """The greedy law in float32: one-hot on the argmax, the first index on ties (`greedy_tokens`)."""
    if logits.device.type != "cpu":
        _check_finite(logits)
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    index = greedy_tokens(logits)
    probs = np.zeros(tuple(logits.shape), dtype=np.float32)
    probs[np.arange(index.shape[0]), index] = 1.0
    return torch.from_numpy(probs)


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def greedy_tokens(logits: torch.Tensor) -> np.ndarray:
    """[N, V] logits -> [N] int64: the token of each row's greedy law (its argmax, the
    first index on ties), with `_check_finite`'s rule. The argmax is taken before any cast (a cast
    is exact, so the same index), without copying the vocabulary; in numpy, whose argmax's value is
    the row's max (NaN where the row holds one: numpy's argmax takes the first NaN), so the check
    reads N values. Why numpy: torch's argmax took 0.58 ms for 8 rows of a 49,152-token vocabulary
    (numpy's 0.02), and its small ops cost several times numpy's. `wire_laws` at T = 0, one thread,
    1 / 5 / 8 rows: 41 / 79 / 100 us with torch's check, zeros and scatter, 17 / 42 / 58 so."""
    if logits.device.type != "cpu" or logits.dtype not in _NUMPY_DTYPES:
        _check_finite(logits)
        return logits.detach().argmax(dim=-1).cpu().numpy()
    array = logits.detach().numpy()
    index = np.argmax(array, axis=-1)  # [N]
    _check_row_max(array[np.arange(index.shape[0]), index])
    return index


def _check_finite(logits: torch.Tensor) -> None:
    """Raise on NaN or +inf logits, or a row of all -inf: one pass over the logits, as a row's
    max is NaN when it holds a NaN (amax propagates it), +inf with a +inf, -inf when all are."""
    _check_row_max(logits.detach().amax(dim=-1).float().cpu().numpy())


def _check_row_max(row_max: np.ndarray) -> None:
    """`_check_finite` from each row's max [N] (in numpy: 1.3 us for a row, torch's ops 6.5)."""
    if np.isfinite(row_max).all():
        return
    if np.isnan(row_max).any() or np.isposinf(row_max).any():
        raise NonFiniteLogitsError("model produced NaN or +inf logits")
    raise NonFiniteLogitsError("model produced a row of all -inf logits")


_NUCLEUS_CANDIDATES = 1024


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest most-probable prefix whose mass reaches top_p (the top token always stays).

    probs: [N, V] float32. The ordering needs only the leading candidates: a partial top-k
    replaces the full sort whenever the nucleus lies inside them (the usual case), which is
    ~10x cheaper on a 49k vocabulary. Both paths give the same set (the masses before each
    candidate summed in float64, in the same order).
    """
    vocab = probs.shape[-1]
    candidates = min(vocab, _NUCLEUS_CANDIDATES)
    sorted_probs, order = torch.topk(probs, candidates, dim=-1)
    mass_before = _mass_before(sorted_probs)
    if candidates < vocab and not bool((mass_before[..., -1] + sorted_probs[..., -1] >= top_p).all()):
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = _mass_before(sorted_probs)
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep_sorted)
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _mass_before(sorted_probs: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [N, C] float64: each entry's row mass before it."""
    wide = sorted_probs.to(torch.float64)
    return torch.cumsum(wide, dim=-1) - wide


def wire_laws(logits: torch.Tensor, sampling: Sampling) -> np.ndarray:
    """`to_wire(warp_logits(logits, sampling))`: the laws as the services send them, [N, V] float32."""
    return to_wire(warp_logits(logits, sampling))


def to_wire(probs: torch.Tensor | np.ndarray) -> np.ndarray:
    """[N, V] law -> float32 array as sent between services."""
    if isinstance(probs, torch.Tensor):
        probs = probs.detach().cpu().numpy()
    return np.ascontiguousarray(probs, dtype=np.float32)
