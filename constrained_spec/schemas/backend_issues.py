"""Where in a schema a backend's log message points: the pre-flight's reading of what xgrammar
(or outlines-core) logged while converting it (`backend_log`).

The messages carry no location, so each kind is matched to the keywords it can be about,
among the schema objects xgrammar reads (`read_nodes`: the rewritten schema, `backends`, from
the root through the winning keyword of each node and through ``$ref``; pointers are into the
user's schema):

* "oneOf with overlapping or non-provably-disjoint branches ... falling back to anyOf": each
  ``oneOf`` xgrammar reads (the ones proven disjoint, `disjoint.one_of_disjoint`, reach it as
  ``anyOf`` and raise no warning);
* "pattern combined with minLength/maxLength is not supported": the lengths next to a pattern;
* a message naming a regex ("... is ignored in regex: R", "Anchor ... is ignored: R"): the
  ``pattern`` / ``patternProperties`` key xgrammar was given R for, else the user's patterns
  that share R's text;
* an unknown escape ("Escape sequence \\q ..."): the patterns holding that escape;
* ``multipleOf`` / ``allOf`` / "Keyword X is not supported" / a URI: the nodes with that keyword.

A message none of these rules places is pinned to the schema's root with its own words: the
report must not say "every keyword is enforced" over a warning it cannot read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from .backend_log import BackendMessage
from .backends import (
    SCHEMA_KEYWORDS,
    SCHEMA_LIST_KEYWORDS,
    SCHEMA_MAP_KEYWORDS,
    XGRAMMAR_ORDER,
    backend_schema,
)
from .pointers import resolve_local_ref, to_pointer

__all__ = ["children", "explain", "locate", "nodes", "read_nodes"]

_ONE_OF = "oneOf with overlapping"
_LENGTHS = "pattern combined with minLength/maxLength"
_REGEX_SUBJECT = re.compile(r"(?:in regex|is ignored): (.+)$")
_ESCAPE = re.compile(r"Escape sequence (\\\S+) ")
_KEYWORD = re.compile(r"^Keyword (\S+) is not supported")


def children(node: dict, path: list[Any]) -> Iterator[tuple[list[Any], Any]]:
    """The subschemas directly under schema object `node` (at `path`), with their paths."""
    for k, v in node.items():
        if k in SCHEMA_KEYWORDS:
            if isinstance(v, list):
                yield from ((path + [k, i], sub) for i, sub in enumerate(v))
            else:
                yield path + [k], v
        elif k in SCHEMA_LIST_KEYWORDS and isinstance(v, list):
            yield from ((path + [k, i], sub) for i, sub in enumerate(v))
        elif k in SCHEMA_MAP_KEYWORDS and isinstance(v, dict):
            yield from ((path + [k, name], sub) for name, sub in v.items())


def nodes(schema: Any, path: list[Any] | None = None) -> Iterator[tuple[list[Any], dict]]:
    """Every (sub)schema object of `schema` with its document path, top-down."""
    if isinstance(schema, dict):
        yield path or [], schema
        for sub_path, sub in children(schema, path or []):
            yield from nodes(sub, sub_path)


# keywords whose subschemas xgrammar's converter never reads (definitions: through $ref only)
_UNREAD = frozenset({"not", "if", "then", "else", "contains", "dependentSchemas", "contentSchema",
                     "additionalItems", "$defs", "definitions"})


def _read_by_xgrammar(doc: dict) -> Iterator[tuple[list[Any], dict]]:
    """The schema objects of a rewritten document (`backends.backend_schema`) that xgrammar's
    converter reads, from the root: through the keyword that wins in each node (its branches
    only, for a combinator), the type keywords' subschemas otherwise, and local ``$ref`` s."""
    seen: set[int] = set()
    todo: list[tuple[list[Any], Any]] = [([], doc)]
    while todo:
        path, node = todo.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield path, node
        winner = next((k for k in XGRAMMAR_ORDER if k in node), None)
        if winner == "$ref":
            target = resolve_local_ref(doc, node["$ref"])
            if target is not None:
                todo.append((target[1], target[0]))
        elif winner in ("anyOf", "oneOf", "allOf") and isinstance(node[winner], list):
            todo.extend((path + [winner, i], sub) for i, sub in enumerate(node[winner]))
        elif winner is None:
            todo.extend((sub_path, sub) for sub_path, sub in children(node, path)
                        if sub_path[len(path)] not in _UNREAD)


def _original_path(path: list[Any], schema: Any, doc: Any) -> list[Any]:
    """The path into the user's `schema` of a `path` into its rewritten `doc`: a
    patternProperties key is rewritten (matched by position), a proven ``oneOf`` is ``anyOf``."""
    original: Any = schema
    out: list[Any] = []
    for seg in path:
        key = seg
        if isinstance(original, dict) and isinstance(doc, dict) and seg not in original:
            if seg == "anyOf" and "oneOf" in original:
                key = "oneOf"
            elif len(original) == len(doc) and seg in doc:
                key = list(original)[list(doc).index(seg)]
        out.append(key)
        doc = doc[seg] if isinstance(doc, (dict, list)) else None
        if isinstance(original, dict):
            original = original.get(key)
        elif isinstance(original, list) and isinstance(key, int) and key < len(original):
            original = original[key]
        else:
            original = None
    return out


def read_nodes(schema: Any) -> list[tuple[list[Any], dict]]:
    """(path in the user's `schema`, rewritten node) of each schema object xgrammar reads."""
    doc = backend_schema(schema, "xgrammar")
    return [(_original_path(path, schema, doc), node) for path, node in _read_by_xgrammar(doc)]


def _key_places(read: list[tuple[list[Any], dict]], keyword: str) -> list[tuple[str, str]]:
    return [(keyword, to_pointer(path + [keyword])) for path, node in read if keyword in node]


def _regex_places(schema: Any, read: list[tuple[list[Any], dict]],
                  subject: str) -> list[tuple[str, str]]:
    """(keyword, pointer) of the patterns / keys xgrammar was given `subject` for, else of the
    user's patterns it shares its text with."""
    exact = [("pattern", to_pointer(path + ["pattern"])) for path, node in read
             if node.get("pattern") == subject]
    for path, node in read:
        if isinstance(node.get("patternProperties"), dict) and subject in node["patternProperties"]:
            where = _original_path(["patternProperties", subject], _at(schema, path), node)
            exact.append(("patternProperties", to_pointer(path + where)))
    if exact:
        return exact
    return [(keyword, pointer) for keyword, pattern, pointer in _patterns(schema)
            if pattern.strip("^$") and (pattern.strip("^$") in subject or subject in pattern)]


def _at(schema: Any, path: list[Any]) -> Any:
    for part in path:
        schema = schema.get(part) if isinstance(schema, dict) else (
            schema[part] if isinstance(schema, list) and isinstance(part, int)
            and part < len(schema) else None)
    return schema


def _patterns(schema: Any) -> list[tuple[str, str, str]]:
    """(keyword, pattern, JSON pointer) of every ``pattern`` and ``patternProperties`` key."""
    out = []
    for path, node in nodes(schema):
        if isinstance(node.get("pattern"), str):
            out.append(("pattern", node["pattern"], to_pointer(path + ["pattern"])))
        if isinstance(node.get("patternProperties"), dict):
            out.extend(("patternProperties", key, to_pointer(path + ["patternProperties", key]))
                       for key in node["patternProperties"])
    return out


def locate(message: BackendMessage, schema: Any) -> list[tuple[str, str]]:
    """(keyword, JSON pointer) of each place in `schema` (a JSON Schema document) the message
    can be about; [] when no rule places it (see the module docstring)."""
    text = message.text
    read = read_nodes(schema)
    if text.startswith(_ONE_OF):
        return [("oneOf", to_pointer(path + ["oneOf"])) for path, node in read
                if next((k for k in XGRAMMAR_ORDER if k in node), None) == "oneOf"]
    if text.startswith(_LENGTHS):
        return [place for k in ("minLength", "maxLength") for place in _key_places(
            [(path, node) for path, node in read if isinstance(node.get("pattern"), str)], k)]
    m = _REGEX_SUBJECT.search(text)
    if m:
        return _regex_places(schema, read, m.group(1))
    m = _ESCAPE.match(text)
    if m:
        return [(k, p) for k, pattern, p in _patterns(schema) if m.group(1) in pattern]
    m = _KEYWORD.match(text)
    keyword = m.group(1) if m else next(
        (k for k in ("multipleOf", "allOf") if k in text), "$ref" if text.startswith("URI ") else None)
    return _key_places(read, keyword) if keyword is not None else []


def explain(message: BackendMessage, keyword: str) -> str:
    """The report's sentence for a backend message placed at `keyword` ("" when unplaced)."""
    said = f"{message.backend} warns while converting: {message.text!r}"
    if keyword == "oneOf":
        return (f"{said}; oneOf is generated as anyOf: an instance matching several branches "
                "(which oneOf forbids) is possible; make the branches disjoint, e.g. with a "
                "const discriminator property required in every branch")
    if keyword in ("pattern", "patternProperties", "regex"):
        return (f"{said}; strings the pattern excludes can be generated (final validation, "
                "with Python's re, rejects them); rewrite the pattern without that construct")
    if keyword:
        return f"{said}; {keyword!r} is not enforced here"
    return (f"{said}; the pre-flight cannot tell which keyword this is about, so treat the "
            "schema as not fully enforced (final validation still checks every output)")
