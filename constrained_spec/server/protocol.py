"""The wire format of the OpenAI-compatible server: the request body, OpenAI's error envelope,
and the mapping of library errors and request fields onto them.

Nothing here runs a model: a request is parsed and checked (``parse_body``: its nesting
depth first, `json_limits`, then its fields and its messages' fields), its
``response_format`` turned into a schema and a pre-flight mode (``schema_of``), its ``tools``,
``tool_choice`` and ``parallel_tool_calls`` into a :class:`~constrained_spec.frontend.tools.ToolSet`
(``toolset_of``), its messages (tool calls and tool results included) into the library's
prompt (``chat_prompt``). Every refusal is an :class:`APIError`, answered in
OpenAI's envelope ``{"error": {message, type, param, code}}`` with an HTTP status.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from constrained_spec.api import SchemaMode
from constrained_spec.errors import (
    ConfigError,
    GenerationError,
    JSONDepthError,
    OutputValidationError,
    PromptTooLongError,
    SchemaError,
)
from constrained_spec.frontend.tools import ToolSet, history_arguments
from constrained_spec.generation.serving import QueueFullError
from constrained_spec.json_limits import check_text_depth, loads

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
R = TypeVar("R", bound="RequestFields")
#: Upper bound of a request's ``max_retries``: each retry is one more whole generation in a
#: batch slot, and two retries (the default) already complete every benchmark task (README).
MAX_RETRIES = 4


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


def internal_error(exc: BaseException) -> JSONResponse:
    """The 500 of an exception no handler expected: its type only (the traceback goes to the
    log, never to the client)."""
    return JSONResponse(envelope(f"internal error: {type(exc).__name__}", "server_error", None,
                                 "internal_error"), status_code=500)


_OPTION_PARAMS = {"prompt": "messages", "max_tokens": "max_tokens", "temperature": "temperature",
                  "top_p": "top_p", "top_k": "top_k", "seed": "seed"}


#: the pre-flight's hint to Python callers (schemas.check_schema), as an HTTP client follows it
_LENIENT_HINT = ("pass mode='lenient' to generate anyway",
                 'send "strict": false in response_format.json_schema to generate anyway')


def api_error(exc: BaseException, *, schema_param: str | None = "response_format") -> APIError:
    """The API error for a library exception raised while preparing or running a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SchemaError):
        # the pre-flight's advice names the Python option; a client sends the field instead
        message = str(exc).replace(*_LENIENT_HINT)
        return APIError(400, f"bad schema: {message}", param=schema_param, code="invalid_schema")
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


class ChatMessage(BaseModel):
    """One message of the history. Any other field is refused with a 400 naming it
    (`check_message_fields`), except those in ``_MESSAGE_IGNORED`` and a falsy value of those
    in ``_MESSAGE_UNSUPPORTED``, as for the request's own fields."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers


class RequestFields(BaseModel):
    """The fields that chat completions and completions share: sampling, the library's levers,
    and every form of output constraint (`structured.constraint_of` reads them). Any other
    field is refused with a 400 naming it (`check_extra_fields`), except the bookkeeping ones
    in ``_IGNORED`` and a falsy (default) value of the unimplemented ones in ``_UNSUPPORTED``.

    Every field is strict (pydantic's strict mode): a number is a JSON number, never a string
    ("2") nor a boolean (Python's bool is an int, so lax mode took ``n: true`` for 1); a
    boolean is ``true`` / ``false``, never 1 or "yes". An integer field takes no fraction
    (2.0), a number field takes integers (``temperature: 1``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    response_format: dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # vLLM's extra parameter; -1 (vLLM's "off") and 0 both switch it off
    top_k: int | None = Field(default=None, ge=-1)
    max_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    # vLLM-style extra parameters: the library's levers, as in the library when absent (the
    # repetition guard off; max_retries the library's default, none with stream); their
    # ranges are SamplingParams', checked by make_request.
    repetition_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    max_retries: int | None = Field(default=None, ge=0, le=MAX_RETRIES)
    # vLLM's: no stop token before min_tokens output tokens; stop tokens never (until
    # max_tokens). A grammar still ends the output where it must (docs/server.md).
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    # ours: which distribution logprobs report ("masked": the grammar's, renormalized, the
    # default; "raw": the model's before the mask, as vLLM's default) -- docs/server.md
    logprobs_mode: Literal["masked", "raw"] | None = None
    # output constraints (`structured`): vLLM's current object, its older guided_* fields,
    # SGLang's regex / ebnf / json_schema, llama.cpp's server's grammar / json_schema
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: Any = None
    regex: Any = None
    ebnf: Any = None
    grammar: Any = None
    json_schema: Any = None

    #: extra fields refused (when truthy) by this kind of request besides ``_UNSUPPORTED``
    unsupported: ClassVar[tuple[str, ...]] = ()

    def logprob_count(self) -> int | None:
        """Alternatives per token the response lists with its logprobs (None: no logprobs)."""
        return None

    def check(self) -> None:
        """Checks across fields, after each field's own."""
        include_usage = (self.stream_options or {}).get("include_usage")
        if include_usage is not None and not isinstance(include_usage, bool):
            raise APIError(400, f"stream_options.include_usage must be true or false, got "
                           f"{_json(include_usage)}", param="stream_options.include_usage",
                           code="invalid_value")
        if self.stream and self.max_retries:
            raise APIError(400, "max_retries cannot be combined with stream: the text of a failed "
                           "attempt would already be sent; leave max_retries out (a streamed "
                           "request is never retried) or set it to 0", param="max_retries",
                           code="unsupported_parameter")


class ChatCompletionRequest(RequestFields):
    """The fields of OpenAI's chat-completions request this server reads, with vLLM's extra
    ones (`RequestFields`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # a reasoning model's thinking budget (the library's max_reasoning_tokens; absent: none)
    max_reasoning_tokens: int | None = Field(default=None, ge=0)
    # reasoning on / off for this request (absent: the server's, "auto"); vLLM and SGLang
    # clients switch it with chat_template_kwargs.enable_thinking
    reasoning: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs",
                           code="invalid_value")
        check_message_fields(self.messages)
        if self.tool_choice not in (None, "none") and not self.tools:
            raise APIError(400, "tool_choice needs tools: give the tools the model may call",
                           param="tool_choice", code="invalid_value")
        self.reasoning_option()

    def reasoning_option(self) -> Literal["template", False] | None:
        """Reasoning on / off for this request (None: the server's): ``reasoning`` or
        ``chat_template_kwargs.enable_thinking`` (or ``thinking``); the two must agree. On is
        the library's ``"template"``: the markers the model's chat template names, and a 400
        naming ``reasoning`` for a model whose template names none (forcing ``<think>`` on a
        model that never closes it would take its whole answer for reasoning)."""
        kwargs = self.chat_template_kwargs or {}
        switch: bool | None = None
        for name, value in kwargs.items():  # every key reaches the template (make_request)
            param = f"chat_template_kwargs.{name[:40]}"
            if name not in TEMPLATE_SWITCHES:
                continue
            if not isinstance(value, bool):
                raise APIError(400, f"{param} must be true or false", param=param,
                               code="invalid_value")
            if switch is not None and switch != value:
                raise APIError(400, "chat_template_kwargs.enable_thinking and .thinking "
                               "disagree; give one", param=param, code="invalid_value")
            switch = value
        if switch is not None and self.reasoning is not None and switch != self.reasoning:
            raise APIError(400, "reasoning and chat_template_kwargs.enable_thinking disagree; "
                           "give one", param="reasoning", code="invalid_value")
        on = self.reasoning if self.reasoning is not None else switch
        return None if on is None else ("template" if on else False)


#: the chat-template variables that also switch the library's reasoning on / off for the
#: request (Qwen3's and DeepSeek-V3.1's templates name them so); every variable is passed on
TEMPLATE_SWITCHES = ("enable_thinking", "thinking")


class CompletionRequest(RequestFields):
    """OpenAI's (legacy) completions request: a raw prompt, no chat template."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    # vLLM's: the tokenizer's special tokens (a BOS) before the prompt, as vLLM's default
    add_special_tokens: bool = True
    # here a count (0-20; OpenAI's API allows 5): 0 asks for the chosen tokens' logprobs only
    logprobs: int | None = Field(default=None, ge=0, le=20)

    unsupported: ClassVar[tuple[str, ...]] = ("suffix", "best_of")

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_boolean_ids(cls, prompt: Any) -> Any:
        """A boolean is no token id (Python's bool is an int): a 400 naming where it is."""
        for i, item in enumerate(prompt if isinstance(prompt, list) else ()):
            for j, x in enumerate(item if isinstance(item, list) else [item]):
                if isinstance(x, bool):
                    where = f"prompt.{i}.{j}" if isinstance(item, list) else f"prompt.{i}"
                    raise APIError(400, f"{where} is {_json(x)}: a token id is an integer, not "
                                   "a boolean", param=where, code="invalid_value")
        return prompt

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or token ids (OpenAI's four forms); one choice set per
        prompt."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
        return list(p)  # type: ignore[arg-type]


# request fields that would change the answer and that this server does not implement:
# refused rather than silently ignored (a falsy value is accepted: clients send defaults)
_UNSUPPORTED = ("functions", "function_call", "logit_bias",
                "audio", "frequency_penalty", "presence_penalty", "prediction", "min_p",
                "reasoning_effort", "web_search_options", "use_beam_search", "stop_token_ids",
                "include_stop_str_in_output", "prompt_logprobs", "bad_words", "allowed_token_ids")
# unimplemented fields' values that ask for nothing besides what this server does
_DEFAULTS: dict[str, tuple[Any, ...]] = {"best_of": (1,)}
# request fields that do not change the answer: accepted and ignored
_IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")
# OpenAI's penalties subtract from the logits by count; the guard here divides (as vLLM's and
# transformers' repetition_penalty) or bans repeated n-grams: a different setting, not a rename
_INSTEAD = {**dict.fromkeys(("frequency_penalty", "presence_penalty"),
                            "; use repetition_penalty (> 1 penalises the tokens already in the "
                            "output, 1.1 to 1.3 is typical) or no_repeat_ngram_size instead"),
            "reasoning_effort": "; a reasoning model's thinking is bounded by max_reasoning_tokens",
            **dict.fromkeys(("functions", "function_call"),
                            " (OpenAI's deprecated form); use tools and tool_choice"),
            "prompt_logprobs": " yet: the prompt's log-probabilities are not returned (the "
                               "output's are: logprobs); leave it out",
            **dict.fromkeys(("logit_bias", "bad_words", "allowed_token_ids"),
                            "; constrain the output with response_format or structured_outputs "
                            "(a regex, choices or a grammar) instead"),
            "min_p": "; use top_p or top_k instead",
            "stop_token_ids": "; use stop (strings) instead",
            "include_stop_str_in_output": "; the stop string is never part of the output here",
            "use_beam_search": "; use n with sampling (temperature > 0) instead",
            "prediction": "; speculation here drafts by itself (the server's speculative config)",
            "suffix": "; put the text after the insertion point in the prompt instead",
            "best_of": "; use n and choose among the choices instead"}


# message fields that clients send back as a response gave them (OpenAI's message objects,
# vLLM's reasoning_content / reasoning) or to name a participant: accepted and ignored
_MESSAGE_IGNORED = ("name", "refusal", "annotations", "reasoning_content", "reasoning")
# message fields for what this server does not do: refused unless falsy (None, as echoed back)
_MESSAGE_UNSUPPORTED = ("audio", "function_call")


def depth_error(exc: JSONDepthError) -> APIError:
    """The 400 for a request body nested past the limit, named by where it is: inside
    ``response_format`` or ``tools`` a schema (``invalid_schema``), else ``invalid_json``."""
    path = [p for p in exc.path if p is not ...]
    if path[:1] == ["response_format"]:
        param = ("response_format.json_schema.schema"
                 if path[1:3] == ["json_schema", "schema"] else "response_format")
        return APIError(400, f"bad schema: {exc}", param=param, code="invalid_schema")
    if path[:1] == ["tools"]:
        return APIError(400, f"bad tool: {exc}", param="tools", code="invalid_schema")
    return APIError(400, str(exc), param=".".join(str(p) for p in path[:3]) or None,
                    code="invalid_json")


def parse_body(raw: bytes, kind: type[R] = ChatCompletionRequest) -> R:  # type: ignore[assignment]
    """The request body ``raw`` as a ``kind`` (chat completions by default, or
    :class:`CompletionRequest`), every field checked; a 400 naming the field otherwise."""
    try:
        # the depth first: json.loads, pydantic and every later walker recurse per level
        data = loads(raw, what="the request body")
    except JSONDepthError as e:
        raise depth_error(e) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    try:
        body = kind.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e
    check_extra_fields(body)
    body.check()
    return body


def validation_error(exc: ValidationError) -> APIError:
    """The 400 of a body that failed its model, naming the field (pydantic's tags of the union
    member it tried, such as ``str`` or ``list[int]``, left out of the name)."""
    err = exc.errors()[0]
    loc = [p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
    param = ".".join(str(p) for p in loc) or None
    message = err["msg"]
    if err["type"] != "missing" and isinstance(err.get("input"), (bool, int, float, str)):
        message += f", got {_json(err['input'])}"  # "got true": what lax types took for 1
    return APIError(400, f"{param}: {message}" if param else message, param=param,
                    code="invalid_value")


_TYPE_TAGS = ("str", "int", "float", "bool", "dict", "list", "none")


def _json(value: Any) -> str:
    """``value`` as the client wrote it (JSON: ``true``, not ``True``), at most 40 characters."""
    return json.dumps(value, ensure_ascii=False)[:40]


def check_extra_fields(body: RequestFields) -> None:
    """Refuse a field the request model does not declare, unless it is bookkeeping
    (``_IGNORED``) or an unimplemented one at its default (falsy, or ``_DEFAULTS``): a
    misspelt or newer parameter would otherwise be silently ignored."""
    unsupported = (*_UNSUPPORTED, *body.unsupported)
    for name, value in (body.model_extra or {}).items():
        if name in unsupported:
            if value and value not in _DEFAULTS.get(name, ()):
                raise APIError(400, f"{name} is not supported by this server"
                               f"{_INSTEAD.get(name, '')}", param=name, code="unsupported_parameter")
        elif name == "modalities":
            if value not in (None, "none", [], ["text"]):  # what the server does anyway
                raise APIError(400, f"{name} {value!r:.40} is not supported by this server",
                               param=name, code="unsupported_parameter")
        elif name not in _IGNORED:
            raise APIError(400, f"unknown parameter {name!r:.60}: this server does not implement "
                           "it; remove it from the request", param=name[:60],
                           code="unknown_parameter")


def check_message_fields(messages: Sequence[ChatMessage]) -> None:
    """Refuse a field of a message that this server does not read, as an unknown field of the
    request is refused: a misspelt one would otherwise be silently ignored."""
    for i, m in enumerate(messages):
        for name, value in (m.model_extra or {}).items():
            param = f"messages.{i}.{name[:60]}"
            if name in _MESSAGE_UNSUPPORTED:
                if value:
                    raise APIError(400, f"{name} in messages[{i}] is not supported by this "
                                   "server", param=param, code="unsupported_parameter")
            elif name not in _MESSAGE_IGNORED:
                raise APIError(400, f"unknown field {name!r:.60} in messages[{i}]: this server "
                               "does not implement it; remove it from the message",
                               param=param, code="unknown_parameter")


def schema_of(response_format: dict[str, Any] | None) -> tuple[Any, SchemaMode]:
    """``response_format`` -> (schema for ``make_request``, pre-flight mode); a
    ``structural_tag`` one and every other form of constraint: `structured.constraint_of`.

    json_schema: the schema; ``strict`` true -> "strict", absent -> "default", false ->
    "lenient". json_object: any JSON object, or the ``schema`` in it (llama.cpp's server reads
    one there). text / absent: free text (``None``).
    """
    if response_format is None:
        return None, "default"
    kind = response_format.get("type")
    if kind == "text":
        return None, "default"
    if kind == "json_object":
        schema = response_format.get("schema")
        if schema is None:
            return {"type": "object"}, "default"
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.schema must be a JSON Schema object",
                           param="response_format.schema", code="invalid_schema")
        return schema, "default"
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
    raise APIError(400, f"response_format.type {kind!r:.40} is not supported; use "
                   "'json_schema', 'json_object', 'text' or 'structural_tag'",
                   param="response_format.type")


def toolset_of(body: ChatCompletionRequest, constraint_param: str | None = None) -> ToolSet | None:
    """The request's tools, ``tool_choice`` (default "auto") and ``parallel_tool_calls``
    (default true, as OpenAI's) as a ToolSet; None without tools. An output constraint (named
    by ``constraint_param``) together with tools that may be called is refused: the answer may
    be a call."""
    if not body.tools:
        return None
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    choice = "auto" if body.tool_choice is None else body.tool_choice
    try:
        toolset = ToolSet(body.tools, choice, parallel)
    except SchemaError as e:
        raise APIError(400, f"bad tool: {e}", param="tools", code="invalid_schema") from e
    except ConfigError as e:
        raise APIError(400, str(e), param=e.option or "tools", code="invalid_value") from e
    if toolset.active and constraint_param is not None:
        field = constraint_param.split(".")[0]
        raise APIError(400, f"{constraint_param} cannot be combined with tools the model may "
                       "call (tool_choice 'none' keeps the tools out)", param=field,
                       code="unsupported_parameter")
    return toolset


def chat_prompt(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages -> the library's ``[{role, content}]`` (text content parts joined; an
    assistant turn's ``tool_calls`` and a tool turn's ``tool_call_id`` kept). Tool-call
    arguments are JSON text the prompt's template parses again: nested past the limit of
    `json_limits`, a 400 ``invalid_json`` naming the call."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            content = "".join(_text_part(part, i, j) for j, part in enumerate(content))
        role = "system" if m.role == "developer" else m.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    for i, j, args in history_arguments(out):  # JSON text in a string: not the body's scan
        try:
            check_text_depth(args, what=f"the arguments of tool call {j} in messages[{i}]")
        except JSONDepthError as e:
            raise APIError(400, str(e), param=f"messages.{i}.tool_calls.{j}.function.arguments",
                           code="invalid_json") from None
    return out


def _text_part(part: dict[str, Any], i: int, j: int) -> str:
    """The text of content part ``j`` of ``messages[i]``: a text part's ``text``, else a 400."""
    if part.get("type") != "text":
        raise APIError(400, f"only text content parts are supported, got "
                       f"{_json(part.get('type'))} in messages[{i}].content[{j}]",
                       param=f"messages.{i}.content", code="invalid_value")
    text = part.get("text")
    if not isinstance(text, str):
        what = "has no 'text' field" if text is None else f"has 'text' {_json(text)}"
        raise APIError(400, f"the text part messages[{i}].content[{j}] {what}: give its text "
                       "as a string", param=f"messages.{i}.content.{j}.text",
                       code="invalid_value")
    return text


def stop_strings(stop: str | list[str] | None) -> list[str]:
    items = [stop] if isinstance(stop, str) else list(stop or [])
    if len(items) > 4:
        raise APIError(400, "stop takes at most 4 strings", param="stop")
    return [s for s in items if s]
