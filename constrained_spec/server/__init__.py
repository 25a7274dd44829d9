"""The OpenAI-compatible chat-completions server over constrained_spec (the ``app`` extra).

    constrained-spec serve --port 8000 [--api-key-file FILE] [--enable-metrics]

or, embedded in your own program (``examples/openai_server.py``)::

    from constrained_spec import load_model
    from constrained_spec.server import ServerConfig, create_app

    model = load_model(None)
    app = create_app(model, ServerConfig(model_name=model.name))   # a FastAPI app

Modules: ``protocol`` (the request body and OpenAI's error envelope), ``state`` (the config
and the Generator + engine loop behind the routes), ``choices`` (one choice while it runs and
its outcome), ``routes``, ``streaming`` (stop strings, SSE), ``metrics`` (Prometheus) and
``app`` (the app factory and `serve`). Without fastapi and uvicorn installed, importing this package raises
:class:`AppExtraMissingError`, which names the extra to install.

Differences from OpenAI's API, on purpose: ``temperature`` defaults to 0 (greedy, the
library's default); ``stop`` applies to free text only (under a schema the grammar decides
where the output ends); ``json_schema.strict`` true refuses any keyword the grammar would not
enforce, absent refuses only unsupported ones, false only warns (and the output is then
returned even if it fails final validation). ``frequency_penalty`` / ``presence_penalty``
(additive, OpenAI's) are refused: ``repetition_penalty`` is the multiplicative one of vLLM and
transformers (here on the output's tokens only, not the prompt's). A choice whose output
failed is retried as in the library (``max_retries``, two by default), except in a streamed
request, which is never retried: a failed attempt's text would already be sent (an explicit
``max_retries`` > 0 with ``stream`` is refused).

Untrusted schemas: a ``$ref`` that does not resolve inside the schema is refused with a 400
naming its JSON pointer, whatever ``strict`` says; nothing a schema names is ever fetched or
read (docs/security.md).
"""

from __future__ import annotations

from constrained_spec.errors import ConfigError


class AppExtraMissingError(ConfigError, ImportError):
    """The server's dependencies (the ``app`` extra) are not installed."""


try:
    import fastapi  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:
    raise AppExtraMissingError(
        f"the OpenAI-compatible server needs the app extra ({e.name or 'fastapi'} is not "
        "installed): pip install constrained_spec[app]", option="serve") from e

from constrained_spec.server.app import create_app, serve  # noqa: E402
from constrained_spec.server.protocol import DEFAULT_MAX_REQUEST_BYTES, MAX_RETRIES, APIError  # noqa: E402
from constrained_spec.server.state import Server, ServerConfig  # noqa: E402

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "MAX_RETRIES", "APIError", "AppExtraMissingError", "Server", "ServerConfig",
           "create_app", "serve"]
