"""The app factory: the ASGI guard (body limit, API key), ``create_app`` and ``serve``.

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

import contextlib
import dataclasses
import logging
import secrets
import sys
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

from fastapi import FastAPI

from constrained_spec import __version__
from constrained_spec.server.protocol import (
    APIError,
)
from constrained_spec.server.state import Server, ServerConfig

logger = logging.getLogger(__name__)


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
