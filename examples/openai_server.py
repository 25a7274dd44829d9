"""Embed the OpenAI-compatible server in your own program.

The server is part of the package (the ``app`` extra: ``pip install constrained_spec[app]``);
``constrained-spec serve --port 8000`` runs it as it is. This script builds the same app by
hand, to show the pieces you would use to embed it: load the model once, build the FastAPI
app over it with ``create_app``, add routes of your own, and serve it with uvicorn (or mount
it in a larger ASGI app). It takes the flags of ``constrained-spec serve``:

    python examples/openai_server.py --port 8000 [--api-key-file FILE] [--enable-metrics]

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY")
    person = client.beta.chat.completions.parse(model=..., messages=[...], response_format=Person)
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

import uvicorn

from constrained_spec import load_model
from constrained_spec.cli.args import engine_options_from_args, server_config_from_args
from constrained_spec.cli.parser import build_parser
from constrained_spec.server import create_app
from constrained_spec.server.state import check_exposure


def main(argv: list[str] | None = None) -> None:
    # the serve subcommand's own flags and checks
    args = build_parser().parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)

    config = server_config_from_args(args)  # bad flags fail before the model loads
    # loaded once (ours or vLLM's engine: --engine): every request shares its weights and drafter
    model = load_model(args.model, **engine_options_from_args(args))
    config = dataclasses.replace(config, model_name=config.model_name or model.name)
    app = create_app(model, config)  # the engine loop starts and stops with the app's lifespan
    server = app.state.server  # the state behind the routes: generator, engine loop, threads

    @app.get("/stats")  # a route of your own, beside the OpenAI ones
    async def stats() -> dict[str, Any]:
        return {"model": config.model_name, "running": server.loop.running,
                "waiting": server.loop.waiting,
                "speculation": str(server.generator.speculative or "off")}

    if check_exposure(args.host, config):  # beyond loopback without a key, on purpose
        logging.warning("serving on %s WITHOUT an API key (--allow-unauthenticated)", args.host)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
