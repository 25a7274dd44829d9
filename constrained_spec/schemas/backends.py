"""Hand a JSON Schema to a backend: per-backend rewrites, then the backend's own converter.

Both backends get a rewritten copy of the user's schema, never the original:

* ``pattern`` is rewritten to JSON Schema's *search* semantics. JSON Schema patterns are
  unanchored (``"^[A-Z]"`` means "starts with a capital"), but both backends match the whole
  string, which would turn that pattern into "exactly one capital". ``p`` becomes
  ``.*(?:p).*`` minus the side(s) anchored by ``^`` / ``$``, per top-level alternative.
* both: ``.`` in patterns gets Python's meaning spelled out (`python_dots`: jsonschema, and
  ``re.fullmatch`` for a `Regex`, use Python's ``re``; xgrammar's ``.`` would match a newline);
  the ``s`` flag of inline flag groups is applied there and taken out.
* both: draft 4's boolean ``exclusiveMinimum`` / ``exclusiveMaximum`` become numeric bounds.
* ``format: date`` (both), ``date-time``, ``ipv4`` and ``hostname`` (xgrammar) become an
  exact pattern (the backends' own grammars would write Feb 30, year 0000, "10.0.0.01" or a
  64-character label, which final validation rejects), unless the node has a keyword the backend ranks before a pattern
  (pre-flight reports that case).
* xgrammar: a group's ``?`` in patterns (and patternProperties keys) is written ``{0,1}``
  (xgrammar mis-compiles ``(...)?`` in JSON strings, see `xgrammar_pattern`); object / array
  ``const`` and ``enum`` values are spelled out as schemas (xgrammar
  writes them compactly, ignoring the layout); integer bounds that are not whole numbers are
  rounded inward and bounds past 64 bits are clamped (xgrammar raises on both); a node where
  allOf with several subschemas wins becomes the ``enum`` of the values it accepts when a
  member fixes them (``enum`` / ``const``; exact, see `all_of_values`), else ``{}`` (what
  xgrammar generates for it anyway, without failing on what it would have converted); a
  ``oneOf`` whose branches are proven disjoint (`disjoint.one_of_disjoint`) is written
  ``anyOf`` (the same instances; xgrammar would fall back to anyOf with a warning when its own,
  narrower proof fails); next to ``properties`` and ``patternProperties`` / ``propertyNames``,
  an ``additionalProperties`` (``unevaluatedProperties``) that admits anything is dropped
  (xgrammar would let a declared name or a pattern key through it with any value,
  `extra_bypass`; without it no extra key is generated, strict mode's reading);
  arrays / objects that declare no items / properties at all get ``items: {}`` /
  ``additionalProperties: {}`` (strict mode would otherwise allow only ``[]`` / ``{}``).
* outlines: annotations and unknown keywords are dropped and ``true`` subschemas become
  ``{}`` (outlines raises on both); ``additionalProperties: false`` without ``properties``
  becomes ``maxProperties: 0`` (outlines raises); ``.`` in patterns becomes one JSON string
  character (outlines matches patterns against the raw JSON text, so ``.`` would emit raw
  quotes and backslashes); enum values are ordered longest first (outlines' leftmost-first DFA
  never completes "ab" in ``(a|ab)``).

``convert_json_schema`` returns what the token-level compiler consumes (an ``xgrammar.Grammar``
or an outlines regex string), raising `SchemaError` with the backend's message; `conversion`
also returns what the backend logged while converting (`backend_log`), cached with it.
"""

from __future__ import annotations

import copy
import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Literal

from constrained_spec.errors import SchemaError

from .backend_log import BackendMessage, hear_conversion
from .disjoint import one_of_disjoint
from .patterns import python_regex, scan_regex, search_pattern, xgrammar_pattern  # noqa: F401
from .pointers import resolve_local_ref, to_pointer
from .spec import JsonLayout, SchemaSpec, clean_backend_message
from .support import ANNOTATIONS, KEYWORD_SUPPORT
from .validator import json_validator

_OUTLINES_KEEP = frozenset(KEYWORD_SUPPORT) | {"$defs", "definitions", "$id", "then", "else",
                                               "additionalItems"}

Backend = Literal["xgrammar", "outlines"]
BACKENDS: tuple[str, ...] = ("xgrammar", "outlines")

# One JSON string character as raw JSON text (outlines' STRING_INNER).
OUTLINES_STRING_CHAR = r'(?:[^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])'
# ... any but a newline (its escape \n): what Python's ``.`` matches, as raw JSON text.
OUTLINES_LINE_CHAR = r'(?:[^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfrt])'

# Keywords whose value is a schema / a list of schemas / a map of schemas.
SCHEMA_KEYWORDS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items",
                   "unevaluatedItems", "contains", "not", "if", "then", "else", "contentSchema",
                   "additionalItems")
SCHEMA_LIST_KEYWORDS = ("prefixItems", "anyOf", "oneOf", "allOf")
SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions",
                       "dependentSchemas")


def map_schema(node: Any, fn: Callable[[Any], Any]) -> Any:
    """Rebuild a schema bottom-up, applying `fn` to every (sub)schema position."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k in SCHEMA_KEYWORDS:
                out[k] = map_schema(v, fn) if not isinstance(v, list) else [map_schema(s, fn) for s in v]
            elif k in SCHEMA_LIST_KEYWORDS and isinstance(v, list):
                out[k] = [map_schema(s, fn) for s in v]
            elif k in SCHEMA_MAP_KEYWORDS and isinstance(v, dict):
                out[k] = {name: map_schema(s, fn) for name, s in v.items()}
            else:
                out[k] = copy.deepcopy(v)
        node = out
    return fn(node)


def _types_of(node: dict) -> set[str]:
    t = node.get("type")
    # (draft 3 also allows schemas in a type list: they are not type names)
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _drop_false_properties(node: dict) -> None:
    # "x": false forbids property x; neither backend accepts a false schema there, but an
    # undeclared property is never generated, which is the same thing.
    props = node.get("properties")
    if isinstance(props, dict) and any(v is False for v in props.values()):
        node["properties"] = {k: v for k, v in props.items() if v is not False}


def _literal_schema(value: Any) -> Any:
    """A schema whose only instance is `value`, spelled out structurally (see below)."""
    if isinstance(value, dict):
        return {"type": "object", "properties": {k: _literal_schema(v) for k, v in value.items()},
                "required": list(value), "additionalProperties": False}
    if isinstance(value, list):
        return {"type": "array", "prefixItems": [_literal_schema(v) for v in value], "items": False,
                "minItems": len(value)}
    return {"const": value}


# RFC 3339 full-date, calendar-exact: 30-day months, Feb 29 in leap years only, no year 0000
# (what ``datetime.date.fromisoformat`` and so jsonschema's "date" checker accept; checked on
# every YYYY-MM-DD of years 0000-9999). Both backends' own "date" only check the syntax.
_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
FULL_DATE = (rf"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
             rf"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
# xgrammar's own date-time time part (hh:mm:ss[.frac] then Z or an offset), after FULL_DATE.
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)?(?:Z|[+\-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
# Formats a backend's own grammar lets invalid values through: the exact pattern instead.
# ipv4: xgrammar allows leading zeros ("10.0.0.01"), which Python's ipaddress (jsonschema's
# check) refuses as ambiguous (octal).
# hostname: xgrammar's labels have no length limit; RFC 1123 allows 63 characters (the total
# of 253 is not expressible here; it would take four 63-character labels).
_LABEL = r"[a-z0-9](?:[a-z0-9\-]{0,61}[a-z0-9])?"
FORMAT_PATTERNS = {"date": f"^{FULL_DATE}$", "date-time": f"^{FULL_DATE}T{_TIME}$",
                   "ipv4": rf"^(?:{_OCTET}\.){{3}}{_OCTET}$",
                   "hostname": rf"^{_LABEL}(?:\.{_LABEL})*$"}
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def _exact_formats(node: dict, precedence_keys: tuple[str, ...], formats: tuple[str, ...]) -> None:
    """format date / date-time -> the calendar-exact pattern, unless a keyword the backend puts
    before a pattern (its own precedence) is there; pre-flight reports that case."""
    fmt = node.get("format")
    if fmt in formats and not any(k in node for k in precedence_keys):
        del node["format"]
        node["pattern"] = FORMAT_PATTERNS[fmt]


def declarable_required(node: dict) -> dict[str, Any]:
    """The names `node` requires without declaring them under ``properties``, each with the
    schema JSON Schema applies to it anyway: its one matching ``patternProperties`` schema,
    else ``additionalProperties`` (``{}`` when absent or true). Left out: a name that several
    key patterns match (their conjunction has no single schema) or that
    ``additionalProperties: false`` forbids (the schema cannot be satisfied)."""
    required = node.get("required")
    props = node.get("properties")
    if not isinstance(required, list) or (props is not None and not isinstance(props, dict)):
        return {}
    patterns = node.get("patternProperties")
    if not isinstance(patterns, dict):
        patterns = {}
    out: dict[str, Any] = {}
    for name in required:
        if not isinstance(name, str) or name in (props or {}) or name in out:
            continue
        try:
            hits = [sub for pat, sub in patterns.items() if re.search(pat, name)]
        except re.error:
            continue
        extra = node.get("additionalProperties", {})
        if len(hits) == 1:
            out[name] = copy.deepcopy(hits[0])
        elif not hits and extra is not False:
            out[name] = {} if extra is True else copy.deepcopy(extra)
    return out


def _draft4_bounds(node: dict) -> None:
    """Draft 4's boolean exclusiveMinimum / exclusiveMaximum (a flag on minimum / maximum) ->
    the numeric form of later drafts, which is all either backend reads."""
    for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(flag), bool):
            if node.pop(flag) and isinstance(node.get(bound), (int, float)):
                node[flag] = node.pop(bound)


def _xgrammar_rewrite(node: Any) -> Any:
    """One (sub)schema as xgrammar's converter should get it (the xgrammar rewrites of the module
    docstring); `map_schema` applies it bottom-up, to a fresh copy it may change in place."""
    if not isinstance(node, dict):
        return node
    replacement = _xgrammar_replacement(node)
    if replacement is not None:
        return replacement
    _drop_false_properties(node)
    _draft4_bounds(node)
    types = _types_of(node)
    _open_undeclared_containers(node, types)
    _declare_required_names(node, types)
    _close_bypassing_extra(node)
    _exact_formats(node, ("pattern",), ("date", "date-time", "ipv4", "hostname"))
    _xgrammar_patterns(node)
    if "integer" in types:
        _int64_bounds(node)
    if node.get("type") == "integer":
        _whole_integer_bounds(node)
    return node


def _xgrammar_replacement(node: dict) -> dict | None:
    """The schema that replaces ``node`` whole for xgrammar, or None to rewrite it keyword by
    keyword: ``{}`` where several-subschema allOf wins, object / array const and enum values
    spelled out as schemas."""
    # xgrammar writes object / array const and enum values in its own compact form ('{"a":1}'),
    # whatever the separators / indent: spelled out as schemas they follow the layout. const /
    # enum win over their siblings in xgrammar (and pre-flight checks the values against them),
    # so replacing the node keeps the semantics; $ref wins over both, so it is left alone.
    winner = next((k for k in XGRAMMAR_ORDER if k in node), None)
    if winner == "allOf" and isinstance(node["allOf"], list) and len(node["allOf"]) > 1:
        # xgrammar generates any JSON value for allOf with several subschemas (pre-flight
        # reports it), but still converts them and fails on some (a false subschema): say it
        return {}
    if "$ref" not in node:
        if "const" in node:
            if isinstance(node["const"], (dict, list)):
                return _literal_schema(node["const"])
        elif isinstance(node.get("enum"), list) and any(isinstance(v, (dict, list)) for v in node["enum"]):
            return {"anyOf": [_literal_schema(v) for v in node["enum"]]}
    return None


def extra_bypass(node: Any) -> str | None:
    """The keyword through which xgrammar generates extra keys of ANY name in object `node`:
    ``additionalProperties`` (else ``unevaluatedProperties``) next to ``properties`` and
    ``patternProperties`` / ``propertyNames``; None when the node has no such extra keys."""
    # xgrammar (0.2.9, json_schema_converter.cc "Case 1a") then writes the extra keys as any
    # string: a declared name or a key matching a patternProperties pattern can come through
    # them with the extra-keys schema's value (or twice); measured, e.g. {"avro_name": 123}
    # under patternProperties {"^avro_name$": {"oneOf": [string, null]}} and
    # additionalProperties true.
    if not isinstance(node, dict):
        return None
    props = node.get("properties")
    if not isinstance(props, dict) or all(v is False for v in props.values()):
        return None
    if not node.get("patternProperties") and not isinstance(node.get("propertyNames"), dict):
        return None
    key = next((k for k in ("additionalProperties", "unevaluatedProperties") if k in node), None)
    return None if key is None or node[key] is False else key


def constrains_nothing(sub: Any) -> bool:
    """Whether a subschema admits every value (``true``, ``{}``, only annotations)."""
    return sub is True or isinstance(sub, dict) and all(
        k in ANNOTATIONS or k not in KEYWORD_SUPPORT for k in sub)


def _close_bypassing_extra(node: dict) -> None:
    """An `extra_bypass` keyword that admits anything is dropped: xgrammar then generates no
    extra keys (strict mode's reading of an object without one), instead of letting a declared
    name or a patternProperties key through them with any value. The pre-flight reports the
    keyword when it has a schema of its own (that cannot be kept apart from the others)."""
    key = extra_bypass(node)
    while key is not None and constrains_nothing(node[key]):
        del node[key]
        key = extra_bypass(node)


def _open_undeclared_containers(node: dict, types: set[str]) -> None:
    """``items: {}`` on an array, ``additionalProperties: {}`` on an object, that declares no
    items / properties at all."""
    # strict_mode forbids items / properties the schema does not declare. That is what we want
    # for declared objects, but a bare {"type": "array", "minItems": 1} would become "[] only"
    # (and fail to compile): an array or object that declares nothing gets "anything" back.
    if "array" in types and not any(
            k in node for k in ("items", "prefixItems", "unevaluatedItems")):
        node["items"] = {}
    if "object" in types and not any(
            k in node for k in ("properties", "additionalProperties", "patternProperties",
                                "unevaluatedProperties", "propertyNames")):
        node["additionalProperties"] = {}


def _declare_required_names(node: dict, types: set[str]) -> None:
    """Each required name an object node does not declare, declared under ``properties`` with
    the schema that applies to it anyway (`declarable_required`)."""
    if "object" in types or not types and any(
            k in node for k in ("properties", "additionalProperties", "unevaluatedProperties")):
        # (an untyped node with these keywords is an object to xgrammar and to pre-flight)
        # strict mode never generates a required name that is not declared (the output would
        # always miss it): declare it with the schema that applies to it anyway (exact)
        for name, sub in declarable_required(node).items():
            node.setdefault("properties", {})[name] = sub


def _xgrammar_patterns(node: dict) -> None:
    """``pattern`` and the ``patternProperties`` keys given search semantics and written the
    way xgrammar compiles them right (`search_pattern`, `xgrammar_pattern`)."""
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        rewritten = search_pattern(pattern, any_text=".*")
        node["pattern"] = xgrammar_pattern(rewritten if rewritten is not None else pattern)
    if isinstance(node.get("patternProperties"), dict):
        # xgrammar matches key patterns whole; JSON Schema searches them, as `pattern` (a key
        # with an inner anchor has no such rewrite: pre-flight reports it, see support.py)
        node["patternProperties"] = {
            xgrammar_pattern(search_pattern(k, any_text=".*") or python_regex(k)): v
            for k, v in node["patternProperties"].items()}


def _int64_bounds(node: dict) -> None:
    """An integer node's bounds past 64 bits clamped to them, or dropped when the whole range
    lies past them (xgrammar raises on both)."""
    # xgrammar raises on integer bounds past 64 bits; clamping them only narrows.
    for key, bound in (("maximum", INT64_MAX), ("exclusiveMaximum", INT64_MAX)):
        v = node.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > bound:
            del node[key]
            node["maximum"] = min(bound, node.get("maximum", bound))
    for key, bound in (("minimum", INT64_MIN), ("exclusiveMinimum", INT64_MIN)):
        v = node.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < bound:
            del node[key]
            node["minimum"] = max(bound, node.get("minimum", bound))
    # a range wholly past 64 bits (minimum 2**70) has no 64-bit integer at all: xgrammar
    # raises on it; pre-flight reports it unsupported, and under "lenient" the grammar
    # generates unbounded integers and final validation checks the bound
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        v = node.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and (
                v > INT64_MAX if key.endswith("inimum") else v < INT64_MIN):
            del node[key]


def _whole_integer_bounds(node: dict) -> None:
    """A ``type: integer`` node's fractional bounds rounded inward to inclusive whole ones
    (xgrammar raises on fractional integer bounds); the same integers pass."""
    for key, rnd in (("minimum", math.ceil), ("maximum", math.floor)):
        v = node.get(key)
        if isinstance(v, float) and math.isfinite(v) and not v.is_integer():
            node[key] = int(rnd(v))
    v = node.get("exclusiveMinimum")
    if isinstance(v, float) and math.isfinite(v) and not v.is_integer():
        del node["exclusiveMinimum"]
        node["minimum"] = max(int(math.floor(v)) + 1, node.get("minimum", -math.inf))
    v = node.get("exclusiveMaximum")
    if isinstance(v, float) and math.isfinite(v) and not v.is_integer():
        del node["exclusiveMaximum"]
        node["maximum"] = min(int(math.ceil(v)) - 1, node.get("maximum", math.inf))


def _outlines_rewrite(node: Any) -> Any:
    if node is True:
        return {}
    if not isinstance(node, dict):
        return node
    _drop_false_properties(node)
    # outlines raises on any keyword it does not dispatch on (e.g. {"title": "x"}, which is
    # pydantic's schema for Any): keep only keywords that constrain instances.
    for key in [k for k in node if k not in _OUTLINES_KEEP]:
        del node[key]
    _draft4_bounds(node)
    # date-time stays outlines' own (reported: it accepts times without an offset)
    _exact_formats(node, ("pattern", "minLength", "maxLength"), ("date",))
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        rewritten = search_pattern(pattern, any_text=OUTLINES_STRING_CHAR + "*",
                                   dot=OUTLINES_LINE_CHAR, dot_all=OUTLINES_STRING_CHAR)
        if rewritten is not None:
            # outlines strips one leading ^ and trailing $ (only both together) before use.
            node["pattern"] = "^" + rewritten + "$"
    if isinstance(node.get("enum"), list):
        # outlines' DFA is leftmost-first: in (a|ab) the text "ab" can never complete.
        node["enum"] = sorted(node["enum"], key=lambda v: -len(json.dumps(v)))
    if node.get("additionalProperties") is False and "properties" not in node:
        del node["additionalProperties"]
        if "patternProperties" not in node and "propertyNames" not in node:
            node["maxProperties"] = 0
    return node


XGRAMMAR_ORDER = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")  # which keyword wins


def all_of_values(node: Any, root: Any) -> list | None:
    """For a node where several-subschema ``allOf`` wins in xgrammar (which would generate any
    value): when a member fixes the values (``enum`` / ``const``, through local ``$ref``s), the
    values the whole node accepts -- an exact replacement, ``{"enum": values}``. Else None."""
    if not isinstance(node, dict) or next((k for k in XGRAMMAR_ORDER if k in node), None) != "allOf":
        return None
    members = node["allOf"]
    if not isinstance(members, list) or len(members) < 2:
        return None
    candidates = None
    for member in members:
        for _ in range(8):
            if isinstance(member, dict) and "$ref" in member and not ("enum" in member or "const" in member):
                target = resolve_local_ref(root, member["$ref"])
                member = target[0] if target is not None else None
            else:
                break
        if isinstance(member, dict) and ("const" in member or "enum" in member):
            candidates = [member["const"]] if "const" in member else member["enum"]
            break
    if not isinstance(candidates, list):
        return None
    try:
        validator = json_validator(root).evolve(schema=node)
        values, seen = [], set()
        for v in candidates:
            key = json.dumps(v, sort_keys=True)
            if key not in seen and validator.is_valid(v):
                seen.add(key)
                values.append(v)
    except Exception:  # a subschema jsonschema cannot evaluate: leave the node to xgrammar
        return None
    return values or None


def _fold_all_of_values(node: Any, root: Any) -> Any:
    """Top-down copy of `node` with every `all_of_values` node replaced by its enum, and every
    ``oneOf`` whose branches are disjoint (`disjoint.one_of_disjoint`) written ``anyOf``: the
    same instances, and xgrammar then has no anyOf fallback to warn about."""
    values = all_of_values(node, root)
    if values is not None:
        return {"enum": values}
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in SCHEMA_KEYWORDS:
            out[k] = [_fold_all_of_values(x, root) for x in v] if isinstance(v, list) else _fold_all_of_values(v, root)
        elif k in SCHEMA_LIST_KEYWORDS and isinstance(v, list):
            out[k] = [_fold_all_of_values(x, root) for x in v]
        elif k in SCHEMA_MAP_KEYWORDS and isinstance(v, dict):
            out[k] = {name: _fold_all_of_values(x, root) for name, x in v.items()}
        else:
            out[k] = v
    if next((k for k in XGRAMMAR_ORDER if k in node), None) == "oneOf" \
            and one_of_disjoint(node["oneOf"], root):
        out = {("anyOf" if k == "oneOf" else k): v for k, v in out.items()}
    return out


def backend_schema(schema: dict, backend: str) -> dict:
    """The rewritten copy of `schema` that `backend`'s converter is given (see module doc)."""
    if backend == "xgrammar":
        return _rewrite_document(schema, _xgrammar_rewrite, fold=True)
    if backend == "outlines":
        return _rewrite_document(schema, _outlines_rewrite, fold=False)
    raise SchemaError(f"unknown backend {backend!r}; use 'xgrammar' or 'outlines'")


_REF_ROUNDS = 16  # rounds of schemas found only through a $ref (each may hold more refs)


def _rewrite_document(schema: dict, rewrite: Callable[[Any], Any], *, fold: bool) -> dict:
    """`map_schema` over the document, then over every schema a local ``$ref`` reaches that
    `map_schema` does not visit: one stored under a key that is not a schema keyword (a JSON
    pointer reaches ``#/definitions/misc/text`` all the same, and the backend converts it)."""
    visited: set[int] = set()

    def fn(node: Any) -> Any:
        out = rewrite(node)
        visited.add(id(out))
        return out

    def prepare(node: Any) -> Any:
        return _fold_all_of_values(node, schema) if fold else node

    doc = map_schema(prepare(schema), fn)
    for _ in range(_REF_ROUNDS):
        missed: dict[tuple, list[Any]] = {}
        for ref in _local_refs(doc):
            target = resolve_local_ref(doc, ref)
            if target is not None and target[1] and isinstance(target[0], dict) \
                    and id(target[0]) not in visited:
                missed.setdefault(tuple(target[1]), target[1])
        if not missed:
            break
        for path in missed.values():
            original = resolve_local_ref(schema, "#" + to_pointer(path))
            current = resolve_local_ref(doc, "#" + to_pointer(path))
            source = original[0] if original is not None else current[0] if current else None
            parent = resolve_local_ref(doc, "#" + to_pointer(path[:-1]))
            if source is not None and parent is not None:
                parent[0][path[-1]] = map_schema(prepare(source), fn)
    return doc


def _local_refs(node: Any) -> list[str]:
    """Every local ``$ref`` string anywhere in a document."""
    out, todo = [], [node]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                out.append(ref)
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return out


def outlines_whitespace(layout: JsonLayout) -> str:
    """outlines puts one whitespace pattern around every separator, so an exact layout can only
    be had for compact JSON; otherwise the pattern admits the layout plus bounded variants."""
    if layout.indent is None and layout.separators == (",", ":"):
        return ""
    if layout.indent is None:
        return "[ ]?"
    return "[ ]?(?:\\n[ ]{0,%d})?" % (layout.indent * 24)


# xgrammar writes a string with minLength / maxLength as `"` X_characters{min,max} `"` where one
# character is `[^"\\\r\n]`: no escape at all (a valid "line1\nline2" is refused) and raw control
# characters other than CR / LF (a raw tab: not JSON, json.loads refuses it). The rule, exactly as
# xgrammar 0.2.9 prints it:
_XGR_LENGTH_CHAR_RULE = re.compile(r'^(\S+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
# ... and one JSON string character instead: an unescaped character JSON allows, or an escape.
# Each alternative is one character of the decoded string, so {min,max} still counts what
# JSON Schema counts (code points). A \uD800-\uDFFF escape is left out: a surrogate pair is two
# escapes but one code point, which the count would get wrong (a minLength 2 string could then
# be one emoji); such a character can still be written as itself.
_JSON_STRING_CHAR = (r'(([^\0-\x1f\"\\]) | ("\\" [\"\\/bfnrt]) '
                     r'| ("\\u" [0-9A-Ca-cE-Fe-f] [0-9A-Fa-f] [0-9A-Fa-f] [0-9A-Fa-f]) '
                     r'| ("\\u" [Dd] [0-7] [0-9A-Fa-f] [0-9A-Fa-f]))')


def length_string_escapes(grammar: Any) -> Any:
    """`grammar` (from xgrammar's JSON Schema converter) with every length-limited string's
    character rule allowing escapes and refusing raw control characters (see above); the grammar
    itself when it has no such rule."""
    text = str(grammar)
    fixed, n = _XGR_LENGTH_CHAR_RULE.subn(lambda m: f"{m.group(1)} ::= {_JSON_STRING_CHAR}", text)
    if not n:
        return grammar
    import xgrammar

    return xgrammar.Grammar.from_ebnf(fixed, root_rule_name="root")


# --------------------------------------------------------------------------------------------
# conversion (cached: pre-flight and compile both convert the same spec)
# --------------------------------------------------------------------------------------------

_CONVERT_CACHE: OrderedDict[tuple[str, str], Conversion] = OrderedDict()
_CONVERT_CACHE_SIZE = 128
_CONVERT_LOCK = threading.Lock()


@dataclass(frozen=True)
class Conversion:
    """What a backend's JSON Schema converter made of a spec: the ``result`` the token-level
    compiler consumes (an ``xgrammar.Grammar``, or an outlines regex string), the ``source``
    text the converter was given, and what the backend logged while converting (``heard``,
    `backend_log`): cached together, so a cache hit reports the same warnings."""

    result: Any
    source: str
    heard: tuple[BackendMessage, ...] = ()


def convert_json_schema(spec: SchemaSpec, backend: str) -> Any:
    """Run the backend's JSON Schema converter on `spec` (json_schema kind).

    Returns an ``xgrammar.Grammar`` (xgrammar) or a regex string (outlines); `conversion` has
    what the backend logged as well.

    Raises
    ------
    SchemaError
        The backend rejects the schema (message is the backend's own).
    """
    return conversion(spec, backend).result


def conversion(spec: SchemaSpec, backend: str) -> Conversion:
    """`convert_json_schema` with the text the backend was given and what it logged meanwhile
    (cached: pre-flight and compile both convert the same spec)."""
    if spec.kind != "json_schema" or spec.json_schema is None:
        raise SchemaError(f"convert_json_schema needs a json_schema spec, got kind {spec.kind!r}")
    cache_key = (spec.key, backend)
    with _CONVERT_LOCK:
        if cache_key in _CONVERT_CACHE:
            _CONVERT_CACHE.move_to_end(cache_key)
            return _CONVERT_CACHE[cache_key]
    text = json.dumps(backend_schema(spec.json_schema, backend), ensure_ascii=False)
    layout = spec.layout
    try:
        with hear_conversion(backend, text) as heard:
            if backend == "xgrammar":
                import xgrammar

                result: Any = length_string_escapes(xgrammar.Grammar.from_json_schema(
                    text, any_whitespace=False, indent=layout.indent,
                    separators=layout.separators, strict_mode=True))
            else:
                from outlines_core.json_schema import build_regex_from_schema

                result = build_regex_from_schema(text, outlines_whitespace(layout))
    except SchemaError:
        raise
    except Exception as exc:  # RuntimeError (xgrammar), ValueError (outlines)
        raise SchemaError(f"the {backend} backend cannot convert this JSON Schema: "
                          f"{clean_backend_message(exc)}", backend=backend) from exc
    done = Conversion(result, text, tuple(heard))
    with _CONVERT_LOCK:
        _CONVERT_CACHE[cache_key] = done
        while len(_CONVERT_CACHE) > _CONVERT_CACHE_SIZE:
            _CONVERT_CACHE.popitem(last=False)
    return done
