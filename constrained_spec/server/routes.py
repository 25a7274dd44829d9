"""The routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (a raw prompt,
`completions`), ``GET /v1/models`` and ``/v1/models/{id}``, ``POST /tokenize`` and
``/detokenize`` (vLLM's shapes), ``GET /version``, ``GET /health`` and, with metrics on,
``GET /metrics``; and the error handlers that answer in OpenAI's envelope.

Both completion routes read every form of output constraint (`structured`: ``response_format``,
vLLM's ``structured_outputs`` and ``guided_*``, SGLang's and llama.cpp's fields), ``min_tokens``
and ``ignore_eos``; ``POST /v1/chat/completions`` reads ``response_format`` (json_schema / json_object / text),
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

from constrained_spec import __version__
from constrained_spec.errors import ConstrainedSpecError
from constrained_spec.server.choices import response_warnings
from constrained_spec.server.completions import (
    DetokenizeRequest,
    TokenizeRequest,
    completion_body,
    max_model_len,
    parse_small,
)
from constrained_spec.server.completions import detokenize as detokenize_body
from constrained_spec.server.completions import tokenize as tokenize_body
from constrained_spec.server.logprobs import chat_logprobs
from constrained_spec.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    RequestFields,
    api_error,
    envelope,
    internal_error,
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
        return {"object": "list", "data": [_model_card(server)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        _check_model(server, model_id)
        return _model_card(server)

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": __version__}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _completions(server, request, ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _completions(server, request, CompletionRequest)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        raw = await _read_body(request, config.max_request_bytes)
        body = parse_small(raw, TokenizeRequest, config.model_name)
        return await asyncio.get_running_loop().run_in_executor(
            server.prep, functools.partial(tokenize_body, server.model, body))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        raw = await _read_body(request, config.max_request_bytes)
        body = parse_small(raw, DetokenizeRequest, config.model_name)
        return detokenize_body(server.model, body)

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

    @app.exception_handler(Exception)  # (the app's Guard answers first, keeping the connection)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return internal_error(exc)


def _model_card(server: Server) -> dict[str, Any]:
    return {"id": server.config.model_name, "object": "model", "created": server.created,
            "owned_by": "constrained_spec", "max_model_len": max_model_len(server.model)}


def _check_model(server: Server, name: str) -> None:
    if name != server.config.model_name:
        raise APIError(404, f"the model {name!r:.80} does not exist; this server serves "
                       f"{server.config.model_name!r}", param="model", code="model_not_found")


async def _completions(server: Server, request: Request, kind: type[RequestFields]) -> Response:
    """``POST /v1/chat/completions`` (``kind`` ChatCompletionRequest) or ``/v1/completions``."""
    config = server.config
    body = parse_body(await _read_body(request, config.max_request_bytes), kind)
    _check_model(server, body.model)
    count = body.n * (len(body.prompts()) if isinstance(body, CompletionRequest) else 1)
    capacity = config.max_batch_size + config.max_queue
    if count > capacity:
        raise APIError(400, f"n={body.n} for {count // body.n} prompt(s) is more than this server "
                       f"holds at once ({capacity})", param="n")
    stop = stop_strings(body.stop)
    try:
        built = await asyncio.get_running_loop().run_in_executor(server.prep,
                                                                 server.build_requests, body)
        tickets = server.loop.submit([req for req, _, _ in built])
    except ConstrainedSpecError as e:
        raise api_error(e) from e
    choices = [Choice.of(i, t, spec, mode, server.decode, stop if spec is None else (),
                         server.model.tokenizer_data.decoded)
               for i, (t, (_, spec, mode)) in enumerate(zip(tickets, built))]
    echo = None
    if isinstance(body, CompletionRequest):
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        echo = {c.index: server.decode(c.request.prompt_ids) for c in choices} if body.echo else {}
    else:
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(
            stream(server, request, choices, completion_id, body.model, include_usage, echo=echo),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _complete(server, request, body, choices, completion_id, echo)


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _complete(server: Server, request: Request, body: RequestFields,
                    choices: Sequence[Choice], completion_id: str,
                    echo: dict[int, str] | None = None) -> Response:
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
    if echo is not None:
        return JSONResponse(completion_body(completion_id, created, body.model, choices, outcomes,
                                            echo, response_warnings(choices, outcomes,
                                                                    server.config.backend)))
    return JSONResponse({
        "id": completion_id, "object": "chat.completion", "created": created, "model": body.model,
        "system_fingerprint": None,
        "choices": [{"index": c.index, "message": o.message(),
                     "logprobs": None if o.logprobs is None else chat_logprobs(c.decoded, o.logprobs),
                     "finish_reason": o.finish_reason}
                    for c, o in zip(choices, outcomes)],
        "usage": usage(choices, outcomes),
        **response_warnings(choices, outcomes, server.config.backend),
    })


async def run_attempts(server: Server, body: RequestFields,
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
                fresh = Choice.of(c.index, ticket, c.spec, c.mode, server.decode, c.text.stop,
                                  c.decoded)
                c.ticket, c.text, c.thought, c._seen = ticket, fresh.text, fresh.thought, 0
        await run_choices(running)
        for c in running:
            outcomes[c.index] = await server.outcome_async(c)
            # free text is run again only when max_retries asks (the library's rule)
            attempts.record(c.index, outcomes[c.index].result,
                            retry=c.spec is not None or body.max_retries is not None)
    return [outcomes[c.index] for c in choices]
