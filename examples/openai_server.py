"""An OpenAI-compatible chat-completions server over constrained_spec.

    python examples/openai_server.py --port 8000 [--api-key KEY] [--enable-metrics]

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY")
    person = client.beta.chat.completions.parse(model=..., messages=[...], response_format=Person)

Routes: ``POST /v1/chat/completions`` (``response_format`` json_schema / json_object / text,
``stream``, ``n``, ``stop``, ``seed``, ``temperature``, ``top_p``, ``max_tokens``, and as
vLLM-style extra parameters ``top_k`` and the library's opt-in output-quality levers:
``repetition_penalty``, ``no_repeat_ngram_size``, ``max_retries``; any other parameter is
refused with a 400 naming it, except bookkeeping ones such as ``user`` or ``metadata``),
``GET /v1/models``, ``GET /health`` and, with ``--enable-metrics``, ``GET /metrics``
(Prometheus). Errors come in OpenAI's envelope ``{"error": {message, type, param, code}}``.

Design: the handlers turn a request into engine requests with
``Generator.make_request`` (schema compile + prompt encoding, on one helper thread) and
submit them to ONE :class:`~constrained_spec.serving.EngineLoop`, which batches every
in-flight request in a background thread (continuous batching, each request with its own
schema). Tokens come back to the handler as they are accepted; the handler detokenizes them,
watches ``stop`` strings and writes SSE chunks. Final validation of a finished output runs on
two more helper threads, so the event loop (and ``/health``) never waits on it. A client that
goes away cancels its requests, which frees their slots at the next engine step.

Untrusted schemas: a ``$ref`` that does not resolve inside the schema is refused with a 400
naming its JSON pointer, whatever ``strict`` says; nothing a schema names is ever fetched or
read (docs/security.md).

Differences from OpenAI's API, on purpose: ``temperature`` defaults to 0 (greedy, the
library's default); ``stop`` applies to free text only (under a schema the grammar decides
where the output ends); ``json_schema.strict`` true refuses any keyword the grammar would not
enforce, absent refuses only unsupported ones, false only warns (and the output is then
returned even if it fails final validation). ``frequency_penalty`` / ``presence_penalty``
(additive, OpenAI's) are refused: ``repetition_penalty`` is the multiplicative one of vLLM and
transformers (here on the output's tokens only, not the prompt's). ``max_retries`` is refused with ``stream``: a failed attempt's text would already
be sent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import secrets
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from constrained_spec import __version__
from constrained_spec.api import DEFAULT_RETRY_TEMPERATURE, Generator
from constrained_spec.cli import speculative_from_args
from constrained_spec.config import METHODS
from constrained_spec.errors import (
    ConfigError,
    ConstrainedSpecError,
    GenerationError,
    IncompleteOutputError,
    OutputValidationError,
    PromptTooLongError,
    SchemaError,
)
from constrained_spec.serving import EngineLoop, QueueFullError, Ticket

logger = logging.getLogger("openai_server")

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
#: Upper bound of a request's ``max_retries``: each retry is one more whole generation in a
#: batch slot, and two retries already complete every benchmark task (README).
MAX_RETRIES = 4

# ------------------------------------------------------------------------------------------------
# errors: OpenAI's envelope
# ------------------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered in OpenAI's envelope with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(envelope(self.message, self.type, self.param, self.code),
                            status_code=self.status, headers=headers)


def envelope(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    # a lone surrogate echoed from the request could not be written as UTF-8: escape it, or
    # the error response itself would fail (a 500)
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_OPTION_PARAMS = {"prompt": "messages", "max_tokens": "max_tokens", "temperature": "temperature",
                  "top_p": "top_p", "top_k": "top_k", "seed": "seed"}


def api_error(exc: BaseException, *, schema_param: str | None = "response_format") -> APIError:
    """The API error for a library exception raised while preparing or running a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SchemaError):
        return APIError(400, f"bad schema: {exc}", param=schema_param, code="invalid_schema")
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, ConfigError):
        return APIError(400, str(exc), param=_OPTION_PARAMS.get(exc.option or "", exc.option),
                        code="invalid_value")
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full")
    if isinstance(exc, GenerationError):  # this request alone failed; the server goes on
        return APIError(500, str(exc), type="server_error", code="generation_failed")
    if isinstance(exc, OutputValidationError):
        return APIError(500, f"the output failed final validation: {exc}", type="server_error",
                        code="output_validation_failed")
    return APIError(500, f"{type(exc).__name__}: {exc}", type="server_error", code="internal_error")


# ------------------------------------------------------------------------------------------------
# the request body
# ------------------------------------------------------------------------------------------------


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(BaseModel):
    """The fields of OpenAI's chat-completions request this server reads. Any other field is
    refused with a 400 naming it (`check_extra_fields`), except the bookkeeping ones in
    ``_IGNORED`` and a falsy (default) value of the unimplemented ones in ``_UNSUPPORTED``."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    response_format: dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # vLLM's extra parameter; -1 (vLLM's "off") and 0 both switch it off
    top_k: int | None = Field(default=None, ge=-1, strict=True)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    # vLLM-style extra parameters: the library's opt-in levers (off when absent). Strict types
    # (no "2" or true for a number); their ranges are SamplingParams', checked by make_request.
    repetition_penalty: float | None = Field(default=None, strict=True)
    no_repeat_ngram_size: int | None = Field(default=None, strict=True)
    max_retries: int | None = Field(default=None, ge=0, le=MAX_RETRIES, strict=True)


# request fields that would change the answer and that this server does not implement:
# refused rather than silently ignored (a falsy value is accepted: clients send defaults)
_UNSUPPORTED = ("tools", "functions", "function_call", "logprobs", "top_logprobs", "logit_bias",
                "audio", "frequency_penalty", "presence_penalty", "prediction", "min_p",
                "reasoning_effort", "web_search_options")
# request fields that do not change the answer: accepted and ignored
_IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier",
            "prompt_cache_key")
# OpenAI's penalties subtract from the logits by count; the guard here divides (as vLLM's and
# transformers' repetition_penalty) or bans repeated n-grams: a different setting, not a rename
_INSTEAD = dict.fromkeys(("frequency_penalty", "presence_penalty"),
                         "; use repetition_penalty (> 1 penalises the tokens already in the "
                         "output, 1.1 to 1.3 is typical) or no_repeat_ngram_size instead")


def parse_body(raw: bytes) -> ChatCompletionRequest:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    try:
        body = ChatCompletionRequest.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param,
                       code="invalid_value") from e
    extra = body.model_extra or {}
    for name, value in extra.items():
        if name in _UNSUPPORTED:
            if value:
                raise APIError(400, f"{name} is not supported by this server"
                               f"{_INSTEAD.get(name, '')}", param=name, code="unsupported_parameter")
        elif name in ("tool_choice", "modalities"):
            if value not in (None, "none", [], ["text"]):  # what the server does anyway
                raise APIError(400, f"{name} {value!r:.40} is not supported by this server",
                               param=name, code="unsupported_parameter")
        elif name not in _IGNORED:
            # a misspelt or newer parameter would otherwise be silently ignored
            raise APIError(400, f"unknown parameter {name!r:.60}: this server does not implement "
                           "it; remove it from the request", param=name[:60],
                           code="unknown_parameter")
    if body.stream and body.max_retries:
        raise APIError(400, "max_retries cannot be combined with stream: the text of a failed "
                       "attempt would already be sent", param="max_retries",
                       code="unsupported_parameter")
    return body


SchemaMode = Literal["default", "strict", "lenient"]


def schema_of(response_format: dict[str, Any] | None) -> tuple[Any, SchemaMode]:
    """``response_format`` -> (schema for ``make_request``, pre-flight mode).

    json_schema: the schema; ``strict`` true -> "strict", absent -> "default", false ->
    "lenient". json_object: any JSON object. text / absent: free text (``None``).
    """
    if response_format is None:
        return None, "default"
    kind = response_format.get("type")
    if kind == "text":
        return None, "default"
    if kind == "json_object":
        return {"type": "object"}, "default"
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError(400, "response_format.json_schema must be an object with 'name' and "
                           "'schema'", param="response_format.json_schema")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema must be a JSON Schema object",
                           param="response_format.json_schema.schema", code="invalid_schema")
        strict = spec.get("strict")
        mode: SchemaMode = "default" if strict is None else ("strict" if strict else "lenient")
        return schema, mode
    raise APIError(400, f"response_format.type {kind!r} is not supported; use 'json_schema', "
                   "'json_object' or 'text'", param="response_format.type")


def chat_prompt(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """OpenAI messages -> the library's ``[{role, content}]`` (text content parts joined)."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"only text content parts are supported, got "
                                   f"{part.get('type')!r}", param=f"messages.{i}.content")
                parts.append(part["text"])
            content = "".join(parts)
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": content or ""})
    return out


def stop_strings(stop: str | list[str] | None) -> list[str]:
    items = [stop] if isinstance(stop, str) else list(stop or [])
    if len(items) > 4:
        raise APIError(400, "stop takes at most 4 strings", param="stop")
    return [s for s in items if s]


# ------------------------------------------------------------------------------------------------
# detokenizing one choice, with stop strings
# ------------------------------------------------------------------------------------------------


class ChoiceText:
    """The text of one choice as its tokens arrive: what may be sent, and where it stops.

    The ids so far are decoded as a whole (decoding piece by piece would split multi-byte
    characters). Text that could be the start of a stop string is held back until it is not;
    when a stop string appears the text is cut before it and ``stopped`` is set.
    """

    def __init__(self, decode: Any, stop: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stop = list(stop)
        self.ids: list[int] = []
        self.text = ""  # the text so far (cut at a stop string once found)
        self.sent = ""  # the part of it already handed out
        self.stopped = False

    def feed(self, ids: Sequence[int]) -> str:
        """Add tokens; return the new text that is safe to send."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        # an incomplete UTF-8 sequence decodes to U+FFFD until its last byte arrives
        self.text = self.decode(self.ids).rstrip("\ufffd")
        safe = len(self.text)
        if self.stop:
            hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                safe = len(self.text)
            else:
                safe -= self._held_back(self.text)
        return self._release(self.text[:safe])

    def finish(self, final_text: str | None = None) -> str:
        """The rest to send once generation ended (``final_text``: the whole output)."""
        if final_text is not None and not self.stopped:
            self.text = final_text
        return self._release(self.text)

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _release(self, upto: str) -> str:
        if not upto.startswith(self.sent):
            return ""  # decoding rewrote an earlier character; wait for more (or the end)
        new = upto[len(self.sent):]
        self.sent = upto
        return new


@dataclass
class Choice:
    """One of the ``n`` outputs of a chat completion while it runs."""

    index: int
    ticket: Ticket
    spec: Any
    mode: SchemaMode
    text: ChoiceText

    @property
    def request(self) -> Any:
        return self.ticket.request


@dataclass
class Outcome:
    text: str
    finish_reason: str
    error: APIError | None = None
    completion_tokens: int = 0
    retryable: bool = False  # incomplete or invalid: what ``max_retries`` runs again


# ------------------------------------------------------------------------------------------------
# the app
# ------------------------------------------------------------------------------------------------


@dataclass
class ServerConfig:
    """What ``create_app`` needs besides the model."""

    model_name: str
    speculative: Any = None  # SpeculativeConfig | False | None, as Generator takes it
    backend: Literal["xgrammar", "outlines"] = "xgrammar"
    max_batch_size: int = 8
    max_queue: int = 64
    max_tokens: int = 512
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    enable_metrics: bool = False
    http_responses: Counter = field(default_factory=Counter)  # (path, status) -> responses


class Server:
    """The state behind the routes: generators per schema mode, the engine loop, a prep thread."""

    def __init__(self, model: Any, config: ServerConfig) -> None:
        self.config = config
        self.model = model
        self._generators: dict[str, Generator[Any]] = {}
        self._lock = threading.Lock()
        self.generator("default")  # fail on a bad speculative config before serving
        self.loop = EngineLoop(self.generator("default").new_engine(),
                               max_batch_size=config.max_batch_size, max_queue=config.max_queue)
        # schema compiles and prompt encoding run here, off the event loop and off the engine
        self.prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openai-server-prep")
        # final validation (jsonschema, Pydantic) of finished outputs runs here: it takes time
        # on large outputs, and the event loop must keep answering (/health) meanwhile
        self.finish = ThreadPoolExecutor(max_workers=2, thread_name_prefix="openai-server-finish")
        self.created = int(time.time())

    def generator(self, mode: SchemaMode) -> Generator[Any]:
        # one Generator per pre-flight mode (make_request takes no schema_mode), one model
        with self._lock:
            if mode not in self._generators:
                c = self.config
                self._generators[mode] = Generator(
                    self.model, speculative=c.speculative, backend=c.backend, schema_mode=mode,
                    max_tokens=c.max_tokens, max_batch_size=c.max_batch_size)
            return self._generators[mode]

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.tokenizer.decode(list(ids))

    def build_requests(self, body: ChatCompletionRequest, *, attempt: int = 0,
                       indices: Sequence[int] | None = None) -> list[tuple[Any, Any, SchemaMode]]:
        """Engine requests for the ``n`` choices (runs on the prep thread); with ``attempt``
        >= 1, the retry of the choices ``indices`` (``max_retries``)."""
        schema, mode = schema_of(body.response_format)
        gen = self.generator(mode)
        prompt = chat_prompt(body.messages)
        overrides: dict[str, Any] = {}
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is not None:
            overrides["max_tokens"] = max_tokens
        if body.temperature is not None:
            overrides["temperature"] = float(body.temperature)
        if body.top_p is not None:
            overrides["top_p"] = float(body.top_p)
        if body.top_k is not None:
            overrides["top_k"] = max(body.top_k, 0)  # -1: off, as in vLLM
        if body.repetition_penalty is not None:
            overrides["repetition_penalty"] = body.repetition_penalty
        if body.no_repeat_ngram_size is not None:
            overrides["no_repeat_ngram_size"] = body.no_repeat_ngram_size
        out = []
        for i in range(body.n) if indices is None else indices:
            options = {**overrides, "seed": None if body.seed is None else body.seed + i}
            if attempt:
                # the library's definition of retry k (Generator.batch, max_retries): sampled at
                # the request's temperature or the retry temperature, seed + k
                options = gen.retry_options(options, attempt, DEFAULT_RETRY_TEMPERATURE)
            try:
                req, spec = gen.make_request(prompt, schema=schema, **options)
            except ConstrainedSpecError as e:
                raise api_error(e, schema_param=("response_format.json_schema.schema"
                                                 if body.response_format and
                                                 body.response_format.get("type") == "json_schema"
                                                 else "response_format")) from e
            out.append((req, spec, mode))
        return out

    async def outcome_async(self, choice: Choice) -> Outcome:
        """`outcome`, computed on the finish threads, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.finish, self.outcome, choice)

    def outcome(self, choice: Choice) -> Outcome:
        """The final text and finish_reason of a finished choice (or its error)."""
        req = choice.request
        tokens = len(req.output_ids)
        if choice.text.stopped:
            return Outcome(choice.text.text, "stop", completion_tokens=tokens)
        result = self.generator(choice.mode).finalize(req, choice.spec, return_result=True)
        if isinstance(result, IncompleteOutputError):
            return Outcome(result.partial_text, "length", completion_tokens=tokens, retryable=True)
        if isinstance(result, OutputValidationError) and choice.mode == "lenient":
            # strict false: best effort, as OpenAI's non-strict mode (logged, not refused)
            logger.warning("choice %d failed final validation (strict false): %s", choice.index, result)
            return Outcome(result.text, "stop", completion_tokens=tokens, retryable=True)
        if isinstance(result, BaseException):
            if req.finish_reason == "cancelled":
                return Outcome("", "cancelled", api_error(result), tokens)
            if req.error is not None:
                logger.error("request %s failed: %r", req.id, req.error)
            return Outcome("", "error", api_error(result), tokens,
                           retryable=isinstance(result, OutputValidationError))
        return Outcome(result.text, "stop", completion_tokens=tokens)


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(request: Request) -> None:
    """Return once the client has gone away (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _events(choices: Sequence[Choice]) -> AsyncIterator[tuple[Choice, list[int] | None]]:
    """Token ids of all choices as they arrive, and ``(choice, None)`` when one finishes."""
    queue: asyncio.Queue[tuple[Choice, list[int] | None]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        async for ids in choice.ticket:
            queue.put_nowait((choice, ids))
        queue.put_nowait((choice, None))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        running = len(choices)
        while running:
            choice, ids = await queue.get()
            running -= ids is None
            yield choice, ids
    finally:
        for t in tasks:
            t.cancel()


class Guard:
    """ASGI middleware: ``--api-key`` on /v1 routes (401), ``--max-request-bytes`` by
    Content-Length (413; the body reader enforces it on chunked bodies), and the response
    counter behind the ``http_responses`` metric."""

    def __init__(self, app: Any, config: ServerConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        error: APIError | None = None
        key = self.config.api_key
        if key and path.startswith("/v1"):
            given = headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
                error = APIError(401, "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                                 code="invalid_api_key")
        if error is None:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                length = 0
            if length > self.config.max_request_bytes:
                error = APIError(413, f"the request body is larger than "
                                 f"{self.config.max_request_bytes} bytes", code="request_too_large")
        counted = self.config.http_responses
        route = path if path in ("/v1/chat/completions", "/v1/models", "/health", "/metrics") else "other"

        started = False

        async def counting_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                counted[(route, message["status"])] += 1
            await send(message)

        if error is not None:
            await error.response()(scope, receive, counting_send)
            return
        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            # Starlette's outermost middleware answers an unhandled error (the app's
            # "internal_error" 500), past this one: count that response here
            if not started:
                counted[(route, 500)] += 1
            raise


def create_app(model: Any, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``model`` (a :class:`~constrained_spec.LoadedModel`)."""
    server = Server(model, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.loop.start()
        try:
            yield
        finally:
            server.loop.stop()
            server.prep.shutdown(wait=False, cancel_futures=True)
            server.finish.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="constrained_spec OpenAI-compatible server", version=__version__,
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server

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

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "running": server.loop.running, "waiting": server.loop.waiting}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model",
                                            "created": server.created, "owned_by": "constrained_spec"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_body(await _read_body(request, config.max_request_bytes))
        if body.model != config.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{config.model_name!r}", param="model", code="model_not_found")
        capacity = config.max_batch_size + config.max_queue
        if body.n > capacity:
            raise APIError(400, f"n={body.n} is more than this server holds at once ({capacity})",
                           param="n")
        stop = stop_strings(body.stop)
        loop = asyncio.get_running_loop()
        try:
            built = await loop.run_in_executor(server.prep, server.build_requests, body)
            tickets = server.loop.submit([req for req, _, _ in built])
        except ConstrainedSpecError as e:
            raise api_error(e) from e
        choices = [Choice(i, t, spec, mode, ChoiceText(server.decode, stop if spec is None else ()))
                   for i, (t, (_, spec, mode)) in enumerate(zip(tickets, built))]
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(
                _stream(server, request, choices, completion_id, body.model, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _complete(server, request, body, choices, completion_id)

    if config.enable_metrics:
        registry = metrics_registry(server)

        @app.get("/metrics")
        async def metrics() -> Response:
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(Guard, config=config)
    return app


async def _run_choices(choices: Sequence[Choice], on_text: Any = None, on_done: Any = None) -> None:
    """Consume every choice's tokens; cancel a choice at its stop string."""
    async for choice, ids in _events(choices):
        if ids is None:
            if on_done is not None:
                await on_done(choice)
            continue
        delta = choice.text.feed(ids)
        if choice.text.stopped:
            choice.ticket.cancel()
        if delta and on_text is not None:
            await on_text(choice, delta)


def _usage(choices: Sequence[Choice], outcomes: Sequence[Outcome]) -> dict[str, int]:
    prompt = len(choices[0].request.prompt_ids)
    completion = sum(o.completion_tokens for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


async def _run_attempts(server: Server, body: ChatCompletionRequest,
                        choices: Sequence[Choice]) -> list[Outcome]:
    """Run the choices to their outcomes. With ``max_retries``, a choice that ended incomplete or
    invalid runs again as a new request (retry k: sampled, seed + k, as in the library) until
    one attempt succeeds or the retries run out; its outcome is its last attempt's."""
    await _run_choices(choices)
    outcomes = [await server.outcome_async(c) for c in choices]
    for attempt in range(1, (body.max_retries or 0) + 1):
        again = [c for c, o in zip(choices, outcomes) if o.retryable]
        if not again:
            break
        build = functools.partial(server.build_requests, body, attempt=attempt,
                                  indices=[c.index for c in again])
        built = await asyncio.get_running_loop().run_in_executor(server.prep, build)
        try:
            tickets = server.loop.submit([req for req, _, _ in built])
        except ConstrainedSpecError as e:
            raise api_error(e) from e
        for c, ticket in zip(again, tickets):
            c.ticket, c.text = ticket, ChoiceText(server.decode, c.text.stop)
        await _run_choices(again)
        for c in again:
            outcomes[c.index] = await server.outcome_async(c)
    return outcomes


async def _complete(server: Server, request: Request, body: ChatCompletionRequest,
                    choices: Sequence[Choice], completion_id: str) -> Response:
    created = int(time.time())
    work = asyncio.create_task(_run_attempts(server, body, choices))
    gone = asyncio.create_task(_disconnected(request))
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
        "choices": [{"index": c.index, "message": {"role": "assistant", "content": o.text, "refusal": None},
                     "logprobs": None, "finish_reason": o.finish_reason}
                    for c, o in zip(choices, outcomes)],
        "usage": _usage(choices, outcomes),
    })


async def _stream(server: Server, request: Request, choices: Sequence[Choice], completion_id: str,
                  model: str, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(items: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        data: dict[str, Any] = {"id": completion_id, "object": "chat.completion.chunk",
                                "created": created, "model": model, "system_fingerprint": None,
                                "choices": items}
        if include_usage:
            data["usage"] = usage
        return _sse(data)

    def delta(choice: Choice, content: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {"index": choice.index, "delta": content, "logprobs": None, "finish_reason": finish_reason}

    # one queue for everything the response waits on: SSE chunks, the end (None), the
    # client going away (_GONE) and a failure of the producer (the exception)
    out: asyncio.Queue[Any] = asyncio.Queue()

    async def on_text(choice: Choice, text: str) -> None:
        out.put_nowait(chunk([delta(choice, {"content": text})]))

    outcomes: dict[int, Outcome] = {}

    async def on_done(choice: Choice) -> None:
        o = outcomes[choice.index] = await server.outcome_async(choice)
        if o.error is not None:
            raise o.error
        rest = choice.text.finish(o.text)
        out.put_nowait(chunk([delta(choice, {"content": rest} if rest else {}, o.finish_reason)]))

    async def produce() -> None:
        try:
            await _run_choices(choices, on_text, on_done)
            if include_usage:
                out.put_nowait(chunk([], _usage(choices, [outcomes[c.index] for c in choices])))
            out.put_nowait(None)
        except Exception as e:  # noqa: BLE001 -- sent as an error event, then [DONE] (as vLLM)
            out.put_nowait(e)

    async def watch() -> None:
        await _disconnected(request)
        out.put_nowait(_GONE)

    tasks = [asyncio.create_task(produce()), asyncio.create_task(watch())]
    ended = False
    try:
        yield chunk([delta(c, {"role": "assistant", "content": ""}) for c in choices])
        while (item := await out.get()) is not None:
            if item is _GONE:
                return
            if isinstance(item, BaseException):
                if not isinstance(item, APIError):
                    logger.error("%s failed", completion_id, exc_info=item)
                e = api_error(item)
                yield _sse(envelope(e.message, e.type, e.param, e.code))
                break
            yield item
        ended = True
        yield "data: [DONE]\n\n"
    finally:
        # runs on completion, on a client disconnect (Starlette cancels the stream), on errors
        if not ended and not all(c.ticket.done for c in choices):
            logger.info("%s: client disconnected; cancelling", completion_id)
        for t in tasks:
            t.cancel()
        for c in choices:
            c.ticket.cancel()


_GONE = object()


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


# ------------------------------------------------------------------------------------------------
# Prometheus metrics
# ------------------------------------------------------------------------------------------------


def metrics_registry(server: Server) -> Any:
    """A registry whose collector reads the engine loop's counters at scrape time."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    class EngineCollector:
        def collect(self) -> Any:
            s = server.loop.metrics.snapshot()
            p = "constrained_spec_"
            c = CounterMetricFamily(p + "requests", "Finished requests, by finish reason",
                                    labels=["finish_reason"])
            for reason, n in sorted(s["finished"].items()):
                c.add_metric([reason], n)
            yield c
            yield CounterMetricFamily(p + "requests_submitted", "Requests accepted into the queue",
                                      value=s["submitted"])
            yield CounterMetricFamily(p + "requests_rejected", "Requests refused because the queue "
                                      "was full (429)", value=s["rejected"])
            h = CounterMetricFamily(p + "http_responses", "HTTP responses, by route and status",
                                    labels=["route", "status"])
            for (route, status), n in sorted(server.config.http_responses.items()):
                h.add_metric([route, str(status)], n)
            yield h
            yield CounterMetricFamily(p + "prompt_tokens", "Prompt tokens of finished requests",
                                      value=s["prompt_tokens"])
            yield CounterMetricFamily(p + "generation_tokens", "Generated (accepted) tokens",
                                      value=s["generated_tokens"])
            yield GaugeMetricFamily(p + "generation_tokens_per_second",
                                    "Generated tokens per second over the last 10 s",
                                    value=s["tokens_per_s"])
            yield CounterMetricFamily(p + "engine_steps", "Batched engine steps", value=s["steps"])
            yield CounterMetricFamily(p + "engine_failed_steps", "Engine steps whose shared target "
                                      "forward or verification failed", value=s["failed_steps"])
            yield CounterMetricFamily(p + "engine_step_seconds", "Time spent in engine steps",
                                      value=s["step_s"])
            yield CounterMetricFamily(p + "target_forwards", "Target forwards, counted per request "
                                      "(finished requests)", value=s["target_forwards"])
            yield CounterMetricFamily(p + "drafted_tokens", "Drafted tokens (finished requests)",
                                      value=s["drafted_tokens"])
            yield CounterMetricFamily(p + "accepted_tokens", "Accepted drafts (finished requests)",
                                      value=s["accepted_tokens"])
            yield GaugeMetricFamily(p + "acceptance_length", "Tokens emitted per target forward "
                                    "(finished requests; 1.0 without speculation)",
                                    value=s["acceptance_length"])
            yield GaugeMetricFamily(p + "acceptance_rate", "Accepted / drafted tokens (finished "
                                    "requests)", value=s["acceptance_rate"])
            g = GaugeMetricFamily(p + "acceptance_rate_by_position", "Of the steps that drafted "
                                  "position i, the share that accepted it", labels=["position"])
            for i, rate in enumerate(s["acceptance_rate_by_position"], start=1):
                g.add_metric([str(i)], rate)
            yield g
            yield GaugeMetricFamily(p + "queue_depth", "Requests waiting for a slot",
                                    value=server.loop.waiting)
            yield GaugeMetricFamily(p + "running_requests", "Requests in the running batch",
                                    value=server.loop.running)
            slots = server.loop.slots_in_use
            if slots is not None:
                yield GaugeMetricFamily(p + "kv_slots_in_use", "KV-cache slots held by the model "
                                        "runner (running requests; more would be a leak)",
                                        value=slots)
            lat = HistogramMetricFamily(p + "request_latency_seconds", "Time from queueing to the "
                                        "end of generation")
            lat.add_metric([], [(str(b), n) for b, n in s["latency_buckets"]], s["latency_sum"])
            yield lat

    registry = CollectorRegistry()
    registry.register(EngineCollector())
    return registry


# ------------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="openai_server.py", description="An OpenAI-compatible chat-completions server: "
        "schema-constrained outputs, speculative decoding, continuous batching.")
    model = parser.add_argument_group("model and speculation (as the constrained-spec command)")
    model.add_argument("--model", metavar="PATH", default=None,
                       help="a checkpoint folder or .gguf file (default: the embedded model)")
    model.add_argument("--served-model-name", metavar="NAME", default=None,
                       help="the model id clients send and /v1/models lists (default: the model's name)")
    model.add_argument("--speculative-config", metavar="JSON",
                       help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 5}\'')
    model.add_argument("--speculative-algorithm", metavar="METHOD",
                       choices=[*METHODS, "deepseek_mtp"], help=f"the drafter: {', '.join(METHODS)}")
    model.add_argument("--speculative-num-draft-tokens", type=int, metavar="N",
                       help="drafts proposed per step")
    model.add_argument("--speculative-draft-model", metavar="PATH", help="the drafter's weights")
    model.add_argument("--no-speculation", action="store_true",
                       help="plain decoding: no drafts at all, not even forced tokens")
    model.add_argument("--backend", choices=("xgrammar", "outlines"), default="xgrammar",
                       help="grammar backend (default: %(default)s)")
    serve = parser.add_argument_group("serving")
    serve.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 routes (else 401)")
    serve.add_argument("--max-batch-size", type=int, default=8,
                       help="requests decoded together (default: %(default)s)")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="requests waiting for a slot; past it the server answers 429 "
                            "(default: %(default)s)")
    serve.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help="larger request bodies are refused with 413 (default: %(default)s)")
    serve.add_argument("--max-tokens", type=int, default=512,
                       help="max_tokens of a request that gives none (default: %(default)s)")
    serve.add_argument("--enable-metrics", action="store_true",
                       help="expose Prometheus metrics on GET /metrics")
    serve.add_argument("--log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug"))
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_batch_size < 1 or args.max_queue < 0 or args.max_request_bytes < 1:
        parser.error("--max-batch-size and --max-request-bytes must be >= 1, --max-queue >= 0")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(levelname)s:     %(name)s: %(message)s")
    logging.captureWarnings(True)  # schema pre-flight warnings become log lines
    try:
        speculative = speculative_from_args(args)
    except ConfigError as e:
        parser.error(str(e))
    import uvicorn

    from constrained_spec.models import load_model

    logger.info("loading the model %s", args.model or "(embedded default)")
    with contextlib.redirect_stdout(sys.stderr):  # stdout is uvicorn's
        try:
            loaded = load_model(args.model)
        except ConstrainedSpecError as e:
            parser.exit(5, f"openai_server.py: model error: {e}\n")
        config = ServerConfig(
            model_name=args.served_model_name or loaded.name, speculative=speculative,
            backend=args.backend, max_batch_size=args.max_batch_size, max_queue=args.max_queue,
            max_tokens=args.max_tokens, api_key=args.api_key,
            max_request_bytes=args.max_request_bytes, enable_metrics=args.enable_metrics)
        try:
            app = create_app(loaded, config)
        except ConfigError as e:
            parser.error(str(e))
    logger.info("serving %s (speculation: %s, max batch %d, queue %d)", config.model_name,
                app.state.server.generator("default").speculative or "off",
                args.max_batch_size, args.max_queue)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
