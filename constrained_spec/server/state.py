"""The server's state: its config, and the one Generator and engine loop behind every route.

`ServerConfig` is what `create_app` needs besides the model (the command line builds it from
its flags, `constrained_spec.cli.args.server_config_from_args`); `Server` holds the Generator,
the engine loop and the helper threads, and turns a request body into running choices.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from constrained_spec.api import Generator, RetryPolicy
from constrained_spec.errors import (
    ConfigError,
    ConstrainedSpecError,
    IncompleteOutputError,
    OutputValidationError,
)
from constrained_spec.frontend.tools import ToolParser
from constrained_spec.generation.serving import EngineLoop
from constrained_spec.server.choices import Choice, Outcome
from constrained_spec.server.protocol import (
    DEFAULT_MAX_REQUEST_BYTES,
    ChatCompletionRequest,
    SchemaMode,
    api_error,
    chat_prompt,
    schema_of,
    toolset_of,
)

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
