"""The OpenAI-compatible HTTP API over the coordinator: JSON -> GenerateRequest -> Generate /
GenerateStream -> OpenAI JSON or server-sent events.

Handlers are wire -> request -> coordinator call -> wire (`gateway.mapping` does both
conversions); every failure is an OpenAI-style error body (`gateway.errors`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException

from gateway.coordinator_client import CoordinatorClient
from gateway.errors import error_body, from_rpc_error, from_service_error
from gateway.http_metrics import HttpMetrics
from gateway.mapping import Renderer, chat_request, check_extra_fields, check_model, completion_request, sse
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.request_scope import REQUEST_ID_HEADER, RequestScope
from gateway.settings import GatewaySettings
from specdec.core.errors import ServiceError

log = logging.getLogger(__name__)


def forwarded_metadata(request: Request) -> tuple:
    """The request id (`RequestScope`) as the coordinator's `x-request-id` metadata, and the
    client's `Authorization` header as its `authorization`: the gateway holds no keys, the
    coordinator checks them."""
    request_id = (REQUEST_ID_HEADER, request.state.request_id)
    value = request.headers.get("authorization", "")
    if not value:
        return (request_id,)
    if not (value.isascii() and value.isprintable()):  # gRPC metadata cannot carry it
        raise ServiceError("malformed Authorization header", code="UNAUTHENTICATED")
    return (request_id, ("authorization", value))


def _json_error(status: int, body: dict) -> JSONResponse:
    return JSONResponse(body, status_code=status)


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 as OpenAI's 400, naming the first wrong field."""
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'decode error')}"
        return _json_error(400, error_body(400, message, "invalid_json"))
    path = [str(part) for part in first["loc"] if part != "body"]
    message = f"{'.'.join(path)}: {first['msg']}" if path else f"the body: {first['msg']}"
    return _json_error(400, error_body(400, message, "invalid_request", path[0] if path else None))


def _add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, lambda request, exc: _json_error(*from_service_error(exc)))
    app.add_exception_handler(grpc.aio.AioRpcError, lambda request, exc: _json_error(*from_rpc_error(exc)))
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(
        HTTPException,
        lambda request, exc: _json_error(
            exc.status_code, error_body(exc.status_code, str(exc.detail), f"http_{exc.status_code}")
        ),
    )

    def internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return _json_error(500, error_body(500, "internal error", "internal"))

    app.add_exception_handler(Exception, internal)


async def _events(call: grpc.aio.UnaryStreamCall, first, render: Renderer) -> AsyncIterator[str]:
    """The SSE body: the rendered chunks, an error event if the call fails mid-way, then [DONE].
    When the client goes away, the coordinator call is cancelled (its rounds stop)."""
    try:
        for obj in render.start():
            yield sse(obj)
        chunk = first
        while chunk is not grpc.aio.EOF:
            for obj in render.chunk(chunk):
                yield sse(obj)
            chunk = await call.read()
    except grpc.aio.AioRpcError as exc:
        yield sse(from_rpc_error(exc)[1])
    finally:
        call.cancel()
    yield sse("[DONE]")


async def _stream(call: grpc.aio.UnaryStreamCall, render: Renderer) -> StreamingResponse:
    try:
        first = await call.read()  # a refusal before any token is the HTTP status, not an event
    except BaseException:
        call.cancel()
        raise
    headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
    return StreamingResponse(_events(call, first, render), media_type="text/event-stream", headers=headers)


def create_app(settings: GatewaySettings, client: CoordinatorClient) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await client.close()

    app = FastAPI(
        title="specdec OpenAI-compatible gateway",
        lifespan=lifespan,
        max_body_size=settings.max_body_bytes,
        docs_url=None,
        redoc_url=None,
    )
    app.add_middleware(HttpMetrics)
    app.add_middleware(RequestScope)  # outermost: its span and log context cover everything inside
    _add_error_handlers(app)
    started = int(time.time())

    async def generate(body, to_request: Callable, request: Request, chat: bool):
        check_model(body.model, settings.model_name)
        check_extra_fields(body.model_extra or {})
        grpc_request, metadata = to_request(body), forwarded_metadata(request)
        render = Renderer(chat, settings.model_name, bool(body.stream_options and body.stream_options.include_usage))
        if body.stream:
            return await _stream(client.stream(grpc_request, metadata), render)
        return JSONResponse(render.response(await client.generate(grpc_request, metadata)))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await generate(body, completion_request, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await generate(body, chat_request, request, chat=True)

    def model_card() -> dict:
        return {"id": settings.model_name, "object": "model", "created": started, "owned_by": "specdec"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        check_model(model, settings.model_name)
        return model_card()

    @app.get("/health")
    async def health():
        if await client.serving():
            return {"status": "serving"}
        return _json_error(503, error_body(503, "the coordinator is not serving", "unavailable"))

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return app
