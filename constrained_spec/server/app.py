"""The app factory: the server's state, its ASGI guard, ``create_app`` and ``serve``.

Design: the handlers (``routes``) turn a request into engine requests with
:meth:`Generator.make_request <constrained_spec.api.Generator.make_request>` (schema compile +
prompt encoding, on one helper thread) and submit them to ONE
:class:`~constrained_spec.generation.serving.EngineLoop`, which batches every in-flight request in a
background thread (continuous batching, each request with its own schema and pre-flight
mode). One :class:`Generator` serves every request: the model, its runner and drafter are
loaded once, and everything a request sets (schema, mode, sampling, levers) is per call.
Final validation of a finished output runs on two more helper threads, so the event loop
(and ``/health``) never waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI

from constrained_spec import __version__
from constrained_spec.api import Generator, RetryPolicy
from constrained_spec.errors import (
    ConfigError,
    ConstrainedSpecError,
    IncompleteOutputError,
    OutputValidationError,
)
from constrained_spec.frontend.tools import ToolParser
from constrained_spec.generation.serving import EngineLoop
from constrained_spec.server.protocol import (
    DEFAULT_MAX_REQUEST_BYTES,
    APIError,
    ChatCompletionRequest,
    SchemaMode,
    api_error,
    chat_prompt,
    schema_of,
    toolset_of,
)
from constrained_spec.server.streaming import Choice, Outcome

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """What ``create_app`` needs besides the model; checked on construction."""

    model_name: str = ""  # the name clients send and see; "" in `serve`: the loaded model's
    speculative: Any = None  # SpeculativeConfig | False | None, as Generator takes it
    backend: Literal["xgrammar", "outlines"] = "xgrammar"
    max_batch_size: int = 8
    max_queue: int = 64
    max_tokens: int = 512
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    enable_metrics: bool = False
    http_responses: Counter = field(default_factory=Counter)  # (path, status) -> responses

    def __post_init__(self) -> None:
        for name, minimum in (("max_batch_size", 1), ("max_queue", 0), ("max_request_bytes", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"must be an integer >= {minimum}, got {value!r}", option=name)


class Server:
    """The state behind the routes: one Generator, the engine loop, the helper threads."""

    def __init__(self, model: Any, config: ServerConfig) -> None:
        self.config = config
        # fails on a bad speculative config before serving
        self.generator: Generator[Any] = Generator(
            model, speculative=config.speculative, backend=config.backend,
            max_tokens=config.max_tokens, max_batch_size=config.max_batch_size)
        self.model = self.generator.model
        self.loop = EngineLoop(self.generator.new_engine(), max_batch_size=config.max_batch_size,
                               max_queue=config.max_queue)
        # schema compiles and prompt encoding run here, off the event loop and off the engine
        self.prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openai-server-prep")
        # final validation (jsonschema, Pydantic) of finished outputs runs here: it takes time
        # on large outputs, and the event loop must keep answering (/health) meanwhile
        self.finish = ThreadPoolExecutor(max_workers=2, thread_name_prefix="openai-server-finish")
        self.created = int(time.time())
        #: retry attempts run (``max_retries``): the ``retries`` metric
        self.retries = 0

    @staticmethod
    def retry_policy(body: ChatCompletionRequest) -> RetryPolicy:
        """The library's retry rule for a request's ``max_retries`` (at its default temperature):
        absent, the library's default (:data:`~constrained_spec.api.DEFAULT_MAX_RETRIES`), none
        for a streamed request (``parse_body`` has refused an explicit count with ``stream``)."""
        return RetryPolicy.resolve(body.max_retries, streaming=body.stream)

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.tokenizer.decode(list(ids))

    def build_requests(self, body: ChatCompletionRequest, *, attempt: int = 0,
                       indices: Sequence[int] | None = None) -> list[tuple[Any, Any, SchemaMode]]:
        """Engine requests for the ``n`` choices (runs on the prep thread); with ``attempt``
        >= 1, the retry of the choices ``indices`` (``max_retries``, :class:`RetryPolicy`)."""
        schema, mode = schema_of(body.response_format)
        tools = toolset_of(body)
        prompt = chat_prompt(body.messages)
        overrides = _sampling_overrides(body)
        policy = self.retry_policy(body)
        schema_param = ("response_format.json_schema.schema" if body.response_format and
                        body.response_format.get("type") == "json_schema" else "response_format")
        out = []
        for i in range(body.n) if indices is None else indices:
            # OpenAI's n and seed: choice i uses seed + i; retry k of it seed + i + k
            options = {**overrides, "seed": None if body.seed is None else body.seed + i}
            options = policy.options(options, attempt, self.generator.sampling)
            try:
                req, spec = self.generator.make_request(prompt, schema=schema, schema_mode=mode,
                                                        tools=tools, **options)
            except ConstrainedSpecError as e:
                raise api_error(e, schema_param=schema_param) from e
            out.append((req, spec, mode))
        return out

    async def outcome_async(self, choice: Choice) -> Outcome:
        """`outcome`, computed on the finish threads, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.finish, self.outcome, choice)

    def outcome(self, choice: Choice) -> Outcome:
        """The final text and finish_reason of a finished choice (or its error), with a
        reasoning model's thinking."""
        o = self._outcome(choice)
        if choice.thought is not None:
            result = o.result
            o.reasoning = getattr(result, "reasoning", None)
            if o.reasoning is None:  # an error or a stop string: what was thought until then
                o.reasoning = choice.thought.text.strip()
                if o.finish_reason == "length":  # the answer part of the partial output
                    o.text = choice.text.text
        return o

    def _outcome(self, choice: Choice) -> Outcome:
        req = choice.request
        tokens = len(req.output_ids)
        if choice.text.stopped:
            return Outcome(choice.text.text, "stop", completion_tokens=tokens)
        result = self.generator.finalize(req, choice.spec, return_result=True)
        if isinstance(result, IncompleteOutputError):
            # "length", or another way the engine ended the output early (a detected loop):
            # OpenAI's finish reasons have one word for a cut output, "length"
            return Outcome(result.partial_text, "length",
                           completion_tokens=tokens, result=result)
        if isinstance(result, OutputValidationError) and choice.mode == "lenient":
            # strict false: best effort, as OpenAI's non-strict mode (logged, not refused)
            logger.warning("choice %d failed final validation (strict false): %s", choice.index, result)
            return Outcome(result.text, "stop", completion_tokens=tokens, result=result)
        if isinstance(result, BaseException):
            if req.finish_reason == "cancelled":
                return Outcome("", "cancelled", api_error(result), tokens, result=result)
            if req.error is not None:
                logger.error("request %s failed: %r", req.id, req.error)
            return Outcome("", "error", api_error(result), tokens, result=result)
        if isinstance(choice.spec.target if choice.spec is not None else None, ToolParser):
            content, calls = choice.spec.target.split(result.text)
            if calls:
                return Outcome(content, "tool_calls", completion_tokens=tokens, result=result,
                               tool_calls=calls)
        return Outcome(result.text, "stop", completion_tokens=tokens, result=result)


def _sampling_overrides(body: ChatCompletionRequest) -> dict[str, Any]:
    """The Generator call options a request sets (absent fields keep the server's defaults)."""
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
    if body.max_reasoning_tokens is not None:
        overrides["max_reasoning_tokens"] = body.max_reasoning_tokens
    return overrides


class Guard:
    """ASGI middleware: ``--api-key`` on /v1 routes (401), ``--max-request-bytes`` by
    Content-Length (413; the body reader enforces it on chunked bodies), and the response
    counter behind the ``http_responses`` metric."""

    def __init__(self, app: Any, config: ServerConfig) -> None:
        self.app = app
        self.config = config

    def _refusal(self, path: str, headers: dict[str, str]) -> APIError | None:
        key = self.config.api_key
        if key and path.startswith("/v1"):
            given = headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return APIError(401, "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                                code="invalid_api_key")
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            length = 0
        if length > self.config.max_request_bytes:
            return APIError(413, f"the request body is larger than "
                            f"{self.config.max_request_bytes} bytes", code="request_too_large")
        return None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        error = self._refusal(path, headers)
        counted = self.config.http_responses
        route = path if path in ("/v1/chat/completions", "/v1/models", "/health", "/metrics") else "other"
        started = False

        async def counting_send(message: MutableMapping[str, Any]) -> None:
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
    """The FastAPI app serving ``model`` (a :class:`~constrained_spec.LoadedModel`, or anything
    :func:`~constrained_spec.model.loading.load_model` takes); its state is ``app.state.server``.

    The engine loop runs while the app's lifespan does: serve it with uvicorn, mount it in a
    larger ASGI app, or add routes of your own to it.
    """
    from constrained_spec.server.metrics import metrics_registry
    from constrained_spec.server.routes import add_routes

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
    add_routes(app, server, metrics_registry(server) if config.enable_metrics else None)
    app.add_middleware(Guard, config=config)
    return app


def serve(model: str | None, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> int:
    """Load ``model`` (None: the embedded default), build the app and serve it until stopped.

    ``constrained-spec serve`` builds ``config`` from its flags (`constrained_spec.cli.args`);
    an empty ``config.model_name`` becomes the loaded model's name. Logs go to stderr at
    ``log_level``; stdout carries uvicorn's access log only.
    """
    import uvicorn

    from constrained_spec.model.loading import load_model

    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(levelname)s:     %(name)s: %(message)s")
    logging.captureWarnings(True)  # schema pre-flight warnings become log lines
    logger.info("loading the model %s", model or "(embedded default)")
    with contextlib.redirect_stdout(sys.stderr):  # stdout is uvicorn's
        loaded = load_model(model)
        config = dataclasses.replace(config, model_name=config.model_name or loaded.name)
        app = create_app(loaded, config)
    logger.info("serving %s (speculation: %s, max batch %d, queue %d)", config.model_name,
                app.state.server.generator.speculative or "off", config.max_batch_size,
                config.max_queue)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
    return 0
