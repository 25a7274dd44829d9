"""Every way a client asks for structured output, mapped onto the library's schema kinds.

Clients written for other servers put the constraint in different places of the body; each
becomes one :class:`Constraint`: the schema ``make_request`` takes (a JSON Schema dict, a
:class:`~constrained_spec.schemas.Regex`, a list of choices, a
:class:`~constrained_spec.schemas.Grammar`, a structural tag), the pre-flight mode, and the
request field it came from (the ``param`` of a 400 about it):

* OpenAI: ``response_format`` ``json_schema`` (``strict`` true -> "strict", absent ->
  "default", false -> "lenient"), ``json_object`` (llama.cpp's server also reads a ``schema``
  inside it), ``text``; and ``structural_tag`` (vLLM's and xgrammar's shapes);
* vLLM: ``structured_outputs`` {``json``, ``regex``, ``choice``, ``grammar``, ``json_object``,
  ``structural_tag``} and the options ``whitespace_pattern``, ``disable_any_whitespace``,
  ``disable_additional_properties``; the older top-level ``guided_json``, ``guided_regex``,
  ``guided_choice``, ``guided_grammar``, ``guided_whitespace_pattern``,
  ``guided_decoding_backend``;
* SGLang: top-level ``regex``, ``ebnf`` and ``json_schema`` (a JSON string);
* llama.cpp's server: top-level ``grammar`` (GBNF) and ``json_schema`` (an object).

At most one constraint per request: two are a 400 naming both (as vLLM and SGLang refuse
them). Nothing here compiles a grammar: ``make_request`` normalises, pre-flights and compiles
the schema, and its :class:`~constrained_spec.errors.SchemaError` becomes a 400 naming
``Constraint.param``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from constrained_spec.api import SchemaMode
from constrained_spec.errors import SchemaError
from constrained_spec.json_limits import loads
from constrained_spec.schemas import Grammar, Regex, StructuralTag
from constrained_spec.server.protocol import APIError, schema_of

#: the fields of vLLM's ``structured_outputs`` that are a constraint (one at most)
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
#: its fields that adjust the constraint
STRUCTURED_OPTIONS = ("whitespace_pattern", "disable_any_whitespace",
                      "disable_additional_properties", "disable_fallback", "backend")
#: top-level request fields that are a constraint: vLLM's older ``guided_*``, SGLang's and
#: llama.cpp's server's
TOP_LEVEL_KINDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                   "guided_grammar": "grammar", "regex": "regex", "ebnf": "grammar",
                   "grammar": "grammar", "json_schema": "json"}
#: backends a request may name (``guided_decoding_backend``, ``structured_outputs.backend``):
#: "auto" or the server's own; the backend is the server's (``--backend``), not per request
AUTO_BACKENDS = ("", "auto")


@dataclass(frozen=True)
class Constraint:
    """A request's output constraint: ``schema`` for ``make_request`` (None: free text), the
    pre-flight ``mode``, and ``param``, the request field it came from."""

    schema: Any = None
    mode: SchemaMode = "default"
    param: str | None = None

    @property
    def constrained(self) -> bool:
        return self.schema is not None


FREE_TEXT = Constraint()


def constraint_of(body: Any, backend: str) -> Constraint:
    """The one constraint of a request body (chat or completions), or free text; ``backend``:
    the server's grammar backend (a request naming another is refused)."""
    found: list[Constraint] = []
    rf = getattr(body, "response_format", None)
    if rf is not None:
        c = response_format_constraint(rf)
        if c.constrained:
            found.append(c)
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        found.extend(_from_structured_outputs(so, backend))
    for name, kind in TOP_LEVEL_KINDS.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append(_of_kind(kind, value, name))
    _check_backend(getattr(body, "guided_decoding_backend", None), "guided_decoding_backend",
                   backend)
    if len(found) > 1:
        names = " and ".join(c.param or "?" for c in found[:2])
        raise APIError(400, f"two output constraints in one request: {names}; give one "
                       "(response_format, structured_outputs or one guided_* field)",
                       param=found[1].param, code="invalid_value")
    # the options adjust the one constraint, wherever it came from; on free text they are a
    # 400 (there is no JSON to apply them to), never silently ignored
    c = _with_options(so, found[0] if found else FREE_TEXT)
    pattern = getattr(body, "guided_whitespace_pattern", None)
    if pattern is not None:
        _check_whitespace(pattern, "guided_whitespace_pattern", c)
    return c


def response_format_constraint(rf: Mapping[str, Any] | None) -> Constraint:
    """The constraint of ``response_format`` alone (free text when absent)."""
    if rf is not None and rf.get("type") == "structural_tag":
        return Constraint(structural_tag(dict(rf), "response_format"), "default",
                          "response_format")
    schema, mode = schema_of(dict(rf) if rf is not None else None)
    if schema is None:
        return FREE_TEXT
    assert rf is not None
    param = {"json_schema": "response_format.json_schema.schema"}.get(rf.get("type", ""),
                                                                       "response_format")
    if rf.get("type") == "json_object" and rf.get("schema") is not None:
        param = "response_format.schema"
    return Constraint(schema, mode, param)


def _from_structured_outputs(so: Any, backend: str) -> list[Constraint]:
    if not isinstance(so, dict):
        raise APIError(400, "structured_outputs must be an object, e.g. {\"regex\": \"...\"}",
                       param="structured_outputs")
    for name in so:
        if name not in STRUCTURED_KINDS and name not in STRUCTURED_OPTIONS:
            raise APIError(400, f"unknown field {name!r:.40} in structured_outputs; it takes "
                           f"one of {', '.join(STRUCTURED_KINDS)} and the options "
                           f"{', '.join(STRUCTURED_OPTIONS[:3])}",
                           param=f"structured_outputs.{name[:40]}", code="unknown_parameter")
    _check_backend(so.get("backend"), "structured_outputs.backend", backend)
    found = []
    for kind in STRUCTURED_KINDS:
        value = so.get(kind)
        if value is None or (kind == "json_object" and value is False):
            continue
        found.append(_of_kind(kind, value, f"structured_outputs.{kind}"))
    return found


def _with_options(so: Any, c: Constraint) -> Constraint:
    """``c`` adjusted by the options of ``structured_outputs`` ``so`` (None: none), each a 400
    naming it where it does not apply (free text, a regex) or is not supported."""
    if not so:
        return c
    if so.get("disable_additional_properties"):
        if not isinstance(c.schema, dict):
            raise APIError(400, "structured_outputs.disable_additional_properties applies to "
                           "a JSON schema constraint, and this request has "
                           f"{'none (free text)' if c.schema is None else 'a ' + str(c.param)}; "
                           "leave it out", param="structured_outputs."
                           "disable_additional_properties", code="invalid_value")
        c = Constraint(closed_objects(c.schema), c.mode, c.param)
    if so.get("whitespace_pattern") is not None:
        _check_whitespace(so["whitespace_pattern"], "structured_outputs.whitespace_pattern", c)
    if so.get("disable_any_whitespace"):
        raise APIError(400, "structured_outputs.disable_any_whitespace is not supported: "
                       "this server writes JSON on one line with ', ' and ': ' and no other "
                       "whitespace (the model cannot add any), and other output has no JSON "
                       "whitespace to remove; leave it out",
                       param="structured_outputs.disable_any_whitespace",
                       code="unsupported_parameter")
    return c


def _of_kind(kind: str, value: Any, param: str) -> Constraint:
    """One constraint of vLLM's ``kind`` (json / regex / choice / grammar / json_object /
    structural_tag) given as ``value`` in the field ``param``."""
    if kind == "json":
        if isinstance(value, str):  # vLLM and SGLang take the schema as JSON text too
            value = _json_text(value, param)
        if not isinstance(value, dict):
            raise APIError(400, f"{param} must be a JSON Schema (an object or its JSON text)",
                           param=param, code="invalid_schema")
        return Constraint(value, "default", param)
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise APIError(400, f"{param} must be a non-empty string", param=param,
                           code="invalid_schema")
        return Constraint(Regex(value) if kind == "regex" else Grammar(value), "default", param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise APIError(400, f"{param} must be a non-empty list of strings", param=param,
                           code="invalid_schema")
        return Constraint(list(value), "default", param)
    if kind == "json_object":
        if value is not True:
            raise APIError(400, f"{param} must be true", param=param, code="invalid_value")
        return Constraint({"type": "object"}, "default", param)
    # structural_tag: JSON text in vLLM's structured_outputs (an object accepted too)
    return Constraint(structural_tag(value, param), "default", param)


def structural_tag(obj: Any, param: str) -> StructuralTag:
    """The library's structural tag of a client's ``obj`` (xgrammar's ``{"type":
    "structural_tag", "format": ...}`` or vLLM's legacy ``structures`` + ``triggers``, or the
    JSON text of either), in the field ``param``; a 400 names the part at fault
    (``response_format.structures.0.schema``)."""
    try:
        return StructuralTag.from_dict(obj, where=param)
    except SchemaError as e:
        where = param + (e.pointer or "").replace("/", ".")
        raise APIError(400, f"bad structural tag: {e}", param=where, code="invalid_schema") from e


def _json_text(text: str, param: str) -> Any:
    try:
        return loads(text, what=param)
    except (ValueError, UnicodeError) as e:  # JSONDecodeError and JSONDepthError among them
        raise APIError(400, f"{param} is not valid JSON: {e}", param=param,
                       code="invalid_schema") from None


def _check_backend(value: Any, param: str, backend: str) -> None:
    if value is None or value in AUTO_BACKENDS or value == backend:
        return
    raise APIError(400, f"{param} {value!r:.40}: this server's grammar backend is {backend!r} "
                   "for every request (chosen when it starts, --backend); leave the field out "
                   f"or set it to 'auto' or {backend!r}", param=param, code="unsupported_parameter")


def _check_whitespace(pattern: Any, param: str, c: Constraint) -> None:
    """A whitespace pattern is accepted when it allows what this server writes: JSON on one
    line, a single space after ',' and ':' and none elsewhere (the grammar allows no other
    whitespace, so the output always matches such a pattern)."""
    if not isinstance(pattern, str):
        raise APIError(400, f"{param} must be a regular expression string", param=param,
                       code="invalid_value")
    if not isinstance(c.schema, dict):
        what = "this request has none (free text)" if c.schema is None else f"{c.param} is not one"
        raise APIError(400, f"{param} applies to a JSON schema constraint (response_format "
                       f"json_schema, guided_json, ...) and {what}; leave it out", param=param,
                       code="invalid_value")
    try:
        fits = all(re.fullmatch(pattern, ws) for ws in ("", " "))
    except re.error as e:
        raise APIError(400, f"{param} is not a valid regular expression: {e}", param=param,
                       code="invalid_value") from None
    if not fits:
        raise APIError(400, f"{param} {pattern!r:.40} does not allow the whitespace this server "
                       "writes in JSON (none, or one space after ',' and ':'); leave it out",
                       param=param, code="unsupported_parameter")


# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
              "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object schema that does not
    say otherwise (vLLM's ``disable_additional_properties``); a new value, the input unchanged.
    Only schema positions are walked (a property named "properties" is a name, not a keyword);
    the depth is bounded by the body's check before this runs."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind)
    if (is_object or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
