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
import hashlib
import logging
import secrets
import sys
from collections.abc import AsyncIterator, Mapping, MutableMapping
from typing import Any

from fastapi import FastAPI

from constrained_spec import __version__
from constrained_spec.server.protocol import (
    APIError,
    internal_error,
)
from constrained_spec.server.state import Server, ServerConfig, check_bind, check_exposure

logger = logging.getLogger(__name__)


class Guard:
    """ASGI middleware: the API key on every route but ``/health`` (401), ``--max-request-bytes``
    by Content-Length (413; the body reader enforces it on chunked bodies), the response
    counter behind the ``http_responses`` metric, and the 500 of an unexpected error before
    the response started, which leaves the connection open.

    With a key set, ``/health`` alone stays open (a liveness probe; it shows two queue
    counts); ``/metrics``, the ``/v1`` routes and any route an embedding program adds need
    ``Authorization: Bearer KEY`` (a Prometheus scrape config takes a bearer token). The key is
    compared in constant time (`Guard.authorized`).
    """

    OPEN_PATHS = frozenset({"/health"})
    #: the paths counted by name in the ``http_responses`` metric (any other: "other")
    ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                        "/metrics", "/tokenize", "/detokenize", "/version"})

    def __init__(self, app: Any, config: ServerConfig) -> None:
        self.app = app
        self.config = config

    @staticmethod
    def authorized(authorization: list[bytes], key: str) -> bool:
        """Whether the request's ``Authorization`` header values (raw bytes, as received) carry
        ``key``: exactly one header, the scheme ``Bearer`` (any case), then the key.

        The token is compared as SHA-256 digests with `secrets.compare_digest`: equal lengths
        whatever was sent, so the time taken tells neither the key's bytes nor its length. Raw
        bytes are compared, so a header of any bytes (non-ASCII, invalid UTF-8) is just a wrong
        key, a 401.
        """
        if len(authorization) != 1:
            return False
        scheme, _, token = authorization[0].strip().partition(b" ")
        expected = hashlib.sha256(key.encode("ascii")).digest()
        given = hashlib.sha256(token.lstrip(b" ")).digest()
        return secrets.compare_digest(given, expected) and scheme.lower() == b"bearer"

    def _refusal(self, path: str, headers: dict[str, str],
                 authorization: list[bytes]) -> APIError | None:
        key = self.config.api_key
        if key is not None and path not in self.OPEN_PATHS and not self.authorized(authorization, key):
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
        authorization = [v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"]
        key = self.config.api_key
        if scope["type"] == "websocket" and key is not None and not self.authorized(authorization, key):
            # a route an embedding program adds: closing before accepting refuses the handshake
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        error = self._refusal(path, headers, authorization)
        counted = self.config.http_responses
        route = path if path in self.ROUTES else "other"
        started = False

        async def counting_send(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                counted[(route, message["status"])] += 1
            await send(message)

        if error is not None:
            response = error.response()
            if error.status == 401:
                response.headers["WWW-Authenticate"] = "Bearer"  # RFC 6750
            await response(scope, receive, counting_send)
            return
        try:
            await self.app(scope, receive, counting_send)
        except Exception as exc:
            if started:  # mid-response: only ending the connection tells the client
                raise
            # answered here, not re-raised: Starlette's outermost middleware would answer the
            # same 500 and then re-raise, and uvicorn closes the connection of an exception
            # it sees, so a keep-alive client would lose its next, innocent request
            logger.exception("unhandled error on %s", path)
            await internal_error(exc)(scope, receive, counting_send)



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
        server.start_compile_worker()
        try:
            yield
        finally:
            server.loop.stop()
            server.close_compile_workers()
            server.prep.shutdown(wait=False, cancel_futures=True)
            server.finish.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="constrained_spec OpenAI-compatible server", version=__version__,
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    add_routes(app, server, metrics_registry(server) if config.enable_metrics else None)
    app.add_middleware(Guard, config=config)
    return app


def serve(model: str | None, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", load_options: Mapping[str, Any] | None = None) -> int:
    """Load ``model`` (None: the embedded default), build the app and serve it until stopped.

    ``constrained-spec serve`` builds ``config`` from its flags (`constrained_spec.cli.args`);
    an empty ``config.model_name`` becomes the loaded model's name. Logs go to stderr at
    ``log_level``; stdout carries uvicorn's access log only.

    ``load_options``: more keywords for ``load_model`` (``engine="vllm"`` and its options:
    vLLM's engine under the same routes, docs/scale-out.md).

    A ``host`` beyond loopback without ``config.api_key`` is a `ConfigError` unless
    ``config.allow_unauthenticated`` (`check_exposure`), and so is an address the server could
    not listen on (`check_bind`): both raised before the model loads.
    """
    import uvicorn

    from constrained_spec.model.loading import load_model

    check_bind(host, port)  # before the model's seconds of loading, as the exposure check
    exposed_without_key = check_exposure(host, config)
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(levelname)s:     %(name)s: %(message)s")
    logging.captureWarnings(True)  # schema pre-flight warnings become log lines
    if exposed_without_key:
        logger.warning("serving on %s port %d WITHOUT an API key (--allow-unauthenticated): "
                       "anyone who can reach this address can use the model", host, port)
    logger.info("loading the model %s", model or "(embedded default)")
    with contextlib.redirect_stdout(sys.stderr):  # stdout is uvicorn's
        loaded = load_model(model, **(load_options or {}))
        config = dataclasses.replace(config, model_name=config.model_name or loaded.name)
        app = create_app(loaded, config)
    logger.info("serving %s (speculation: %s, max batch %d, queue %d)", config.model_name,
                app.state.server.generator.speculative or "off", config.max_batch_size,
                config.max_queue)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
    return 0
