"""A GenerateRequest, checked and turned into tokens: what the coordinator accepts and why not."""

from __future__ import annotations

import re
from dataclasses import dataclass

from jinja2 import TemplateError

from coordinator.settings import CoordinatorSettings
from specdec.core.errors import FailedPrecondition, InvalidArgument
from specdec.core.sampling import Sampling
from specdec.rpc.wire import sampling_from_proto
from specdec.settings import env_vars, flags
from specdec.v1 import coordinator_pb2

# Exactly what SessionStore.new_session_id issues (uuid4().hex): nothing else names a session,
# so an id can never reach another Redis key (`<id>:lock`) or carry megabytes.
_SESSION_ID = re.compile(r"[0-9a-f]{32}")
# Bytes a prompt token id counts for against max_prompt_bytes (an int32 on the wire).
TOKEN_ID_BYTES = 4
# The roles a `messages` conversation may use (what chat templates know; tools are not served).
CHAT_ROLES = ("system", "user", "assistant")


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
    if not _SESSION_ID.fullmatch(session_id):
        # Not echoed: it may be long, and it is not one of ours.
        raise InvalidArgument(
            f"session_id ({len(session_id)} characters) is not one this coordinator issues: "
            "sessions are named by 32 lowercase hex digits"
        )


def _raise_with(name: str) -> str:
    """How an operator raises the limit `name` (a CoordinatorSettings field)."""
    return f"{name}: raise it with {flags(CoordinatorSettings)[name]} / {env_vars(CoordinatorSettings)[name]}"


def _check_limit(what: str, value: int, name: str, settings: CoordinatorSettings) -> None:
    """INVALID_ARGUMENT naming the limit and the setting (flag and env var) that raises it."""
    limit = getattr(settings, name)
    if value > limit:
        raise InvalidArgument(f"{what} is {value}, over the limit of {limit} ({_raise_with(name)})")


def _in_range(name: str, value: int, low: int, high: int, limit: str = "") -> int:
    """`value`; INVALID_ARGUMENT outside [low, high] (naming the setting `limit` that sets high)."""
    if not low <= value <= high:
        hint = f" ({_raise_with(limit)})" if limit else ""
        raise InvalidArgument(f"{name} must be in [{low}, {high}], got {value}{hint}")
    return value


def _text_bytes(text: str, limit: int) -> int:
    """UTF-8 bytes of `text`; one certainly under `limit` (a character is at most 4 bytes) is not encoded."""
    if TOKEN_ID_BYTES * len(text) <= limit:
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def prompt_bytes(request: coordinator_pb2.GenerateRequest, limit: int) -> int:
    """The prompt's size as counted against max_prompt_bytes: UTF-8 bytes of the text (of every
    message's role and content), 4 per token id."""
    if request.prompt_token_ids:
        return TOKEN_ID_BYTES * len(request.prompt_token_ids)
    if request.messages:
        return sum(_text_bytes(m.role, limit) + _text_bytes(m.content, limit) for m in request.messages)
    return _text_bytes(request.prompt, limit)


def _check_stops(stops, settings: CoordinatorSettings) -> None:
    _check_limit("the number of stop strings", len(stops), "max_stop_strings", settings)
    for stop in stops:
        if not stop:
            raise InvalidArgument("stop strings must be non-empty")
        # Characters first: a long string is refused before it is encoded.
        size = len(stop) if len(stop) > settings.max_stop_bytes else len(stop.encode("utf-8", "surrogatepass"))
        _check_limit("a stop string's UTF-8 length (bytes)", size, "max_stop_bytes", settings)


def _check_sizes(request: coordinator_pb2.GenerateRequest, settings: CoordinatorSettings) -> None:
    """What makes a request large: checked first, before anything costs in proportion to it."""
    if request.session_id:
        validate_session_id(request.session_id)
    size = prompt_bytes(request, settings.max_prompt_bytes)
    _check_limit("the prompt's size (UTF-8 bytes, or 4 per token id)", size, "max_prompt_bytes", settings)
    _check_stops(request.stop, settings)


def check_request_work(params: RequestParams, context_tokens: int, settings: CoordinatorSettings) -> None:
    """INVALID_ARGUMENT when num_samples x (context tokens + max_new_tokens) is over
    max_request_tokens: a bound on the tokens (KV rows, forwards) one request may cost."""
    samples, new = params.num_samples, params.max_new_tokens
    what = (
        f"the request's work, num_samples x (context tokens + max_new_tokens) = {samples} x ({context_tokens} + {new}),"
    )
    _check_limit(what, samples * (context_tokens + new), "max_request_tokens", settings)


def validate_request(
    request: coordinator_pb2.GenerateRequest, settings: CoordinatorSettings, streaming: bool
) -> RequestParams:
    """Everything a request can be checked for before it is tokenised (cheap, whatever its size);
    the caller checks the work once the context is known (`check_request_work`)."""
    s = settings
    _check_sizes(request, s)
    try:
        sampling = sampling_from_proto(request.sampling)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    max_new = request.max_new_tokens if request.HasField("max_new_tokens") else s.default_max_new_tokens
    _in_range("max_new_tokens", max_new, 1, s.max_new_tokens_limit, "max_new_tokens_limit")
    auto_k = False
    if request.HasField("num_speculative_tokens"):
        k = _in_range("num_speculative_tokens", request.num_speculative_tokens, 0, s.max_num_speculative_tokens)
    else:
        default = s.default_k()
        auto_k = default is None
        k = s.max_num_speculative_tokens if auto_k else default
    num_samples = _in_range("num_samples", request.num_samples or 1, 1, s.max_num_samples, "max_num_samples")
    if num_samples > 1 and request.session_id:
        raise InvalidArgument("num_samples > 1 cannot continue a session")
    if num_samples > 1 and streaming:
        raise InvalidArgument("GenerateStream serves one sample; use Generate for num_samples > 1")
    if request.prompt and request.prompt_token_ids:
        raise InvalidArgument("set prompt or prompt_token_ids, not both")
    if request.chat and request.prompt_token_ids:
        raise InvalidArgument("chat applies to a text prompt, not to prompt_token_ids")
    if request.messages:
        _check_messages(request)
    if request.HasField("received_tokens"):
        raise InvalidArgument("received_tokens applies to a resume request only")
    params = RequestParams(sampling, max_new, k, num_samples, auto_k=auto_k and k > 0)
    # Token ids are context already known: their share of the work is checked now.
    check_request_work(params, len(request.prompt_token_ids), s)
    return params


def _check_messages(request: coordinator_pb2.GenerateRequest) -> None:
    """A `messages` conversation stands alone: a new session, no other prompt, known roles."""
    if request.prompt or request.prompt_token_ids or request.chat:
        raise InvalidArgument("messages is a whole conversation: set it without prompt, prompt_token_ids or chat")
    if request.session_id:
        raise InvalidArgument("messages starts a new conversation; continue a session with chat and prompt")
    for i, message in enumerate(request.messages):
        if message.role not in CHAT_ROLES:
            # Length-capped: the size limit has been checked, but a role is echoed into a status.
            raise InvalidArgument(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {message.role[:32]!r}"
            )


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
    if request.messages:
        return _conversation_token_ids(tokenizer, request.messages)
    if not request.prompt:
        return []
    if request.chat:
        rendered = chat_turn_text(tokenizer, request.prompt, continuing=has_history)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    # A continued session already has its BOS.
    return tokenizer(request.prompt, add_special_tokens=not has_history)["input_ids"]


def _conversation_token_ids(tokenizer, messages) -> list[int]:
    """A whole conversation through the chat template, ending with the assistant's generation
    prompt; the template writes any BOS itself, so none is added."""
    if not getattr(tokenizer, "chat_template", None):
        raise FailedPrecondition("the target's tokenizer has no chat template: send a prompt instead of messages")
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    try:
        rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    except TemplateError as exc:  # e.g. a template that wants roles to alternate
        raise InvalidArgument(f"the chat template refused the messages: {exc}") from exc
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]
