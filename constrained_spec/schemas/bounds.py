"""Opt-in bounds on strings and arrays: ``maxLength`` / ``maxItems`` where the schema sets none.

A small model can loop inside a free string or keep appending array items until
``max_tokens`` runs out. ``bound_schema(spec, max_string_length=N, max_items=M)`` returns the
spec the grammar is compiled from, with ``maxLength: N`` on every plain string and
``maxItems: M`` on every array that has no such bound, and the list of what it added. Final
validation stays against the user's own spec: the bounds narrow what the model may write,
they never admit an output the user's schema rejects.

Left alone: strings with ``pattern`` / ``format`` / ``enum`` / ``const`` (already shaped; with
xgrammar a pattern or format would win over the added bound anyway) and nodes under ``not``,
``if``, ``contains`` or ``dependentSchemas`` (a bound there would change what they select, not
narrow the output). An added bound never contradicts the node's own minimum
(``max(N, minLength)``). With xgrammar, a string with a length bound admits no escape sequences
(``\\"``, ``\\n``), as for any string with ``maxLength``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .spec import SchemaSpec, to_pointer

__all__ = ["AddedBound", "bound_schema"]

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("additionalProperties", "items", "additionalItems", "unevaluatedProperties",
                  "unevaluatedItems", "then", "else")
_SHAPED_STRING = ("maxLength", "pattern", "format", "enum", "const")


@dataclass(frozen=True)
class AddedBound:
    """One keyword ``bound_schema`` added: where (JSON pointer), what, and which option did."""

    keyword: str
    pointer: str
    value: int
    option: str

    def format(self) -> str:
        return f"added: {self.keyword} {self.value} at {self.pointer or '/'} ({self.option})"


def bound_schema(spec: SchemaSpec, *, max_string_length: int | None = None,
                 max_items: int | None = None) -> tuple[SchemaSpec, list[AddedBound]]:
    """The spec to compile (``spec`` itself when nothing is added) and the bounds added."""
    if spec.kind != "json_schema" or spec.json_schema is None or (
            max_string_length is None and max_items is None):
        return spec, []
    schema = copy.deepcopy(spec.json_schema)
    added: list[AddedBound] = []
    stack: list[tuple[Any, list[Any]]] = [(schema, [])]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        types = node.get("type")
        types = {types} if isinstance(types, str) else set(types or ())
        if (max_string_length is not None and "string" in types
                and not any(k in node for k in _SHAPED_STRING)):
            value = max(max_string_length, _int(node.get("minLength")))
            node["maxLength"] = value
            added.append(AddedBound("maxLength", to_pointer(path), value, "max_string_length"))
        if (max_items is not None and "array" in types and "maxItems" not in node
                and "enum" not in node and "const" not in node and node.get("items") is not False):
            value = max(max_items, _int(node.get("minItems")))
            node["maxItems"] = value
            added.append(AddedBound("maxItems", to_pointer(path), value, "max_items"))
        for key in _SCHEMA_MAPS:
            sub = node.get(key)
            if isinstance(sub, dict):
                stack.extend((v, path + [key, k]) for k, v in sub.items())
        for key in _SCHEMA_LISTS:
            sub = node.get(key)
            if isinstance(sub, list):
                stack.extend((v, path + [key, i]) for i, v in enumerate(sub))
        for key in _SCHEMA_VALUES:
            sub = node.get(key)
            if isinstance(sub, dict):
                stack.append((sub, path + [key]))
            elif key == "items" and isinstance(sub, list):  # draft-07 tuple form
                stack.extend((v, path + [key, i]) for i, v in enumerate(sub))
    if not added:
        return spec, []
    added.sort(key=lambda b: (b.pointer, b.keyword))
    return dataclasses.replace(spec, json_schema=schema, key=""), added


def _int(value: Any) -> int:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return int(math.ceil(value))
    return 0
