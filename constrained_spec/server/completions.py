"""OpenAI's (legacy) ``/v1/completions`` and vLLM's ``/tokenize`` / ``/detokenize``: a raw
prompt, no chat template.

A completions prompt (a string, token ids, or a list of either) is encoded as it is, with the
tokenizer's special tokens when ``add_special_tokens`` (vLLM's default), and becomes one
engine request per choice (`raw_request`) under the same constraint forms, pre-flight,
sampling and levers as a chat request; there is no reasoning split (a raw prompt has no
template to open or close a think block). ``echo`` puts the prompt's text before each
choice's text, as OpenAI and vLLM do.

``/tokenize`` takes ``prompt`` (+ ``add_special_tokens``, default true) or ``messages`` (+
``add_generation_prompt``, default true, and ``add_special_tokens``, default false: the
template writes them) and answers ``tokens``, ``count``, ``max_model_len`` (and
``token_strs`` on ``return_token_strs``); ``/detokenize`` takes ``tokens`` and answers
``prompt``: vLLM's shapes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, ValidationError

from constrained_spec.api import check_reachable
from constrained_spec.errors import ConfigError, PromptTooLongError
from constrained_spec.frontend.prompts import build_messages, check_text
from constrained_spec.frontend.render import render_chat_template
from constrained_spec.frontend.tools import check_history_arguments
from constrained_spec.generation.engine import Request
from constrained_spec.json_limits import loads
from constrained_spec.server.choices import Choice, Outcome
from constrained_spec.server.logprobs import completion_logprobs
from constrained_spec.server.protocol import APIError, ChatMessage, chat_prompt, validation_error

if TYPE_CHECKING:
    from constrained_spec.api import Generator
    from constrained_spec.model.loading import LoadedModel
    from constrained_spec.server.structured import Constraint


def token_limit(model: LoadedModel) -> int:
    """The ids a token may be here: below the tokenizer's size and the logits' width."""
    return min(len(model.tokenizer), model.vocab_size)


def max_model_len(model: LoadedModel) -> int:
    """The context in tokens: our runner's KV capacity, or what vLLM reserves KV cache for."""
    return model.max_context if model.vllm is not None else model.runner.max_context


def check_ids(ids: Sequence[int], limit: int, param: str) -> list[int]:
    for i, t in enumerate(ids):
        if not 0 <= t < limit:
            raise APIError(400, f"{param}[{i}] = {t} is not a token id of this model (0 to "
                           f"{limit - 1})", param=f"{param}.{i}", code="invalid_value")
    return list(ids)


def prompt_ids(tokenizer: Any, prompt: str | list[int], index: int, add_special_tokens: bool,
               limit: int) -> list[int]:
    """The ids of one completions prompt (``index``: its place in the request's list)."""
    param = "prompt" if index == 0 else f"prompt.{index}"
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, f"{param} is empty", param=param, code="invalid_value")
        ids = list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        if not ids:
            raise APIError(400, f"{param} encodes to no token", param=param, code="invalid_value")
        return ids
    if not prompt:
        raise APIError(400, f"{param} is empty", param=param, code="invalid_value")
    return check_ids(prompt, limit, param)


def raw_request(generator: Generator[Any], ids: list[int], constraint: Constraint,
                options: Mapping[str, Any]) -> tuple[Request, Any]:
    """An engine request continuing the prompt ``ids`` as they are (no chat template, no
    schema description: the prompt is the client's), under ``constraint`` and the call
    ``options`` (`Generator.make_request`'s, but ``reasoning``); the spec to finalize it with.
    The library's own option checks, pre-flight and compile cache apply (its ``_call_options``
    and ``_request_spec``, the steps of ``make_request`` before the prompt is encoded)."""
    schema_options, _, params = generator._call_options(dict(options), constraint.mode)
    spec, compiled, _ = generator._request_spec(constraint.schema, None, schema_options)
    if spec is not None:
        check_reachable(spec, params.max_tokens, generator.model.tokenizer_data)
    limit = max_model_len(generator.model)
    if len(ids) + params.max_tokens + 1 > limit:
        raise APIError(400, f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} "
                       f"exceeds the model's context of {limit} tokens; shorten the prompt or "
                       "lower max_tokens", param="prompt", code="context_length_exceeded")
    matcher = compiled.new_matcher() if compiled is not None else None
    return Request(list(ids), matcher, params, generator.model.eos_token_ids), spec


def completion_body(completion_id: str, created: int, model: str, choices: Sequence[Choice],
                    outcomes: Sequence[Outcome], echo: Mapping[int, str],
                    warnings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``text_completion`` response (``echo``: choice index -> the prompt text before
    its text; ``warnings``: `choices.response_warnings`, empty when nothing to say)."""
    return {"id": completion_id, "object": "text_completion", "created": created,
            "model": model, "system_fingerprint": None,
            "choices": [{"index": c.index, "text": echo.get(c.index, "") + o.text,
                         "logprobs": None if o.logprobs is None else completion_logprobs(
                             c.decoded, o.logprobs, len(echo.get(c.index, ""))),
                         "finish_reason": o.finish_reason}
                        for c, o in zip(choices, outcomes)],
            "usage": completion_usage(choices, outcomes), **(warnings or {})}


def completion_usage(choices: Sequence[Choice], outcomes: Sequence[Outcome]) -> dict[str, int]:
    """OpenAI's ``usage``: each distinct prompt once, every choice's completion tokens."""
    prompts: dict[tuple[int, ...], int] = {}
    for c in choices:
        ids = c.request.prompt_ids
        prompts.setdefault(tuple(ids), len(ids))
    prompt = sum(prompts.values())
    completion = sum(o.completion_tokens for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize`` body: ``prompt`` or ``messages`` (strict types, as a completion
    request's: `protocol.RequestFields`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    """vLLM's ``/detokenize`` body (strict: a token id is an integer, never a boolean)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


def parse_small(raw: bytes, kind: type[Any], model_name: str) -> Any:
    """A ``/tokenize`` or ``/detokenize`` body as ``kind``; a 400 naming the field, a 404 for
    another model."""
    try:
        data = loads(raw, what="the request body")
        body = kind.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, JSONDepthError
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from e
    if body.model is not None and body.model != model_name:
        raise APIError(404, f"the model {body.model!r:.80} does not exist; this server serves "
                       f"{model_name!r}", param="model", code="model_not_found")
    return body


def tokenize(model: LoadedModel, body: TokenizeRequest) -> dict[str, Any]:
    """vLLM's ``/tokenize`` answer."""
    tokenizer = model.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt",
                       code="invalid_value")
    if body.prompt is not None:
        try:
            check_text(body.prompt, "prompt", "the prompt")
        except ConfigError as e:
            raise APIError(400, str(e), param="prompt", code="invalid_value") from None
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = list(tokenizer.encode(body.prompt, add_special_tokens=special))
    else:
        messages = chat_prompt(body.messages or [])
        try:  # the checks of the chat route: roles, text, a user message, tool-call history
            messages = build_messages(messages, None, False)
            check_history_arguments(messages, option="messages")
        except ConfigError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        special = bool(body.add_special_tokens)
        if getattr(tokenizer, "chat_template", None):
            try:  # bounded in time and size, as for the chat route (frontend/render.py)
                text = render_chat_template(tokenizer, messages, context=max_model_len(model),
                                            option="messages",
                                            add_generation_prompt=body.add_generation_prompt)
            except ConfigError as e:
                code = "context_length_exceeded" if isinstance(e, PromptTooLongError) else "invalid_value"
                raise APIError(400, str(e), param="messages", code=code) from None
        else:  # the library's own rendering without a template (frontend.prompts)
            text = "\n\n".join(m["content"] for m in messages) + "\n"
        ids = list(tokenizer.encode(text, add_special_tokens=special))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len(model),
                           "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(model: LoadedModel, body: DetokenizeRequest) -> dict[str, Any]:
    """vLLM's ``/detokenize`` answer."""
    ids = check_ids(body.tokens, token_limit(model), "tokens")
    return {"prompt": model.tokenizer.decode(ids)}
