"""specdec/rpc/wire.py: tensors, sampling, Propose / Verify messages and stats, through real serialisation."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from specdec.core.engine import Stats
from specdec.core.protocols import DraftProposal, DraftRequest, VerifyRequest, VerifyResult
from specdec.core.sampling import Sampling
from specdec.rpc import wire
from specdec.v1 import common_pb2, draft_pb2, target_pb2

RNG = np.random.default_rng(0)


def _over_the_wire(message):
    """What the other end parses: the message serialised and read back."""
    return type(message).FromString(message.SerializeToString())


def _probs(rows: int, vocab: int) -> np.ndarray:
    p = RNG.random((rows, vocab), dtype=np.float32) + np.float32(1e-7)
    return p / p.sum(axis=1, keepdims=True)


# ---------------------------------------------------------------- tensors


@pytest.mark.parametrize("shape", [(3, 7), (1, 1), (0, 5)])
def test_probs_round_trip_exactly_as_float32(shape):
    probs = _probs(*shape)
    probs[..., :1] = np.float32(1.0) / np.float32(3.0)  # a value with a full mantissa
    tensor = _over_the_wire(wire.encode_probs(probs))
    assert tensor.dtype == common_pb2.DTYPE_FLOAT32
    assert list(tensor.shape) == list(shape)
    decoded = wire.decode_probs(tensor)
    assert decoded.dtype == np.float32 and decoded.shape == shape
    assert np.array_equal(decoded, probs)
    assert not decoded.flags.writeable


def test_encode_probs_converts_float64_and_non_contiguous_input_to_float32():
    probs = _probs(4, 6).astype(np.float64).T  # [6, 4], Fortran order
    decoded = wire.decode_probs(wire.encode_probs(probs))
    assert decoded.dtype == np.float32
    assert np.array_equal(decoded, probs.astype(np.float32))


def _bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)


def _top_k_law(rows: int, vocab: int, k: int) -> np.ndarray:
    """[rows, vocab] float32 with k stored entries per row, as warping with top-k leaves a law."""
    probs = np.zeros((rows, vocab), np.float32)
    for row in range(rows):
        kept = RNG.choice(vocab, k, replace=False)
        probs[row, kept] = _probs(1, k)[0]
    return probs


def test_a_greedy_law_travels_as_its_one_stored_entry_per_row():
    probs = np.zeros((5, 1000), np.float32)
    probs[np.arange(5), [7, 0, 999, 7, 500]] = 1.0
    tensor = _over_the_wire(wire.encode_probs(probs))
    assert tensor.HasField("sparse") and len(tensor.data) == 5 * 4 and len(tensor.sparse.indices) == 5 * 4
    assert list(tensor.sparse.row_offsets) == [0, 1, 2, 3, 4, 5]
    decoded = wire.decode_probs(tensor)
    assert decoded.dtype == np.float32 and not decoded.flags.writeable
    assert np.array_equal(_bits(decoded), _bits(probs))


def test_a_sparse_law_decodes_bit_for_bit_including_odd_values():
    probs = _top_k_law(4, 512, 50)
    probs[0, 3] = np.float32(1.0) / np.float32(3.0)  # a full mantissa
    probs[1, 4] = np.float32(1e-45)  # the smallest subnormal
    probs[2, 5] = np.float32(-0.0)  # +0.0 is what is left out; -0.0 has a bit set and travels
    probs[2, 6] = np.float32("nan")
    probs[3, :] = 0.0  # a row with nothing stored
    tensor = _over_the_wire(wire.encode_probs(probs))
    assert tensor.HasField("sparse") and list(tensor.sparse.row_offsets)[-1] == np.count_nonzero(_bits(probs))
    assert np.array_equal(_bits(wire.decode_probs(tensor)), _bits(probs))


@pytest.mark.parametrize(
    ("probs", "sparse"),
    [
        (_probs(3, 64), False),  # no cut: every entry stored
        (_top_k_law(3, 64, 31), True),  # just under half: 8 bytes each still beats 4 x 64
        (_top_k_law(3, 64, 33), False),
        (np.zeros((0, 64), np.float32), False),
        (_probs(1, 1), False),
    ],
)
def test_the_encoder_picks_the_smaller_form(probs, sparse):
    tensor = wire.encode_probs(probs)
    assert tensor.HasField("sparse") == sparse
    assert tensor.ByteSize() <= wire.encode_probs(probs, allow_sparse=False).ByteSize()
    assert np.array_equal(_bits(wire.decode_probs(_over_the_wire(tensor))), _bits(probs))


def test_allow_sparse_false_always_sends_dense_bytes():
    probs = _top_k_law(2, 100, 3)
    tensor = wire.encode_probs(probs, allow_sparse=False)
    assert not tensor.HasField("sparse") and len(tensor.data) == probs.nbytes


def _sparse_tensor(shape, offsets, indices, values) -> common_pb2.ProbTensor:
    return common_pb2.ProbTensor(
        data=np.asarray(values, np.float32).tobytes(),
        shape=shape,
        dtype=common_pb2.DTYPE_FLOAT32,
        sparse=common_pb2.SparseRows(indices=np.asarray(indices, "<i4").tobytes(), row_offsets=offsets),
    )


@pytest.mark.parametrize(
    ("tensor", "words"),
    [
        (_sparse_tensor([2, 4, 1], [0, 1, 2], [0, 1], [0.5, 0.5]), "shape [rows, columns]"),
        (_sparse_tensor([2, 4], [0, 1], [0], [1.0]), "row_offsets must be 3"),
        (_sparse_tensor([2, 4], [1, 1, 2], [0, 1], [0.5, 0.5]), "row_offsets must be 3"),
        (_sparse_tensor([2, 4], [0, 2, 1], [0, 1], [0.5, 0.5]), "row_offsets must be 3"),
        (_sparse_tensor([2, 4], [0, 1, 2], [0, 1], [0.5]), "index and 4 value bytes"),
        (_sparse_tensor([2, 4], [0, 1, 2], [0], [0.5, 0.5]), "4 index and"),
        (_sparse_tensor([2, 4], [0, 1, 2], [0, 4], [0.5, 0.5]), "lie in [0, 4)"),
        (_sparse_tensor([2, 4], [0, 1, 2], [-1, 1], [0.5, 0.5]), "lie in [0, 4)"),
        (_sparse_tensor([1, 4], [0, 2], [2, 1], [0.5, 0.5]), "ascend within each row"),
        (_sparse_tensor([1, 4], [0, 2], [1, 1], [0.5, 0.5]), "ascend within each row"),
    ],
)
def test_malformed_sparse_tensors_are_value_errors(tensor, words):
    with pytest.raises(ValueError) as info:
        wire.decode_probs(_over_the_wire(tensor))
    assert words in str(info.value)


def test_hidden_states_travel_as_float16():
    hidden = RNG.standard_normal((5, 8)).astype(np.float32)
    tensor = _over_the_wire(wire.encode_hidden_states(hidden))
    assert tensor.dtype == common_pb2.DTYPE_FLOAT16
    assert len(tensor.data) == hidden.size * 2
    decoded = wire.decode_probs(tensor)
    assert decoded.dtype == np.float16 and decoded.shape == (5, 8)
    assert np.array_equal(decoded, hidden.astype(np.float16))


def test_float64_tensors_decode():
    values = np.array([[0.25, 0.75]], dtype="<f8")
    tensor = common_pb2.ProbTensor(data=values.tobytes(), shape=[1, 2], dtype=common_pb2.DTYPE_FLOAT64)
    decoded = wire.decode_probs(tensor)
    assert decoded.dtype == np.float64 and np.array_equal(decoded, values)


@pytest.mark.parametrize("dtype", [common_pb2.DTYPE_UNSPECIFIED, 99])
def test_decode_rejects_an_unknown_dtype(dtype):
    tensor = common_pb2.ProbTensor(data=b"\0" * 8, shape=[2], dtype=dtype)
    with pytest.raises(ValueError, match="unsupported probability dtype"):
        wire.decode_probs(tensor)


@pytest.mark.parametrize(
    ("nbytes", "shape"),
    [(11, [3]), (13, [3]), (0, [1, 1]), (12, [])],
    ids=["short", "long", "empty", "scalar-shape"],
)
def test_decode_rejects_a_byte_count_that_does_not_match_the_shape(nbytes, shape):
    tensor = common_pb2.ProbTensor(data=b"\0" * nbytes, shape=shape, dtype=common_pb2.DTYPE_FLOAT32)
    with pytest.raises(ValueError, match=f"has {nbytes} bytes"):
        wire.decode_probs(tensor)


# ---------------------------------------------------------------- sampling


def test_unset_sampling_params_mean_plain_sampling():
    assert wire.sampling_from_proto(common_pb2.SamplingParams()) == Sampling(temperature=1.0, top_k=0, top_p=1.0)


@pytest.mark.parametrize(
    "sampling", [Sampling(0.0), Sampling(0.5, top_k=40, top_p=0.75), Sampling(2.0, top_p=1.0), Sampling(1.0, top_k=1)]
)
def test_sampling_round_trips(sampling):
    params = _over_the_wire(wire.sampling_to_proto(sampling))
    assert params.HasField("temperature") and params.HasField("top_p")
    assert wire.sampling_from_proto(params) == sampling


def test_temperature_zero_stays_greedy_over_the_wire():
    assert wire.sampling_from_proto(_over_the_wire(wire.sampling_to_proto(Sampling(0.0)))).greedy


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": -0.5}, "temperature must be a finite number >= 0 (0 = greedy), got -0.5"),
        ({"temperature": math.inf}, "temperature must be a finite number >= 0"),
        ({"temperature": math.nan}, "temperature must be a finite number >= 0"),
        ({"top_k": -1}, "top_k must be >= 0 (0 = off), got -1"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": -0.5}, "top_p must be in (0, 1], got -0.5"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": math.nan}, "top_p must be in (0, 1]"),
    ],
)
def test_sampling_validation_messages(params, message):
    with pytest.raises(ValueError) as info:
        wire.sampling_from_proto(common_pb2.SamplingParams(**params))
    assert str(info.value).startswith(message)


# ---------------------------------------------------------------- Propose


def _draft_requests_from_proto(request: draft_pb2.ProposeRequest) -> list[DraftRequest]:
    """As the draft service reads them."""
    return [
        DraftRequest(
            seq.cache_key,
            list(seq.prefix_token_ids),
            seq.num_draft_tokens,
            seq.seed,
            wire.decode_probs(seq.target_hidden_states) if seq.HasField("target_hidden_states") else None,
            hidden_offset=seq.hidden_states_offset,
            hidden_key=seq.hidden_states_key,
        )
        for seq in request.sequences
    ]


def test_propose_request_carries_every_field():
    hidden = RNG.standard_normal((2, 4)).astype(np.float16)
    requests = [
        DraftRequest("cache-a", [1, 2, 3], 4, 2**64 - 1, hidden[1:], sequence=7, hidden_offset=1, hidden_key="g/7"),
        DraftRequest("", [5], 1, 0),
    ]
    sampling = Sampling(0.5, top_k=3, top_p=0.75)
    message = _over_the_wire(wire.propose_request(requests, sampling))

    assert wire.sampling_from_proto(message.sampling) == sampling
    first, second = _draft_requests_from_proto(message)
    assert (first.cache_key, first.prefix_token_ids, first.num_draft_tokens, first.seed) == (
        "cache-a",
        [1, 2, 3],
        4,
        2**64 - 1,
    )
    assert first.target_hidden.dtype == np.float16 and np.array_equal(first.target_hidden, hidden[1:])
    assert (first.hidden_offset, first.hidden_key) == (1, "g/7")
    assert first.sequence == 0  # never sent
    assert second == DraftRequest("", [5], 1, 0, None)
    assert not message.sequences[1].HasField("target_hidden_states")


def test_proposals_round_trip():
    proposals = [
        DraftProposal([4, 0, 2], _probs(3, 6), cached_tokens=9),
        DraftProposal([], np.zeros((0, 6), dtype=np.float32)),
    ]
    decoded = wire.proposals_from_proto(_over_the_wire(wire.propose_response(proposals)))
    assert len(decoded) == 2
    for got, sent in zip(decoded, proposals, strict=True):
        assert got.draft_token_ids == sent.draft_token_ids
        assert got.cached_tokens == sent.cached_tokens
        assert got.draft_probs.shape == sent.draft_probs.shape
        assert np.array_equal(got.draft_probs, sent.draft_probs)


def test_point_mass_proposals_travel_as_token_ids_alone():
    proposals = [
        DraftProposal([4, 0, 2], None, cached_tokens=3, point_mass=True),
        DraftProposal([], None, point_mass=True),
        DraftProposal([1], _probs(1, 6)),
    ]
    message = _over_the_wire(wire.propose_response(proposals))
    assert message.proposals[0].point_mass and not message.proposals[0].HasField("draft_probs")
    assert not message.proposals[2].point_mass and message.proposals[2].HasField("draft_probs")
    decoded = wire.proposals_from_proto(message)
    assert decoded[:2] == proposals[:2]
    assert not decoded[2].point_mass and np.array_equal(decoded[2].draft_probs, proposals[2].draft_probs)


def test_proposals_with_a_broken_tensor_are_a_value_error():
    response = wire.propose_response([DraftProposal([1], _probs(1, 4))])
    response.proposals[0].draft_probs.shape[:] = [1, 5]
    with pytest.raises(ValueError, match="bytes"):
        wire.proposals_from_proto(response)


# ---------------------------------------------------------------- Verify


def _verify_requests_from_proto(request: target_pb2.VerifyRequest) -> list[VerifyRequest]:
    """As the target service reads them (a target with a lookup draft, vocabulary 100)."""
    from target_service.server import _rounds_of

    return [
        VerifyRequest(
            seq.cache_key,
            list(seq.prefix_token_ids),
            list(seq.draft_token_ids),
            seq.hidden_states_from if seq.HasField("hidden_states_from") else None,
            **_rounds_of(seq, 100, 8),
        )
        for seq in request.sequences
    ]


def test_verify_request_carries_every_field_and_tells_hidden_from_0_from_unset():
    requests = [
        VerifyRequest("cache-b", [1, 2, 3], [4, 5], hidden_from=0, sequence=3),
        VerifyRequest("", [1], [], hidden_from=None),
        VerifyRequest("c", [1, 2], [7], hidden_from=1),
        VerifyRequest("d", [1, 2], [], decode_uniforms=(0.25, 0.5), stop_token_ids=frozenset({3}), stop_ngram=2),
        VerifyRequest("e", [1, 2], [], decode_uniforms=(0.25, 0.5, 0.75) * 2, lookup_k=2, max_tokens=5),
        VerifyRequest("f", [1, 2], [], decode_uniforms=(0.25, 0.5, 0.75), lookup_k=2, lookup_acceptance=(0.75, 0.5)),
    ]
    sampling = Sampling(0.0, top_k=0, top_p=0.5)
    message = _over_the_wire(wire.verify_request(requests, sampling))

    assert wire.sampling_from_proto(message.sampling) == sampling
    assert [s.HasField("hidden_states_from") for s in message.sequences] == [True, False, True] + [False] * 3
    assert _verify_requests_from_proto(message) == [
        VerifyRequest("cache-b", [1, 2, 3], [4, 5], 0),
        VerifyRequest("", [1], [], None),
        VerifyRequest("c", [1, 2], [7], 1),
        VerifyRequest("d", [1, 2], [], None, 0, (0.25, 0.5), frozenset({3}), 2),
        VerifyRequest("e", [1, 2], [], None, 0, (0.25, 0.5, 0.75) * 2, frozenset(), 0, 2, 5),
        VerifyRequest("f", [1, 2], [], None, 0, (0.25, 0.5, 0.75), frozenset(), 0, 2, 0, (0.75, 0.5)),
    ]
    assert _verify_requests_from_proto(message)[-2].rounds == 2


def test_lookup_rounds_come_back_with_their_counts_and_a_mismatch_is_refused():
    no_laws = np.empty((0, 0), np.float32)
    results = [VerifyResult(no_laws, 3, decoded_token_ids=(4, 5, 6), round_drafts=((2, 1), (0, 0)))]
    message = _over_the_wire(wire.verify_response(results))
    (back,) = wire.verify_results_from_proto(message)
    assert back.decoded_token_ids == (4, 5, 6) and back.round_drafts == ((2, 1), (0, 0))
    del message.verifications[0].round_accepted[1]
    with pytest.raises(ValueError, match="round_drafted"):
        wire.verify_results_from_proto(message)
    # What the lookup proposed, where a shared step verified fewer: one per round, or none.
    cut = [VerifyResult(no_laws, 3, decoded_token_ids=(4, 5), round_drafts=((1, 1),), round_proposed=(3,))]
    message = _over_the_wire(wire.verify_response(cut))
    (back,) = wire.verify_results_from_proto(message)
    assert back.round_drafts == ((1, 1),) and back.round_proposed == (3,)
    message.verifications[0].round_proposed.append(2)
    with pytest.raises(ValueError, match="round_proposed"):
        wire.verify_results_from_proto(message)
    # Each round's seconds in the target: one per round, or none.
    timed = [VerifyResult(no_laws, 3, decoded_token_ids=(4, 5), round_drafts=((1, 1),), round_seconds=(0.25,))]
    message = _over_the_wire(wire.verify_response(timed))
    (back,) = wire.verify_results_from_proto(message)
    assert back.round_seconds == (0.25,) and back.round_proposed == ()
    message.verifications[0].round_seconds.append(0.5)
    with pytest.raises(ValueError, match="round_seconds"):
        wire.verify_results_from_proto(message)


def test_verify_results_round_trip_with_and_without_hidden_states():
    hidden = RNG.standard_normal((4, 8)).astype(np.float32)
    step = {"step_sequences": 7, "step_rows": 12}
    results = [VerifyResult(_probs(3, 6), cached_tokens=5, hidden=hidden, **step), VerifyResult(_probs(1, 6))]
    first, second = wire.verify_results_from_proto(_over_the_wire(wire.verify_response(results)))
    assert (first.step_rows, second.step_rows) == (12, 0)

    assert np.array_equal(first.target_probs, results[0].target_probs) and first.target_probs.dtype == np.float32
    assert first.cached_tokens == 5 and (first.step_sequences, second.step_sequences) == (7, 1)
    assert first.hidden.dtype == np.float16 and np.array_equal(first.hidden, hidden.astype(np.float16))
    assert np.array_equal(second.target_probs, results[1].target_probs)
    assert second.cached_tokens == 0 and second.hidden is None


def test_an_empty_hidden_state_block_is_not_none():
    (result,) = wire.verify_results_from_proto(
        _over_the_wire(wire.verify_response([VerifyResult(_probs(1, 4), hidden=np.zeros((0, 8), np.float32))]))
    )
    assert result.hidden is not None and result.hidden.shape == (0, 8)


def test_verify_results_with_a_broken_tensor_are_a_value_error():
    response = wire.verify_response([VerifyResult(_probs(2, 4), hidden=np.zeros((2, 3), np.float32))])
    response.verifications[0].hidden_states.dtype = common_pb2.DTYPE_FLOAT32  # 2-byte values read as 4-byte
    with pytest.raises(ValueError, match="bytes"):
        wire.verify_results_from_proto(response)


# ---------------------------------------------------------------- stats


def test_stats_to_proto():
    stats = Stats(
        rounds=3,
        sample_rounds=6,
        drafted_tokens=12,
        accepted_tokens=9,
        recovered_tokens=2,
        bonus_tokens=4,
        emitted_tokens=15,
        draft_time_s=0.5,
        verify_time_s=1.0,
        prompt_tokens=11,
        started=time.perf_counter() - 2.0,
    )
    proto = wire.stats_to_proto(stats, generated_tokens=15)

    assert (proto.rounds, proto.drafted_tokens, proto.accepted_tokens) == (3, 12, 9)
    assert (proto.recovered_tokens, proto.bonus_tokens, proto.prompt_tokens, proto.generated_tokens) == (2, 4, 11, 15)
    assert proto.acceptance_rate == pytest.approx(0.75)
    assert proto.mean_tokens_per_round == pytest.approx(15 / 6)  # per sample round, not per batch round
    assert (proto.draft_time_s, proto.verify_time_s) == (0.5, 1.0)
    assert proto.total_time_s == pytest.approx(2.0, abs=0.5)
    assert proto.coordinator_time_s == pytest.approx(proto.total_time_s - 1.5)
    assert proto.tokens_per_second == pytest.approx(15 / proto.total_time_s)


def test_stats_to_proto_with_nothing_drafted_or_run():
    proto = wire.stats_to_proto(Stats(), generated_tokens=0)
    assert proto.acceptance_rate == 0.0
    assert proto.mean_tokens_per_round == 0.0
    assert proto.tokens_per_second == 0.0

    no_drafts = wire.stats_to_proto(Stats(rounds=2, sample_rounds=2, emitted_tokens=2), generated_tokens=2)
    assert no_drafts.acceptance_rate == 0.0
    assert no_drafts.mean_tokens_per_round == 1.0


def test_coordinator_time_is_never_negative():
    stats = Stats(draft_time_s=5.0, verify_time_s=5.0, started=time.perf_counter() - 1.0)
    assert wire.stats_to_proto(stats, generated_tokens=1).coordinator_time_s == 0.0


def test_propose_and_verify_responses_carry_warped_laws_sparsely_and_exactly():
    draft, target = _top_k_law(4, 2048, 50), _top_k_law(5, 2048, 50)
    proposals = wire.proposals_from_proto(
        _over_the_wire(wire.propose_response([DraftProposal([1, 2, 3, 4], draft, cached_tokens=3)]))
    )
    response = _over_the_wire(wire.verify_response([VerifyResult(target, 3)]))
    assert response.verifications[0].target_probs.HasField("sparse")
    assert response.ByteSize() < target.nbytes / 4
    (result,) = wire.verify_results_from_proto(response)
    assert np.array_equal(_bits(proposals[0].draft_probs), _bits(draft))
    assert np.array_equal(_bits(result.target_probs), _bits(target))
