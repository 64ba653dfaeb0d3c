"""OpenAIIngress: the OpenAI-compatible HTTP API, over the same operations as the handle API.

The deployment class is OpenAIServing (serving.py: `completions`, `chat`, `models`, which Python
callers use through a handle) plus FastAPI routes that call exactly those methods: API keys,
JSON parsing, errors as `{"error": {...}}` with their status (and Retry-After on 503),
server-sent events for streams, /health and /metrics. A client that disconnects cancels its
request down to the engine.
"""

# No `from __future__ import annotations`: FastAPI must see the real `Request` type of the
# route parameters (Ray Serve rebuilds the routes from the class).
import asyncio
import hmac
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import FastAPI, Request
from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.responses import JSONResponse, Response, StreamingResponse

from app.config import ServerConfig
from app.deployments import logs
from app.deployments.errors import parse_request
from app.deployments.llm_server import set_switch_interval
from app.deployments.metrics import CONTENT_TYPE
from app.deployments.protocol import (
    AuthenticationError,
    BadRequestError,
    ChatCompletionRequest,
    CompletionRequest,
    InternalServerError,
    OpenAIError,
    RequestTooLargeError,
)
from app.deployments.serving import CHAT, COMPLETIONS, OpenAIServing, last_item

logger = logging.getLogger(__name__)

API_KEYS_ENV = "APP_API_KEYS"
SESSION_HEADER = "x-session-id"
_STATS_TIMEOUT_S = 2.0

app = FastAPI(title="FP4-KV LLM server (OpenAI-compatible)")


def error_response(e: OpenAIError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else None
    return JSONResponse(e.to_response().model_dump(mode="json"), status_code=e.status_code, headers=headers)


def api_keys(config: ServerConfig, environ) -> frozenset[str]:
    """The keys of config.api_keys plus those of $APP_API_KEYS (comma-separated). In the config they
    are SecretStr: a printed or logged config shows '**********'."""
    from_env = (k.strip() for k in environ.get(API_KEYS_ENV, "").split(","))
    return frozenset(k for k in (*(s.get_secret_value() for s in config.api_keys), *from_env) if k)


async def _sse_events(first: BaseModel, items: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """Server-sent events: `data: {json}` per chunk, an error object if the stream fails midway,
    then `data: [DONE]`. Closing this generator closes `items` (and so cancels the engine stream)."""
    async with aclosing(items):
        yield f"data: {first.model_dump_json()}\n\n"
        try:
            async for item in items:
                yield f"data: {item.model_dump_json()}\n\n"
        except OpenAIError as e:
            yield f"data: {e.to_response().model_dump_json()}\n\n"
        except Exception as e:  # whatever failed, the client gets an error event and [DONE]
            logger.exception("stream failed")
            yield f"data: {_internal_error(e).to_response().model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"


def _internal_error(e: BaseException) -> InternalServerError:
    return InternalServerError(f"internal error: {type(e).__name__}: {e}"[:500], code="internal_error")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` bytes (by Content-Length before reading, or
    while reading a body sent without one)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise RequestTooLargeError(f"the request body is {int(length)} bytes, more than the {limit} this server "
                                   "accepts (max_request_body_bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLargeError(f"the request body is more than the {limit} bytes this server accepts "
                                       "(max_request_body_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that closes its body iterator however it ends: a client disconnect
    cancels the send loop, which would otherwise leave the generator to the garbage collector."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def transport_of_this_process(handle: DeploymentHandle) -> DeploymentHandle:
    """The handle with the transport a handle made in this process would use. The LLMServer handle
    is made where the application is built, outside the replicas' runtime_env, so it arrives set
    for Ray actor calls; in a replica that runs Serve's throughput-optimized mode
    (serve_throughput_optimized: RAY_SERVE_THROUGHPUT_OPTIMIZED=1, which makes gRPC Serve's default
    between deployments) the calls go over that gRPC channel instead, as a handle made here would.
    Ray 2.60 exposes the choice only as the private `_by_reference` option."""
    from ray.serve._private.constants import RAY_SERVE_USE_GRPC_BY_DEFAULT

    return handle.options(_by_reference=False) if RAY_SERVE_USE_GRPC_BY_DEFAULT else handle


@serve.ingress(app)
class OpenAIIngress(OpenAIServing):
    """Ray Serve deployment name: OpenAIIngress (see builder.py). Stateless; scales out."""

    def __init__(self, llm_server: DeploymentHandle, config: ServerConfig | dict) -> None:
        super().__init__(transport_of_this_process(llm_server), config)
        logs.install()  # a client's bad request is a warning line here, not a traceback
        set_switch_interval(self.config.gil_switch_interval_s)  # streams' Python and Serve's threads share the GIL
        self.api_keys = api_keys(self.config, os.environ)

    def _authorize(self, request: Request) -> None:
        if not self.api_keys:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError("missing API key: send the header 'Authorization: Bearer <key>'")
        key_bytes = key.strip().encode()
        if not any(hmac.compare_digest(key_bytes, k.encode()) for k in self.api_keys):
            raise AuthenticationError("invalid API key")

    async def _serve_http(self, request: Request, endpoint: str, schema: type[BaseModel], operation) -> Response:
        try:
            self._authorize(request)
            raw = await read_body(request, self.config.max_request_body_bytes)
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadRequestError(f"the request body is not valid JSON: {e}") from None
            parsed = parse_request(schema, body)
        except OpenAIError as e:
            self.metrics.count_request(endpoint, e.status_code)
            return error_response(e)
        items = operation(parsed, session_id=request.headers.get(SESSION_HEADER))
        try:
            if not parsed.stream:
                final = await last_item(items)
                if final is None:
                    raise InternalServerError("the engine produced no output for this request")
                return JSONResponse(final.model_dump(mode="json"))
            first = await anext(items)
        except OpenAIError as e:
            return error_response(e)
        except Exception as e:  # unmapped: still an OpenAI error body, never a bare 500
            logger.exception("request failed")
            return error_response(_internal_error(e))
        return _SSEResponse(_sse_events(first, items), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})

    # -- HTTP routes ----------------------------------------------------------------------------
    @app.get("/v1/models")
    async def http_models(self, request: Request) -> Response:
        try:
            self._authorize(request)
            models = await self.models()
        except OpenAIError as e:
            return error_response(e)
        return JSONResponse(models.model_dump(mode="json"))

    @app.post(COMPLETIONS)
    async def http_completions(self, request: Request) -> Response:
        return await self._serve_http(request, COMPLETIONS, CompletionRequest, self.completions)

    @app.post(CHAT)
    async def http_chat(self, request: Request) -> Response:
        return await self._serve_http(request, CHAT, ChatCompletionRequest, self.chat)

    @app.get("/health")
    async def health(self) -> Response:
        """200 while an engine replica answers its health check, else 503 with the reason (probes
        need no API key)."""
        try:
            await asyncio.wait_for(self.llm_server.check_health.remote(), timeout=_STATS_TIMEOUT_S)
        except Exception as e:
            return JSONResponse({"status": "unavailable", "error": f"{type(e).__name__}: {e}"[:500]}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def http_metrics(self, request: Request) -> Response:
        if self.config.metrics_require_api_key:
            try:
                self._authorize(request)
            except OpenAIError as e:
                return error_response(e)
        try:
            self.metrics.engine.replace(await asyncio.wait_for(self._fetch_stats(), timeout=_STATS_TIMEOUT_S))
        except Exception as e:  # an index restarting must not break the scrape (series keep their values)
            logger.warning("engine stats unavailable for /metrics: %r", e)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def _fetch_stats(self) -> dict[str, dict]:
        """Every live LLMServer replica's latest stats, as each reported them to the index (the one
        stats path: replicas report once per routing-stats period)."""
        from app.router.index_actor import get_index

        index = get_index(serve.get_replica_context().app_name)
        if index is None:
            raise LookupError("the application's KV index is not running")
        return await index.replica_stats.remote()
