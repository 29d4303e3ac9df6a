"""A small Python client of the coordinator."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Self

import grpc

from specdec.rpc.tls import channel_credentials
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

FINISH_REASONS = {
    coordinator_pb2.FINISH_REASON_UNSPECIFIED: "unspecified",
    coordinator_pb2.FINISH_REASON_LENGTH: "length",
    coordinator_pb2.FINISH_REASON_EOS: "eos",
    coordinator_pb2.FINISH_REASON_STOP: "stop",
}


def build_request(
    prompt: str | Sequence[int],
    *,
    session_id: str = "",
    max_new_tokens: int | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    num_speculative_tokens: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    chat: bool = False,
    num_samples: int = 1,
) -> coordinator_pb2.GenerateRequest:
    """A GenerateRequest from keyword arguments; a str prompt is text, a sequence of ints is token ids."""
    request = coordinator_pb2.GenerateRequest(
        session_id=session_id,
        sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
        stop=list(stop),
        ignore_eos=ignore_eos,
        chat=chat,
        num_samples=num_samples,
    )
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(int(t) for t in prompt)
    if max_new_tokens is not None:
        request.max_new_tokens = max_new_tokens
    if seed is not None:
        request.seed = seed
    if num_speculative_tokens is not None:
        request.num_speculative_tokens = num_speculative_tokens
    return request


def reassembled(held: Sequence[int], chunks) -> list[int]:
    """The generation's tokens once a (resumed) stream's chunks are placed at their token_offset
    after the `held` ones: a resumed stream may send stored tokens again, or restart before the
    end of `held` (those were never stored)."""
    tokens = list(held)
    for chunk in chunks:
        tokens[chunk.token_offset :] = chunk.token_ids
    return tokens


class SpecdecClient:
    """Generate / stream / manage sessions on a coordinator.

    TLS when `tls` is set or a CA file is given (`tls_ca_file`: the CA of the coordinator's
    certificate, empty = the system's roots; `tls_cert_file` + `tls_key_file`: a client certificate
    for mutual TLS). `api_key` is sent as `authorization: Bearer <key>` on every call.

    >>> with SpecdecClient("localhost:50051") as client:
    ...     response = client.generate("Hello", max_new_tokens=16, seed=1)
    ...     print(response.completions[0].text)
    """

    def __init__(
        self,
        address: str = "localhost:50051",
        timeout_s: float | None = 600.0,
        max_message_mb: int = 256,
        *,
        api_key: str = "",
        tls: bool = False,
        tls_ca_file: str = "",
        tls_cert_file: str = "",
        tls_key_file: str = "",
    ):
        size = max_message_mb * 1024 * 1024
        options = [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)]
        if tls or tls_ca_file or tls_cert_file:
            credentials = channel_credentials(tls_ca_file, tls_cert_file, tls_key_file)
            self.channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def _call(self, method, request):
        return method(request, timeout=self.timeout_s, metadata=self.metadata)

    def generate(self, prompt: str | Sequence[int], **kwargs) -> coordinator_pb2.GenerateResponse:
        return self._call(self.stub.Generate, build_request(prompt, **kwargs))

    def stream(self, prompt: str | Sequence[int], **kwargs) -> Iterator[coordinator_pb2.GenerateChunk]:
        return self._call(self.stub.GenerateStream, build_request(prompt, **kwargs))

    def resume(self, session_id: str, received_tokens: int | None = None) -> Iterator[coordinator_pb2.GenerateChunk]:
        """Stream the rest of the session's interrupted generation (README "Sessions"); given how
        many of its tokens were received, first those stored but never received."""
        request = coordinator_pb2.GenerateRequest(session_id=session_id, resume=True, received_tokens=received_tokens)
        return self._call(self.stub.GenerateStream, request)

    def get_session(self, session_id: str) -> coordinator_pb2.Session:
        return self._call(self.stub.GetSession, coordinator_pb2.GetSessionRequest(session_id=session_id))

    def delete_session(self, session_id: str) -> bool:
        return self._call(self.stub.DeleteSession, coordinator_pb2.DeleteSessionRequest(session_id=session_id)).deleted
