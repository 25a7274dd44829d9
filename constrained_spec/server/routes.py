"""The routes: ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health`` and, with
metrics on, ``GET /metrics``; and the error handlers that answer in OpenAI's envelope.

``POST /v1/chat/completions`` reads ``response_format`` (json_schema / json_object / text),
``stream``, ``n``, ``stop``, ``seed``, ``temperature``, ``top_p``, ``max_tokens``, ``tools``,
``tool_choice``, ``parallel_tool_calls`` (calls come back as ``message.tool_calls`` with
``finish_reason`` "tool_calls", streamed as OpenAI's tool-call deltas), and as
vLLM-style extra parameters ``top_k`` and the library's output-quality levers
``repetition_penalty``, ``no_repeat_ngram_size``, ``max_retries``; any other parameter is
refused with a 400 naming it, except bookkeeping ones such as ``user`` or ``metadata``, and
so is an unknown field inside a message (``protocol.parse_body``). A body nested deeper than
``json_limits.MAX_JSON_DEPTH`` is refused (400) before it is parsed.

A completion's choices are submitted to the engine loop at once; a streamed one is answered
as its tokens arrive (``streaming``), any other once every choice has finished. A choice that
failed is run again under the library's :class:`~constrained_spec.api.RetryPolicy`: by
default up to twice, ``max_retries`` says otherwise (0: never); a streamed choice is never run
again (its text would already be sent).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from constrained_spec.errors import ConstrainedSpecError
from constrained_spec.server.protocol import (
    APIError,
    ChatCompletionRequest,
    api_error,
    envelope,
    parse_body,
    stop_strings,
)
from constrained_spec.server.streaming import Choice, Outcome, disconnected, run_choices, stream, usage

if TYPE_CHECKING:
    from constrained_spec.server.state import Server

logger = logging.getLogger(__name__)


def add_routes(app: FastAPI, server: Server, registry: Any = None) -> None:
    """Add the server's routes and error handlers to ``app`` (``registry``: the Prometheus
    registry behind ``GET /metrics``; None: no such route)."""
    _add_error_handlers(app)
    config = server.config

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "running": server.loop.running, "waiting": server.loop.waiting}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model",
                                            "created": server.created, "owned_by": "constrained_spec"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _chat_completions(server, request)

    if registry is not None:
        @app.get("/metrics")
        async def metrics() -> Response:
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(envelope(str(exc.detail), "invalid_request_error", None, code),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(envelope(f"internal error: {type(exc).__name__}", "server_error", None,
                                     "internal_error"), status_code=500)


async def _chat_completions(server: Server, request: Request) -> Response:
    config = server.config
    body = parse_body(await _read_body(request, config.max_request_bytes))
    if body.model != config.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                       f"{config.model_name!r}", param="model", code="model_not_found")
    capacity = config.max_batch_size + config.max_queue
    if body.n > capacity:
        raise APIError(400, f"n={body.n} is more than this server holds at once ({capacity})",
                       param="n")
    stop = stop_strings(body.stop)
    try:
        built = await asyncio.get_running_loop().run_in_executor(server.prep,
                                                                 server.build_requests, body)
        tickets = server.loop.submit([req for req, _, _ in built])
    except ConstrainedSpecError as e:
        raise api_error(e) from e
    choices = [Choice.of(i, t, spec, mode, server.decode, stop if spec is None else ())
               for i, (t, (_, spec, mode)) in enumerate(zip(tickets, built))]
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(
            stream(server, request, choices, completion_id, body.model, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _complete(server, request, body, choices, completion_id)


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _complete(server: Server, request: Request, body: ChatCompletionRequest,
                    choices: Sequence[Choice], completion_id: str) -> Response:
    created = int(time.time())
    work = asyncio.create_task(run_attempts(server, body, choices))
    gone = asyncio.create_task(disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            logger.info("%s: client disconnected; cancelling", completion_id)
            return JSONResponse(envelope("client closed the request", "invalid_request_error"),
                                status_code=499)
        outcomes = work.result()
    finally:
        gone.cancel()
        work.cancel()
        for c in choices:
            c.ticket.cancel()  # no-op for finished ones
    for o in outcomes:
        if o.error is not None:
            return o.error.response()
    return JSONResponse({
        "id": completion_id, "object": "chat.completion", "created": created, "model": body.model,
        "system_fingerprint": None,
        "choices": [{"index": c.index, "message": o.message(),
                     "logprobs": None, "finish_reason": o.finish_reason}
                    for c, o in zip(choices, outcomes)],
        "usage": usage(choices, outcomes),
    })


async def run_attempts(server: Server, body: ChatCompletionRequest,
                       choices: Sequence[Choice]) -> list[Outcome]:
    """Run the choices (their first attempt already submitted) to their outcomes.

    A choice whose attempt failed (:class:`RetryPolicy` decides; ``max_retries``, by default
    the library's) runs again as a new request until one attempt succeeds or the retries run
    out; its outcome is its last attempt's."""
    by_index = {c.index: c for c in choices}
    outcomes: dict[int, Outcome] = {}
    attempts = server.retry_policy(body).attempts(by_index)
    for attempt, todo in attempts:
        running = [by_index[i] for i in todo]
        if attempt:
            server.retries += len(todo)
            build = functools.partial(server.build_requests, body, attempt=attempt, indices=todo)
            built = await asyncio.get_running_loop().run_in_executor(server.prep, build)
            try:
                tickets = server.loop.submit([req for req, _, _ in built])
            except ConstrainedSpecError as e:
                raise api_error(e) from e
            for c, ticket in zip(running, tickets):
                fresh = Choice.of(c.index, ticket, c.spec, c.mode, server.decode, c.text.stop)
                c.ticket, c.text, c.thought, c._seen = ticket, fresh.text, fresh.thought, 0
        await run_choices(running)
        for c in running:
            outcomes[c.index] = await server.outcome_async(c)
            attempts.record(c.index, outcomes[c.index].result)
    return [outcomes[c.index] for c in choices]
