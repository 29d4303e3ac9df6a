"""Protobuf <-> domain conversions: probability arrays, sampling, and the engine's Propose /
Verify dataclasses (`specdec.core.protocols`), for both ends of each call."""

from __future__ import annotations

import math
import time

import numpy as np

from specdec.core.engine import Stats
from specdec.core.protocols import DraftProposal, DraftRequest, VerifyRequest, VerifyResult
from specdec.core.sampling import Sampling
from specdec.v1 import common_pb2, coordinator_pb2, draft_pb2, target_pb2

_DTYPES = {
    common_pb2.DTYPE_FLOAT32: np.float32,
    common_pb2.DTYPE_FLOAT64: np.float64,
    common_pb2.DTYPE_FLOAT16: np.float16,
}


def encode_probs(probs: np.ndarray, allow_sparse: bool = True) -> common_pb2.ProbTensor:
    """[N, V] float32 array -> ProbTensor (raw bytes; never `repeated float`), with only its
    stored entries (`SparseRows`) when that is smaller. Either way decoding gives it back bit for bit."""
    probs = np.ascontiguousarray(probs, dtype=np.float32)
    if allow_sparse and probs.ndim == 2 and probs.size:
        sparse = _encode_sparse(probs)
        if sparse is not None:
            return sparse
    return common_pb2.ProbTensor(data=probs.tobytes(), shape=list(probs.shape), dtype=common_pb2.DTYPE_FLOAT32)


def _encode_sparse(probs: np.ndarray) -> common_pb2.ProbTensor | None:
    """[N, V] float32 -> CSR ProbTensor of the entries whose bits are not all zero (so -0.0 and
    NaN travel as they are); None when that is not smaller than the dense bytes."""
    rows, vocab = probs.shape
    bits = probs.view(np.uint32)  # [N, V]
    # 8 bytes per stored entry (value + index) against 4 per entry dense. A law warped with no
    # cut is dense in every row: its first row answers without a pass over the rest.
    if 2 * np.count_nonzero(bits[0]) >= vocab:
        return None
    # flatnonzero of a flat bool array: ~10x faster than np.nonzero of the 2-D one.
    flat = np.flatnonzero(bits.reshape(-1) != 0)  # [total], ascending: row by row, columns ascending
    if 8 * flat.size + 4 * (rows + 1) >= probs.nbytes:
        return None
    offsets = np.searchsorted(flat, np.arange(rows + 1) * vocab)  # [N + 1]
    return common_pb2.ProbTensor(
        data=probs.reshape(-1)[flat].tobytes(),
        shape=[rows, vocab],
        dtype=common_pb2.DTYPE_FLOAT32,
        sparse=common_pb2.SparseRows(indices=(flat % vocab).astype("<i4").tobytes(), row_offsets=offsets.tolist()),
    )


def encode_hidden_states(hidden: np.ndarray) -> common_pb2.ProbTensor:
    """[N, H] hidden states -> float16 ProbTensor: half the bytes, and float16 is what drafts
    are trained on (the distillation cache stores them so)."""
    hidden = np.ascontiguousarray(hidden, dtype=np.float16)
    return common_pb2.ProbTensor(data=hidden.tobytes(), shape=list(hidden.shape), dtype=common_pb2.DTYPE_FLOAT16)


def decode_probs(tensor: common_pb2.ProbTensor) -> np.ndarray:
    """ProbTensor -> read-only numpy array of its shape; ValueError when inconsistent."""
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"unsupported probability dtype {tensor.dtype}")
    dtype = np.dtype(_DTYPES[tensor.dtype]).newbyteorder("<")
    shape = tuple(tensor.shape)
    if any(size < 0 for size in shape):
        raise ValueError(f"tensor shape {list(shape)} has a negative size")
    if tensor.HasField("sparse"):
        return _decode_sparse(tensor, dtype, shape)
    expected = math.prod(shape) * dtype.itemsize  # Python ints: a huge shape cannot wrap around
    if len(tensor.data) != expected:
        raise ValueError(f"probability tensor has {len(tensor.data)} bytes, shape {shape} needs {expected}")
    return np.frombuffer(tensor.data, dtype=dtype).reshape(shape)


def _decode_sparse(tensor: common_pb2.ProbTensor, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A SparseRows ProbTensor -> the read-only [N, V] array it was encoded from."""
    if len(shape) != 2 or min(shape) < 0:
        raise ValueError(f"a sparse tensor must have shape [rows, columns], got {list(shape)}")
    rows, columns = shape
    offsets = np.asarray(tensor.sparse.row_offsets, dtype=np.int64)  # [N + 1]
    if offsets.shape != (rows + 1,) or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise ValueError(f"sparse row_offsets must be {rows + 1} non-decreasing values from 0")
    total = int(offsets[-1])
    if len(tensor.sparse.indices) != 4 * total or len(tensor.data) != total * dtype.itemsize:
        raise ValueError(
            f"sparse tensor has {len(tensor.sparse.indices)} index and {len(tensor.data)} value bytes "
            f"for {total} entries"
        )
    indices = np.frombuffer(tensor.sparse.indices, dtype="<i4")  # [total]
    row_of = np.repeat(np.arange(rows), np.diff(offsets))  # [total]
    # Ascending, in range, no repeats: each entry lands on its own place and nothing is left over.
    flat = row_of * columns + indices
    if total and (indices.min() < 0 or indices.max() >= columns or np.any(np.diff(flat) <= 0)):
        raise ValueError(f"sparse indices must ascend within each row and lie in [0, {columns})")
    dense = np.zeros(shape, dtype=dtype)
    dense.reshape(-1)[flat] = np.frombuffer(tensor.data, dtype=dtype)
    dense.flags.writeable = False
    return dense


def sampling_from_proto(params: common_pb2.SamplingParams) -> Sampling:
    """Proto sampling params -> validated Sampling (unset temperature / top_p mean 1)."""
    temperature = params.temperature if params.HasField("temperature") else 1.0
    top_p = params.top_p if params.HasField("top_p") else 1.0
    sampling = Sampling(temperature=float(temperature), top_k=int(params.top_k), top_p=float(top_p))
    validate_sampling(sampling)
    return sampling


def sampling_to_proto(sampling: Sampling) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)


def validate_sampling(sampling: Sampling) -> None:
    """ValueError with a user-facing message for out-of-range sampling parameters."""
    if not np.isfinite(sampling.temperature) or sampling.temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {sampling.temperature}")
    if sampling.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {sampling.top_k}")
    if not (0.0 < sampling.top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p}")


# ---------------------------------------------------------------- Propose


def propose_request(requests: list[DraftRequest], sampling: Sampling) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(
        sequences=[
            draft_pb2.DraftSequence(
                cache_key=r.cache_key,
                prefix_token_ids=r.prefix_token_ids,
                num_draft_tokens=r.num_draft_tokens,
                seed=r.seed,
                target_hidden_states=encode_hidden_states(r.target_hidden) if r.target_hidden is not None else None,
                hidden_states_offset=r.hidden_offset,
                hidden_states_key=r.hidden_key,
                lookup_only=r.lookup_only,
            )
            for r in requests
        ],
        sampling=sampling_to_proto(sampling),
    )


def propose_response(proposals: list[DraftProposal]) -> draft_pb2.ProposeResponse:
    """A point-mass proposal carries its token ids alone (no probability bytes)."""
    return draft_pb2.ProposeResponse(
        proposals=[
            draft_pb2.Proposal(
                draft_token_ids=p.draft_token_ids,
                draft_probs=None if p.point_mass else encode_probs(p.draft_probs),
                cached_tokens=p.cached_tokens,
                point_mass=p.point_mass,
            )
            for p in proposals
        ]
    )


def _laws(tensor: common_pb2.ProbTensor, rows: int, what: str) -> np.ndarray:
    """A [rows, V] array of laws (V >= 1); ValueError naming `what` otherwise."""
    laws = decode_probs(tensor)
    if laws.ndim != 2 or laws.shape[0] != rows or (rows and laws.shape[1] < 1):
        raise ValueError(f"{what} has shape {list(laws.shape)}, expected [{rows}, vocabulary]")
    return laws


def proposals_from_proto(response: draft_pb2.ProposeResponse) -> list[DraftProposal]:
    """ValueError when a probability tensor is inconsistent (or not one law per drafted token)."""
    return [
        DraftProposal(list(p.draft_token_ids), None, p.cached_tokens, point_mass=True)
        if p.point_mass
        else DraftProposal(
            list(p.draft_token_ids), _laws(p.draft_probs, len(p.draft_token_ids), "draft_probs"), p.cached_tokens
        )
        for p in response.proposals
    ]


# ---------------------------------------------------------------- Verify


def verify_request(requests: list[VerifyRequest], sampling: Sampling) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(
        sequences=[
            target_pb2.VerifySequence(
                cache_key=r.cache_key,
                prefix_token_ids=r.prefix_token_ids,
                draft_token_ids=r.draft_token_ids,
                hidden_states_from=r.hidden_from,
                decode_uniforms=r.decode_uniforms,
                stop_token_ids=sorted(r.stop_token_ids) if r.decode_uniforms else (),
                stop_ngram=r.stop_ngram if r.decode_uniforms else 0,
                lookup_k=r.lookup_k if r.decode_uniforms else 0,
                max_tokens=r.max_tokens if r.decode_uniforms else 0,
                lookup_acceptance=r.lookup_acceptance if r.decode_uniforms and r.lookup_k else (),
            )
            for r in requests
        ],
        sampling=sampling_to_proto(sampling),
    )


def verify_response(results: list[VerifyResult]) -> target_pb2.VerifyResponse:
    return target_pb2.VerifyResponse(
        verifications=[
            target_pb2.Verification(
                target_probs=None if r.decoded_token_ids else encode_probs(r.target_probs),
                cached_tokens=r.cached_tokens,
                hidden_states=encode_hidden_states(r.hidden) if r.hidden is not None else None,
                step_sequences=r.step_sequences,
                step_rows=r.step_rows,
                decoded_token_ids=r.decoded_token_ids,
                round_drafted=[d for d, _ in r.round_drafts],
                round_accepted=[a for _, a in r.round_drafts],
                round_proposed=r.round_proposed,
                round_seconds=r.round_seconds,
            )
            for r in results
        ]
    )


def _hidden(tensor: common_pb2.ProbTensor) -> np.ndarray:
    hidden = decode_probs(tensor)
    if hidden.ndim != 2:
        raise ValueError(f"hidden_states has shape {list(hidden.shape)}, expected [rows, hidden size]")
    return hidden


_NO_LAWS = np.empty((0, 0), np.float32)  # a decode-steps result's target_probs


def verify_results_from_proto(response: target_pb2.VerifyResponse) -> list[VerifyResult]:
    """ValueError when a tensor is inconsistent. (How many laws each needs, K + 1, the engine
    checks: it knows K.)"""
    results = []
    for v in response.verifications:
        if v.decoded_token_ids:  # decode steps: tokens, no laws
            decoded = tuple(v.decoded_token_ids)
            step = (max(1, v.step_sequences), max(0, v.step_rows))
            if len(v.round_drafted) != len(v.round_accepted):
                raise ValueError(f"{len(v.round_drafted)} round_drafted for {len(v.round_accepted)} round_accepted")
            for name in ("round_proposed", "round_seconds"):
                if (values := getattr(v, name)) and len(values) != len(v.round_drafted):
                    raise ValueError(f"{len(values)} {name} for {len(v.round_drafted)} rounds")
            rounds = tuple(zip(v.round_drafted, v.round_accepted, strict=True))
            per_round = (tuple(v.round_proposed), tuple(v.round_seconds))
            results.append(VerifyResult(_NO_LAWS, v.cached_tokens, None, *step, decoded, rounds, *per_round))
            continue
        laws = decode_probs(v.target_probs)
        if laws.ndim != 2 or laws.shape[0] < 1 or laws.shape[1] < 1:
            raise ValueError(f"target_probs has shape {list(laws.shape)}, expected [K + 1, vocabulary]")
        hidden = _hidden(v.hidden_states) if v.HasField("hidden_states") else None
        results.append(VerifyResult(laws, v.cached_tokens, hidden, max(1, v.step_sequences), max(0, v.step_rows)))
    return results


# ---------------------------------------------------------------- Coordinator


def stats_to_proto(stats: Stats, generated_tokens: int) -> coordinator_pb2.GenerationStats:
    total_s = time.perf_counter() - stats.started
    return coordinator_pb2.GenerationStats(
        rounds=stats.rounds,
        drafted_tokens=stats.drafted_tokens,
        accepted_tokens=stats.accepted_tokens,
        acceptance_rate=stats.accepted_tokens / stats.drafted_tokens if stats.drafted_tokens else 0.0,
        mean_tokens_per_round=stats.emitted_tokens / stats.sample_rounds if stats.sample_rounds else 0.0,
        draft_time_s=stats.draft_time_s,
        verify_time_s=stats.verify_time_s,
        coordinator_time_s=max(0.0, total_s - stats.draft_time_s - stats.verify_time_s),
        total_time_s=total_s,
        tokens_per_second=generated_tokens / total_s if total_s > 0 else 0.0,
        prompt_tokens=stats.prompt_tokens,
        generated_tokens=generated_tokens,
        recovered_tokens=stats.recovered_tokens,
        bonus_tokens=stats.bonus_tokens,
        draft_fallback_rounds=stats.draft_fallback_rounds,
    )
