"""The OpenAI request bodies the gateway accepts, as pydantic models (the wire, type-checked).

Strict types: `"0.7"` is not a temperature and `1.0` is not a count. Ranges that are the
gateway's own (proto field sizes, OpenAI's meaning of a field) are checked here; the ones that
are settings of the coordinator (max_new_tokens, n, K, stop strings) are checked there. Fields
beyond these are kept (`model_extra`) and judged by `gateway.mapping.check_extra_fields`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    # None: an assistant turn that only called tools elsewhere; nothing to render here.
    content: str | list[TextPart] | None = None
    name: str | None = None  # accepted; chat templates do not render it


class _Common(_Strict):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # extension (vLLM's): -1 or 0 = off
    n: int = Field(1, ge=1, le=INT32_MAX)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extensions: continue a stored session, fix K (0 = target only), generate past EOS (benchmarks).
    session_id: str | None = None
    num_speculative_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    ignore_eos: bool = False


class CompletionRequest(_Common):
    # Text, a batch of one text, token ids, or a batch of one list of token ids.
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
