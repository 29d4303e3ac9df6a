"""What one round's probability laws cost on the wire: bytes and milliseconds, no model.

A round moves the draft's laws q_1..q_K ([K, V] float32, in the Propose response) and the target's
p_1..p_{K+1} ([K + 1, V], in the Verify response). This serves both from a gRPC server on loopback
that answers with laws built beforehand, as warping leaves them (no cut, top-k, top-p, greedy), and
measures per round, median over --repeats:

  bytes      both responses serialised
  encode     the services' side: ProbTensor from the arrays (`wire.encode_probs`) + SerializeToString
  decode     the coordinator's side: ParseFromString + `wire.decode_probs` back to [N, V] arrays
  round      a Propose and a Verify call over loopback gRPC, then the decode: what the coordinator
             waits per round beyond the two models (the server encodes inside the call); also
             the fastest of the rounds (round_min), steadier on a machine shared with other work

The first row, law `none`, is an empty round (a [1, 1] law each way): the two calls' own cost.

for each encoding: `dense` (every float, what the wire sent before sparse laws) and `auto` (the
encoder's choice: `SparseRows` when smaller). Both decode to the identical float32 arrays (checked).

  python scripts/transport_bench.py                         V = 49152 and 262144, K = 1..8, all laws
  python scripts/transport_bench.py --vocab 49152 --ks 4 --laws top_k=50 --repeats 50
  python scripts/transport_bench.py --json                  one JSON object per row
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent import futures

import grpc
import numpy as np
import torch

from specdec.core.sampling import Sampling
from specdec.models.warping import to_wire, warp_logits
from specdec.rpc import wire
from specdec.rpc.server import grpc_message_options
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

LAWS = {"T=1": Sampling(1.0), "top_k=50": Sampling(1.0, top_k=50), "top_p=0.9": Sampling(1.0, top_p=0.9)}
LAWS["greedy"] = Sampling(0.0)
PREFIX = list(range(256))  # token ids each request carries (a 256-token context)


def warped_laws(sampling: Sampling, rows: int, vocab: int, seed: int) -> np.ndarray:
    """[rows, vocab] float32 laws warped from LM-like logits: Zipf-shaped (logit -1.2 ln rank over a
    random order of the vocabulary) plus noise, so top-p keeps a realistic head."""
    rng = np.random.default_rng(seed)
    rank = np.stack([rng.permutation(vocab) + 1 for _ in range(rows)])  # [rows, vocab]
    logits = -1.2 * np.log(rank) + 0.3 * rng.standard_normal((rows, vocab))
    return to_wire(warp_logits(torch.from_numpy(logits), sampling))


class LawServer(draft_pb2_grpc.DraftServiceServicer, target_pb2_grpc.TargetServiceServicer):
    """Answers Propose with `draft` and Verify with `target`, encoded per call as the services do."""

    def __init__(self):
        self.draft = self.target = np.zeros((1, 1), np.float32)
        self.allow_sparse = True

    def Propose(self, request, context):
        return draft_response(self.draft, self.allow_sparse)

    def Verify(self, request, context):
        return verify_response(self.target, self.allow_sparse)


def draft_response(laws: np.ndarray, allow_sparse: bool) -> draft_pb2.ProposeResponse:
    probs = wire.encode_probs(laws, allow_sparse)
    return draft_pb2.ProposeResponse(
        proposals=[draft_pb2.Proposal(draft_token_ids=[1] * laws.shape[0], draft_probs=probs)]
    )


def verify_response(laws: np.ndarray, allow_sparse: bool) -> target_pb2.VerifyResponse:
    probs = wire.encode_probs(laws, allow_sparse)
    return target_pb2.VerifyResponse(verifications=[target_pb2.Verification(target_probs=probs)])


def decoded(propose: draft_pb2.ProposeResponse, verify: target_pb2.VerifyResponse) -> list[np.ndarray]:
    return [
        wire.decode_probs(propose.proposals[0].draft_probs),
        wire.decode_probs(verify.verifications[0].target_probs),
    ]


def serve(servicer: LawServer) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=grpc_message_options(256))
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _timings_ms(fn, repeats: int) -> list[float]:
    fn()  # warm: first-call allocations and connection set-up are not per-round costs
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - started))
    return times


def _median_ms(fn, repeats: int) -> float:
    return statistics.median(_timings_ms(fn, repeats))


def measure(servicer: LawServer, stubs, draft: np.ndarray, target: np.ndarray, allow_sparse: bool, repeats: int):
    """One row: bytes, and median encode / decode / round milliseconds of one round."""
    servicer.draft, servicer.target, servicer.allow_sparse = draft, target, allow_sparse
    propose_stub, verify_stub = stubs
    propose = draft_response(draft, allow_sparse)
    verify = verify_response(target, allow_sparse)
    blobs = (propose.SerializeToString(), verify.SerializeToString())
    for got, sent in zip(decoded(propose, verify), (draft, target), strict=True):
        assert np.array_equal(got.view(np.uint32), sent.view(np.uint32)), "decoding changed a law"

    def encode():
        draft_response(draft, allow_sparse).SerializeToString()
        verify_response(target, allow_sparse).SerializeToString()

    def decode():
        decoded(draft_pb2.ProposeResponse.FromString(blobs[0]), target_pb2.VerifyResponse.FromString(blobs[1]))

    propose_request = draft_pb2.ProposeRequest(sequences=[draft_pb2.DraftSequence(prefix_token_ids=PREFIX)])
    verify_request = target_pb2.VerifyRequest(sequences=[target_pb2.VerifySequence(prefix_token_ids=PREFIX)])

    def round_trip():
        decoded(propose_stub(propose_request, timeout=60), verify_stub(verify_request, timeout=60))

    rounds = _timings_ms(round_trip, repeats)
    return {
        "bytes": sum(len(b) for b in blobs),
        "encode_ms": _median_ms(encode, repeats),
        "decode_ms": _median_ms(decode, repeats),
        "round_ms": statistics.median(rounds),
        # On a machine shared with other work the fastest round is the steadier figure.
        "round_min_ms": min(rounds),
        "sparse": propose.proposals[0].draft_probs.HasField("sparse"),
    }


def rows(args, servicer: LawServer, stubs):
    """An empty round first (two calls with a [1, 1] law: the calls' own cost), then every
    (V, K, law, encoding) row, laws built once per (V, law) at the largest K."""
    empty = np.ones((1, 1), np.float32)
    yield {"vocab": 1, "k": 0, "law": "none", "stored_per_row": 1, "encoding": "dense"} | measure(
        servicer, stubs, empty, empty, False, args.repeats
    )
    for vocab in args.vocab:
        for law in args.laws:
            biggest = max(args.ks)
            laws = warped_laws(LAWS[law], 2 * biggest + 1, vocab, seed=vocab)  # draft rows, then target rows
            stored = int(np.count_nonzero(laws.view(np.uint32))) / laws.shape[0]
            for k in args.ks:
                draft, target = laws[:k], laws[biggest : biggest + k + 1]
                for encoding in args.encodings:
                    row = measure(servicer, stubs, draft, target, encoding == "auto", args.repeats)
                    yield {"vocab": vocab, "k": k, "law": law, "stored_per_row": stored, "encoding": encoding, **row}


def _table_line(row: dict) -> str:
    sent = "sparse" if row["sparse"] else "dense"
    return (
        f"{row['vocab']:>7} {row['k']:>2} {row['law']:>10} {row['stored_per_row']:>9.0f} {row['encoding']:>6} "
        f"{sent:>6} {row['bytes'] / 1024:>10.1f} {row['encode_ms']:>8.2f} {row['decode_ms']:>8.2f} "
        f"{row['round_ms']:>8.2f} {row['round_min_ms']:>9.2f}"
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: [int(x) for x in text.split(",")]
    parser.add_argument("--vocab", type=ints, default=[49152, 262144], help="vocabulary sizes (comma list)")
    parser.add_argument("--ks", type=ints, default=list(range(1, 9)), help="draft lengths K (comma list)")
    parser.add_argument("--laws", type=lambda t: t.split(","), default=list(LAWS), help=f"of {list(LAWS)}")
    parser.add_argument("--encodings", type=lambda t: t.split(","), default=["dense", "auto"])
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds per row (median)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args(argv)
    unknown = [law for law in args.laws if law not in LAWS] + [e for e in args.encodings if e not in ("dense", "auto")]
    if unknown:
        parser.error(f"unknown laws or encodings: {unknown}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    servicer = LawServer()
    server, port = serve(servicer)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=grpc_message_options(256))
    stubs = (draft_pb2_grpc.DraftServiceStub(channel).Propose, target_pb2_grpc.TargetServiceStub(channel).Verify)
    if not args.json:
        print("  vocab  K        law stored/row    enc   sent   KiB/round encode_ms decode_ms round_ms round_min")
    try:
        for row in rows(args, servicer, stubs):
            print(json.dumps(row) if args.json else _table_line(row), flush=True)
    finally:
        channel.close()
        server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
