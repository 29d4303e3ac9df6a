"""OpenAI requests -> coordinator GenerateRequest, and GenerateResponse / GenerateChunk -> OpenAI
responses and server-sent-event chunks. Pure functions of their inputs (and the clock)."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

from gateway.errors import BadField, ModelNotFound
from gateway.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from specdec.v1 import common_pb2, coordinator_pb2

FINISH_REASONS = {
    coordinator_pb2.FINISH_REASON_LENGTH: "length",
    coordinator_pb2.FINISH_REASON_EOS: "stop",
    coordinator_pb2.FINISH_REASON_STOP: "stop",
}
# Fields OpenAI clients send that change nothing at these values. Any other value would change the
# output, and this server samples exactly from the target model's distribution: refused, not ignored.
NEUTRAL_VALUES = {
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "min_tokens": (None, 0),
    "min_p": (None, 0),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
}
# Fields that never change the output (bookkeeping, or options of features not served).
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key"})
ROLES = {"developer": "system"}  # OpenAI's newer name for the system role


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise ModelNotFound(requested, served)


def check_extra_fields(extra: dict) -> None:
    """BadField for a field this server does not serve, or serves only at its neutral value."""
    for name, value in extra.items():
        if name in IGNORED_FIELDS:
            continue
        if name not in NEUTRAL_VALUES:
            raise BadField(f"unknown field `{name[:64]}`: not part of the API this server serves", name[:64])
        if value not in NEUTRAL_VALUES[name]:
            neutral = NEUTRAL_VALUES[name][-1]
            raise BadField(
                f"{name}={json.dumps(value)[:64]} is not supported: it would change the output, and this server "
                f"samples exactly from the target model's distribution (leave it unset or {json.dumps(neutral)})",
                name,
            )


def _common(body, max_tokens: int | None) -> coordinator_pb2.GenerateRequest:
    if body.n > 1 and body.stream:
        raise BadField("n > 1 is served without streaming only: set stream to false", "n")
    sampling = common_pb2.SamplingParams(top_k=max(body.top_k or 0, 0))
    if body.temperature is not None:
        sampling.temperature = body.temperature
    if body.top_p is not None:
        sampling.top_p = body.top_p
    request = coordinator_pb2.GenerateRequest(
        sampling=sampling,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or ()),
        ignore_eos=body.ignore_eos,
        num_samples=body.n,
        session_id=body.session_id or "",
    )
    for name, value in (("max_new_tokens", max_tokens), ("seed", body.seed)):
        if value is not None:
            setattr(request, name, value)
    if body.num_speculative_tokens is not None:
        request.num_speculative_tokens = body.num_speculative_tokens
    return request


def completion_request(body: CompletionRequest) -> coordinator_pb2.GenerateRequest:
    request = _common(body, body.max_tokens)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise BadField("a batch of prompts is not served: send one prompt per request (n for samples)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(prompt)
    return request


def _text(message: ChatMessage) -> str:
    if isinstance(message.content, list):
        return "".join(part.text for part in message.content)
    return message.content or ""


def chat_request(body: ChatCompletionRequest) -> coordinator_pb2.GenerateRequest:
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    request = _common(body, max_tokens)
    if body.session_id:
        # The session holds the conversation so far: the request brings only the next user turn.
        if len(body.messages) != 1 or body.messages[0].role != "user":
            raise BadField("with session_id, messages is the next user turn only: one message of role user", "messages")
        request.chat, request.prompt = True, _text(body.messages[0])
        return request
    for message in body.messages:
        request.messages.add(role=ROLES.get(message.role, message.role), content=_text(message))
    return request


def _stats(stats: coordinator_pb2.GenerationStats) -> dict:
    return {f.name: getattr(stats, f.name) for f in stats.DESCRIPTOR.fields}


def usage(stats: coordinator_pb2.GenerationStats) -> dict:
    prompt, completion = stats.prompt_tokens, stats.generated_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def specdec_stats(reply: coordinator_pb2.GenerateResponse | coordinator_pb2.GenerateChunk) -> dict:
    """The extension object: the speculative stats, and the session (continue it with session_id) and seed."""
    return {**_stats(reply.stats), "session_id": reply.session_id, "seed": reply.seed}


@dataclass
class Renderer:
    """One response's OpenAI JSON objects: its id, kind (chat or text) and model, the same in every chunk."""

    chat: bool
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def response(self, reply: coordinator_pb2.GenerateResponse) -> dict:
        choices = [self._choice(i, c) for i, c in enumerate(reply.completions)]
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._head(kind), "choices": choices, "usage": usage(reply.stats), "specdec": specdec_stats(reply)}

    def _choice(self, index: int, completion: coordinator_pb2.Completion) -> dict:
        finish = FINISH_REASONS.get(completion.finish_reason)
        if self.chat:
            message = {"role": "assistant", "content": completion.text}
            return {"index": index, "message": message, "logprobs": None, "finish_reason": finish}
        return {"index": index, "text": completion.text, "logprobs": None, "finish_reason": finish}

    def _chunk(self, choices: list[dict], **extra) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        out = {**self._head(kind), "choices": choices}
        if self.include_usage:
            out["usage"] = None  # as OpenAI: only the last chunk carries the usage
        return {**out, **extra}

    def _delta(self, text: str | None, finish: str | None = None, role: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def start(self) -> list[dict]:
        """What a stream sends before the first text: a chat's assistant role."""
        return [self._chunk([self._delta("", role=True)])] if self.chat else []

    def chunk(self, chunk: coordinator_pb2.GenerateChunk) -> list[dict]:
        """The OpenAI chunks of one coordinator chunk: its text (if any), and on the last one the
        finish reason with the speculative stats, then the usage when asked for."""
        out = [self._chunk([self._delta(chunk.text)])] if chunk.text and (self.chat or not chunk.done) else []
        if not chunk.done:
            return out
        text = None if self.chat else chunk.text
        finish = self._delta(text, FINISH_REASONS.get(chunk.finish_reason, "stop"))
        out.append(self._chunk([finish], specdec=specdec_stats(chunk)))
        if self.include_usage:
            out.append({**self._chunk([]), "usage": usage(chunk.stats)})
        return out


def sse(obj: dict | str) -> str:
    """One server-sent event: `data: <json>` (or the literal `[DONE]`) and a blank line."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n"
