"""specdec/rpc/wire.py, decoding side: a response whose tensors do not fit is a ValueError that
names what is wrong (the pool clients turn it into a status), never a crash further on."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.rpc import wire
from specdec.v1 import common_pb2, draft_pb2, target_pb2


def _laws(rows: int, vocab: int = 4) -> np.ndarray:
    return np.full((rows, vocab), 1.0 / vocab, np.float32)


def test_negative_and_huge_shapes_are_refused():
    with pytest.raises(ValueError, match="negative"):
        wire.decode_probs(common_pb2.ProbTensor(data=b"\0" * 16, shape=[-2, -2], dtype=common_pb2.DTYPE_FLOAT32))
    # (2^16)^4 entries wrap a 64-bit product to 0 bytes: Python ints do not.
    with pytest.raises(ValueError, match="bytes"):
        wire.decode_probs(common_pb2.ProbTensor(data=b"", shape=[1 << 16] * 4, dtype=common_pb2.DTYPE_FLOAT32))


def test_a_proposal_needs_one_law_per_drafted_token():
    ok = draft_pb2.Proposal(draft_token_ids=[1, 2], draft_probs=wire.encode_probs(_laws(2)))
    assert wire.proposals_from_proto(draft_pb2.ProposeResponse(proposals=[ok]))[0].draft_probs.shape == (2, 4)
    for probs in (_laws(3), _laws(2).reshape(-1), _laws(2)[:, :0]):
        bad = draft_pb2.Proposal(draft_token_ids=[1, 2], draft_probs=wire.encode_probs(probs))
        with pytest.raises(ValueError, match="draft_probs has shape"):
            wire.proposals_from_proto(draft_pb2.ProposeResponse(proposals=[bad]))


def test_a_verification_needs_2d_laws_and_2d_hidden_states():
    def response(probs, hidden=None):
        v = target_pb2.Verification(target_probs=wire.encode_probs(probs))
        if hidden is not None:
            v.hidden_states.CopyFrom(wire.encode_hidden_states(hidden))
        return target_pb2.VerifyResponse(verifications=[v])

    assert wire.verify_results_from_proto(response(_laws(2), np.zeros((3, 8))))[0].hidden.shape == (3, 8)
    for probs in (_laws(2).reshape(-1), _laws(0), _laws(2)[:, :0]):
        with pytest.raises(ValueError, match="target_probs has shape"):
            wire.verify_results_from_proto(response(probs))
    with pytest.raises(ValueError, match="hidden_states has shape"):
        wire.verify_results_from_proto(response(_laws(2), np.zeros(8)))
