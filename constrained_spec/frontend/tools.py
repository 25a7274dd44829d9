"""Tool calls: the tools a model may call, the grammar of a call, and the calls read back.

A tool is a typed Python function (its signature and docstring become the schema), a Pydantic
model, or an OpenAI tool dict; :func:`normalize_tools` turns each into a :class:`Tool` (name,
description, the JSON Schema of its arguments as a :class:`SchemaSpec`). A :class:`ToolSet` is
the tools of one request with its ``tool_choice`` and ``parallel_tool_calls``.

How a call is written follows the model's chat template (:func:`detect_format`):

===========  =========================================================  ====================
format       one call                                                   between calls
===========  =========================================================  ====================
hermes       ``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>``  newline
llama3       ``{"name": "NAME", "parameters": ARGS}``                   ``"; "``
mistral      ``[TOOL_CALLS][{"name": "NAME", "arguments": ARGS}, ...]``  ``", "`` (one list)
mistral_v11  ``[TOOL_CALLS]NAME[ARGS]ARGS``                             nothing
===========  =========================================================  ====================

Mistral's templates of tokenizers v2 to v7 (7B v0.3, Nemo, Small 2409 / 2501) write one JSON
list after ``[TOOL_CALLS]`` (after ``"[TOOL_CALLS] ["`` where the template puts a space there,
as the sentencepiece ones do); those of tokenizers v11 and later write ``[ARGS]`` and repeat
``[TOOL_CALLS]`` before each call. Their call ids are 9 letters and digits (the templates refuse
others in the history).

Hermes is also the documented default for templates without a tool section (the embedded
SmolLM2 among them): the tools are then described in a system message of ours
(:meth:`ToolSet.describe`) and earlier calls / tool results in the history are written in the
same format. A template with a tool section renders the tools itself (``tools=`` of
``apply_chat_template``).

The grammar is an xgrammar structural tag (:meth:`ToolSet.spec`): the tags and the tool names
are constant strings (so the forced drafter drafts them for free), and each tool's arguments are
the project's own JSON grammar of its schema (``convert_json_schema``: the JSON layout, no free
whitespace, the backend fixes), embedded as a ``grammar`` format. The compiled structural tag
is written back as EBNF and compiled like any :class:`Grammar`, so caching, speculation and
masking are the usual ones. What each ``tool_choice`` allows:

* ``"required"``: one or more calls (exactly one without ``parallel_tool_calls``), nothing else;
* a tool's name: exactly one call to that tool;
* ``"auto"``: text, or text followed by calls as under ``"required"``; the text cannot contain
  the call trigger, so a call is always well-formed and nothing follows the calls;
* ``"none"``: no tools (free text, or the request's schema).

Parsing (:meth:`ToolSet.parse`) splits a finished text into the text before the calls and the
calls; each call's arguments are validated against its tool's schema (jsonschema + Pydantic)
and typed (the Pydantic instance, a dict of typed values for a function, the dict for an
OpenAI tool). :class:`StreamingToolParser` does the same on a growing text, for OpenAI's
streamed tool-call deltas. The outlines backend has no structural tags: tools there are a
`SchemaError` naming the backend.

Special tokens: a marker that is one token of the model's tokenizer (Mistral's
``[TOOL_CALLS]`` and ``[ARGS]``; :attr:`ToolFormat.tokens`, found by :func:`detect_format`) is
written by the grammar as that one token (an xgrammar ``TokenFormat``), never spelled in text
tokens, and the text before the calls cannot spell it either. Parsing reads the decoded text,
in which the token is its marker again.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import re
import secrets
import string
import threading
import typing
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from constrained_spec.errors import ConfigError, JSONDepthError, OutputValidationError, SchemaError
from constrained_spec.json_limits import check_depth, check_text_depth, loads
from constrained_spec.schemas import JsonLayout, SchemaSpec, normalize_schema, parse_output

__all__ = ["Tool", "ToolCall", "ToolSet", "ToolFormat", "FORMATS", "DEFAULT_FORMAT",
           "normalize_tools", "detect_format", "StreamingToolParser", "history_arguments",
           "check_history_arguments"]

ToolChoice = str  # "auto" | "required" | "none" | a tool's name
_COMPACT = JsonLayout()  # the library's default layout (api.DEFAULT_LAYOUT)
# (ToolSet.key(), format, backend, layout, bounds) -> the tool-call spec, most recent last
_SPECS: OrderedDict[tuple[Any, ...], SchemaSpec] = OrderedDict()
_SPECS_LOCK = threading.Lock()
_SPECS_SIZE = 64
_MODES = ("auto", "required", "none")
# OpenAI's rule for function names: also keeps names free of JSON escapes in the grammar
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


# --------------------------------------------------------------------------------------------
# tools
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tool:
    """One tool the model may call: its name, description and the schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]
    #: the arguments' spec: final validation and the typed value (Pydantic model or TypeAdapter)
    spec: SchemaSpec = field(repr=False, compare=False)
    #: the Python function, for a function tool (:meth:`ToolCall.invoke`)
    function: Callable[..., Any] | None = field(default=None, repr=False, compare=False)

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's ``{"type": "function", "function": {...}}``."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}

    def arguments(self, value: Any) -> Any:
        """Validate parsed JSON ``value`` as this tool's arguments and type it."""
        parsed = parse_output(self.spec, self.spec.layout.dumps(value))
        if self.function is not None:  # keyword arguments, each typed by the annotation
            return dict(parsed)
        return parsed


@dataclass
class ToolCall:
    """One call the model made: the tool's ``name``, its validated and typed ``arguments``
    (the Pydantic instance, a dict of typed values for a function, the dict for an OpenAI tool)
    and an ``id`` (OpenAI's ``call_...``)."""

    name: str
    arguments: Any
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    #: the arguments exactly as the model wrote them (JSON text)
    arguments_json: str = ""
    tool: Tool | None = field(default=None, repr=False, compare=False)

    def invoke(self) -> Any:
        """Run the call: a function tool's Python function with the arguments; for a Pydantic
        model tool, the validated model instance (the model is the tool: its instance is what
        the call produces). An OpenAI tool dict has nothing to run here."""
        from pydantic import BaseModel

        if self.tool is not None and self.tool.function is not None:
            return self.tool.function(**self.arguments)
        if isinstance(self.arguments, BaseModel):
            return self.arguments
        raise ConfigError(f"tool {self.name!r} is an OpenAI tool dict, with no Python function "
                          "or model to run: run it yourself with .arguments (a dict)",
                          option="tools")

    def openai(self) -> dict[str, Any]:
        """The call as an OpenAI ``tool_calls`` item (arguments as JSON text)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments_json}}

    def to_json(self) -> dict[str, Any]:
        """``{"name", "arguments"}`` with the arguments as JSON values (the command line's output)."""
        return {"name": self.name, "arguments": json.loads(self.arguments_json)}


def normalize_tools(tools: Any) -> list[Tool]:
    """Turn each of ``tools`` (functions, Pydantic models, OpenAI tool dicts, :class:`Tool`)
    into a :class:`Tool`; names must be distinct."""
    try:  # before anything walks them (a repr in an error message too)
        check_depth(tools, what="the tool list")
    except JSONDepthError as e:  # the nesting is the arguments' schemas': a schema error
        raise SchemaError(str(e)) from None
    if isinstance(tools, (dict, Tool)) or callable(tools) and not isinstance(tools, (list, tuple)):
        tools = [tools]
    if not isinstance(tools, (list, tuple)) or not tools:
        raise ConfigError("must be a non-empty list of functions, Pydantic models or OpenAI tool "
                          "dicts", option="tools")
    out = [_tool(t, i) for i, t in enumerate(tools)]
    seen: set[str] = set()
    for t in out:
        if t.name in seen:
            raise ConfigError(f"two tools are named {t.name!r}; tool names must be distinct",
                              option="tools")
        seen.add(t.name)
    return out


def history_arguments(messages: Any) -> list[tuple[int, int, str]]:
    """``(message index, call index, arguments)`` of every earlier tool call in a message
    history whose arguments are JSON text (as OpenAI's clients send them)."""
    out = []
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        for j, c in enumerate(calls if isinstance(calls, list) else []):
            fn = c.get("function", c) if isinstance(c, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            if isinstance(args, str):
                out.append((i, j, args))
    return out


def check_history_arguments(messages: Any, *, option: str = "prompt") -> None:
    """Refuse, with a :class:`~constrained_spec.errors.JSONDepthError` naming the message and
    the call, tool-call arguments in a message history nested deeper than the limit for JSON
    from outside (``json_limits``), before anything parses them: the prompt's template reads
    them back as JSON."""
    for i, j, args in history_arguments(messages):
        check_text_depth(args, what=f"the arguments of tool call {j} in messages[{i}]",
                         option=option)


def _tool(obj: Any, i: int) -> Tool:
    if isinstance(obj, Tool):
        return obj
    if isinstance(obj, dict):
        return _from_openai(obj, i)
    from pydantic import BaseModel

    if isinstance(obj, type) and issubclass(obj, BaseModel):
        doc = inspect.getdoc(obj) or ""
        if doc == inspect.getdoc(BaseModel):
            doc = ""
        return _make(obj.__name__, _summary(doc), obj, i)
    if inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.isbuiltin(obj):
        return _from_function(obj, i)
    raise ConfigError(f"tool {i}: expected a function, a Pydantic model or an OpenAI tool dict, "
                      f"got {type(obj).__name__}", option="tools")


def _make(name: str, description: str, schema: Any, i: int,
          function: Callable[..., Any] | None = None) -> Tool:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"tool {i}: name {name!r:.70} must be 1 to 64 letters, digits, '_' or "
                          "'-'", option="tools")
    try:
        spec = normalize_schema(schema)
    except SchemaError as e:
        raise SchemaError(f"tool {name!r}: the arguments' schema: {e}") from e
    params = spec.json_schema or {}
    if spec.kind != "json_schema" or params.get("type", "object") != "object":
        raise SchemaError(f"tool {name!r}: the arguments must be a JSON object schema "
                          "(\"type\": \"object\")", pointer="")
    return Tool(name, description, params, spec, function)


def _from_openai(d: dict[str, Any], i: int) -> Tool:
    fn = d.get("function", d) if d.get("type", "function") == "function" else None
    if not isinstance(fn, dict) or "name" not in fn:
        raise ConfigError(f"tool {i}: an OpenAI tool is {{\"type\": \"function\", \"function\": "
                          f"{{\"name\", \"description\", \"parameters\"}}}}, got {d!r:.80}",
                          option="tools")
    params = fn.get("parameters")
    if params is None:  # OpenAI: a function without parameters takes none
        params = {"type": "object", "properties": {}}
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise ConfigError(f"tool {i}: description must be a string", option="tools")
    return _make(fn["name"], desc, params, i)


def _from_function(fn: Callable[..., Any], i: int) -> Tool:
    from pydantic import create_model

    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as e:  # an annotation that does not resolve
        raise ConfigError(f"tool {i} ({getattr(fn, '__name__', fn)!r}): its annotations do not "
                          f"resolve: {e}", option="tools") from e
    doc = inspect.getdoc(fn) or ""
    params_doc = _param_docs(doc)
    fields: dict[str, Any] = {}
    from pydantic import Field

    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in ("self", "cls") and name not in hints:
            continue
        if name not in hints:
            raise ConfigError(f"tool {fn.__name__!r}: parameter {name!r} has no type annotation "
                              "(its type becomes the schema)", option="tools")
        default = ... if p.default is p.empty else p.default
        fields[name] = (hints[name], Field(default, description=params_doc.get(name)))
    model = create_model(fn.__name__, **fields)
    return _make(fn.__name__, _summary(doc), model, i, function=fn)


def _summary(doc: str) -> str:
    """The first paragraph of a docstring, on one line."""
    head = doc.strip().split("\n\n")[0]
    return " ".join(head.split())


_SECTIONS = ("Returns", "Return", "Raises", "Yields", "Examples", "Example", "Notes", "See Also",
             "Attributes", "Warns", "References")


def _param_docs(doc: str) -> dict[str, str]:
    """Parameter descriptions from a NumPy-style (``name : type``, the text on the indented
    lines below) or Google-style (``Args:``, then ``name (type): text``) docstring."""
    out: dict[str, str] = {}
    in_params, current, base = False, None, None
    for line in doc.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if stripped in ("Parameters", "Parameters:", "Args:", "Arguments:"):
            in_params, current, base = True, None, None
            continue
        if not in_params or not stripped or set(stripped) == {"-"}:
            continue
        if base is not None and indent < base or stripped.rstrip(":") in _SECTIONS:
            in_params = False  # the next section
            continue
        numpy = re.match(r"^(\w+)\s+:\s*\S.*$|^(\w+)\s*:$", stripped)
        google = re.match(r"^(\w+)\s*(?:\([^)]*\))?:\s*(.*)$", stripped)
        if (base is None or indent == base) and (numpy or google):
            base = indent
            if numpy:
                current = numpy.group(1) or numpy.group(2)
                out[current] = ""
            else:
                assert google is not None
                current = google.group(1)
                out[current] = google.group(2)
        elif current is not None:
            out[current] = f"{out[current]} {stripped}".strip()
    return {k: v for k, v in out.items() if v}


# --------------------------------------------------------------------------------------------
# formats
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes tool calls (see the module docstring): each call is
    ``call_begin`` NAME ``name_end`` ARGUMENTS ``call_end``, calls are joined by ``separator``
    and the whole list sits between ``list_begin`` and ``list_end``."""

    name: str
    call_begin: str  # before the tool's name
    name_end: str  # between the name and the arguments
    call_end: str  # after the arguments
    separator: str  # between two calls
    trigger: str  # what starts the calls (excluded from the text before them)
    list_begin: str = ""  # around all calls (mistral)
    list_end: str = ""
    #: written by our default system message and history rendering (no tool section in the
    #: template), rather than by the template
    default: bool = False
    #: the markers the model's tokenizer has as one (special) token, with its id: the grammar
    #: writes each as that token, never spelled in text tokens (:func:`detect_format`)
    tokens: tuple[tuple[str, int], ...] = ()
    #: call ids: OpenAI's ``call_...``, or Mistral's 9 letters and digits (its templates refuse
    #: any other id in the history)
    id_style: typing.Literal["openai", "mistral"] = "openai"

    def begin(self, name: str) -> str:
        return f"{self.call_begin}{name}{self.name_end}"

    def write(self, calls: Sequence[tuple[str, Any]], layout: JsonLayout | None = None) -> str:
        """``calls`` ((name, arguments) pairs) as the model writes them."""
        layout = layout or _COMPACT
        text = self.separator.join(self.begin(n) + layout.dumps(a) + self.call_end for n, a in calls)
        return self.list_begin + text + self.list_end

    def new_id(self) -> str:
        """A new call id in this format's style."""
        if self.id_style == "mistral":
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:24]}"


_ALNUM = string.ascii_letters + string.digits
_JSON_NAME = '", "{}": '
FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", '<tool_call>\n{"name": "', _JSON_NAME.format("arguments"),
                         "}\n</tool_call>", "\n", "<tool_call>"),
    "llama3": ToolFormat("llama3", '{"name": "', _JSON_NAME.format("parameters"), "}", "; ",
                         '{"name": '),
    # Mistral's tokenizers v2 to v7 (7B v0.3, Nemo, Small 2409 / 2501, Large 2407 / 2411)
    "mistral": ToolFormat("mistral", '{"name": "', _JSON_NAME.format("arguments"), "}", ", ",
                          "[TOOL_CALLS]", list_begin="[TOOL_CALLS][", list_end="]",
                          id_style="mistral"),
    # Mistral's tokenizers v11 and later: each call its own [TOOL_CALLS], the name as text
    "mistral_v11": ToolFormat("mistral_v11", "[TOOL_CALLS]", "[ARGS]", "", "", "[TOOL_CALLS]",
                              id_style="mistral"),
}
#: The format for templates without a tool section: Hermes' ``<tool_call>`` tags, with the tools
#: described in our system message (what SmolLM2 and Qwen-style models were tuned on).
DEFAULT_FORMAT = dataclasses.replace(FORMATS["hermes"], default=True)
# the markers of a format that a tokenizer may have as one special token each
_MARKERS = ("[TOOL_CALLS]", "[ARGS]")


def detect_format(tokenizer: Any) -> ToolFormat:
    """The call format of ``tokenizer``'s chat template: the family its tool section names
    (Hermes / Qwen ``<tool_call>``, Llama-3 ``<|python_tag|>`` / ``"parameters"`` JSON,
    Mistral ``[TOOL_CALLS]``: a JSON list, or ``NAME[ARGS]`` when the template writes
    ``[ARGS]``), else :data:`DEFAULT_FORMAT`. A Mistral marker that is one token of
    ``tokenizer`` is written as that token (:attr:`ToolFormat.tokens`)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    if not isinstance(template, str) or "tools" not in template:
        return DEFAULT_FORMAT
    if "[TOOL_CALLS]" in template:
        if "[ARGS]" in template:
            fmt = FORMATS["mistral_v11"]
        else:
            fmt = FORMATS["mistral"]
            if re.search(r"\[TOOL_CALLS\]\s+\[", template):
                # sentencepiece templates (7B v0.3) write the list after a space, as the model
                # was trained: "[TOOL_CALLS] [{...}]"
                fmt = dataclasses.replace(fmt, list_begin="[TOOL_CALLS] [")
        markers = [m for m in _MARKERS if m in fmt.list_begin + fmt.begin("")]
        tokens = tuple((m, i) for m in markers if (i := _single_token(tokenizer, m)) is not None)
        return dataclasses.replace(fmt, tokens=tokens)
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "<|python_tag|>" in template or '"parameters"' in template or "parameters" in template \
            and "<|eom_id|>" in template:
        return FORMATS["llama3"]
    return DEFAULT_FORMAT


def _single_token(tokenizer: Any, marker: str) -> int | None:
    """The id of ``marker`` when ``tokenizer`` has it as one token, else None."""
    try:
        tid = tokenizer.convert_tokens_to_ids(marker)
        back = tokenizer.convert_ids_to_tokens(tid) if isinstance(tid, int) else None
    except Exception:  # noqa: BLE001 - a tokenizer-like object without these methods
        return None
    if back != marker or tid == getattr(tokenizer, "unk_token_id", None):
        return None
    return int(tid)


# --------------------------------------------------------------------------------------------
# one request's tools
# --------------------------------------------------------------------------------------------

class ToolSet:
    """The tools of one request, its ``tool_choice`` and ``parallel_tool_calls``.

    Parameters
    ----------
    tools:
        Functions, Pydantic models, OpenAI tool dicts or :class:`Tool` objects.
    tool_choice:
        ``"auto"`` (text or calls), ``"required"`` (calls only), ``"none"`` (no calls) or a
        tool's name (one call to it); OpenAI's ``{"type": "function", "function": {"name"}}``
        is taken too.
    parallel_tool_calls:
        Whether more than one call may be made.
    """

    def __init__(self, tools: Any, tool_choice: Any = "auto", parallel_tool_calls: bool = False
                 ) -> None:
        self.tools = normalize_tools(tools)
        self.by_name = {t.name: t for t in self.tools}
        if isinstance(tool_choice, dict):
            check_depth(tool_choice, what="the value", option="tool_choice")
            fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ConfigError(f"{tool_choice!r:.80} is not a tool choice; use 'auto', "
                                  "'required', 'none', a tool's name or {'type': 'function', "
                                  "'function': {'name': ...}}", option="tool_choice")
            tool_choice = fn["name"]
        if not isinstance(tool_choice, str) or (tool_choice not in _MODES
                                                and tool_choice not in self.by_name):
            raise ConfigError(f"{tool_choice!r:.60} is neither 'auto', 'required', 'none' nor one "
                              f"of the tools ({', '.join(self.by_name)})", option="tool_choice")
        if not isinstance(parallel_tool_calls, bool):
            raise ConfigError(f"must be true or false, got {parallel_tool_calls!r:.40}",
                              option="parallel_tool_calls")
        self.choice: ToolChoice = tool_choice
        self.parallel = parallel_tool_calls and tool_choice in ("auto", "required")

    @property
    def active(self) -> bool:
        """Whether calls are possible (``tool_choice`` is not ``"none"``)."""
        return self.choice != "none"

    @property
    def offered(self) -> list[Tool]:
        """The tools the grammar allows a call to."""
        return [self.by_name[self.choice]] if self.choice in self.by_name else self.tools

    def key(self) -> str:
        """Equal for tool sets that allow the same calls and read them back the same way."""
        parts = [[t.name, t.description, t.spec.key, id(t.function)] for t in self.tools]
        return json.dumps([parts, self.choice, self.parallel])

    # -- grammar ------------------------------------------------------------------------------
    def spec(self, fmt: ToolFormat, backend: str = "xgrammar", layout: JsonLayout | None = None,
             *, max_string_length: int | None = None, max_items: int | None = None) -> SchemaSpec:
        """The grammar of this request's output in ``fmt``: a ``grammar`` spec whose ``target``
        is the parser of the output (``Generator.finalize`` returns the calls).
        ``max_string_length`` / ``max_items`` bound the arguments' strings and arrays in the
        grammar (the library's opt-in bounds); the calls are still validated against the tools'
        own schemas."""
        if backend != "xgrammar":
            raise SchemaError("tool calls need structural tags, which the outlines backend does "
                              "not have; use the xgrammar backend", backend=backend)
        layout = layout or _COMPACT
        # a server builds the same tool set's grammar for request after request
        bounds = (max_string_length, max_items)
        key = (self.key(), fmt, backend, layout, bounds)
        with _SPECS_LOCK:
            hit = _SPECS.get(key)
            if hit is not None:
                _SPECS.move_to_end(key)
                return hit
        spec = self._build_spec(fmt, backend, layout, bounds)
        with _SPECS_LOCK:
            _SPECS[key] = spec
            while len(_SPECS) > _SPECS_SIZE:
                _SPECS.popitem(last=False)
        return spec

    def _build_spec(self, fmt: ToolFormat, backend: str, layout: JsonLayout,
                    bounds: tuple[int | None, int | None]) -> SchemaSpec:
        import xgrammar
        from xgrammar import structural_tag as st

        from constrained_spec.schemas import bound_schema, convert_json_schema

        tokens = dict(fmt.tokens) if hasattr(st, "TokenFormat") else {}  # older xgrammar: text
        tags = []
        for tool in self.offered:
            args_spec, _ = bound_schema(dataclasses.replace(tool.spec, layout=layout, key=""),
                                        max_string_length=bounds[0], max_items=bounds[1])
            args = convert_json_schema(args_spec, "xgrammar")
            tags.append(_tag(fmt.begin(tool.name), st.GrammarFormat(grammar=str(args)),
                             fmt.call_end, tokens))
        one = len(tags) == 1 and not self.parallel
        calls: Any
        if one:
            calls = tags[0]
        elif all(isinstance(t, st.TagFormat) for t in tags):
            calls = st.TagsWithSeparatorFormat(tags=tags, separator=fmt.separator,
                                               at_least_one=True,
                                               stop_after_first=not self.parallel)
        else:  # tags that begin with a token: the same, as or / star
            calls = tags[0] if len(tags) == 1 else st.OrFormat(elements=tags)
            if self.parallel:
                more = st.SequenceFormat(elements=[*_pieces(fmt.separator, tokens), calls])
                calls = st.SequenceFormat(elements=[calls, st.StarFormat(content=more)])
        if fmt.list_begin:
            calls = _tag(fmt.list_begin, calls, fmt.list_end, tokens)
        if self.choice == "auto":
            text = st.AnyTextFormat(excludes=[fmt.trigger])
            calls = st.OrFormat(elements=[text, st.SequenceFormat(elements=[text, calls])])
        try:
            grammar = xgrammar.Grammar.from_structural_tag(st.StructuralTag(format=calls))
        except Exception as e:  # noqa: BLE001 - xgrammar raises several types
            from constrained_spec.schemas.spec import clean_backend_message

            raise SchemaError(f"the tool-call grammar does not compile: "
                              f"{clean_backend_message(e)}", backend=backend) from e
        return SchemaSpec(kind="grammar", ebnf=str(grammar), target=ToolParser(self, fmt, layout))

    # -- prompt -------------------------------------------------------------------------------
    def describe(self, fmt: ToolFormat, detail: int = 0) -> str:
        """Our system message for templates without a tool section (``detail`` 0: the tools'
        full JSON; 1: names, descriptions and argument names; 2: names only)."""
        if detail == 0:
            listing = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in self.offered)
        elif detail == 1:
            listing = "\n".join(f"- {t.name}({', '.join(t.parameters.get('properties', {}))})"
                                + (f": {t.description}" if t.description else "")
                                for t in self.offered)
        else:
            listing = ", ".join(t.name for t in self.offered)
        example = fmt.write([("<name>", {"<argument>": "<value>"})])
        head = "You can call functions (tools). Their signatures are within <tools></tools>:"
        if self.choice == "required":
            ask = "Answer with a call to one of the tools."
        elif self.choice in self.by_name:
            ask = f"Answer with a call to {self.choice}."
        else:
            ask = "Call a tool when it helps to answer; otherwise answer in text."
        return (f"{head}\n<tools>\n{listing}\n</tools>\n{ask} Write each call as JSON in this "
                f"form:\n{example}")

    # -- output -------------------------------------------------------------------------------
    def parse(self, text: str, fmt: ToolFormat) -> tuple[str, list[ToolCall]]:
        """``text`` (a finished output) -> (the text before the calls, the validated calls)."""
        return ToolParser(self, fmt).split(text)


def _pieces(text: str, tokens: dict[str, int]) -> list[Any]:
    """``text`` as structural-tag formats: constant strings, and each marker in ``tokens`` as
    its one token (which then is the only way to write it: not its spelling)."""
    from xgrammar import structural_tag as st

    if not tokens:
        return [st.ConstStringFormat(value=text)] if text else []
    out: list[Any] = []
    for part in re.split("(" + "|".join(map(re.escape, tokens)) + ")", text):
        if part in tokens:
            out.append(st.TokenFormat(token=tokens[part]))
        elif part:
            out.append(st.ConstStringFormat(value=part))
    return out


def _tag(begin: str, content: Any, end: str, tokens: dict[str, int]) -> Any:
    """``begin`` content ``end``: a structural tag, or a sequence when a marker is a token."""
    from xgrammar import structural_tag as st

    if not any(m in begin + end for m in tokens):
        return st.TagFormat(begin=begin, content=content, end=end)
    return st.SequenceFormat(elements=[*_pieces(begin, tokens), content, *_pieces(end, tokens)])


@dataclass
class ToolReading:
    """What :meth:`ToolParser.read` found in an output: the text before the calls, the calls
    kept, and what was dropped (each said in :meth:`notes`)."""

    content: str
    calls: list[ToolCall]
    #: (its index, the index of the earlier call it repeats, the tool's name) of the first call
    #: identical to an earlier one: it ended the calls, it and anything after it were dropped
    repeated: tuple[int, int, str] | None = None
    #: (its index, the tool's name, "" while the name itself was not complete) of a call that
    #: had begun but did not end (an output cut by ``max_tokens``): dropped
    cut: tuple[int, str] | None = None

    def notes(self, why: str = "max_tokens") -> list[dict[str, Any]]:
        """What was dropped and why, one ``{"type", "message"}`` item each (``why``: what cut
        the output)."""
        out = []
        if self.repeated is not None:
            k, j, name = self.repeated
            out.append({"type": "tool_call_repeated", "message": (
                f"tool call {k} ({name}) repeated tool call {j} with the same arguments; a call "
                "identical to an earlier one ends the calls: it and anything after it were "
                "dropped")})
        if self.cut is not None:
            k, name = self.cut
            fix = ("raise max_tokens to let it finish" if why == "max_tokens" else
                   "sampling (temperature) or a repetition guard (no_repeat_ngram_size) helps")
            out.append({"type": "tool_call_dropped", "message": (
                f"tool call {k}{f' ({name})' if name else ''} was cut by {why} before its "
                f"arguments ended and was dropped; {fix}")})
        return out


@dataclass(frozen=True)
class ToolParser:
    """Reads a finished output of a :class:`ToolSet` in one format back into calls; the
    ``target`` of the tool spec, which :meth:`Generator.finalize` calls.

    A call identical to an earlier one (same tool, same arguments, written the same way: the
    grammar writes JSON in one layout) ends the calls: a small model under ``"required"`` with
    parallel calls tends to repeat its first call until ``max_tokens``, and the repeat adds
    nothing. It and anything after it are dropped (:attr:`ToolReading.repeated`)."""

    tools: ToolSet
    fmt: ToolFormat
    layout: JsonLayout = _COMPACT

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """``text`` (a finished output) -> (the text before the calls, the validated calls)."""
        reading = self.read(text)
        return reading.content, reading.calls

    def read(self, text: str, *, complete: bool = True) -> ToolReading:
        """The text before the calls and the validated calls of ``text``: a finished output
        (``complete``: a call that does not end is an error, so is no call where one is
        required), or one cut short (a call that had begun but did not end is dropped, and
        may leave no call at all)."""
        start = text.find(self.fmt.trigger) if self.tools.choice == "auto" else 0
        if start < 0:
            cut = 0 if complete else _held_back(text, self.fmt.trigger)
            return ToolReading(text[:len(text) - cut], [])
        content, rest = text[:start], text[start:]
        spans = _scan_calls(rest, self.fmt)
        reading = ToolReading(content.strip(), [])
        seen: dict[tuple[str, str], int] = {}
        for k, span in enumerate(spans):
            if span.end is None:
                if complete:
                    raise OutputValidationError(f"the arguments of the call to {span.name!r} do "
                                                "not end", text=text,
                                                errors=["unterminated arguments"])
                reading.cut = (k, span.name)
                break
            args_text = rest[span.args_at:span.end]
            earlier = seen.setdefault((span.name, args_text), k)
            if earlier != k:
                reading.repeated = (k, earlier, span.name)
                break
            reading.calls.append(self._call(span.name, args_text, text))
        else:
            if not complete and _begun_after(rest, spans, self.fmt):
                reading.cut = (len(spans), "")  # its markers or name were still being written
        if complete and not reading.calls:
            raise OutputValidationError("the output has no complete tool call", text=text,
                                        errors=["no tool call"])
        return reading

    def repeats(self, text: str) -> bool:
        """Whether ``text`` (an output so far) has a complete call identical to an earlier one
        (which ends the calls: a server stops the output there)."""
        start = text.find(self.fmt.trigger) if self.tools.choice == "auto" else 0
        if start < 0:
            return False
        seen = set()
        for span in _scan_calls(text[start:], self.fmt):
            if span.end is None:
                return False
            key = (span.name, text[start + span.args_at:start + span.end])
            if key in seen:
                return True
            seen.add(key)
        return False

    def _call(self, name: str, args_text: str, text: str) -> ToolCall:
        """The validated call to ``name`` with the arguments ``args_text`` (in output ``text``)."""
        tool = self.tools.by_name.get(name)
        if tool is None:
            raise OutputValidationError(f"the output calls {name!r}, which is not a tool",
                                        text=text, errors=[f"unknown tool {name!r}"])
        try:
            args = loads(args_text, what=f"the arguments of the call to {name!r}")
        except (json.JSONDecodeError, JSONDepthError) as e:
            raise OutputValidationError(f"a tool call is not JSON: {e}", text=text,
                                        errors=[str(e)]) from None
        try:
            value = tool.arguments(args)
        except OutputValidationError as e:
            raise OutputValidationError(f"tool {name!r}: {e}", text=text,
                                        errors=e.errors) from None
        return ToolCall(name, value, id=self.fmt.new_id(), arguments_json=args_text, tool=tool)

    def value(self, text: str) -> Any:
        """What ``generate`` returns: the text (auto, no call), the call, or the list of calls
        (``parallel_tool_calls``)."""
        content, calls = self.split(text)
        if not calls:
            return content
        return calls if self.tools.parallel else calls[0]


class _Span(typing.NamedTuple):
    """Where one call sits in an output that starts with the calls."""

    name: str
    args_at: int  # where its arguments start
    end: int | None  # where they end (None while they are still being written)


def _scan_calls(text: str, fmt: ToolFormat) -> list[_Span]:
    """(name, start of the arguments, their end or None while they are still being written)
    of each call in ``text``, which starts with the calls; stops before a call whose name is
    not complete yet. One reader for whole outputs and streamed ones."""
    out: list[_Span] = []
    pos = _marker(text, 0, fmt.list_begin)
    while pos is not None:
        if out:
            end = out[-1].end
            pos = None if end is None else _marker(text, end, fmt.call_end)
            pos = None if pos is None else _marker(text, pos, fmt.separator)
            if pos is None:
                break
        name_at = _marker(text, pos, fmt.call_begin)
        if name_at is None:
            break
        name = _NAME_RUN.match(text, name_at)
        args_at = _marker(text, name.end(), fmt.name_end) if name else None
        if name is None or args_at is None:
            break
        args_at = len(text) - len(text[args_at:].lstrip())
        out.append(_Span(name.group(), args_at, _json_end(text, args_at)))
    return out


_NAME_RUN = re.compile(r"[A-Za-z0-9_-]+")


def _begun_after(text: str, spans: list[_Span], fmt: ToolFormat) -> bool:
    """Whether ``text`` (which starts with the calls ``spans``, all complete) goes on into one
    more call whose name is not complete yet."""
    if not spans:
        return bool(text.strip())
    pos = _marker(text, spans[-1].end or len(text), fmt.call_end)
    rest = "" if pos is None else text[pos:].strip()  # None: the end markup is being written
    return bool(rest) and rest != fmt.list_end.strip()


def _marker(text: str, pos: int, marker: str) -> int | None:
    """The end of ``marker`` when ``text`` continues with it at ``pos`` (else None), with
    loose whitespace: any run (or none) before it, where it has some and after a ``[NAME]``
    marker, since a tokenizer may decode spaces around special tokens its own way."""
    found = _marker_pattern(marker).match(text, pos)
    return found.end() if found else None


@functools.lru_cache(maxsize=64)
def _marker_pattern(marker: str) -> re.Pattern[str]:
    out = [r"\s*"]
    for part in re.split(r"(\s+|\[[A-Z_]+\])", marker):
        if part.isspace():
            out.append(r"\s*")
        elif part:
            out.append(re.escape(part) + (r"\s*" if re.fullmatch(r"\[[A-Z_]+\]", part) else ""))
    return re.compile("".join(out))


def _json_end(text: str, start: int) -> int | None:
    """The end of the JSON object or array that starts at ``text[start]``, or None when the
    text ends first."""
    depth, in_string, escape = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class StreamingToolParser:
    """OpenAI's streamed deltas of a growing tool-call output: ``feed(text_so_far)`` returns
    the new content text and the new tool-call deltas (``{"index", "id", "type", "function":
    {"name", "arguments"}}`` for a call's first delta, ``{"index", "function": {"arguments"}}``
    after), as OpenAI streams them.

    Text that may be the start of the call trigger is held back until it is not; a call's
    arguments stream as they are written (the grammar guarantees they are complete JSON when
    the call ends). A call identical to an earlier one ends the calls, as in
    :meth:`ToolParser.read`: a call to the same tool whose arguments so far begin an earlier
    call's arguments is held back until they differ (then it streams) or end the same (then it
    and anything after it are never sent), so streamed and whole responses carry the same
    calls."""

    def __init__(self, tools: ToolSet, fmt: ToolFormat) -> None:
        self.tools, self.fmt = tools, fmt
        self.content_sent = 0
        self.calls: list[dict[str, Any]] = []  # {"id", "name", "sent", "args"}
        #: a call repeated an earlier one: nothing more is sent
        self.ended = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        fmt = self.fmt
        start = text.find(fmt.trigger) if self.tools.choice == "auto" else 0
        if start < 0:
            safe = len(text) if final else len(text) - _held_back(text, fmt.trigger)
            new = text[self.content_sent:safe]
            self.content_sent = max(self.content_sent, safe)
            return new, []
        content = text[self.content_sent:start].rstrip() if self.content_sent < start else ""
        self.content_sent = max(self.content_sent, start)
        deltas: list[dict[str, Any]] = []
        for index, (name, args_at, end) in enumerate(_scan_calls(text[start:], fmt)):
            if self.ended:
                break
            args = text[start + args_at:len(text) if end is None else start + end]
            if index == len(self.calls):
                held = self._held(name, args, complete=end is not None)
                if held:
                    self.ended = held == "repeat"
                    break
                self.calls.append({"id": fmt.new_id(), "name": name, "sent": 0})
                deltas.append({"index": index, "id": self.calls[index]["id"], "type": "function",
                               "function": {"name": name, "arguments": ""}})
            call = self.calls[index]
            call["args"] = args
            if len(args) > call["sent"]:
                deltas.append({"index": index, "function": {"arguments": args[call["sent"]:]}})
                call["sent"] = len(args)
        return content, deltas

    def _held(self, name: str, args: str, *, complete: bool) -> str:
        """For a call not sent yet: "repeat" when it is identical to an earlier call, "prefix"
        while it may still become one, "" when it is a new call."""
        for call in self.calls:
            if call["name"] == name and call["args"].startswith(args):
                if not complete:
                    return "prefix"
                if call["args"] == args:
                    return "repeat"
        return ""


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
