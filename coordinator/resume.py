"""What a session keeps of a stream in progress, so that `resume` can finish it after an interruption.

The record holds what the request fixed (seed, sampling, stops, K, the token budget) and how far
it got (tokens generated, the next round's index). Resuming rebuilds the sample exactly as the
interrupted call held it when it last saved, and runs the engine from that round: every round's
randomness derives from (seed, sample, round), so a resumed seeded stream with a fixed K gives
the very tokens the uninterrupted one would have, and its law is the target's for any K policy.
"""

from __future__ import annotations

from dataclasses import replace

from specdec.core.engine import GenerationSpec, Sample
from specdec.core.errors import FailedPrecondition, InvalidArgument
from specdec.core.sampling import Sampling
from specdec.v1 import coordinator_pb2

_VERSION = 1
# The fields a resume request may set.
_ALLOWED = {"session_id", "resume", "received_tokens"}


def generation_record(spec: GenerationSpec, sample: Sample, next_round: int) -> dict | None:
    """The JSON-able record of `sample`'s generation after a round; None once it has finished."""
    if not sample.running:
        return None
    return {
        "v": _VERSION,
        "seed": spec.seed,
        "max_new_tokens": spec.max_new_tokens,
        "generated": len(sample.generated),
        "round": next_round,
        "sampling": [spec.sampling.temperature, spec.sampling.top_k, spec.sampling.top_p],
        "stop": list(spec.stop),
        "eos": sorted(spec.eos_token_ids),
        "k": spec.num_speculative_tokens,
        "auto_k": spec.auto_k,
    }


def check_resume_request(request: coordinator_pb2.GenerateRequest, streaming: bool) -> None:
    """InvalidArgument unless the request names a session and sets nothing else (but what the
    client received, on a stream): a resumed generation keeps every parameter of the one it
    finishes."""
    if not request.session_id:
        raise InvalidArgument("resume needs the session_id of the interrupted generation")
    extra = sorted(field.name for field, _ in request.ListFields() if field.name not in _ALLOWED)
    if extra:
        raise InvalidArgument(f"resume continues the interrupted request as it was: leave {', '.join(extra)} unset")
    if request.HasField("received_tokens"):
        if not streaming:
            raise InvalidArgument("received_tokens applies to a resumed GenerateStream (its chunks say where they go)")
        if request.received_tokens < 0:
            raise InvalidArgument(f"received_tokens must be >= 0, got {request.received_tokens}")


def tokens_held(request: coordinator_pb2.GenerateRequest, stored: int) -> int:
    """How many of the `stored` tokens of the interrupted generation the client holds: the resumed
    stream sends the rest again. A client holding more than was stored drops the excess (the
    chunks' token_offset tells it), since the stream generates those again."""
    return min(request.received_tokens, stored) if request.HasField("received_tokens") else stored


def resumable_tokens(record: dict | None) -> int:
    """Tokens a resume would still generate (0: nothing to resume)."""
    return 0 if not record else max(0, record["max_new_tokens"] - record["generated"])


def resumed(record: dict | None, token_ids: list[int], spec: GenerationSpec) -> tuple[GenerationSpec, Sample, int]:
    """(spec, sample, first round) continuing the interrupted generation of a session's `token_ids`.

    `spec` is a fresh request's spec for this context (pool limits, cache key); the record's
    parameters replace its request ones."""
    if not resumable_tokens(record):
        raise FailedPrecondition("this session has no interrupted generation to resume")
    if record.get("v") != _VERSION:
        raise FailedPrecondition(f"this session's generation record has version {record.get('v')}, not {_VERSION}")
    temperature, top_k, top_p = record["sampling"]
    spec = replace(
        spec,
        seed=record["seed"],
        max_new_tokens=record["max_new_tokens"],
        sampling=Sampling(temperature, top_k, top_p),
        stop=tuple(record["stop"]),
        eos_token_ids=frozenset(record["eos"]),
        num_speculative_tokens=record["k"],
        auto_k=record["auto_k"],
    )
    count = record["generated"]
    sample = Sample(index=0, context=list(token_ids), generated=list(token_ids[len(token_ids) - count :]))
    return spec, sample, record["round"]
