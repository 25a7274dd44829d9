"""Turn every schema input a user can give into one internal `SchemaSpec`.

A user passes a Pydantic model, a JSON Schema (dict or JSON text), a `Regex`, a list / `Literal`
/ `Enum` of choices, a `Grammar` (EBNF) or any type Pydantic's `TypeAdapter` understands. All of
them become a frozen `SchemaSpec` with one of four kinds (json_schema / regex / choice / grammar),
the JSON layout to write JSON in, the object final parsing converts to (`target`), and a stable
content hash (`key`) the grammar cache uses.

Normalisation checks what can be checked without a backend: JSON well-formedness, size and depth
limits (`MAX_SCHEMA_VALUES`, `MAX_SCHEMA_DEPTH`), the JSON Schema metaschema, that every
``$ref`` resolves inside the document (`refs.check_refs`: nothing is ever fetched), that a
regex compiles, that choices are non-empty and distinct, that EBNF parses. What a *backend*
enforces is the pre-flight report's business (`preflight.py`), not this module's.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import hashlib
import json
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from constrained_spec.errors import JSONDepthError, SchemaError
from constrained_spec.json_limits import loads

from .limits import check_choice_count, check_pattern_cost, json_patterns
from .patterns import regex_escape, strip_edge_anchors  # noqa: F401 - re-exported
from .pointers import to_pointer

__all__ = ["Regex", "Grammar", "JsonLayout", "SchemaSpec", "normalize_schema",
           "MAX_SCHEMA_DEPTH", "MAX_SCHEMA_VALUES", "lone_surrogate", "to_pointer",
           "load_schema_json"]


@dataclass(frozen=True)
class Regex:
    """A regular expression the whole output must match: ``re.fullmatch(pattern, output)``, with
    Python's semantics on every backend (``.`` matches no newline unless the pattern says
    ``(?s)``), in the syntax subset shared by xgrammar and Rust's `regex`: no look-around, no
    backreferences."""

    pattern: str


@dataclass(frozen=True)
class Grammar:
    """An EBNF grammar in xgrammar's (GBNF-like) syntax; `root` names the start rule."""

    ebnf: str
    root: str = "root"


@dataclass(frozen=True)
class JsonLayout:
    """How JSON is written: one line with `separators`, or pretty with `indent` spaces.

    The grammar allows exactly this layout (no free whitespace), so the model cannot wander off
    into runs of spaces and newlines, and outputs are byte-identical to
    ``json.dumps(value, indent=indent, separators=separators, ensure_ascii=False)``. The
    grammar also ends where the JSON value ends: no trailing whitespace or newline can follow.

    ``separators`` defaults as in ``json.dumps``: ``(", ", ": ")`` on one line, ``(",", ": ")``
    when indented (no space before each newline).
    """

    indent: int | None = None
    separators: tuple[str, str] = None  # type: ignore[assignment]  # None -> json.dumps' default

    def __post_init__(self) -> None:
        if self.indent is not None and (isinstance(self.indent, bool) or not isinstance(self.indent, int)
                                        or self.indent < 0):
            raise SchemaError(f"JsonLayout.indent must be None or a non-negative int, got {self.indent!r}")
        if self.separators is None:
            object.__setattr__(self, "separators", (", ", ": ") if self.indent is None else (",", ": "))
        seps = self.separators
        if (not isinstance(seps, tuple) or len(seps) != 2
                or any(not isinstance(s, str) for s in seps)
                or seps[0] not in (",", ", ") or seps[1] not in (":", ": ")):
            raise SchemaError("JsonLayout.separators must be (',' or ', ', ':' or ': '), "
                              f"got {seps!r}")

    def dumps(self, value: Any) -> str:
        """`value` written in this layout (what a conforming output looks like)."""
        return json.dumps(value, indent=self.indent, separators=self.separators, ensure_ascii=False)


SpecKind = Literal["json_schema", "regex", "choice", "grammar"]


@typing.runtime_checkable
class SpecSource(typing.Protocol):
    """A schema input that makes its own `SchemaSpec` (`structural.StructuralTag`): how a kind
    built on top of the four joins `normalize_schema` without this module importing it."""

    def to_spec(self, layout: JsonLayout) -> SchemaSpec: ...


@typing.runtime_checkable
class OutputReader(typing.Protocol):
    """A spec ``target`` that reads an output its grammar accepted into the user's value
    (`structural.TagReader`); `parse_output` calls it after the grammar check."""

    def read_output(self, text: str) -> Any: ...


@dataclass(frozen=True)
class SchemaSpec:
    """One normalised schema: what to constrain generation to and what to parse the output into."""

    kind: SpecKind
    json_schema: dict | None = field(default=None, compare=False, hash=False)
    regex: str | None = None
    choices: tuple[str, ...] = ()
    ebnf: str | None = None
    root: str = "root"
    layout: JsonLayout = JsonLayout()
    # What parse_output converts to: a pydantic model class / TypeAdapter, an Enum class, the
    # tuple of choice values, or None. Not part of equality: the grammar does not depend on it.
    target: Any = field(default=None, compare=False, hash=False, repr=False)
    key: str = ""

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", _spec_key(self))

    def __eq__(self, other: object) -> bool:  # dicts are unhashable: compare through the key
        return isinstance(other, SchemaSpec) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)


def _spec_key(spec: SchemaSpec) -> str:
    # Property order matters to the grammar (properties are generated in declared order), so the
    # schema is NOT key-sorted: two orderings are two grammars.
    content = {
        "kind": spec.kind,
        "json_schema": spec.json_schema,
        "regex": spec.regex,
        "choices": list(spec.choices),
        "ebnf": spec.ebnf,
        "root": spec.root,
        "layout": [spec.layout.indent, list(spec.layout.separators)],
    }
    text = json.dumps(content, ensure_ascii=False, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------
# normalisation
# --------------------------------------------------------------------------------------------

def normalize_schema(schema: Any, *, layout: JsonLayout = JsonLayout()) -> SchemaSpec:
    """Turn any supported schema input into a `SchemaSpec`.

    Parameters
    ----------
    schema
        A Pydantic ``BaseModel`` subclass (parsed into an instance), a JSON Schema ``dict`` or
        JSON text (parsed into plain JSON values), a `Regex` (-> ``str``), a list / tuple of
        choices, ``typing.Literal[...]`` or an ``Enum`` subclass (-> the chosen value / member),
        a `Grammar` (-> ``str``), a `StructuralTag` (-> a ``TaggedText``: free text with
        segments, each validated; ``structural.py``), any other type Pydantic's ``TypeAdapter`` accepts (e.g.
        ``list[int]``, a dataclass, a TypedDict), or an existing `SchemaSpec`.
    layout
        How JSON outputs are written (json_schema kind only).

    Raises
    ------
    SchemaError
        Malformed JSON text, JSON that is not a schema, a JSON Schema failing its metaschema,
        an invalid regex, empty or duplicate choices, unparsable EBNF, or an unknown input type.
    """
    if not isinstance(layout, JsonLayout):
        raise SchemaError(f"layout must be a JsonLayout, got {type(layout).__name__}")
    if isinstance(schema, SchemaSpec):
        if schema.layout == layout or schema.kind != "json_schema":
            return schema
        return dataclasses.replace(schema, layout=layout, key="")
    if isinstance(schema, Regex):
        return _from_regex(schema.pattern)
    if isinstance(schema, Grammar):
        return _from_grammar(schema)
    if isinstance(schema, SpecSource):  # a StructuralTag (structural.py) builds its own
        return schema.to_spec(layout)
    if isinstance(schema, str):
        return _from_json_text(schema, layout)
    if isinstance(schema, (bytes, bytearray)):
        return _from_json_text(bytes(schema).decode("utf-8", errors="replace"), layout)
    if isinstance(schema, dict):
        check_json_document(schema)  # before deepcopy: it recurses, and NaN / sets must not pass
        return _from_json_schema(copy.deepcopy(schema), layout, target=None)
    if isinstance(schema, (list, tuple)):
        return _from_choices(list(schema), target=tuple(schema), what="choices")
    if typing.get_origin(schema) is Literal:
        values = list(typing.get_args(schema))
        return _from_choices(values, target=tuple(values), what="Literal")
    if isinstance(schema, type) and issubclass(schema, enum.Enum):
        members = list(schema)
        return _from_choices([m.value for m in members], target=schema, what=f"Enum {schema.__name__}")
    if _is_pydantic_model(schema):
        try:
            js = schema.model_json_schema()
        except Exception as exc:  # pydantic raises several types for unschematisable fields
            raise SchemaError(f"pydantic model {schema.__name__} has no JSON Schema: {exc}") from exc
        return _from_json_schema(js, layout, target=schema)
    return _from_type_adapter(schema, layout)


def _is_pydantic_model(obj: Any) -> bool:
    try:
        from pydantic import BaseModel
    except ImportError:  # pragma: no cover - pydantic is a dependency
        return False
    return isinstance(obj, type) and issubclass(obj, BaseModel)


def _from_type_adapter(schema: Any, layout: JsonLayout) -> SchemaSpec:
    from pydantic import TypeAdapter

    try:
        adapter = TypeAdapter(schema)
        js = adapter.json_schema()
    except Exception as exc:
        raise SchemaError(
            f"unsupported schema input of type {type(schema).__name__}: {schema!r}. Pass a pydantic "
            "model, a JSON Schema (dict or JSON text), Regex(...), Grammar(...), a list of choices, "
            "a Literal or an Enum") from exc
    return _from_json_schema(js, layout, target=adapter)


def load_schema_json(text: str, *, what: str) -> Any:
    """``json.loads`` for schema text from outside: nesting deeper than `MAX_SCHEMA_DEPTH` is a
    `SchemaError` naming ``what`` and the limit, raised before the text is parsed (deeper text
    would reach Python's recursion limit in the parser itself); malformed JSON raises
    ``json.JSONDecodeError`` for the caller to word."""
    try:
        return loads(text, what=what, limit=MAX_SCHEMA_DEPTH)
    except JSONDepthError as exc:
        known = [p for p in exc.path if p is not ...]
        raise SchemaError(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels (JSON objects / "
                          "arrays inside each other; the first one past the limit is under the "
                          "pointer); flatten it, or use $defs and $ref for recursive structures",
                          pointer=to_pointer(known)) from None


def _from_json_text(text: str, layout: JsonLayout) -> SchemaSpec:
    stripped = text.lstrip()
    try:
        value = load_schema_json(text, what="the JSON Schema text")
    except json.JSONDecodeError as exc:
        if stripped.startswith("{"):
            raise SchemaError(
                f"malformed JSON Schema text: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
        raise SchemaError(
            f"a plain string that is not JSON ({exc.msg} at column {exc.colno}) is not a schema: "
            f"wrap a regular expression in Regex({text[:40]!r}) and an EBNF grammar in "
            "Grammar(...), or pass JSON Schema text") from exc
    if not isinstance(value, dict):
        raise SchemaError(
            f"JSON text is a {type(value).__name__}, not a JSON Schema object; a JSON Schema is "
            "an object such as {\"type\": \"string\"} (for choices pass a Python list)", pointer="")
    return _from_json_schema(value, layout, target=None)


def _from_json_schema(js: Any, layout: JsonLayout, *, target: Any) -> SchemaSpec:
    if not isinstance(js, dict):
        raise SchemaError(f"a JSON Schema must be an object, got {type(js).__name__}", pointer="")
    check_json_document(js)
    check_json_schema(js)
    from .refs import check_refs

    check_refs(js)  # before anything resolves a reference: none is ever fetched
    return SchemaSpec(kind="json_schema", json_schema=js, layout=layout, target=target)


#: Limits on a JSON Schema document, checked before anything else looks at it. Deeper documents
#: overflow Python's recursion limit in the metaschema check, the pre-flight walkers and final
#: validation; bigger ones take many seconds to check and convert (10,000 properties: ~20 s),
#: and their description alone would not fit in a small model's context. The largest schema of
#: JSONSchemaBench (6,245 real-world schemas) has 1,874 JSON values and nests 63 levels deep.
MAX_SCHEMA_DEPTH = 128
MAX_SCHEMA_VALUES = 10_000


def check_json_document(js: Any) -> None:
    """Raise `SchemaError` (with a pointer) unless `js` is a plain JSON document within the
    limits: at most `MAX_SCHEMA_DEPTH` levels of nesting and `MAX_SCHEMA_VALUES` values, string
    keys only, Unicode text only (no lone surrogates), finite numbers only (NaN / Infinity are
    not JSON), JSON types only."""
    count = 0
    largest: tuple[int, list[Any]] = (0, [])
    stack: list[tuple[Any, list[Any]]] = [(js, [])]
    while stack:
        value, path = stack.pop()
        count += 1
        if len(path) >= MAX_SCHEMA_DEPTH:
            raise SchemaError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels (JSON "
                              "objects / arrays inside each other); flatten it, or use $defs and "
                              "$ref for recursive structures", pointer=to_pointer(path))
        if isinstance(value, dict):
            if len(value) > largest[0]:
                largest = (len(value), path)
            for k, v in value.items():
                if not isinstance(k, str):
                    raise SchemaError(f"schema keys must be strings, got {type(k).__name__} {k!r}",
                                      pointer=to_pointer(path))
                _check_text(k, f"the key {k!r}", pointer=to_pointer(path))
                stack.append((v, path + [k]))
        elif isinstance(value, list):
            if len(value) > largest[0]:
                largest = (len(value), path)
            stack.extend((v, path + [i]) for i, v in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, "the string", pointer=to_pointer(path))
        elif isinstance(value, float):
            if value != value or value in (float("inf"), float("-inf")):
                raise SchemaError(f"{value} is not a JSON number", pointer=to_pointer(path))
        elif not (value is None or isinstance(value, (str, int, bool))):
            raise SchemaError(f"{type(value).__name__} {value!r:.60} is not a JSON value "
                              "(use dicts, lists, str, int, float, bool and None)",
                              pointer=to_pointer(path))
        if count > MAX_SCHEMA_VALUES:
            raise SchemaError(
                f"the schema has more than {MAX_SCHEMA_VALUES:,} JSON values (the largest object "
                f"or array so far, at {to_pointer(largest[1]) or '/'}, has {largest[0]:,} members); "
                "split it into smaller schemas", pointer=to_pointer(largest[1]))


def check_json_schema(js: dict) -> None:
    """Raise `SchemaError` (keyword + pointer) if `js` fails its metaschema (default 2020-12)."""
    import jsonschema

    from .refs import validator, validator_class

    try:
        cls = validator_class(js)
    except Exception as exc:  # unknown $schema URI
        raise SchemaError(f"unknown $schema {js.get('$schema')!r}: {exc}", keyword="$schema",
                          pointer="/$schema") from exc
    # "regex" format: final validation runs patterns through Python's re, which raises on one
    # it cannot compile; better refused here, with the pattern's pointer
    checker = jsonschema.FormatChecker(formats=("regex",))
    try:
        error = jsonschema.exceptions.best_match(
            validator(cls.META_SCHEMA, cls=cls, format_checker=checker).iter_errors(js))
    except RecursionError:  # check_json_document bounds the depth; a deep caller stack remains
        raise SchemaError("the schema nests too deeply to be checked", pointer="") from None
    if error is None:
        for pattern, keyword, where in json_patterns(js):
            check_pattern_cost(pattern, what="the pattern", keyword=keyword,
                               pointer=to_pointer(where))
        return
    path = list(error.absolute_path)
    keyword = next((p for p in reversed(path) if isinstance(p, str)), error.validator)
    if error.validator == "format" and error.validator_value == "regex":
        try:
            re.compile(error.instance)
            reason = "not a regular expression"
        except (re.error, TypeError) as exc:
            reason = str(exc)
        if path and path[-1] != "pattern":  # a patternProperties / propertyNames key
            keyword = "patternProperties" if "patternProperties" in path else str(keyword)
        raise SchemaError(f"invalid regular expression {error.instance!r}: {reason} (patterns "
                          "must compile with Python's re, which final validation uses)",
                          keyword=str(keyword), pointer=to_pointer(path))
    raise SchemaError(f"invalid JSON Schema: {error.message}", keyword=str(keyword),
                      pointer=to_pointer(path))


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> str | None:
    """Where `text` has a lone surrogate (a str that is not Unicode text: it cannot be encoded
    as UTF-8, so no tokenizer, backend or JSON writer can take it), e.g. "U+D800 at character
    3"; None when it has none. The message never contains the surrogate itself."""
    m = _SURROGATE.search(text)
    return None if m is None else f"U+{ord(m.group()):04X} at character {m.start()}"


def _check_text(text: str, what: str, **where: Any) -> None:
    bad = lone_surrogate(text)
    if bad is not None:
        raise SchemaError(f"{what} has a lone surrogate ({bad}), which is not Unicode text (it "
                          "cannot be written as UTF-8): fix the encoding of the input", **where)



def _from_regex(pattern: Any) -> SchemaSpec:
    if not isinstance(pattern, str):
        raise SchemaError(f"Regex pattern must be a str, got {type(pattern).__name__}")
    _check_text(pattern, "the regular expression")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise SchemaError(f"invalid regular expression {pattern!r}: {exc}") from exc
    check_pattern_cost(pattern, what="the regular expression")
    return SchemaSpec(kind="regex", regex=pattern)


def _from_grammar(g: Grammar) -> SchemaSpec:
    if not isinstance(g.ebnf, str) or not g.ebnf.strip():
        raise SchemaError("Grammar(ebnf) needs a non-empty EBNF string")
    _check_text(g.ebnf, "the EBNF grammar")
    if not isinstance(g.root, str):
        raise SchemaError(f"Grammar root must be a rule name (str), got {type(g.root).__name__}")
    _check_text(g.root, "the root rule name")
    import xgrammar

    from .backend_log import hear_conversion

    try:
        # heard, not leaked: the pre-flight builds it again and reports what xgrammar logs
        with hear_conversion("xgrammar", g.ebnf):
            xgrammar.Grammar.from_ebnf(g.ebnf, root_rule_name=g.root)
    except Exception as exc:  # xgrammar raises RuntimeError with its parser's message
        raise SchemaError(f"invalid EBNF grammar: {clean_backend_message(exc)}",
                          backend="xgrammar") from exc
    return SchemaSpec(kind="grammar", ebnf=g.ebnf, root=g.root)


def choice_text(value: Any) -> str:
    """The exact output text of one choice: strings as themselves, other JSON scalars as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, enum.Enum):
        return choice_text(value.value)
    if value is None or isinstance(value, (bool, int, float)):
        return json.dumps(value)
    raise SchemaError(f"choice {value!r} is not a str, number, bool or None")


def _from_choices(values: list, *, target: Any, what: str) -> SchemaSpec:
    if not values:
        raise SchemaError(f"{what}: at least one choice is needed")
    check_choice_count(len(values), what=what)
    texts = [choice_text(v) for v in values]
    for i, t in enumerate(texts):
        _check_text(t, f"{what}: choice {i}")
    if "" in texts:
        raise SchemaError(f"{what}: a choice cannot be the empty string (an empty output)")
    seen: dict[str, int] = {}
    for i, t in enumerate(texts):
        if t in seen:
            raise SchemaError(f"{what}: choices {seen[t]} and {i} both are written {t!r}")
        seen[t] = i
    # Longest first: leftmost-first regex engines (outlines-core's DFA) would otherwise stop at
    # "ab" and never reach "abc" in "ab|abc".
    regex = "|".join(regex_escape(t) for t in sorted(texts, key=len, reverse=True))
    return SchemaSpec(kind="choice", choices=tuple(texts), regex=regex, target=target)



_XGR_LOG_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+?:\d+:\s*")
# xgrammar's internal assertions: "Check failed: (val <= MAX_INT64_AS_DOUBLE) is false: ..."
_XGR_CHECK = re.compile(r"Check failed: \(.*?\) is false:?\s*")


def clean_backend_message(exc: BaseException) -> str:
    """The backend's own message without xgrammar's "[time] file.cc:line:" prefix, its
    internal assertion text ("Check failed: (...) is false") and traceback."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    first = _XGR_CHECK.sub("", _XGR_LOG_PREFIX.sub("", first))
    return first.strip() or type(exc).__name__
