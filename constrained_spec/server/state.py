"""The server's state: its config, and the one Generator and engine loop behind every route.

`ServerConfig` is what `create_app` needs besides the model (the command line builds it from
its flags, `constrained_spec.cli.args.server_config_from_args`); `Server` holds the Generator,
the engine loop and the helper threads, and turns a request body into running choices.

The API key and the address: `resolve_api_key` takes the key from exactly one of ``--api-key``,
``CONSTRAINED_SPEC_API_KEY`` or ``--api-key-file`` (the last two keep it out of ``ps``, which
shows every process's command line to every local user), and `check_exposure` refuses to serve
an address beyond loopback without a key unless ``allow_unauthenticated`` says it is on purpose.
An empty key is an error, never "authentication off".
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import stat
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
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
from constrained_spec.grammar import CompileWorkers
from constrained_spec.server.choices import Choice, Outcome, schema_warnings
from constrained_spec.server.completions import prompt_ids, raw_request, token_limit
from constrained_spec.server.protocol import (
    DEFAULT_MAX_REQUEST_BYTES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    RequestFields,
    SchemaMode,
    api_error,
    chat_prompt,
    toolset_of,
)
from constrained_spec.server.structured import constraint_of

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
    # 'Authorization: Bearer KEY' on every route but /health; kept out of the repr (logs)
    api_key: str | None = field(default=None, repr=False)
    # serve beyond loopback without a key on purpose (`check_exposure`)
    allow_unauthenticated: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    enable_metrics: bool = False
    http_responses: Counter = field(default_factory=Counter)  # (path, status) -> responses

    def __post_init__(self) -> None:
        for name, minimum in (("max_batch_size", 1), ("max_queue", 0), ("max_request_bytes", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"must be an integer >= {minimum}, got {value!r}", option=name)
        if self.api_key is not None:
            check_api_key(self.api_key, "api_key")
        if not isinstance(self.allow_unauthenticated, bool):
            raise ConfigError(f"must be True or False, got {self.allow_unauthenticated!r}",
                              option="allow_unauthenticated")


#: threads preparing requests (schema compiles, chat templates, prompt encoding)
PREP_THREADS = 4
#: child processes compiling grammars at once (each about 290 MB resident, 200 MB of it its
#: own: xgrammar imports torch); the first starts with the server, the second when two
#: compiles overlap
COMPILE_PROCESSES = 2

API_KEY_ENV = "CONSTRAINED_SPEC_API_KEY"
#: the longest key accepted (a key file's first line is read up to this many bytes)
MAX_API_KEY_BYTES = 4096


def check_api_key(key: Any, source: str) -> str:
    """``key`` if it can authenticate a request: a non-empty string of printable ASCII without
    spaces (it travels in an HTTP header, whose parsers strip surrounding blanks and may refuse
    other bytes). The key itself is never put in the message. ``source`` names where it came
    from (a flag, the variable, ``api_key``)."""
    if not isinstance(key, str):
        raise ConfigError(f"must be a string, got {type(key).__name__}", option=source)
    if not key.strip():
        raise ConfigError("the API key is empty; an empty key does not turn authentication "
                          "off: give a key, or give none (beyond loopback, serving without one "
                          "needs --allow-unauthenticated)", option=source)
    if len(key) > MAX_API_KEY_BYTES:
        raise ConfigError(f"the API key is longer than {MAX_API_KEY_BYTES} characters",
                          option=source)
    if not all("!" <= c <= "~" for c in key):
        raise ConfigError("the API key holds spaces, control or non-ASCII characters, which an "
                          "'Authorization: Bearer KEY' header cannot carry as they are: use "
                          "printable ASCII (e.g. python -c 'import secrets; "
                          "print(secrets.token_urlsafe(32))')", option=source)
    return key


def resolve_api_key(*, flag: str | None = None, file: str | None = None,
                    environ: Mapping[str, str] | None = None) -> str | None:
    """The server's API key from exactly one source: ``flag`` (``--api-key``, which ``ps``
    shows to every local user), the ``CONSTRAINED_SPEC_API_KEY`` variable of ``environ``
    (default ``os.environ``), or ``file`` (``--api-key-file``: its first line, stripped; a
    warning when group or others may read or write it). None when none is given; an empty
    value or two sources are a `ConfigError`."""
    env = os.environ if environ is None else environ
    given = {name: value for name, value in (("--api-key", flag), (API_KEY_ENV, env.get(API_KEY_ENV)),
                                             ("--api-key-file", file)) if value is not None}
    if len(given) > 1:
        raise ConfigError(f"the API key is given by both {' and '.join(given)}: give it one way "
                          "only", option=next(iter(given)))
    if not given:
        return None
    ((source, value),) = given.items()
    return check_api_key(_read_key_file(value) if source == "--api-key-file" else value, source)


def _read_key_file(path: str) -> str:
    """The first line of the key file ``path``, stripped (a pipe such as ``<(pass show key)``
    works too)."""
    option = "--api-key-file"
    try:
        with open(Path(path).expanduser(), "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            line = f.readline(MAX_API_KEY_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read the key file {path!r}: {e.strerror or e}",
                          option=option) from e
    if os.name == "posix" and stat.S_ISREG(mode) and mode & 0o066:
        logger.warning("the key file %s can be read or written by group or others (mode %s): "
                       "chmod 600 it", path, oct(stat.S_IMODE(mode)))
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"the key file {path!r} is not UTF-8 text", option=option) from e
    if len(line) > MAX_API_KEY_BYTES:
        raise ConfigError(f"the first line of the key file {path!r} is longer than "
                          f"{MAX_API_KEY_BYTES} bytes: it should hold the key alone",
                          option=option)
    return text.strip()


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only: ``localhost``, 127.0.0.0/8, ``::1``
    (or an IPv4-mapped loopback address). Any other name is not resolved and counts as
    exposed: what a name resolves to can change after the check, and a name may resolve to
    several addresses, so only the literal loopback forms are trusted."""
    name = host  # not stripped: "127.0.0.1 " is no address to bind (`check_bind` refuses it)
    if name.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def check_bind(host: str, port: int) -> None:
    """Refuse (`ConfigError` naming ``host`` or ``port``) an address the server could not
    listen on, before the model's seconds of loading: a port outside 0..65535, a host with
    spaces or one that does not resolve, a port in use or not permitted. It binds a socket to
    the address and closes it (nothing listens, so nothing is exposed meanwhile)."""
    import socket

    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"must be a port number 0..65535, got {port!r:.20}", option="port")
    if not host or any(c.isspace() for c in host):
        raise ConfigError(f"{host!r:.80} is not an address: a host name or IP address has no "
                          "spaces", option="host")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.removeprefix("[").removesuffix("]"), port, type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"cannot listen on {host!r:.80}: {getattr(e, 'strerror', None) or e}",
                          option="host") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as e:
            raise ConfigError(f"cannot listen on {host} port {port}: {e.strerror or e}",
                              option="port") from None


def check_exposure(host: str, config: ServerConfig) -> bool:
    """Refuse (`ConfigError`) to serve ``host`` beyond loopback without an API key, unless
    ``config.allow_unauthenticated`` says so on purpose; returns True in that case (the caller
    logs a warning naming the address), False when a key is set or ``host`` is loopback.

    ``0.0.0.0``, ``::``, a LAN address and any host name but ``localhost`` count as beyond
    loopback (names are not resolved: `is_loopback`)."""
    if config.api_key is not None or is_loopback(host):
        return False
    if config.allow_unauthenticated:
        return True
    raise ConfigError(
        f"{host!r} is not a loopback address, so anyone who can reach it could use the model, "
        f"and no API key is set: give one ({API_KEY_ENV}, --api-key-file FILE or --api-key; "
        "ServerConfig(api_key=...) in Python), or pass --allow-unauthenticated "
        "(allow_unauthenticated=True) to serve without one on purpose", option="host")


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
        # schema compiles and prompt encoding run here, off the event loop and off the engine;
        # several, so that one slow request (a large schema's compile, up to its timeout; a
        # long template) does not hold the others' preparation
        self.prep = ThreadPoolExecutor(max_workers=PREP_THREADS, thread_name_prefix="openai-server-prep")
        # compiles run in child processes, stopped at their timeout: one client's schema
        # cannot keep a core or its memory past it (grammar/compile_worker.py)
        self.generator.compile_workers = CompileWorkers(COMPILE_PROCESSES)
        # final validation (jsonschema, Pydantic) of finished outputs runs here: it takes time
        # on large outputs, and the event loop must keep answering (/health) meanwhile
        self.finish = ThreadPoolExecutor(max_workers=2, thread_name_prefix="openai-server-finish")
        self.created = int(time.time())
        #: retry attempts run (``max_retries``): the ``retries`` metric
        self.retries = 0

    def start_compile_worker(self) -> None:
        """Start the first compile process in the background (a few seconds: the import of
        xgrammar), so that the first schema does not wait for it."""
        if self.generator.compile_workers is not None:
            self.generator.compile_workers.start(self.model.tokenizer_data, wait=False)

    def close_compile_workers(self) -> None:
        if self.generator.compile_workers is not None:
            self.generator.compile_workers.close()

    @staticmethod
    def retry_policy(body: RequestFields) -> RetryPolicy:
        """The library's retry rule for a request's ``max_retries`` (at its default temperature):
        absent, the library's default (:data:`~constrained_spec.api.DEFAULT_MAX_RETRIES`), none
        for a streamed request (``parse_body`` has refused an explicit count with ``stream``).
        Free text is retried only when ``max_retries`` is given (`Choice.retryable`)."""
        return RetryPolicy.resolve(body.max_retries, streaming=body.stream)

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.tokenizer.decode(list(ids))

    def build_requests(self, body: RequestFields, *, attempt: int = 0,
                       indices: Sequence[int] | None = None) -> list[tuple[Any, Any, SchemaMode]]:
        """Engine requests for the choices (runs on the prep thread): ``n`` per prompt, index
        ``prompt * n + j``; with ``attempt`` >= 1, the retry of the choices ``indices``
        (``max_retries``, :class:`RetryPolicy`)."""
        constraint = constraint_of(body, self.config.backend)
        overrides = _sampling_overrides(body)
        policy = self.retry_policy(body)
        if isinstance(body, CompletionRequest):
            limit = token_limit(self.model)
            prompts: list[Any] = [prompt_ids(self.model.tokenizer, p, i, body.add_special_tokens,
                                             limit) for i, p in enumerate(body.prompts())]
            tools = None
        else:
            assert isinstance(body, ChatCompletionRequest)
            tools = toolset_of(body, constraint.param if constraint.constrained else None)
            prompts = [chat_prompt(body.messages)]
            reasoning = body.reasoning_option()
            if reasoning is not None:
                overrides["reasoning"] = reasoning
        out = []
        for i in range(len(prompts) * body.n) if indices is None else indices:
            # OpenAI's n and seed: choice i uses seed + i; retry k of it seed + i + k
            options = {**overrides, "seed": None if body.seed is None else body.seed + i}
            options = policy.options(options, attempt, self.generator.sampling)
            prompt = prompts[i // body.n]
            try:
                if isinstance(body, CompletionRequest):
                    req, spec = raw_request(self.generator, prompt, constraint, options)
                else:
                    req, spec = self.generator.make_request(
                        prompt, schema=constraint.schema, schema_mode=constraint.mode,
                        tools=tools, chat_template_kwargs=body.chat_template_kwargs, **options)
            except ConstrainedSpecError as e:
                raise api_error(e, schema_param=constraint.param or "response_format") from e
            out.append((req, spec, constraint.mode))
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
                if o.finish_reason == "length" and choice.tools is None:  # the answer part
                    o.text = choice.text.text
        o.logprobs = choice.final_logprobs(o.text, bool(o.tool_calls))
        return o

    def _outcome(self, choice: Choice) -> Outcome:
        req = choice.request
        tokens = len(req.output_ids)
        if choice.text.stopped:  # a stop string, or a repeated tool call
            return choice.stopped_outcome(tokens)
        result = self.generator.finalize(req, choice.spec, return_result=True)
        calls = choice.tool_outcome(result, tokens)  # tool calls, never their markup as text
        if calls is not None:
            return calls
        if isinstance(result, IncompleteOutputError):
            # "length", or another way the engine ended the output early (a detected loop):
            # OpenAI's finish reasons have one word for a cut output, "length"
            return Outcome(result.partial_text, "length",
                           completion_tokens=tokens, result=result)
        if isinstance(result, OutputValidationError) and choice.mode == "lenient":
            # strict false: best effort, as OpenAI's non-strict mode (logged, not refused)
            logger.warning("choice %d failed final validation (strict false): %s", choice.index, result)
            return Outcome(result.text, "stop", completion_tokens=tokens, result=result)
        if isinstance(result, OutputValidationError):
            unenforced = schema_warnings(choice.spec, self.config.backend)
            if unenforced:  # the schema asked for what the grammar cannot enforce: its fault
                return Outcome("", "error", unenforced_error(result, unenforced, choice.spec),
                               tokens, result=result)
        if isinstance(result, BaseException):
            if req.finish_reason == "cancelled":
                return Outcome("", "cancelled", api_error(result), tokens, result=result)
            if req.error is not None:
                logger.error("request %s failed: %r", req.id, req.error)
            return Outcome("", "error", api_error(result), tokens, result=result)
        return Outcome(result.text, "stop", completion_tokens=tokens, result=result)


def unenforced_error(error: OutputValidationError, unenforced: Sequence[Mapping[str, Any]],
                     spec: Any) -> APIError:
    """The 400 of an output that failed final validation on a keyword the grammar does not
    enforce (``unenforced``: `schema_warnings`' items), where a 500 would blame the server:
    the pre-flight's words for each keyword, and the client's two ways out."""
    tools = isinstance(spec.target, ToolParser)
    where = "; ".join(f"{w.get('tool', '') and w['tool'] + ': '}{w['keyword'] or 'the schema'} "
                      f"at {w['pointer'] or '/'} ({w['level']})" for w in unenforced[:5])
    more = f" and {len(unenforced) - 5} more" if len(unenforced) > 5 else ""
    way = ("rewrite the tool's parameters with keywords the grammar enforces" if tools else
           "send strict: false to receive such outputs anyway, or rewrite the schema with "
           "keywords the grammar enforces")
    return APIError(400, f"the output failed final validation after {error.attempts} "
                    f"attempt(s) ({error}): the grammar does not enforce {where}{more}; {way}",
                    param="tools" if tools else "response_format", code="schema_not_enforced")


def _sampling_overrides(body: RequestFields) -> dict[str, Any]:
    """The Generator call options a request sets (absent fields keep the server's defaults)."""
    overrides: dict[str, Any] = {}
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if max_tokens is not None:
        overrides["max_tokens"] = max_tokens
    if body.temperature is not None:
        overrides["temperature"] = float(body.temperature)
    if body.top_p is not None:
        overrides["top_p"] = float(body.top_p)
    if body.top_k is not None:
        overrides["top_k"] = max(body.top_k, 0)  # -1: off, as in vLLM
    for name in ("repetition_penalty", "no_repeat_ngram_size", "max_reasoning_tokens",
                 "min_tokens", "ignore_eos", "logprobs_mode"):
        value = getattr(body, name, None)
        if value is not None:
            overrides[name] = value
    if body.logprob_count() is not None:
        overrides["logprobs"] = body.logprob_count()
    return overrides
