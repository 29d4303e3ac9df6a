"""A GenerateRequest, checked and turned into tokens: what the coordinator accepts and why not."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.settings import CoordinatorSettings
from specdec.core.errors import InvalidArgument
from specdec.core.sampling import Sampling
from specdec.rpc.wire import sampling_from_proto
from specdec.v1 import coordinator_pb2


@dataclass(frozen=True)
class RequestParams:
    """The numbers of a request, validated, with the settings' defaults filled in."""

    sampling: Sampling
    max_new_tokens: int
    num_speculative_tokens: int  # with auto_k, the largest K a round may draft
    num_samples: int
    auto_k: bool = False  # K chosen per round (the request left it unset and the default is auto)


def validate_session_id(session_id: str) -> None:
    if not session_id:
        raise InvalidArgument("session_id is empty")
    if len(session_id) > 128 or not session_id.isprintable() or any(c.isspace() for c in session_id):
        raise InvalidArgument("session_id must be 1-128 printable characters without spaces")


def _in_range(name: str, value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise InvalidArgument(f"{name} must be in [{low}, {high}], got {value}")
    return value


def validate_request(
    request: coordinator_pb2.GenerateRequest, settings: CoordinatorSettings, streaming: bool
) -> RequestParams:
    s = settings
    try:
        sampling = sampling_from_proto(request.sampling)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    max_new = request.max_new_tokens if request.HasField("max_new_tokens") else s.default_max_new_tokens
    _in_range("max_new_tokens", max_new, 1, s.max_new_tokens_limit)
    auto_k = False
    if request.HasField("num_speculative_tokens"):
        k = _in_range("num_speculative_tokens", request.num_speculative_tokens, 0, s.max_num_speculative_tokens)
    else:
        default = s.default_k()
        auto_k = default is None
        k = s.max_num_speculative_tokens if auto_k else default
    num_samples = request.num_samples or 1
    if not 1 <= num_samples <= s.max_num_samples:
        raise InvalidArgument(f"num_samples must be in [1, {s.max_num_samples}], got {request.num_samples}")
    if num_samples > 1 and request.session_id:
        raise InvalidArgument("num_samples > 1 cannot continue a session")
    if num_samples > 1 and streaming:
        raise InvalidArgument("GenerateStream serves one sample; use Generate for num_samples > 1")
    if request.prompt and request.prompt_token_ids:
        raise InvalidArgument("set prompt or prompt_token_ids, not both")
    if request.chat and request.prompt_token_ids:
        raise InvalidArgument("chat applies to a text prompt, not to prompt_token_ids")
    if any(not stop for stop in request.stop):
        raise InvalidArgument("stop strings must be non-empty")
    if request.session_id:
        validate_session_id(request.session_id)
    return RequestParams(sampling, max_new, k, num_samples, auto_k=auto_k and k > 0)


def chat_turn_text(tokenizer, prompt: str, continuing: bool) -> str:
    """The chat-template text of one user turn, ending with the assistant's generation prompt.

    A first turn is the whole template (with any default system prompt). A follow-up turn in a
    session is what the template adds after an earlier exchange, so the system prompt and BOS
    are not repeated; templates that are not prefix-stable fall back to the first-turn form.
    """
    user = {"role": "user", "content": prompt}
    if continuing:
        earlier = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
        before = tokenizer.apply_chat_template(earlier, tokenize=False)
        after = tokenizer.apply_chat_template([*earlier, user], add_generation_prompt=True, tokenize=False)
        if after.startswith(before):
            return after[len(before) :]
    return tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=False)


def prompt_token_ids(
    tokenizer, request: coordinator_pb2.GenerateRequest, has_history: bool, vocab_size: int
) -> list[int]:
    if request.prompt_token_ids:
        ids = list(request.prompt_token_ids)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(f"prompt_token_ids contains {bad[0]}, outside [0, {vocab_size})")
        return ids
    if not request.prompt:
        return []
    if request.chat:
        rendered = chat_turn_text(tokenizer, request.prompt, continuing=has_history)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    # A continued session already has its BOS.
    return tokenizer(request.prompt, add_special_tokens=not has_history)["input_ids"]
