"""Structural tags: free text with constrained segments, as one grammar.

A model that answers in prose and calls a function in between (``<function=get_weather>{...}
</function>``), or thinks freely and then writes an answer block, needs most of its output
free and a few segments exact. A :class:`StructuralTag` says which: each :class:`Tag` is a
constant ``begin`` string, a schema for what follows (anything `normalize_schema` takes: a
Pydantic model, a JSON Schema, a `Regex`, choices, a `Grammar`) and a constant ``end``.

Two ways to write one, the shapes clients send (vLLM's ``structured_outputs.structural_tag``,
SGLang's and OpenAI-style ``response_format: {"type": "structural_tag", ...}``):

* **Triggered tags** (``StructuralTag(tags=[...], triggers=[...])``; the legacy dict
  ``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}``):
  free text, and wherever a trigger appears the output continues with one of the tags whose
  ``begin`` starts with it; after the tag's ``end`` the free text goes on. ``at_least_one``
  (at least one tag before the output may end) and ``stop_after_first`` (the output ends after
  the first tag) are xgrammar's options of the same names.
* **A format tree** (``{"type": "structural_tag", "format": {...}}``, xgrammar's structural tag
  format, `StructuralTag.from_dict`): sequences, ors, tags, constant strings, free text,
  triggered tags, ... as xgrammar defines them.

Every JSON schema inside becomes **our** JSON grammar of it (`convert_json_schema`: the JSON
layout, no free whitespace, the backend fixes), embedded as a grammar format, exactly as the
tool-call grammar is built (`frontend.tools`); the whole structural tag is compiled by
xgrammar and written back as EBNF, so the spec is an ordinary ``grammar`` spec: caching,
masking and speculation are the usual ones, and the constant tags are forced tokens the forced
drafter drafts for free. The output's value is a :class:`TaggedText`: the whole text and each
tagged segment parsed and validated against its own schema (jsonschema + Pydantic, like any
JSON output; a keyword the grammar does not enforce is still checked here).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from constrained_spec.errors import OutputValidationError, SchemaError
from constrained_spec.json_limits import check_depth

__all__ = ["StructuralTag", "Tag", "TaggedSegment", "TaggedText"]

_STRUCTURAL = "structural_tag"


@dataclass(frozen=True)
class Tag:
    """One constrained segment: ``begin``, then what ``schema`` allows, then ``end``."""

    begin: str
    schema: Any
    end: str


@dataclass(frozen=True, eq=False)
class StructuralTag:
    """Free text with tagged segments (module docstring). Give ``tags`` (with ``triggers``,
    default: each tag's ``begin``) or a ``format`` tree (xgrammar's structural tag format,
    usually through :meth:`from_dict`), not both."""

    tags: Sequence[Tag] = ()
    triggers: Sequence[str] | None = None
    at_least_one: bool = False
    stop_after_first: bool = False
    format: Mapping[str, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if bool(self.tags) == (self.format is not None):
            raise SchemaError("StructuralTag takes tags or a format tree, exactly one of them")
        for i, tag in enumerate(self.tags):
            if not isinstance(tag, Tag):
                raise SchemaError(f"StructuralTag.tags[{i}] must be a Tag, got {type(tag).__name__}")
            if not isinstance(tag.begin, str) or not tag.begin or not isinstance(tag.end, str):
                raise SchemaError(f"StructuralTag.tags[{i}]: begin must be a non-empty string and "
                                  "end a string")
        triggers = self.triggers
        if triggers is not None:
            if isinstance(triggers, str) or not all(isinstance(t, str) and t for t in triggers):
                raise SchemaError("StructuralTag.triggers must be a list of non-empty strings")
            for i, tag in enumerate(self.tags):
                if not any(tag.begin.startswith(t) for t in triggers):
                    raise SchemaError(f"StructuralTag.tags[{i}].begin {tag.begin!r} starts with "
                                      f"none of the triggers {list(triggers)!r}")

    @classmethod
    def from_dict(cls, obj: Any, *, where: str = "structural_tag") -> StructuralTag:
        """A structural tag as clients send it: ``{"type": "structural_tag", "format": {...}}``
        (xgrammar), or ``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}],
        "triggers": [...]}`` (vLLM / SGLang / OpenAI-style; every structure needs its
        ``schema``); JSON text of either is accepted too. ``where`` names the field in errors,
        and a :class:`SchemaError` about one part of ``obj`` has its JSON ``pointer``."""
        if isinstance(obj, (str, bytes)):
            from constrained_spec.json_limits import loads

            try:
                obj = loads(obj, what=where)
            except ValueError as e:
                raise SchemaError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(obj, Mapping):
            raise SchemaError(f"{where} must be an object, got {type(obj).__name__}")
        check_depth(obj, what=where)
        kind = obj.get("type", _STRUCTURAL)
        if kind != _STRUCTURAL:
            raise SchemaError(f"{where}.type must be 'structural_tag', got {kind!r}")
        if "format" in obj:
            extra = set(obj) - {"type", "format"}
            if extra:
                raise SchemaError(f"{where}: unknown fields {sorted(extra)} beside 'format'")
            if not isinstance(obj["format"], Mapping):
                raise SchemaError(f"{where}.format must be an object")
            return cls(format=dict(obj["format"]))
        structures = obj.get("structures")
        if not isinstance(structures, list) or not structures:
            raise SchemaError(f"{where} needs 'format' (xgrammar) or a non-empty 'structures' "
                              "list with 'triggers'")
        extra = set(obj) - {"type", "structures", "triggers", "at_least_one", "stop_after_first"}
        if extra:
            raise SchemaError(f"{where}: unknown fields {sorted(extra)}")
        tags = []
        for i, s in enumerate(structures):
            if not isinstance(s, Mapping) or not {"begin", "end"} <= set(s):
                raise SchemaError(f"{where}.structures[{i}] must be an object with 'begin', "
                                  "'schema' and 'end'")
            if s.get("schema") is None:
                # xgrammar's and vLLM's structures need one too (vLLM's null fails to compile)
                raise SchemaError(f"{where}.structures[{i}] has no 'schema': give the JSON "
                                  "Schema of what goes between its begin and end (for other "
                                  "content, such as free text, use a 'format' tree)",
                                  pointer=f"/structures/{i}/schema")
            tags.append(Tag(s["begin"], s["schema"], s["end"]))
        return cls(tags=tuple(tags), triggers=obj.get("triggers"),
                   at_least_one=bool(obj.get("at_least_one", False)),
                   stop_after_first=bool(obj.get("stop_after_first", False)))

    # -- the grammar ------------------------------------------------------------------------
    def format_tree(self, layout: Any) -> tuple[dict[str, Any], list[tuple[str, str, Any]]]:
        """(xgrammar's format tree with every schema as our grammar, the segments: (begin,
        end, SchemaSpec) of each tag) for JSON written in ``layout``."""
        segments: list[tuple[str, str, Any]] = []
        if self.format is not None:
            tree = _our_grammars(self.format, layout, segments, "format")
            return tree, segments
        tags = []
        for i, tag in enumerate(self.tags):
            spec = _normalize(tag.schema, layout, f"tags[{i}].schema")
            segments.append((tag.begin, tag.end, spec))
            tags.append({"type": "tag", "begin": tag.begin, "end": tag.end,
                         "content": {"type": "grammar", "grammar": segment_grammar(spec)}})
        triggers = list(self.triggers) if self.triggers is not None else sorted({t.begin for t in self.tags})
        return ({"type": "triggered_tags", "triggers": triggers, "tags": tags,
                 "at_least_one": self.at_least_one, "stop_after_first": self.stop_after_first},
                segments)

    def to_spec(self, layout: Any) -> Any:
        """The ``grammar`` `SchemaSpec` of this structural tag (its ``target`` parses outputs
        into a :class:`TaggedText`)."""
        import xgrammar

        from .spec import SchemaSpec, clean_backend_message

        tree, segments = self.format_tree(layout)
        try:
            grammar = xgrammar.Grammar.from_structural_tag(
                json.dumps({"type": _STRUCTURAL, "format": tree}))
        except Exception as e:  # noqa: BLE001 - xgrammar raises several types
            raise SchemaError(f"the structural tag does not compile: {clean_backend_message(e)}",
                              backend="xgrammar") from e
        return SchemaSpec(kind="grammar", ebnf=str(grammar), target=TagReader(tuple(segments)))


def _normalize(schema: Any, layout: Any, where: str) -> Any:
    from .spec import normalize_schema

    try:
        return normalize_schema(schema, layout=layout)
    except SchemaError as e:
        raise SchemaError(f"structural tag {where}: {e}") from None


def segment_grammar(spec: Any) -> str:
    """The xgrammar EBNF of one segment's spec: our JSON conversion, a regex with Python's
    semantics, the choices, or the EBNF (its root renamed ``root`` by xgrammar)."""
    import xgrammar

    from .backends import convert_json_schema
    from .patterns import python_regex

    if spec.kind == "json_schema":
        return str(convert_json_schema(spec, "xgrammar"))
    if spec.kind == "regex":
        return str(xgrammar.Grammar.from_regex(python_regex(spec.regex or "")))
    if spec.kind == "choice":
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choices)
    return str(xgrammar.Grammar.from_ebnf(spec.ebnf or "", root_rule_name=spec.root))


def _our_grammars(node: Any, layout: Any, segments: list[tuple[str, str, Any]], where: str) -> Any:
    """A copy of an xgrammar format tree with each ``json_schema`` format replaced by our
    grammar of the schema; each ``tag`` whose content is a schema (json_schema, regex) is a
    segment."""
    if isinstance(node, list):
        return [_our_grammars(n, layout, segments, f"{where}[{i}]") for i, n in enumerate(node)]
    if not isinstance(node, Mapping):
        return node
    kind = node.get("type")
    if kind == "json_schema":
        schema = node.get("json_schema")
        if isinstance(schema, str):
            schema = _loads_schema(schema, where)
        spec = _normalize(schema, layout, f"{where}.json_schema")
        return {"type": "grammar", "grammar": segment_grammar(spec)}
    out = {k: _our_grammars(v, layout, segments, f"{where}.{k}") for k, v in node.items()}
    if kind == "tag":
        content = node.get("content")
        spec = None
        if isinstance(content, Mapping) and content.get("type") == "json_schema":
            schema = content.get("json_schema")
            spec = _normalize(_loads_schema(schema, where) if isinstance(schema, str) else schema,
                              layout, f"{where}.content.json_schema")
        elif isinstance(content, Mapping) and content.get("type") == "regex":
            from .spec import Regex

            spec = _normalize(Regex(str(content.get("pattern", ""))), layout, f"{where}.content")
        if spec is not None and isinstance(node.get("begin"), str) and isinstance(node.get("end"), str):
            segments.append((node["begin"], node["end"], spec))
    return out


def _loads_schema(text: str, where: str) -> Any:
    from constrained_spec.json_limits import loads

    try:
        return loads(text, what=where)
    except ValueError as e:
        raise SchemaError(f"structural tag {where}: the schema is not valid JSON ({e})") from None


# -- the output -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TaggedSegment:
    """One tagged segment of an output: its markers, its content (``text``, and ``value``
    parsed and validated against the tag's schema: a Pydantic instance, a JSON value, the
    regex's text, the chosen value), and where it lies (``start`` / ``stop``: offsets of the
    whole segment, markers included, in the output text)."""

    begin: str
    end: str
    text: str
    value: Any
    start: int
    stop: int


@dataclass(frozen=True)
class TaggedText:
    """The value of a structural-tag output: the whole ``text`` and its ``segments``."""

    text: str
    segments: tuple[TaggedSegment, ...]

    @property
    def values(self) -> list[Any]:
        """Each segment's parsed value, in order."""
        return [s.value for s in self.segments]

    def free_text(self) -> str:
        """The text outside the segments (the markers go with their segment)."""
        out, pos = [], 0
        for s in self.segments:
            out.append(self.text[pos:s.start])
            pos = s.stop
        out.append(self.text[pos:])
        return "".join(out)


@dataclass(frozen=True)
class TagReader:
    """The ``target`` of a structural tag's spec: reads an output the grammar accepted into a
    :class:`TaggedText`, each segment validated against its own schema."""

    segments: tuple[tuple[str, str, Any], ...]

    def read_output(self, text: str) -> TaggedText:
        found, pos = [], 0
        while self.segments:
            hit = self._next(text, pos)
            if hit is None:
                break
            found.append(hit)
            pos = hit.stop
        return TaggedText(text=text, segments=tuple(found))

    def _next(self, text: str, pos: int) -> TaggedSegment | None:
        """The first segment at or after ``pos`` (the earliest begin marker that starts one)."""
        starts = sorted({i for begin, _, _ in self.segments for i in _occurrences(text, begin, pos)})
        for at in starts:
            errors: list[OutputValidationError] = []
            for begin, end, spec in self.segments:
                if not text.startswith(begin, at):
                    continue
                seg = _segment(text, at, begin, end, spec, errors)
                if seg is not None:
                    return seg
            if errors:  # the markers are there, the content breaks its schema
                raise errors[0]
        return None


def _occurrences(text: str, sub: str, pos: int) -> list[int]:
    out, i = [], text.find(sub, pos)
    while i >= 0:
        out.append(i)
        i = text.find(sub, i + 1)
    return out


def _segment(text: str, at: int, begin: str, end: str, spec: Any,
             errors: list[OutputValidationError]) -> TaggedSegment | None:
    """The segment with ``begin`` at ``at`` when its content and ``end`` follow (the content
    validated: a failure is added to ``errors``), else None."""
    from .validate import parse_output

    c = at + len(begin)
    if spec.kind == "json_schema":  # the JSON value's own extent: an end marker inside a string is no end
        try:
            _, j = json.JSONDecoder().raw_decode(text, c)
        except ValueError:
            return None
        stops = [j] if text.startswith(end, j) else []
    else:
        stops = [i for i in _occurrences(text, end, c)] if end else [len(text)]
    for j in stops:
        content = text[c:j]
        try:
            value = parse_output(spec, content)
        except OutputValidationError as e:
            errors.append(OutputValidationError(
                f"tagged segment {begin!r}...{end!r} at offset {at}: {e}", text=text,
                errors=list(getattr(e, "errors", []) or [])))
            continue
        return TaggedSegment(begin=begin, end=end, text=content, value=value, start=at,
                             stop=j + len(end))
    return None
