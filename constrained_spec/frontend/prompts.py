"""Turning a user prompt + schema into the token ids the model sees.

String prompts go through the model's chat template with the schema described in a system
message (``system_prompt=None``: our default text; a string: yours, used as is; ``False``: no
system message). A list of chat messages is used as given (a content that is a list of
OpenAI-style text parts is joined), with our system message put in front unless one is
already there or ``system_prompt=False``. Text that is not Unicode (lone surrogates) or
content that is not text is a `ConfigError` naming ``prompt`` / ``system_prompt``.

The default system message fits a token budget. It pastes the whole JSON Schema (today's text)
when that takes at most :data:`SCHEMA_PROMPT_SHARE` of the model's context and leaves room for
the rest of the prompt and ``max_tokens``; a bigger schema is described by a compact outline
(one line per field path: type, enum values, required, description) that leaves out what the
grammar enforces anyway (patterns, formats, bounds, ``additionalProperties``, definitions);
then the outline without descriptions, then the field names alone, cut to fit. The grammar
enforces the structure whatever the message says, so a schema is never refused for the length
of its description: only a user prompt or ``max_tokens`` too long for the context is.

Tools (``tools=``, a :class:`~constrained_spec.frontend.tools.ToolSet`): a chat template with a tool
section renders them itself (``apply_chat_template(tools=...)``); for any other template the
tools are described in our system message within the same budget (their full JSON, then names,
descriptions and argument names, then names alone). Earlier tool calls (an assistant message's
``tool_calls``) and tool results (``tool`` messages) in the history are passed to a template with
a tool section as they are, and otherwise written as text in the default call format. Mistral's
templates refuse any call id but 9 letters and digits, so for the Mistral formats every other id
(OpenAI's ``call_...``, a client's own) is mapped to one, the same for a call and the tool result
that answers it (:func:`mistral_call_ids`).

The chat template renders within a time and a size bound (:mod:`~constrained_spec.frontend.render`):
a template that loops over what a request sends is stopped with a typed error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import string
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from constrained_spec.errors import ConfigError
from constrained_spec.frontend.render import render_chat_template
from constrained_spec.json_limits import check_depth, loads
from constrained_spec.schemas import SchemaSpec
from constrained_spec.schemas.spec import lone_surrogate

if TYPE_CHECKING:
    from constrained_spec.frontend.tools import ToolSet

Messages = list[dict[str, Any]]

#: Share of the model's context the default system message may take (e.g. 2,048 of 8,192
#: tokens): a quarter leaves most of the context to the user's prompt and the output, and
#: holds the whole schema of the usual function-call / extraction sizes (a few hundred tokens).
SCHEMA_PROMPT_SHARE = 0.25
# outline details: enum values listed per field, characters of a description kept
_OUTLINE_ENUMS = 12
_OUTLINE_DESCRIPTION = 160
# nesting followed by the outline (a recursive $ref stops at its first repetition anyway)
_OUTLINE_DEPTH = 8


def describe_schema(spec: SchemaSpec | None, budget: int | None = None,
                    count: Callable[[str], int] | None = None) -> str | None:
    """The default system message for a spec: what to answer and in which shape.

    Without ``budget``: the full description (the whole JSON Schema for a JSON spec). With a
    ``budget`` in tokens (``count(text)`` measures a text): the most detailed description that
    fits, see the module docstring; the last resort is a one-line instruction.
    """
    if spec is None:
        return None
    texts = _descriptions(spec)
    if budget is None or count is None:
        return next(texts)
    for text in texts:
        if count(text) <= budget:
            return text
    if spec.kind == "json_schema":
        return _names_within(spec.json_schema or {}, budget, count)
    return text  # the shortest: a one-line instruction


_JSON_HEAD = "Answer with a JSON object that follows this JSON Schema, and nothing else."
_OUTLINE_HEAD = ("Answer with a JSON object, and nothing else. Its fields (one line per path: "
                 "type; * = required; a[] = the items of array a):")
_NAMES_HEAD = "Answer with a JSON object, and nothing else. Its fields: "


#: The instruction for a schema that asks for any JSON object (OpenAI's ``json_object``) or
#: any JSON value: pasting such a schema (``{"type": "object"}``) makes a small model answer
#: with the schema itself, so the instruction names the shape in words and asks for the answer.
_ANY_OBJECT = ("Answer with a JSON object that holds your answer, with field names that fit "
               "the question, and nothing else.")
_ANY_JSON = "Answer in JSON that holds your answer, and nothing else."
# keywords that say nothing about an instance's content
_ANNOTATIONS = frozenset({"$schema", "$id", "title", "description", "$comment"})


def _any_json(schema: Any) -> str | None:
    """The instruction for a schema that allows any object (or any value), else None."""
    if not isinstance(schema, dict):
        return None
    rest = set(schema) - _ANNOTATIONS
    if not rest:
        return _ANY_JSON
    if rest == {"type"} and schema["type"] == "object":
        return _ANY_OBJECT
    return None


def _descriptions(spec: SchemaSpec) -> Iterator[str]:
    """Candidate system messages for ``spec``, most detailed first (computed lazily)."""
    if spec.kind == "json_schema" and (neutral := _any_json(spec.json_schema)) is not None:
        yield neutral
    elif spec.kind == "json_schema":
        schema = json.dumps(spec.json_schema, ensure_ascii=False)
        guide = _field_guide(spec.json_schema or {})
        text = f"{_JSON_HEAD}\nJSON Schema: {schema}"
        yield text + (f"\nFields:\n{guide}" if guide else "")
        fields = _outline_fields(spec.json_schema or {})
        for depth in sorted({f[0] for f in fields}, reverse=True):
            for descriptions in (True, False):
                lines = [_outline_line(f, descriptions) for f in fields if f[0] <= depth]
                yield _OUTLINE_HEAD + "\n" + "\n".join(lines)
    elif spec.kind == "regex":
        yield f"Answer with text that matches this regular expression, and nothing else: {spec.regex}"
        yield "Answer with text in the required format, and nothing else."
    elif spec.kind == "choice":
        yield "Answer with exactly one of these options, and nothing else: " + ", ".join(spec.choices)
        yield "Answer with exactly one of the allowed options, and nothing else."
    else:
        yield f"Answer with text that follows this grammar (EBNF), and nothing else:\n{spec.ebnf}"
        yield "Answer with text in the required format, and nothing else."


# one outline entry: (depth, path, required, type text, description)
_Field = tuple[int, str, bool, str, str]


def _outline_line(field: _Field, descriptions: bool) -> str:
    _, path, required, kind, text = field
    line = f"- {path}{'*' if required else ''}: {kind}"
    return line + (f" - {text}" if descriptions and text else "")


def _names_within(schema: dict[str, Any], budget: int, count: Callable[[str], int]) -> str:
    """The field paths, shallowest first, as many as fit in ``budget`` tokens."""
    fields = sorted(_outline_fields(schema), key=lambda f: f[0])  # stable: schema order per depth
    names = [f[1] + ("*" if f[2] else "") for f in fields]

    def text(k: int) -> str:
        if k == 0:
            return "Answer with a JSON object, and nothing else."
        more = f", ... ({len(names) - k} more)" if k < len(names) else ""
        return _NAMES_HEAD + ", ".join(names[:k]) + more

    lo, hi = 0, len(names)  # the largest k whose text fits (the text grows with k)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text(mid)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return text(lo)


class _TooMany(Exception):
    """The outline walk passed its entry cap (retried with less nesting)."""


# entries an outline walk may produce: far more than any budget holds, so the walk stays cheap
_OUTLINE_CAP = 4000


def _outline_fields(schema: dict[str, Any]) -> list[_Field]:
    """The outline of a JSON Schema: one entry per field path, in schema order.

    Follows local ``$ref`` (a recursive one once), ``allOf`` / ``anyOf`` / ``oneOf`` branches
    (their fields share the path), array items (``path[]``) and object-valued
    ``additionalProperties`` (``path.*``), down to :data:`_OUTLINE_DEPTH` levels; a schema whose
    outline would pass :data:`_OUTLINE_CAP` entries is outlined less deeply.
    """
    for depth in range(_OUTLINE_DEPTH, 0, -1):
        try:
            return _walk_outline(schema, depth)
        except _TooMany:
            continue
    return []


def _walk_outline(root: dict[str, Any], max_depth: int) -> list[_Field]:
    """`_outline_fields` down to ``max_depth`` levels; raises `_TooMany` past the cap."""
    out: list[_Field] = []

    def add(node: Any, path: str, required: bool, depth: int, refs: frozenset[str]) -> None:
        resolved, inner = _resolve_refs(root, node, refs)
        if not isinstance(resolved, dict):
            if isinstance(node, dict) or node is True:  # a recursive reference: no children
                target = _pointer(root, node["$ref"]) if isinstance(node, dict) else None
                kind = _kind_text(root, target, refs) if target else "any"
                out.append((depth, path, required, kind, ""))
            return
        out.append((depth, path, required, _kind_text(root, resolved, inner),
                    _description(resolved)))
        if len(out) > _OUTLINE_CAP:
            raise _TooMany
        if depth < max_depth:
            children(resolved, path, depth, inner)

    def children(node: dict[str, Any], path: str, depth: int, refs: frozenset[str]) -> None:
        props = node.get("properties")
        if isinstance(props, dict):
            required = node.get("required")
            req = required if isinstance(required, list) else []
            for name, sub in props.items():
                add(sub, f"{path}.{name}" if path else name, name in req, depth + 1, refs)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            add(extra, f"{path}.*" if path else "*", False, depth + 1, refs)
        items = node.get("items")
        if isinstance(items, dict):
            sub, inner = _resolve_refs(root, items, refs)
            if isinstance(sub, dict) and depth + 1 < max_depth:
                children(sub, f"{path}[]", depth + 1, inner)
        for key in ("allOf", "anyOf", "oneOf"):
            branches = node.get(key)
            for branch in branches if isinstance(branches, list) else []:
                sub, inner = _resolve_refs(root, branch, refs)
                if isinstance(sub, dict):
                    children(sub, path, depth, inner)

    top, refs = _resolve_refs(root, root, frozenset())
    if isinstance(top, dict):
        if top.get("type") not in (None, "object") or "properties" not in top:
            out.append((0, "(the value)", True, _kind_text(root, top, refs), ""))
        children(top, "", 0, refs)
    return _first_per_path(out)


def _resolve_refs(root: dict[str, Any], node: Any,
                  refs: frozenset[str]) -> tuple[Any, frozenset[str]]:
    """``node`` with its local ``$ref`` chain followed (its own keys over the target's), and the
    references followed so far; ``None`` for a recursive, remote or dangling reference."""
    while isinstance(node, dict) and isinstance(node.get("$ref"), str):
        ref = node["$ref"]
        target = _pointer(root, ref)
        if ref in refs or not isinstance(target, dict):
            return None, refs  # recursive, remote or dangling: described by its neighbours
        refs = refs | {ref}
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return node, refs


def _kind_text(root: dict[str, Any], node: Any, refs: frozenset[str], nest: int = 0) -> str:
    """The type of an outline entry in words: "constant 1", "one of ...", "string or null",
    "array of integer"; branches and array items are described two levels deep."""
    node, refs = _resolve_refs(root, node, frozenset())  # even a recursive reference has a type
    if not isinstance(node, dict):
        return "any"
    if "const" in node:
        return "constant " + json.dumps(node["const"], ensure_ascii=False)
    if isinstance(node.get("enum"), list):
        vals = [json.dumps(v, ensure_ascii=False) for v in node["enum"][:_OUTLINE_ENUMS]]
        return "one of " + ", ".join(vals) + (", ..." if len(node["enum"]) > _OUTLINE_ENUMS else "")
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key] and nest < 2:
            return " or ".join(dict.fromkeys(_kind_text(root, b, refs, nest + 1)
                                             for b in node[key][:4]))
    t = node.get("type")
    if isinstance(t, list):
        t = " or ".join(str(x) for x in t)
    if t is None:
        t = "object" if "properties" in node else "array" if "items" in node else "any"
    if t == "array" and isinstance(node.get("items"), dict) and nest < 2:
        return "array of " + _kind_text(root, node["items"], refs, nest + 1)
    return str(t)


def _description(node: dict[str, Any]) -> str:
    """A node's description (or title) on one line, cut to `_OUTLINE_DESCRIPTION` characters."""
    text = " ".join(str(node.get("description") or node.get("title") or "").split())
    if len(text) > _OUTLINE_DESCRIPTION:
        text = text[:_OUTLINE_DESCRIPTION - 3].rstrip() + "..."
    return text


def _first_per_path(fields: list[_Field]) -> list[_Field]:
    """A path reached by several branches is listed once (the first, most detailed)."""
    seen: set[str] = set()
    unique = []
    for f in fields:
        if f[1] not in seen:
            seen.add(f[1])
            unique.append(f)
    return unique


def _pointer(root: Any, ref: str) -> Any:
    """The node a local reference (``#/definitions/a``) points to, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _field_guide(schema: dict[str, Any]) -> str:
    """One line per top-level property that has a title or description."""
    lines = []
    for name, sub in (schema.get("properties") or {}).items():
        if not isinstance(sub, dict):
            continue
        text = sub.get("description") or sub.get("title")
        if text and text != name:
            lines.append(f"- {name}: {text}")
    return "\n".join(lines)


def check_text(text: str, option: str, what: str | None = None) -> None:
    """Raise `ConfigError` naming `option` if `text` is not Unicode text (a lone surrogate, e.g.
    from bytes decoded with ``surrogateescape``): no tokenizer can encode it."""
    bad = lone_surrogate(text)
    if bad is not None:
        raise ConfigError(f"{what or 'the text'} has a lone surrogate ({bad}), which is not "
                          "Unicode text (it cannot be written as UTF-8): fix the encoding of the "
                          "input", option=option)


def _message_content(content: Any, i: int) -> str:
    """A message's content as text: a string, or OpenAI's list of text parts joined."""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                got = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ConfigError(f"message {i}, content part {j}: only text parts "
                                  f"{{'type': 'text', 'text': ...}} are supported, got {got!r:.40}",
                                  option="prompt")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ConfigError(f"message {i}: content must be a string or a list of text parts, got "
                          f"{type(content).__name__}", option="prompt")
    check_text(content, "prompt", f"message {i}")
    return content


def build_messages(prompt: str | Messages, spec: SchemaSpec | None,
                   system_prompt: str | bool | None = None) -> Messages:
    if isinstance(prompt, list):  # an assistant turn that only called tools has no content
        prompt = [{**m, "content": ""} if isinstance(m, dict) and m.get("content") is None
                  and m.get("role") == "assistant" else m for m in prompt]
    if isinstance(prompt, str):
        check_text(prompt, "prompt", "the prompt")
        messages: Messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m
                                          for m in prompt):
        messages = []
        for i, m in enumerate(prompt):
            if not isinstance(m["role"], str):
                raise ConfigError(f"message {i}: role must be a string, got "
                                  f"{type(m['role']).__name__}", option="prompt")
            check_text(m["role"], "prompt", f"message {i}'s role")
            messages.append({**m, "content": _message_content(m["content"], i)})
    else:
        raise ConfigError("a prompt is a string or a list of {'role', 'content'} messages",
                          option="prompt")
    if not messages or not any(m["role"] == "user" for m in messages):
        raise ConfigError("the conversation has no user message", option="prompt")
    if system_prompt is False:
        return messages
    if isinstance(system_prompt, str):
        check_text(system_prompt, "system_prompt", "the system prompt")
    text = system_prompt if isinstance(system_prompt, str) else describe_schema(spec)
    if text and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": text})
    return messages


def encode_prompt(tokenizer: Any, prompt: str | Messages, spec: SchemaSpec | None,
                  system_prompt: str | bool | None = None, *, context: int | None = None,
                  reserved: int = 0, tools: ToolSet | None = None,
                  template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of the full model input, generation prompt included.

    With ``context`` (the model's context in tokens) and ``reserved`` (the tokens kept for the
    output: max_tokens and the speculative lookahead), the default system message fits a budget
    of ``SCHEMA_PROMPT_SHARE * context`` tokens and whatever the rest of the prompt and
    ``reserved`` leave (module docstring); without them it is the full description. ``tools``
    (active: ``tool_choice`` not "none") are described instead of ``spec``.
    ``template_kwargs``: extra variables for the chat template (``enable_thinking``, ...).
    """
    plain = tokenizer  # the description's fit counts tokens only: cached per tokenizer proper
    if template_kwargs:
        tokenizer = _TemplateArgs(tokenizer, check_template_kwargs(template_kwargs))
    if isinstance(prompt, list):
        # a history from Python: nesting bounded before any recursive walk (template, repr)
        check_depth(prompt, what="the messages", option="prompt")
        prompt = _tool_history(tokenizer, prompt)
    if tools is not None and tools.active:
        return _encode_with_tools(tokenizer, prompt, tools, system_prompt, context, reserved)
    messages = build_messages(prompt, spec, system_prompt)
    if isinstance(prompt, str) and not prompt.strip():
        raise ConfigError("the prompt is empty", option="prompt")
    if context is None or spec is None or system_prompt is not None \
            or any(m["role"] == "system" for m in build_messages(prompt, spec, False)):
        # no system message of ours to fit
        return _encode_messages(tokenizer, messages, context=context)
    user = build_messages(prompt, spec, False)
    # what the prompt takes besides our text: the same messages with an empty system message
    base = _encode_messages(tokenizer, [{"role": "system", "content": ""}, *user], context=context)
    budget = min(int(SCHEMA_PROMPT_SHARE * context), context - reserved - len(base))
    text = _fitting_description(plain, spec, budget)
    return _encode_messages(tokenizer, [{"role": "system", "content": text}, *user],
                            context=context)


# (id(tokenizer), spec key, budget) -> (tokenizer, text): every request of a Generator asks for
# the same description, and measuring a big schema's candidates takes a second
_FITTED: OrderedDict[tuple[int, str, int], tuple[Any, str]] = OrderedDict()
_FITTED_SIZE = 64


def _fitting_description(tokenizer: Any, spec: SchemaSpec, budget: int) -> str:
    key = (id(tokenizer), spec.key, budget)
    hit = _FITTED.get(key)
    if hit is not None and hit[0] is tokenizer:
        _FITTED.move_to_end(key)
        return hit[1]

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    text = describe_schema(spec, budget, count) or ""
    _FITTED[key] = (tokenizer, text)
    if len(_FITTED) > _FITTED_SIZE:
        _FITTED.popitem(last=False)
    return text


class _TemplateArgs:
    """A tokenizer whose chat template also gets ``kwargs`` (a request's
    ``chat_template_kwargs``); everything else is the tokenizer's."""

    def __init__(self, tokenizer: Any, kwargs: Mapping[str, Any]) -> None:
        self._tokenizer = tokenizer
        self._kwargs = dict(kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer.apply_chat_template(*args, **{**self._kwargs, **kwargs})


#: template variables the library sets itself (a request's value would silently lose or
#: break the prompt's structure)
_OWN_TEMPLATE_ARGS = ("messages", "tools", "add_generation_prompt", "tokenize", "documents",
                      "return_dict", "continue_final_message")
#: parameters of transformers' ``apply_chat_template`` that are not template variables: they
#: would replace the template (``chat_template``), the conversation, or how its text is
#: tokenized; `_template_call_parameters` adds those of the installed version's signature
_CALL_PARAMETERS = ("conversation", "chat_template", "sanitize_control_tokens", "padding",
                    "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask",
                    "tokenizer_kwargs")


@functools.cache
def _template_call_parameters() -> frozenset[str]:
    import inspect

    try:
        from transformers import PreTrainedTokenizerBase

        signature = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
        named = {n for n, p in signature.items()
                 if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    except (ImportError, AttributeError, TypeError, ValueError):
        named = set()
    return frozenset(named | set(_CALL_PARAMETERS)) - set(_OWN_TEMPLATE_ARGS)


def check_template_kwargs(kwargs: object) -> dict[str, Any]:
    """``chat_template_kwargs``: a mapping of names to JSON values, each a template variable:
    none the library sets itself, none a parameter of the template call."""
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ConfigError("must be a mapping of template variable names to values",
                          option="chat_template_kwargs")
    check_depth(kwargs, what="chat_template_kwargs", option="chat_template_kwargs")
    own = sorted(set(kwargs) & set(_OWN_TEMPLATE_ARGS))
    if own:
        raise ConfigError(f"{own[0]!r} is set by the library itself; pass the messages, tools "
                          "or options instead", option="chat_template_kwargs")
    call = sorted(set(kwargs) & _template_call_parameters())
    if call:
        raise ConfigError(f"{call[0]!r} is a parameter of the chat template call, not a template "
                          "variable: only variables the template reads pass through",
                          option="chat_template_kwargs")
    return dict(kwargs)


def _encode_messages(tokenizer: Any, messages: Messages,
                     tools: list[dict[str, Any]] | None = None,
                     context: int | None = None) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        # bounded in time and size (render.py); a template that runs away with a request's
        # chat_template_kwargs is the likely case (the model's own loops are linear in the
        # messages), so a timeout names them when the request has some
        option = "chat_template_kwargs" if isinstance(tokenizer, _TemplateArgs) else "prompt"
        text = render_chat_template(tokenizer, messages, tools, context=context, option=option)
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        text = "\n\n".join(m["content"] for m in messages) + "\n"
        ids = tokenizer.encode(text)
    return list(ids)


def _tool_history(tokenizer: Any, messages: Messages) -> Messages:
    """Earlier tool calls and tool results in ``messages``, as the template takes them: as they
    are for a template with a tool section (arguments given as JSON text parsed, as templates
    write them with ``tojson``), else written as text in the default call format (results as a
    user turn in ``<tool_response>`` tags)."""
    if not any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
               for m in messages):
        return messages
    from constrained_spec.frontend.tools import detect_format

    fmt = detect_format(tokenizer)
    # Mistral's templates refuse other call ids; the rest take the ids as the client sent them
    ids = mistral_call_ids(messages) if fmt.id_style == "mistral" else {}
    out: Messages = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            parsed: list[tuple[str, Any, Any]] = []
            for j, c in enumerate(calls):
                fn = c.get("function", c) if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ConfigError(f"message {i}, tool call {j}: expected {{'type': 'function', "
                                      "'function': {'name', 'arguments'}}", option="prompt")
                args = fn.get("arguments") or {}
                if isinstance(args, str):
                    try:
                        args = loads(args, what=f"the arguments of tool call {j} in messages[{i}]",
                                     option="prompt")
                    except json.JSONDecodeError as e:
                        raise ConfigError(f"message {i}, tool call {j}: arguments are not JSON: "
                                          f"{e.msg}", option="prompt") from e
                parsed.append((fn["name"], args, c))
            if fmt.default:
                text = fmt.write([(n, a) for n, a, _ in parsed])
                content = m.get("content") or ""
                out.append({"role": "assistant", "content": f"{content}\n{text}".strip()})
            else:
                out.append({**m, "content": m.get("content") or "", "tool_calls": [
                    {**c, **_renamed(c, "id", ids), "type": "function",
                     "function": {"name": n, "arguments": a}} for n, a, c in parsed]})
        elif isinstance(m, dict) and m.get("role") == "tool" and fmt.default:
            content = _message_content(m.get("content") or "", i)
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        elif isinstance(m, dict) and m.get("role") == "tool":
            out.append({**m, **_renamed(m, "tool_call_id", ids)})
        else:
            out.append(m)
    return out


def _renamed(item: Any, key: str, ids: dict[str, str]) -> dict[str, str]:
    """``{key: new id}`` when ``item[key]`` is an id that ``ids`` renames, else ``{}``."""
    old = item.get(key) if isinstance(item, dict) else None
    return {key: ids[old]} if isinstance(old, str) and old in ids else {}


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALNUM = string.ascii_letters + string.digits


def mistral_call_ids(messages: Messages) -> dict[str, str]:
    """Every call id in ``messages`` (in an assistant turn's ``tool_calls``, as a ``tool``
    turn's ``tool_call_id``) -> the id to give Mistral's templates: 9 letters and digits.

    An id of that form stays as it is; any other becomes its last 9 letters and digits (as
    vLLM does), or, where it has fewer or those are already another id's, 9 characters of a
    hash of it (deterministic: the same conversation gives the same ids on every request). The
    mapping is one-to-one, so a call and the tool result that answers it keep matching ids and
    two different calls never share one.
    """
    seen: dict[str, None] = {}  # the ids in order of appearance, once each
    for m in messages:
        if not isinstance(m, dict):
            continue
        for c in m.get("tool_calls") or []:
            if isinstance(c, dict) and isinstance(c.get("id"), str):
                seen[c["id"]] = None
        if m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str):
            seen[m["tool_call_id"]] = None
    # valid ids first: they keep their value, so no mapped id may take it
    ids = {i: i for i in seen if _MISTRAL_ID.fullmatch(i)}
    taken = set(ids.values())
    for old in seen:
        if old in ids:
            continue
        new = "".join(ch for ch in old if ch in _ALNUM)[-9:]
        salt = 0
        while len(new) != 9 or new in taken:
            n = int.from_bytes(hashlib.sha256(f"{salt}:{old}".encode()).digest(), "big")
            new = "".join(_ALNUM[n // len(_ALNUM) ** k % len(_ALNUM)] for k in range(9))
            salt += 1
        ids[old] = new
        taken.add(new)
    return ids


def _encode_with_tools(tokenizer: Any, prompt: str | Messages, tools: ToolSet,
                       system_prompt: str | bool | None, context: int | None,
                       reserved: int) -> list[int]:
    """The prompt with the tools: rendered by a template with a tool section, else described
    in our system message (the most detailed description that fits the budget)."""
    from constrained_spec.frontend.tools import detect_format

    fmt = detect_format(tokenizer)
    user = build_messages(prompt, None, False)
    if not fmt.default:
        messages = build_messages(prompt, None, system_prompt if isinstance(system_prompt, str)
                                  else False)
        return _encode_messages(tokenizer, messages, [t.openai() for t in tools.offered],
                                context)
    if system_prompt is not None or any(m["role"] == "system" for m in user):
        # the user's system message stays theirs; the tools follow it in the same message
        messages = build_messages(prompt, None, system_prompt if isinstance(system_prompt, str)
                                  else False)
        text = tools.describe(fmt)
        if system_prompt is not False:
            if messages and messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
            else:
                messages.insert(0, {"role": "system", "content": text})
        return _encode_messages(tokenizer, messages, context=context)
    if context is None:
        return _encode_messages(tokenizer, [{"role": "system", "content": tools.describe(fmt)},
                                            *user])
    base = _encode_messages(tokenizer, [{"role": "system", "content": ""}, *user], context=context)
    budget = min(int(SCHEMA_PROMPT_SHARE * context), context - reserved - len(base))
    for detail in (0, 1, 2):
        text = tools.describe(fmt, detail)
        if detail == 2 or len(tokenizer.encode(text, add_special_tokens=False)) <= budget:
            break
    return _encode_messages(tokenizer, [{"role": "system", "content": text}, *user],
                            context=context)
